"""QuantFlashAttn: the op (:mod:`qfa.attention.op`), its torch-library registration and planning
glue, with the implementations that run it in :mod:`qfa.attention.backends`.

The drop-in built on the op lives one layer up, in :mod:`qfa.dropin`. Its public names
(``hif8_attention``, ``HiF8Attention``, ``mxfp8_attention``, ``fp8_attention``, ``calibration``)
stay importable from here, where users import them today; they load on first use, so that this
layer never imports the one above it at import time.
"""

from __future__ import annotations

import importlib
from typing import Any

from qfa.attention import custom_ops  # noqa: F401  (registers torch.ops.qfa.quant_flash_attn)
from qfa.attention.op import quant_flash_attn

#: Names this package re-exports from the drop-in layer: name -> the module that defines it.
_FROM_DROPIN = {
    "HiF8Attention": "qfa.dropin.module",
    "hif8_attention": "qfa.dropin.function",
    "mxfp8_attention": "qfa.dropin.function",
    "fp8_attention": "qfa.dropin.function",
}

__all__ = ["HiF8Attention", "calibration", "fp8_attention", "hif8_attention", "mxfp8_attention", "quant_flash_attn"]


def __getattr__(name: str) -> Any:
    if name in _FROM_DROPIN:
        return getattr(importlib.import_module(_FROM_DROPIN[name]), name)
    if name == "calibration":
        return importlib.import_module("qfa.dropin.calibration")
    raise AttributeError(f"module 'qfa.attention' has no attribute {name!r}")
