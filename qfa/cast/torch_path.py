"""The torch path of the cast: one table gather per element, exact on any device torch runs on.

On CPU the encode normally runs the native encoder instead (:mod:`qfa.attention.backends.cpu_prepare`,
the same bits); this path serves where it is not built, under ``torch.compile`` tracing, with
``QFA_NATIVE=0``, and for the decode. On CPU the gather is compiled once per process with
TorchInductor (a fused C++ loop); eager torch runs the same ops for small tensors, where
compiling does not pay, and wherever compiling is unavailable or disabled (``QFA_COMPILE=0``).
Both run the same function, so they agree bit for bit.
"""

from __future__ import annotations

from typing import Callable

import torch

from qfa import _compile
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


def run(fn: Callable, flat: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``fn(flat, table)``, compiled for large CPU tensors (see :mod:`qfa._compile`)."""
    if flat.numel() >= COMPILE_MIN_ELEMENTS:
        # Dynamo guards on strides and on a view's base, so each input layout would compile a
        # graph of its own until the recompile limit turns compiling off; a contiguous,
        # detached tensor keeps it to one graph per dtype (free for contiguous inputs).
        return _compile.call(fn, flat.contiguous().detach(), table, device=flat.device)
    return fn(flat, table)
