"""The Triton cast kernels under Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py),
bit for bit against the torch path, plus the in-kernel helpers of ``qfa.kernels.hif8``."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import qfa
from qfa.backends import triton_interpreting
from qfa.cast import luts
from qfa.tiling import PLATFORMS, Platform, cast_plan

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
pytestmark = pytest.mark.skipif(not triton_interpreting(), reason="needs TRITON_INTERPRET=1 (set in conftest.py)")

from qfa.kernels import cast as K  # noqa: E402  (imports triton)
from qfa.kernels.hif8 import hif8_decode, hif8_encode, hif8_round_sat  # noqa: E402

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
HALVES = (torch.float16, torch.bfloat16)
MODES = ("saturate", "inf")
BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
#: NaN patterns with a payload no kernel produces: poison for float outputs.
NAN_POISON = {torch.float16: 0x7DA5, torch.bfloat16: 0x7FA5, torch.float32: 0x7FA5A5A5}


def all_patterns(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)


def torch_encode(x: torch.Tensor, overflow: str) -> torch.Tensor:
    return qfa.encode_to_hifloat8(x, overflow=overflow, backend="torch")


def torch_decode(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return qfa.decode_from_hifloat8(codes, dtype, backend="torch")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.dtype]) if t.dtype in BITS else t


def encode_poisoned(x: torch.Tensor, overflow: str, **kw) -> torch.Tensor:
    """Encode twice into outputs poisoned with 0xAA and 0x55: any element left unwritten differs."""
    results = []
    for poison in (0xAA, 0x55):
        out = torch.full((x.numel(),), poison, dtype=torch.uint8)
        assert K.encode(x, overflow, out=out, **kw) is out
        results.append(out)
    assert torch.equal(results[0], results[1])
    return results[0]


def decode_poisoned(codes: torch.Tensor, dtype: torch.dtype, **kw) -> torch.Tensor:
    out = torch.full((codes.numel(),), NAN_POISON[dtype], dtype=BITS[dtype]).view(dtype)
    assert K.decode(codes, dtype, out=out, **kw) is out
    return out


def fp32_specials() -> torch.Tensor:
    f = torch.tensor
    values = [0.0, -0.0, 1.0, -1.0, 1.0625, 15.5, 18.0, 28672.0, 32768.0, 40959.996, 40960.0, -40960.0, 65504.0,
              1e30, -1e30, 1e-30, -1e-30, 2.0**-22, 2.0**-23, 1.5 * 2.0**-17, 1.5 * 2.0**-16, 2.0**-15,
              math.inf, -math.inf, math.nan, 3.4028234663852886e38, 1.401298464324817e-45]
    patterns = [0x7F800001, 0xFF800001, 0x7F80FFFF, 0x7F808000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800000,
                0x00000001, 0x80000001, 0x007FFFFF, 0x34000000, 0x33FFFFFF, 0x471FFFFF, 0x47200000]
    as_int = f([p - (1 << 32) if p >= 1 << 31 else p for p in patterns], dtype=torch.int32).view(torch.float32)
    x = torch.cat([f(values, dtype=torch.float32), as_int])
    # every HiF8 level and every midpoint, with neighbours 1 and 2 ulps away
    levels = torch.tensor([v for v in qfa.cast.format.POSITIVE_VALUES], dtype=torch.float64)
    mids = torch.tensor(qfa.cast.format.ROUNDING_THRESHOLDS, dtype=torch.float64)
    grid = torch.cat([levels, mids]).to(torch.float32)
    near = [grid]
    for k in (1, 2):
        near.append(grid.view(torch.int32).add(k).view(torch.float32))
        near.append(grid.view(torch.int32).sub(k).clamp_min(0).view(torch.float32))
    pos = torch.cat([x, *near])
    return torch.cat([pos, -pos])


def random_fp32(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g).view(torch.float32)


# --------------------------------------------------------------------------- bit-exact


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("overflow", MODES)
def test_encode_all_half_patterns(dtype, overflow):
    x = all_patterns(dtype)
    expected = torch_encode(x, overflow)
    assert torch.equal(qfa.encode_to_hifloat8(x, overflow=overflow, backend="triton"), expected)
    assert torch.equal(encode_poisoned(x, overflow), expected)
    assert torch.equal(bits(x), bits(all_patterns(dtype)))  # input unmodified


@pytest.mark.parametrize("overflow", MODES)
def test_encode_fp32(overflow):
    # specials, levels and midpoints, low-payload NaNs, random patterns, and every upper half
    # (the code depends only on the upper 16 bits, apart from NaN) with odd low halves
    upper = torch.arange(65536, dtype=torch.int32) << 16
    sweep = torch.cat([upper | low for low in (0, 1, 0x8000, 0xFFFF)]).view(torch.float32)
    x = torch.cat([fp32_specials(), random_fp32(100_003, seed=1), sweep])
    x_before = x.clone()
    expected = torch_encode(x, overflow)
    got = qfa.encode_to_hifloat8(x, overflow=overflow, backend="triton")
    assert torch.equal(got, expected)
    assert torch.equal(encode_poisoned(x, overflow), expected)
    assert torch.equal(bits(x), bits(x_before))
    nan_low = torch.tensor([0x7F800001, 0x7F80FFFF, -8388607], dtype=torch.int32).view(torch.float32)  # -8388607 = 0xFF800001
    assert K.encode(nan_low, overflow).tolist() == [0x80, 0x80, 0x80]


@pytest.mark.parametrize("dtype", FLOATS)
def test_decode_all_codes(dtype):
    codes = torch.arange(256, dtype=torch.uint8)
    expected = torch_decode(codes, dtype)
    assert torch.equal(bits(qfa.decode_from_hifloat8(codes, dtype, backend="triton")), bits(expected))
    assert torch.equal(bits(decode_poisoned(codes, dtype)), bits(expected))
    assert torch.equal(codes, torch.arange(256, dtype=torch.uint8))


def test_public_api_shapes_through_triton():
    x = torch.randn(3, 37, 5, dtype=torch.bfloat16).transpose(0, 2)  # non-contiguous
    codes = qfa.encode_to_hifloat8(x, backend="triton")
    assert codes.shape == x.shape and torch.equal(codes, torch_encode(x, "saturate"))
    back = qfa.decode_from_hifloat8(codes, torch.float16, backend="triton")
    assert back.shape == x.shape and torch.equal(bits(back), bits(torch_decode(codes, torch.float16)))
    scalar = torch.tensor(1.0625)
    assert qfa.encode_to_hifloat8(scalar, backend="triton").item() == 0x09
    assert qfa.encode_to_hifloat8(torch.empty(0, 3), backend="triton").shape == (0, 3)
    assert K.encode(torch.empty(0), "saturate").shape == (0,)
    assert K.decode(torch.empty(0, dtype=torch.uint8), torch.float32).shape == (0,)


# --------------------------------------------------------------------------- the plan drives the launch

#: Sizes for the cpu-interpreter platform: checked below to hit every DataCopy branch (copy-in and
#: copy-out), a ragged tail, a program with several tiles and a single-element launch.
INTERP_SIZES = (1, 1000, 3 * 65536 + 17, 8 * 65536 + 12345)


def test_interpreter_sizes_hit_every_branch():
    platform = PLATFORMS["cpu-interpreter"]
    for op in ("encode", "decode"):
        for dtype in FLOATS:
            branches_in, branches_out, ragged, multi = set(), set(), False, False
            for n in INTERP_SIZES:
                plan = cast_plan(op, n, dtype, platform, "saturate" if op == "encode" else None)
                branches_in |= {c.copy_in.branch for c in plan.copies}
                branches_out |= {c.copy_out.branch for c in plan.copies}
                ragged |= plan.last_tail % 32 != 0
                multi |= plan.tiles_per_program > 1 and plan.grid > 1
            assert branches_in | branches_out == {"single", "blocks", "halves"}, (op, dtype)
            wide = branches_in if (op == "encode") else branches_out  # the 2- or 4-byte side
            assert wide == {"single", "blocks", "halves"}, (op, dtype)
            assert ragged and multi


@pytest.mark.parametrize("dtype", FLOATS)
def test_interpreter_plan_sizes(dtype):
    for i, n in enumerate(INTERP_SIZES):
        if dtype == torch.float32:
            x = random_fp32(n, seed=10 + i)
        else:
            g = torch.Generator().manual_seed(20 + i)
            x = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int32, generator=g).to(torch.int16).view(dtype)
        for overflow in MODES:
            assert torch.equal(encode_poisoned(x, overflow), torch_encode(x, overflow)), (n, overflow)
        codes = torch_encode(x, "saturate")
        assert torch.equal(bits(decode_poisoned(codes, dtype)), bits(torch_decode(codes, dtype))), n


def _odd_platforms() -> list[Platform]:
    """Platforms whose plans exercise the other kernel paths: non-power-of-two tiles (several
    sub-blocks), many tiles per program, a capped non-persistent grid, and the real tables."""
    return [
        PLATFORMS["atlas-a2"],
        dataclasses.replace(PLATFORMS["cuda"], vector_cores=132, cube_cores=132),
        Platform(name="odd-persistent", ub_bytes=32768 + 5 * 96 + 100, vector_cores=3, cube_cores=3,
                 max_grid=65535, persistent=True),
        Platform(name="odd-grid", ub_bytes=5 * 1000, vector_cores=None, cube_cores=None, max_grid=7,
                 persistent=False, lut_on_chip=False),
    ]


@pytest.mark.parametrize("platform", _odd_platforms(), ids=lambda p: p.name)
def test_other_platform_plans(platform):
    n = 12_289 if platform.name.startswith("odd") else 50_001  # tiny tiles are slow to interpret
    for dtype in FLOATS:
        x = random_fp32(n, seed=3).to(dtype) if dtype != torch.float32 else random_fp32(n, seed=3)
        plan = K.encode_plan(x, "saturate", platform)
        assert plan.platform == platform.name
        if platform.name.startswith("odd"):
            assert plan.sub_blocks > 1 or plan.tile != plan.block or plan.tiles_per_program > 1
        assert torch.equal(encode_poisoned(x, "saturate", platform=platform), torch_encode(x, "saturate"))
        codes = torch_encode(x, "inf")
        assert torch.equal(bits(decode_poisoned(codes, dtype, platform=platform)), bits(torch_decode(codes, dtype)))


def test_launch_uses_the_plan():
    """Launching with a plan one program short leaves exactly the last program's range unwritten:
    the grid and per-program ranges really come from the plan."""
    x = random_fp32(3 * 65536 + 17, seed=5).to(torch.bfloat16)
    plan = K.encode_plan(x, "saturate")
    assert plan == cast_plan("encode", x.numel(), torch.bfloat16, PLATFORMS["cpu-interpreter"], "saturate")
    assert plan.grid > 1
    out = torch.full((x.numel(),), 0xAA, dtype=torch.uint8)
    lut = luts.half_space_lut(torch.bfloat16, "saturate")
    K._launch(dataclasses.replace(plan, grid=plan.grid - 1), x.view(torch.int16), out, lut, decode=False)
    start, end = plan.program_range(plan.grid - 1)
    expected = torch_encode(x, "saturate")
    assert torch.equal(out[:start], expected[:start])
    assert (out[start:] == 0xAA).all()

    seen = []
    original = K._launch

    def spy(plan, *args, **kwargs):
        seen.append(plan)
        return original(plan, *args, **kwargs)

    try:
        K._launch = spy
        K.decode(expected, torch.float32)
    finally:
        K._launch = original
    assert seen == [cast_plan("decode", x.numel(), torch.float32, "cpu-interpreter")]


def test_kernel_module_bad_inputs():
    x = torch.zeros(10, dtype=torch.float16)
    with pytest.raises(ValueError, match="1-D contiguous"):
        K.encode(torch.zeros(2, 5, dtype=torch.float16), "saturate")
    with pytest.raises(ValueError, match="1-D contiguous"):
        K.encode(torch.zeros(20, dtype=torch.float16)[::2], "saturate")
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        K.encode(torch.zeros(10, dtype=torch.float64), "saturate")
    with pytest.raises(ValueError, match="overflow"):
        K.encode(x, "wrap")
    with pytest.raises(ValueError, match="out must be"):
        K.encode(x, "saturate", out=torch.empty(9, dtype=torch.uint8))
    with pytest.raises(ValueError, match="out must be"):
        K.encode(x, "saturate", out=torch.empty(10, dtype=torch.int8))
    with pytest.raises(TypeError, match="torch.uint8"):
        K.decode(torch.zeros(10, dtype=torch.int8), torch.float16)
    with pytest.raises(TypeError, match="dtype must be"):
        K.decode(torch.zeros(10, dtype=torch.uint8), torch.float64)
    with pytest.raises(ValueError, match="unknown platform"):
        K.encode(x, "saturate", platform="tpu")


# --------------------------------------------------------------------------- in-kernel helpers


@triton.jit
def _round_sat_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, hif8_round_sat(tl.load(x_ptr + offs, mask=mask, other=0.0)), mask=mask)


@triton.jit
def _encode_decode_kernel(x_ptr, code_ptr, val_ptr, lut_ptr, dec_ptr, n, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    code = hif8_encode(tl.load(x_ptr + offs, mask=mask, other=0.0), lut_ptr)
    tl.store(code_ptr + offs, code.to(tl.uint8), mask=mask)
    tl.store(val_ptr + offs, hif8_decode(code, dec_ptr, DTYPE), mask=mask)


def round_sat_twin(x: torch.Tensor) -> torch.Tensor:
    """torch twin of ``hif8_round_sat``: the same integer algorithm, step for step."""
    ax = x.abs()
    a = ax.view(torch.int32)
    m = ((ax >= 2.0**-15) & (ax < 2.0**16)).to(torch.int32)
    m += ((ax >= 2.0**-7) & (ax < 2.0**8)).to(torch.int32)
    m += ((ax >= 2.0**-3) & (ax < 2.0**4)).to(torch.int32)
    half = torch.full_like(a, 1 << 22) >> m
    r = ((a + half) & -(half + half)).view(torch.float32)
    r = torch.where(ax < 2.0**-22, torch.where(ax >= 2.0**-23, 2.0**-22, 0.0), r)
    r = torch.where(ax >= 32768.0, 32768.0, r)
    r = torch.where(x <= -(2.0**-23), -r, r)
    return torch.where(x == x, r, x)


def round_sat_reference(x: torch.Tensor) -> torch.Tensor:
    """The spec: decode(encode(x, saturate)) with Inf -> +-MAX (saturation has no Inf)."""
    y = torch_decode(torch_encode(x, "saturate"), torch.float32)
    return torch.where(torch.isinf(y), torch.copysign(torch.tensor(32768.0), y), y)


def assert_same_values(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-exact (so +0 vs -0 counts), NaN only where NaN is expected."""
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got), nan)
    bad = (got.view(torch.int32) != expected.view(torch.int32)) & ~nan
    assert not bad.any(), (got[bad][:8].tolist(), expected[bad][:8].tolist())


