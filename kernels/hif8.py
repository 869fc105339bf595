"""In-kernel HiF8 helpers (``@triton.jit``), shared by the cast kernel and the attention kernel.

All rounding is done with integer bit operations (bitcast, shifts, masks, ``tl.where``) or with
tables the host built (``qfa.cast.luts``); no built-in fp8 cast is used (Triton's fp32->fp8
casts round wrongly under the 3.8/3.9 interpreter, and triton-ascend has no fp8/HiF8 types).
Comparisons are made on float values where that is equally exact, because int32 vector
compares degrade to scalar code on Atlas A2/A3.

Table helpers read the table from global memory with indices that are in range by construction
(``& 0x7FFF``, ``& 0xFF``), so the table loads need no mask: mask only the element loads/stores.

=====================================  ===========================================================
``hif8_encode_half(bits, lut)``        int32 codes of fp16/bf16 bit patterns (int16/int32 tensor,
                                       sign in bit 15) via the 32768-entry half-space LUT of that
                                       dtype and overflow mode: ``mag | sign << 7`` unless mag == 0
``hif8_encode_f32(x, bf16_lut)``       int32 codes of fp32 values: the upper 16 bits are a bf16
                                       pattern, looked up in the **bf16** half-space LUT; NaNs with
                                       their payload in the low 16 bits -> 0x80
``hif8_encode(x, lut)``                dispatch on ``x.dtype``: fp32 -> ``hif8_encode_f32``;
                                       fp16/bf16 values or int16 patterns -> ``hif8_encode_half``
``hif8_decode_bits(codes, dec_lut)``   bit patterns (the decode LUT's int16/int32) of codes
``hif8_decode(codes, dec_lut, DTYPE)`` values: the bit patterns bitcast to ``DTYPE`` (constexpr
                                       tl.float16 / tl.bfloat16 / tl.float32, matching the LUT)
``hif8_round_sat(x)``                  fp32 -> fp32: the value of ``x`` rounded to HiF8 (ties
                                       away, saturating: |x| >= 32768 and +-Inf -> +-32768), no
                                       table; 0 has no sign; NaN stays NaN
=====================================  ===========================================================

Codes come back as int32 in [0, 255]; ``.to(tl.uint8)`` before storing them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from qfa.cast import format as fmt

# The format's constants, from qfa.cast.format (Triton kernels read globals only as constexprs).
#: Largest |E| of the binades that keep 3, 2 and 1 mantissa bits: 3, 7, 15.
_EDGES = [e for e in range(fmt.MAX_EXPONENT) if fmt.mantissa_bits(e) != fmt.mantissa_bits(e + 1)] + [fmt.MAX_EXPONENT]
assert [fmt.mantissa_bits(e) for e in _EDGES] == [3, 2, 1]
_M3_LO = tl.constexpr(2.0 ** -_EDGES[0])
_M3_HI = tl.constexpr(2.0 ** (_EDGES[0] + 1))
_M2_LO = tl.constexpr(2.0 ** -_EDGES[1])
_M2_HI = tl.constexpr(2.0 ** (_EDGES[1] + 1))
_M1_LO = tl.constexpr(2.0 ** -_EDGES[2])
_M1_HI = tl.constexpr(2.0 ** (_EDGES[2] + 1))
_UNDERFLOW = tl.constexpr(fmt.UNDERFLOW_THRESHOLD)
_MIN_DENORMAL = tl.constexpr(fmt.MIN_DENORMAL)
_MAX = tl.constexpr(fmt.MAX)
_NAN_CODE = tl.constexpr(fmt.NAN_CODE)
_SIGN_BIT = tl.constexpr(fmt.SIGN_BIT)


@triton.jit
def hif8_encode_half(bits, half_lut_ptr):
    """HiF8 codes (int32) of fp16/bf16 bit patterns ``bits`` (any int type; low 16 bits used)."""
    b = bits.to(tl.int32) & 0xFFFF
    mag = tl.load(half_lut_ptr + (b & 0x7FFF)).to(tl.int32)
    # mag | sign << 7 unless mag == 0 (no -0); min(mag, 1) is 0 exactly for mag == 0, and avoids
    # an int32 compare. NaN's 0x80 keeps its single code: 0x80 | 0x80 == 0x80.
    return mag | ((b >> 15) * tl.minimum(mag, 1) * _SIGN_BIT)


@triton.jit
def hif8_encode_f32(x, bf16_half_lut_ptr):
    """HiF8 codes (int32) of fp32 values ``x``, read from the bf16 half-space LUT.

    HiF8 rounding reads the sign, the exponent and the first four mantissa bits, all in the upper
    16 bits, which are the bf16 pattern of ``x`` truncated. Only a NaN whose payload lies in the
    low 16 bits looks like Inf there; ``x != x`` catches it.
    """
    bits = x.to(tl.int32, bitcast=True)
    code = hif8_encode_half(bits >> 16, bf16_half_lut_ptr)
    return tl.where(x != x, _NAN_CODE, code)


@triton.jit
def hif8_encode(x, lut_ptr):
    """HiF8 codes (int32) of ``x``: fp32 values (bf16 LUT), fp16/bf16 values or int16 patterns."""
    if x.dtype == tl.float32:
        code = hif8_encode_f32(x, lut_ptr)
    elif x.dtype == tl.float16 or x.dtype == tl.bfloat16:
        code = hif8_encode_half(x.to(tl.int16, bitcast=True), lut_ptr)
    else:
        code = hif8_encode_half(x, lut_ptr)
    return code


@triton.jit
def hif8_decode_bits(codes, decode_lut_ptr):
    """Bit patterns (the decode LUT's element type) of HiF8 ``codes`` (uint8, int8 or wider)."""
    return tl.load(decode_lut_ptr + (codes.to(tl.int32) & 0xFF))


@triton.jit
def hif8_decode(codes, decode_lut_ptr, DTYPE: tl.constexpr):
    """Values of HiF8 ``codes`` as ``DTYPE``; the LUT must be ``decode_lut(DTYPE)``'s bits."""
    return hif8_decode_bits(codes, decode_lut_ptr).to(DTYPE, bitcast=True)


@triton.jit
def hif8_round_sat(x):
    """The fp32 value of ``x`` rounded to HiF8: round half away from zero, saturating.

    Keeps m(e) mantissa bits of the input's binade e (3 for |e| <= 3, 2 for |e| <= 7, 1 for
    |e| <= 15, 0 for -22 <= e <= -16, where the threshold is 1.5 * 2^e) by adding the first
    dropped bit and clearing the dropped bits of the fp32 pattern (a carry moves to 2^(e+1));
    |x| < 2^-23 -> 0, 2^-23 <= |x| < 2^-22 -> 2^-22, |x| >= 32768 (Inf included) -> 32768, with
    the sign kept except on zero. NaN stays NaN (P in attention is never NaN). Equals
    ``decode(encode(x, overflow="saturate"))`` for every finite x.
    """
    x = x.to(tl.float32)
    ax = tl.abs(x)
    a = ax.to(tl.int32, bitcast=True)
    # m(e) = [2^-15 <= a < 2^16] + [2^-7 <= a < 2^8] + [2^-3 <= a < 2^4]; exact float compares.
    m = ((ax >= _M1_LO) & (ax < _M1_HI)).to(tl.int32)
    m += ((ax >= _M2_LO) & (ax < _M2_HI)).to(tl.int32)
    m += ((ax >= _M3_LO) & (ax < _M3_HI)).to(tl.int32)
    half = 4194304 >> m  # 2^22 >> m: the first dropped mantissa bit
    r = ((a + half) & (0 - (half + half))).to(tl.float32, bitcast=True)
    # below the denormals: [2^-23, 2^-22) -> 2^-22, below 2^-23 -> 0
    r = tl.where(ax < _MIN_DENORMAL, tl.where(ax >= _UNDERFLOW, _MIN_DENORMAL, 0.0), r)
    r = tl.where(ax >= _MAX, _MAX, r)
    r = tl.where(x <= -_UNDERFLOW, -r, r)  # sign kept unless the result is 0
    return tl.where(x == x, r, x)
