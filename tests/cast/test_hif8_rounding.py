"""qfa.cast.rounding: the table-free HiF8 rounding of fp32 equals the 65536-entry table gather
bit for bit, exhaustively over the upper 16 bits and on every special, eager and compiled."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qfa.cast import format as fmt
from qfa.cast import luts
from qfa.cast.rounding import round_hif8_top16


def table_rounding(x: torch.Tensor) -> torch.Tensor:
    """What the torch attention path computed before: one gather in the 65536-entry table."""
    index = (x.view(torch.int32) >> 16) & 0xFFFF
    return torch.index_select(luts.round_lut(x.device), 0, index.reshape(-1)).view(x.shape)


def _patterns(low: torch.Tensor) -> torch.Tensor:
    """Every upper-16-bit pattern, each with the low 16 bits ``low``, as fp32 values."""
    high = torch.arange(1 << 16, dtype=torch.int32) << 16
    return (high | low).view(torch.float32)


def _fp32(values) -> torch.Tensor:
    return torch.tensor(np.asarray(values, dtype=np.float32))


def _neighbours(values: list[float]) -> list[float]:
    """Each value and its fp32 neighbours on both sides, with both signs."""
    v = np.asarray(values, dtype=np.float32)
    with np.errstate(over="ignore"):  # float32 max's upper neighbour is Inf, on purpose
        out = np.concatenate([v, np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(0))])
    return list(np.concatenate([out, -out]))


def specials() -> torch.Tensor:
    inf_bits = 0x7F800000
    nans = [inf_bits | 1, inf_bits | 0xFFFF, inf_bits | 0x10000, inf_bits | 0x400000, 0x7FFFFFFF]
    nans += [b | -0x80000000 for b in nans]
    denormals = [1, 2, 0xFFFF, 0x10000, 0x7FFFFF, 0x400000]
    denormals += [b | -0x80000000 for b in denormals]
    bits = torch.tensor(nans + denormals + [0, -0x80000000, inf_bits, inf_bits | -0x80000000], dtype=torch.int32)
    edges = list(fmt.ROUNDING_THRESHOLDS) + list(fmt.POSITIVE_VALUES) + [
        fmt.OVERFLOW_THRESHOLD, fmt.MAX, fmt.MIN_NORMAL, fmt.MIN_DENORMAL, fmt.UNDERFLOW_THRESHOLD,
        float(np.finfo(np.float32).max), float(np.finfo(np.float32).tiny)]
    return torch.cat([bits.view(torch.float32), _fp32(_neighbours(edges))])


def _compiled():
    return torch.compile(round_hif8_top16, dynamic=True, fullgraph=True)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_equals_table_on_every_top16_pattern(compiled):
    fn = _compiled() if compiled else round_hif8_top16
    gen = torch.Generator().manual_seed(10)
    lows = [torch.zeros(1 << 16, dtype=torch.int32), torch.full((1 << 16,), 0xFFFF, dtype=torch.int32),
            torch.randint(0, 1 << 16, (1 << 16,), dtype=torch.int32, generator=gen)]
    x = torch.cat([_patterns(low) for low in lows])
    before = x.clone()
    got, want = fn(x), table_rounding(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))  # input untouched


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_equals_table_on_specials(compiled):
    fn = _compiled() if compiled else round_hif8_top16
    x = specials()
    got = fn(x)
    assert torch.equal(got.view(torch.int32), table_rounding(x).view(torch.int32))
    # And the values are what the format says, independently of the table.
    xs, gs = x.tolist(), got.tolist()
    for xi, gi in zip(xs, gs):
        if math.isnan(xi):
            continue  # a NaN with its payload in the low bits reads as Inf: the table's choice
        if math.isinf(xi):
            assert gi == xi
        elif abs(xi) >= fmt.MAX:
            assert gi == math.copysign(fmt.MAX, xi)
        elif abs(xi) < fmt.UNDERFLOW_THRESHOLD:
            assert gi == 0.0 and math.copysign(1.0, gi) == 1.0  # no -0
    thresholds = _fp32(fmt.ROUNDING_THRESHOLDS)
    # A threshold itself rounds up (ties away): to the next value on the grid.
    assert torch.equal(fn(thresholds), _fp32(fmt.POSITIVE_VALUES[1:]))
    assert torch.equal(fn(-thresholds), -_fp32(fmt.POSITIVE_VALUES[1:]))


def test_nan_gives_the_decode_tables_nan():
    nan_bits = luts.decode_lut(torch.float32)[fmt.NAN_CODE]
    x = torch.tensor([0x7FC00000, 0x7F810000, -0x007F0000], dtype=torch.int32).view(torch.float32)
    assert torch.isnan(x).all()
    assert (round_hif8_top16(x).view(torch.int32) == nan_bits).all()


def test_shapes_and_strides():
    x = torch.randn(64, 48).t()[::2] * 100  # non-contiguous
    got = round_hif8_top16(x)
    assert got.shape == x.shape
    assert torch.equal(got.view(torch.int32), table_rounding(x.contiguous()).view(torch.int32))
