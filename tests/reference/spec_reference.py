"""HiFloat8 as the spec (docs/spec/hif8-format.md) states it, one value at a time.

This is the tests' independent oracle: it must not import qfa, so a mistake in qfa's format
module, LUT builder or thresholds cannot hide in both sides of a comparison. It rounds by the
spec's procedure (the input's binade, its mantissa bits, the first dropped bit) rather than by
a table of midpoints, and it assembles and parses codes from the bit-layout table.

Values are Python floats: every fp32, fp16 and bf16 value (subnormals included) is exactly a
float64, and scaling one by a power of two stays exact, so no step below rounds.
"""

from __future__ import annotations

import math

#: The bit-layout table: (Dot prefix, D exponent bits). The mantissa gets the rest of the 7
#: magnitude bits, and the exponent field is its sign (1 = negative) then |E| - 2^(D-1).
ROWS = (("11", 4), ("10", 3), ("01", 2), ("001", 1), ("0001", 0))
DENORMAL_DOT = "0000"  # then M = 1..7 for 2^(M-23); M = 0 is zero
DENORMAL_EXPONENTS = range(-22, -15)

OVERFLOW_MODES = ("saturate", "inf")
OVERFLOW_THRESHOLD = 40960.0  # 1.25 * 2^15, the midpoint from MAX to the slot Inf takes
NAN = 0x80
ZERO = 0x00


def _row(magnitude: int) -> tuple[str, int]:
    """The layout row holding exponents +-magnitude."""
    for dot, d in ROWS:
        low = 0 if d == 0 else 1 << (d - 1)
        high = 0 if d == 0 else (1 << d) - 1
        if low <= magnitude <= high:
            return dot, d
    raise ValueError(f"no layout row holds exponent magnitude {magnitude}")


def mantissa_bits(e: int) -> int:
    """Mantissa bits kept in binade 2^e: whatever the row leaves of the 7 magnitude bits."""
    if e in DENORMAL_EXPONENTS:
        return 0
    dot, d = _row(abs(e))
    return 7 - len(dot) - d


def assemble(negative: bool, e: int, mantissa: int) -> int:
    """The code of (-1)^negative * 2^e * (1 + mantissa / 2^m(e)), built bit by bit."""
    if e in DENORMAL_EXPONENTS:
        assert mantissa == 0
        bits = DENORMAL_DOT + format(e + 23, "03b")
    else:
        dot, d = _row(abs(e))
        exponent = ""
        if d > 0:
            exponent = ("1" if e < 0 else "0") + (format(abs(e) - (1 << (d - 1)), f"0{d - 1}b") if d > 1 else "")
        m = 7 - len(dot) - d
        assert 0 <= mantissa < 1 << m
        bits = dot + exponent + (format(mantissa, f"0{m}b") if m else "")
    assert len(bits) == 7, bits
    return int(bits, 2) | (0x80 if negative else 0)


MAX = assemble(False, 15, 0)  # 2^15
POS_INF = assemble(False, 15, 1)  # Inf takes the slot of 1.5 * 2^15
NEG_INF = assemble(True, 15, 1)


def encode(x: float, overflow: str = "saturate") -> int:
    """The HiF8 code of the fp32/fp16/bf16 value ``x`` (given exactly as a Python float)."""
    if overflow not in OVERFLOW_MODES:
        raise ValueError(overflow)
    if math.isnan(x):
        return NAN
    negative = math.copysign(1.0, x) < 0
    a = abs(x)
    if math.isinf(a):
        return NEG_INF if negative else POS_INF
    if a >= OVERFLOW_THRESHOLD:
        if overflow == "inf":
            return NEG_INF if negative else POS_INF
        return assemble(negative, 15, 0)
    if a < 2.0**-23:
        return ZERO  # -0.0 and tiny negatives included: there is no -0
    if a < 2.0**-22:
        return assemble(negative, -22, 0)

    e = math.frexp(a)[1] - 1  # floor(log2 a), exactly
    m = mantissa_bits(e)
    scaled = math.ldexp(a, m - e)  # in [2^m, 2^(m+1)): the kept bits are its integer part
    kept = math.floor(scaled)
    if math.floor(scaled * 2) & 1:  # the first dropped bit: ties and above go away from zero
        kept += 1
    if kept == 2 << m:  # carry out of the mantissa into the next binade
        e, kept = e + 1, 1 << m
    assert e <= 15, "below the overflow threshold rounding stays finite"
    return assemble(negative, e, kept - (1 << m))


def decode(code: int) -> float:
    """The value of a code, parsed from the bit layout."""
    if code == NAN:
        return math.nan
    if code in (POS_INF, NEG_INF):
        return -math.inf if code & 0x80 else math.inf
    sign = -1.0 if code & 0x80 else 1.0
    bits = format(code & 0x7F, "07b")
    if bits.startswith(DENORMAL_DOT):
        m = int(bits[4:], 2)
        return 0.0 if m == 0 else sign * 2.0 ** (m - 23)
    for dot, d in ROWS:
        if bits.startswith(dot):
            exponent, mantissa = bits[len(dot) : len(dot) + d], bits[len(dot) + d :]
            e = 0
            if d > 0:
                e = (1 << (d - 1)) + int(exponent[1:] or "0", 2)
                e = -e if exponent[0] == "1" else e
            return sign * 2.0**e * (1 + int(mantissa, 2) / 2 ** len(mantissa))
    raise AssertionError("the Dot prefixes cover every 7-bit pattern")
