"""The implementations that run QuantFlashAttn: the exact torch paths (:mod:`torch_path` for
HiF8 per-tensor, :mod:`scaled_torch_path` for MXFP8 and FP8), the native CPU kernel's Python
side (:mod:`cpu_kernel`, :mod:`cpu_gemm`), the native preparation and cast (:mod:`cpu_prepare`)
and the paged-K/V gather (:mod:`paged`). The Triton kernels live in ``kernels/`` (``qfa.kernels``).
Nothing here imports the op or the drop-in: :mod:`qfa.attention.op` chooses among these.
"""
