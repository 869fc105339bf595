"""C++ sources of the native CPU kernels (installed as ``qfa.csrc``, built on first use)."""
