"""HiFloat8 (HiF8): the single source of truth for the format.

Every constant, the value of every code and the rounding rule live here; the host LUTs, the
torch paths and the Triton kernels import them. See ``docs/spec/hif8-format.md``.

Byte layout: ``S | Dot (prefix code) | exponent (D bits) | mantissa``.

=========  ==  ============  =========  ===========================
Dot        D   exponent E    mantissa   value
=========  ==  ============  =========  ===========================
``11``     4   +-[8, 15]     1 bit      2^E * (1 + M/2)
``10``     3   +-[4, 7]      2 bits     2^E * (1 + M/4)
``01``     2   +-[2, 3]      3 bits     2^E * (1 + M/8)
``001``    1   +-1           3 bits     2^E * (1 + M/8)
``0001``   0   0             3 bits     1 + M/8
``0000``   -   denormal      M = 1..7   2^(M - 23)
=========  ==  ============  =========  ===========================

The first exponent bit is the exponent's sign (1 = negative); the other D-1 bits hold |E|
without its leading one.
"""

from __future__ import annotations

import math
from typing import Final

#: Codes with a special meaning.
ZERO_CODE: Final = 0x00
NAN_CODE: Final = 0x80
POS_INF_CODE: Final = 0x6F
NEG_INF_CODE: Final = 0xEF
MAX_CODE: Final = 0x6E
SIGN_BIT: Final = 0x80

#: Largest finite magnitude, 2^15.
MAX: Final = 32768.0
#: Magnitudes at or above this overflow (midpoint from MAX to the 1.5 * 2^15 slot that Inf takes).
OVERFLOW_THRESHOLD: Final = 40960.0
#: Smallest positive magnitude (code 0x01) and smallest normal magnitude (code 0x7E).
MIN_DENORMAL: Final = 2.0**-22
MIN_NORMAL: Final = 2.0**-15
#: Magnitudes below this round to zero; from here up to MIN_DENORMAL they round to MIN_DENORMAL.
UNDERFLOW_THRESHOLD: Final = 2.0**-23

#: Supported overflow modes: ``saturate`` (AMCT cast, the default) and ``inf`` (CANN host code).
OVERFLOW_MODES: Final = ("saturate", "inf")

#: Exponent range of the normal binades and of the power-of-two denormals.
MAX_EXPONENT: Final = 15
MIN_EXPONENT: Final = -15
MIN_DENORMAL_EXPONENT: Final = -22


def mantissa_bits(exponent: int) -> int:
    """Mantissa bits HiF8 keeps in binade 2^exponent (0 in the denormal binades)."""
    e = abs(exponent)
    if exponent < MIN_EXPONENT:
        return 0
    if e <= 3:
        return 3
    if e <= 7:
        return 2
    if e <= 15:
        return 1
    raise ValueError(f"exponent {exponent} is outside HiF8's range [-22, 15]")


def _decode_magnitude(code: int) -> float:
    """Value of a 7-bit magnitude code (sign bit clear), following the bit layout."""
    if code == 0:
        return 0.0
    if code >> 5 == 0b11:
        dot_bits, exp_bits = 2, 4
    elif code >> 5 == 0b10:
        dot_bits, exp_bits = 2, 3
    elif code >> 5 == 0b01:
        dot_bits, exp_bits = 2, 2
    elif code >> 4 == 0b001:
        dot_bits, exp_bits = 3, 1
    elif code >> 3 == 0b0001:
        dot_bits, exp_bits = 4, 0
    else:  # Dot 0000: power-of-two denormals 2^(M - 23)
        return math.ldexp(1.0, (code & 0b111) - 23)
    man_bits = 7 - dot_bits - exp_bits
    field = (code >> man_bits) & ((1 << exp_bits) - 1)
    mantissa = code & ((1 << man_bits) - 1)
    exponent = 0
    if exp_bits:
        negative = field >> (exp_bits - 1)
        magnitude = (1 << (exp_bits - 1)) | (field & ((1 << (exp_bits - 1)) - 1))
        exponent = -magnitude if negative else magnitude
    return math.ldexp(1.0 + mantissa / (1 << man_bits), exponent)


def code_value(code: int) -> float:
    """The exact value of one HiF8 code (NaN, +-Inf and finite values)."""
    if not 0 <= code <= 0xFF:
        raise ValueError(f"code must be in [0, 255], got {code}")
    if code == NAN_CODE:
        return math.nan
    if code == POS_INF_CODE:
        return math.inf
    if code == NEG_INF_CODE:
        return -math.inf
    value = _decode_magnitude(code & 0x7F)
    return -value if code & SIGN_BIT else value


#: Value of each of the 256 codes.
DECODE_VALUES: Final[tuple[float, ...]] = tuple(code_value(c) for c in range(256))

#: Positive finite magnitudes in ascending order with their codes, zero first.
_FINITE_POSITIVE = sorted(
    (DECODE_VALUES[c], c) for c in range(0x80) if c != POS_INF_CODE
)
POSITIVE_VALUES: Final[tuple[float, ...]] = tuple(v for v, _ in _FINITE_POSITIVE)
POSITIVE_CODES: Final[tuple[int, ...]] = tuple(c for _, c in _FINITE_POSITIVE)

#: Rounding thresholds between neighbouring magnitudes. Round-to-nearest with ties away from
#: zero inside the input's binade rounds a magnitude up exactly when it reaches the arithmetic
#: midpoint to the next HiF8 value (binade edges and the power-of-two denormals included), so
#: ``POSITIVE_CODES[number of thresholds <= |x|]`` is the encoding of any |x| < 40960.
ROUNDING_THRESHOLDS: Final[tuple[float, ...]] = tuple(
    (lo + hi) / 2 for lo, hi in zip(POSITIVE_VALUES, POSITIVE_VALUES[1:])
)

assert len(POSITIVE_VALUES) == 127 and POSITIVE_VALUES[-1] == MAX
assert ROUNDING_THRESHOLDS[0] == UNDERFLOW_THRESHOLD
assert (MAX + 1.5 * MAX) / 2 == OVERFLOW_THRESHOLD