def test_round_sat_twin_against_spec():
    """Exhaustive over what the rounding reads: every upper half (sign, exponent, 7 mantissa
    bits) with 64 low halves, plus the specials. The low 16 bits never decide the result: every
    threshold is a power of two or one bit above one, all inside the upper half."""
    upper = torch.arange(65536, dtype=torch.int32) << 16
    lows = torch.cat([torch.tensor([0, 1, 0x7FFF, 0x8000, 0xFFFF]), torch.randint(0, 65536, (59,), generator=torch.Generator().manual_seed(7))])
    x = (upper[:, None] | lows[None, :].to(torch.int32)).reshape(-1).view(torch.float32)
    x = torch.cat([x, fp32_specials()])
    assert x.numel() > 4_000_000
    assert_same_values(round_sat_twin(x), round_sat_reference(x))


def test_round_sat_kernel():
    upper = torch.arange(65536, dtype=torch.int32) << 16
    x = torch.cat([(upper | low).view(torch.float32) for low in (0, 0x8000, 0xFFFF)])
    x = torch.cat([x, fp32_specials(), random_fp32(65536, seed=9)])
    y = torch.full_like(x, float("nan"))
    block = 65536
    _round_sat_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), BLOCK=block)
    assert_same_values(y, round_sat_twin(x))
    assert_same_values(y, round_sat_reference(x))
    spot = torch.tensor([15.5, 18.0, 28672.0, 40960.0, math.inf, -math.inf, -1e-30, 2.0**-23, 1.5 * 2.0**-17, 0.75])
    out = torch.empty_like(spot)
    _round_sat_kernel[(1,)](spot, out, spot.numel(), BLOCK=16)
    assert out.tolist() == [16.0, 20.0, 32768.0, 32768.0, 32768.0, -32768.0, 0.0, 2.0**-22, 2.0**-16, 0.75]
    assert math.copysign(1.0, out[6].item()) == 1.0  # no -0


@pytest.mark.parametrize("dtype", FLOATS)
def test_encode_decode_helpers_on_values(dtype):
    """``hif8_encode`` on fp16/bf16/fp32 values (not bit patterns) and ``hif8_decode``."""
    x = all_patterns(dtype) if dtype != torch.float32 else torch.cat([fp32_specials(), random_fp32(30000, seed=4)])
    n = x.numel()
    codes = torch.empty(n, dtype=torch.uint8)
    values = torch.empty(n, dtype=dtype)
    tl_dtype = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]
    lut = luts.half_space_lut(luts.table_dtype(dtype), "inf")
    _encode_decode_kernel[(triton.cdiv(n, 65536),)](x, codes, values, lut, luts.decode_lut(dtype), n, BLOCK=65536, DTYPE=tl_dtype)
    expected = torch_encode(x, "inf")
    assert torch.equal(codes, expected)
    assert torch.equal(bits(values), bits(torch_decode(expected, dtype)))
