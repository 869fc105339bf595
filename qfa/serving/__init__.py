"""Serving with HiF8 KV caches: codes stored once, read by the op in place.

* :class:`PagedHiF8Cache` (:mod:`qfa.serving.paged_cache`): a block allocator over preallocated
  ``PA_BBND`` code tensors, the reference for a vLLM-style engine.
* :class:`HiF8Cache` (:mod:`qfa.serving.hif8_cache`, needs transformers): a ``transformers.Cache``
  for ``model(...)`` / ``model.generate(...)``; :func:`cached_attention`
  (:mod:`qfa.serving.attention`) is what the attention backend calls on it.
"""

from qfa.serving.paged_cache import PagedHiF8Cache

_LAZY = {"HiF8Cache": "qfa.serving.hif8_cache", "is_hif8_cache": "qfa.serving.hif8_cache",
         "cached_attention": "qfa.serving.attention", "hif8_cache_of": "qfa.serving.attention"}

__all__ = ["PagedHiF8Cache", *_LAZY]


def __getattr__(name: str):
    # transformers is optional: the HiF8Cache side imports it only when asked for
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qfa.serving' has no attribute {name!r}")
