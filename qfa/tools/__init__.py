"""Tools built on the library, not part of it: the demo, the benchmarks, perplexity evaluation,
the packaged-model loader and the synthetic workloads. The library (``qfa.cast``,
``qfa.attention``, ``qfa.integrations``) never imports from here."""
