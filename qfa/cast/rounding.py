"""HiF8 rounding of fp32 values in integer and bit operations, without a table.

:func:`round_hif8_top16` computes what ``luts.round_lut`` holds: the saturating HiF8 rounding of
the value whose fp32 pattern is the input's upper 16 bits (its bf16 truncation). The torch
attention path used to look it up in the 65536-entry fp32 table (256 KiB, beyond L1, and a
gather that TorchInductor cannot vectorise); shifts, masks and compares on the bit pattern
vectorise, and give the same bits.

The rule, on the truncated magnitude ``a`` (bits & 0x7FFF0000):

* keep m(e) mantissa bits of the input's binade e (:func:`qfa.cast.format.mantissa_bits`, e read
  from the exponent field) by
  adding the first dropped bit and clearing the dropped bits (ties go away from zero; a carry
  lands on 2^(e+1), always a HiF8 value);
* below MIN_DENORMAL: [UNDERFLOW_THRESHOLD, MIN_DENORMAL) -> MIN_DENORMAL, below -> 0 (fp32
  denormals included); at or above MAX -> MAX (saturate; everything below the overflow
  threshold rounds to MAX there anyway);
* the sign is kept unless the result is 0 (HiF8 has no -0);
* the bf16 truncation's specials are the table's: an Inf pattern (which includes NaNs whose
  payload lies only in the low 16 bits) stays +-Inf, a NaN pattern gives the decode table's
  NaN.
"""

from __future__ import annotations

import struct

import torch

from qfa.cast import format as fmt

_FP32_MANTISSA_BITS = 23
_FP32_BIAS = 127
_TOP16_MASK = 0x7FFF0000  # magnitude bits that survive the bf16 truncation
_SIGN = -0x80000000  # fp32 sign bit as an int32
_INF_BITS = 0x7F800000


def _bits(value: float) -> int:
    """int32 pattern of an fp32 value (exact for the format's powers of two)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def _band_limit(bits: int) -> int:
    """Largest |e| of the binades 2^e that keep at least ``bits`` mantissa bits."""
    exps = [e for e in range(fmt.MIN_DENORMAL_EXPONENT, fmt.MAX_EXPONENT + 1) if fmt.mantissa_bits(e) >= bits]
    assert min(exps) == -max(exps), "the bands are symmetric in e, so |e| decides"
    return max(exps)


#: m(e) = the number of these limits that |e| does not exceed (15, 7, 3: 1, 2 or 3 bits).
BAND_LIMITS: tuple[int, ...] = tuple(_band_limit(k) for k in (1, 2, 3))
MIN_DENORMAL_BITS = _bits(fmt.MIN_DENORMAL)
UNDERFLOW_BITS = _bits(fmt.UNDERFLOW_THRESHOLD)
MAX_BITS = _bits(fmt.MAX)
#: The pattern the decode table gives the NaN code (what the rounding table holds for NaN).
NAN_BITS = _bits(fmt.DECODE_VALUES[fmt.NAN_CODE])
#: First dropped mantissa bit when a binade keeps no mantissa bit.
_HALF_AT_ZERO_BITS = 1 << (_FP32_MANTISSA_BITS - 1)


def round_hif8_bits(bits: torch.Tensor) -> torch.Tensor:
    """int32 fp32 patterns -> int32 patterns of their top-16-bit HiF8 rounding (see module doc)."""
    a = bits & _TOP16_MASK
    # Clamped first: MAX rounds to itself, and the addition below can then not overflow.
    c = torch.clamp_max(a, MAX_BITS)
    e = torch.abs((c >> _FP32_MANTISSA_BITS) - _FP32_BIAS)
    m = torch.zeros_like(a)
    for limit in BAND_LIMITS:
        m = m + (e <= limit).to(torch.int32)
    half = torch.full_like(a, _HALF_AT_ZERO_BITS) >> m
    r = (c + half) & -(half + half)
    below = (c >= UNDERFLOW_BITS).to(torch.int32) * MIN_DENORMAL_BITS  # 0 or MIN_DENORMAL
    r = torch.where(c < MIN_DENORMAL_BITS, below, r)
    r = torch.where(a == _INF_BITS, a, r)
    r = torch.where(r == 0, r, r | (bits & _SIGN))
    return torch.where(a > _INF_BITS, NAN_BITS, r)


def round_hif8_top16(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to HiF8 values (saturating, ties away), bit-equal to the
    ``luts.round_lut`` gather at ``(x.view(int32) >> 16) & 0xFFFF``."""
    return round_hif8_bits(x.view(torch.int32)).view(torch.float32)
