"""The torch path of the cast: one table gather per element, exact on any device torch runs on.

On CPU the gather is compiled once per process with TorchInductor (a fused C++ loop), which is
what makes it faster than torch's native fp8 cast; eager torch runs the same ops for small
tensors, where compiling does not pay, and wherever compiling is unavailable or disabled
(``QFA_CAST_COMPILE=0``). Both run the same function, so they agree bit for bit.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Callable

import torch

from qfa.cast import format as fmt

#: Below this many elements eager torch is faster than calling a compiled graph.
COMPILE_MIN_ELEMENTS = 1 << 16
_FP32_ABS_MASK = 0x7FFFFFFF
_FP32_INF_BITS = 0x7F800000


def encode_bits(bits: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """HiF8 codes of fp16/bf16 (int16) or fp32 (int32) bit patterns, via the 65536-entry LUT."""
    if bits.dtype == torch.int32:
        codes = torch.index_select(table, 0, (bits >> 16) & 0xFFFF)
        # NaNs whose payload sits in the low half would read as Inf in the upper 16 bits.
        return torch.where((bits & _FP32_ABS_MASK) > _FP32_INF_BITS, fmt.NAN_CODE, codes)
    return torch.index_select(table, 0, bits.to(torch.int32) & 0xFFFF)


def decode_codes(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Bit patterns (the decode table's dtype) of HiF8 codes."""
    return torch.index_select(table, 0, codes.to(torch.int32))


_compiled: dict[str, Callable] = {}
_compile_lock = threading.Lock()
_compile_failed = False


def _compile_enabled() -> bool:
    return os.environ.get("QFA_CAST_COMPILE", "1") != "0" and not _compile_failed


def _maybe_compiled(name: str, fn: Callable) -> Callable:
    with _compile_lock:
        if name not in _compiled:
            _compiled[name] = torch.compile(fn, dynamic=True, fullgraph=True)
        return _compiled[name]


def run(name: str, fn: Callable, flat: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Run ``fn(flat, table)`` compiled when that pays off, else eagerly."""
    global _compile_failed
    if flat.device.type == "cpu" and flat.numel() >= COMPILE_MIN_ELEMENTS and _compile_enabled():
        try:
            return _maybe_compiled(name, fn)(flat, table)
        except Exception as exc:  # no C++ compiler, unsupported platform, ...
            _compile_failed = True
            warnings.warn(f"qfa: compiling the HiF8 cast failed ({exc!r}); using eager torch", stacklevel=3)
    return fn(flat, table)
