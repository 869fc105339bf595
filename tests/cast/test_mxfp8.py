"""qfa.cast.mxfp8 against a spec-level MX quantiser written here (Python floats over the
enumerated E4M3 grid of ``mode16_reference``), exhaustively where the format allows; the paired
descale layouts index by index; and the mode-1 attention reference against exact attention."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import attention_reference as ref
import mode16_reference as m16
from qfa.cast import fp8, mxfp8

E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
FINITE_CODES = [c for c in range(256) if c not in (0x7F, 0xFF)]
FINITE_VALUES = [m16.e4m3_value(c) for c in FINITE_CODES]  # +-0 included


def spec_block(values: list[float]) -> tuple[list[float], int]:
    """OCP MX v1.0 for one block (Python floats): the E4M3 element values and the E8M0 code."""
    if not all(math.isfinite(v) for v in values):
        return [math.nan] * len(values), 0xFF
    amax = max(abs(v) for v in values)
    # frexp: amax = f * 2^e with f in [0.5, 1), so floor(log2 amax) = e - 1, exact for any float.
    exponent = -127 if amax == 0 else max(math.frexp(amax)[1] - 1 - 8, -127)
    return [m16.e4m3_nearest(math.ldexp(v, -exponent)) for v in values], exponent + 127


def spec_quantize(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Elements (float64 values) and scale codes of fp32 ``x`` along its last axis, per spec."""
    rows = x.to(torch.float32).reshape(-1, x.shape[-1]).tolist()
    nb = -(-x.shape[-1] // 32)
    elems, codes = [], []
    for row in rows:
        for b in range(nb):
            e, c = spec_block(row[32 * b : 32 * b + 32])
            elems += e
            codes.append(c)
    return np.array(elems).reshape(x.shape), np.array(codes).reshape(*x.shape[:-1], nb)


def values(elements: torch.Tensor) -> np.ndarray:
    return elements.to(torch.float64).numpy()


def codes(scales: torch.Tensor) -> np.ndarray:
    return scales.view(torch.uint8).numpy().astype(np.int64)


def assert_matches_spec(x: torch.Tensor) -> None:
    elements, scales = mxfp8.quantize(x)
    want_e, want_c = spec_quantize(x)
    assert elements.dtype == E4M3 and scales.dtype == E8M0
    assert np.array_equal(codes(scales), want_c)
    got = values(elements)
    assert np.array_equal(got, want_e, equal_nan=True)
    assert np.array_equal(np.signbit(got), np.signbit(want_e))  # the sign of zero too


def varied_blocks(shape, seed: int) -> torch.Tensor:
    """fp32 data whose 32-blocks span fp32's whole range, subnormals included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    nb = -(-shape[-1] // 32)
    exps = torch.randint(-160, 120, (*shape[:-1], nb), generator=g).repeat_interleave(32, -1)[..., : shape[-1]]
    spread = torch.randint(-12, 3, shape, generator=g)  # values well below the block's amax too
    return torch.ldexp(x, (exps + spread).to(torch.float32))


# --- The codes themselves --------------------------------------------------------------------


def test_e4m3_codes_decode_exactly():
    """torch's float8_e4m3fn decodes each of the 256 bytes to the bit layout's value (what
    dequantize relies on), and the grid the spec rounds to is those values in code order."""
    got = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).to(torch.float64).numpy()
    assert np.array_equal(got, m16.E4M3_DECODE, equal_nan=True)
    assert np.array_equal(np.signbit(got), np.arange(256) >= 0x80)
    assert np.isnan(got[[0x7F, 0xFF]]).all() and np.isfinite(np.delete(got, [0x7F, 0xFF])).all()
    assert got[0x7E] == 448 and got[0x01] == 2.0**-9 and got[0x08] == 2.0**-6


def test_e8m0_codes_decode_exactly():
    """Each of the 256 E8M0 bytes is 2^(c - 127), 0xFF NaN: torch's float8_e8m0fnu decode."""
    got = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E8M0).to(torch.float64).numpy()
    assert np.array_equal(got[:255], [math.ldexp(1.0, c - 127) for c in range(255)])
    assert np.isnan(got[255])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_dequantize_every_element_times_every_scale(dtype):
    """All 256 x 256 (element, scale) pairs: the exact product (float64), fp32 where it fits
    (every product has 4 significant bits and is >= 2^-136, so fp32 holds it unless it overflows)."""
    e = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).repeat_interleave(32).repeat(256, 1)
    s = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E8M0).unsqueeze(1).expand(256, 256).contiguous()
    got = mxfp8.dequantize(e, s, dtype=dtype).to(torch.float64).numpy()
    want = np.array([[m16.e4m3_value(c) * m16.e8m0_value(sc) for c in range(256) for _ in range(32)] for sc in range(256)])
    if dtype == torch.float32:
        big = np.abs(want) > np.finfo(np.float32).max
        want = np.where(big, np.copysign(np.inf, want), want)
    assert np.array_equal(got, want, equal_nan=True)
    number = ~np.isnan(want)
    assert np.array_equal(np.signbit(got[number]), np.signbit(want[number]))


@pytest.mark.parametrize("dtype,codes_range", [(torch.float32, range(0, 247)), (torch.bfloat16, range(3, 247)),
                                               (torch.float16, range(112, 135))])
def test_requantising_every_value_at_every_scale_is_identity(dtype, codes_range):
    """Every finite E4M3 value times every scale whose products the dtype holds exactly, in
    blocks anchored by 448 * scale (so the scale is recovered), quantises back to itself."""
    per_block = 31
    vals = FINITE_VALUES + [0.0] * (-len(FINITE_VALUES) % per_block)
    blocks = torch.tensor(vals).view(-1, per_block)
    blocks = torch.cat([torch.full((blocks.shape[0], 1), 448.0), blocks], dim=1).reshape(-1)  # (nblk * 32,)
    c = torch.tensor(list(codes_range))
    scale = torch.ldexp(torch.ones(()), (c - 127).to(torch.float32)).double()
    x = (blocks.double().unsqueeze(0) * scale.unsqueeze(1))  # exact in float64
    assert torch.equal(x.to(dtype).double(), x)  # and in the dtype: these are the useful scales
    elements, scales = mxfp8.quantize(x.to(dtype))
    assert (codes(scales) == c.numpy()[:, None]).all()
    got = values(elements)
    want = blocks.double().unsqueeze(0).expand_as(x).numpy()
    assert np.array_equal(got, want) and np.array_equal(np.signbit(got), np.signbit(want))
    assert torch.equal(mxfp8.dequantize(elements, scales, dtype=torch.float64), x)


# --- The rounding ----------------------------------------------------------------------------


def test_ties_round_to_even():
    """Midpoints between adjacent E4M3 values (subnormals, every binade, both signs) go to the
    neighbour with the even mantissa; one above / below a midpoint goes to the nearer."""
    grid = m16.E4M3_GRID
    mids = [(lo + hi) / 2 for lo, hi in zip(grid, grid[1:])]
    even = [lo if i % 2 == 0 else hi for i, (lo, hi) in enumerate(zip(grid, grid[1:]))]
    assert even[8] == 2.0**-6 and (grid[8] + grid[9]) / 2 == mids[8]  # spot check: 2^-6 is code 8
    above = [float(np.nextafter(np.float32(m), np.float32(np.inf))) for m in mids]
    below = [float(np.nextafter(np.float32(m), np.float32(0))) for m in mids]
    for sign in (1.0, -1.0):
        for column, want in ((mids, even), (above, grid[1:]), (below, grid[:-1])):
            vals = [sign * v for v in column]
            vals += [0.0] * (-len(vals) % 31)
            x = torch.tensor(vals, dtype=torch.float32).view(-1, 31)
            x = torch.cat([torch.full((x.shape[0], 1), 256.0), x], dim=1)  # amax 256: scale 2^0
            elements, scales = mxfp8.quantize(x)
            assert (codes(scales) == 127).all()
            got = values(elements)[:, 1:].reshape(-1)[: len(want)]
            assert np.array_equal(got, sign * np.array(want))
    assert_matches_spec(torch.tensor([mids[:32], below[32:64], above[64:96]], dtype=torch.float32))


def test_values_between_448_and_the_next_binade_saturate():
    """amax in [2^k * 448, 2^(k+1) * 256): the scale is 2^(k) and those values become 448, the
    rest round as usual; both signs and several scales."""
    top = torch.tensor([448.0, 449.0, 463.99, 464.0, 479.0, 480.0, 500.0, 511.99998])
    for k in (-20, 0, 7, 100):
        x = torch.cat([top, -top, torch.linspace(-300, 300, 16)]) * 2.0**k
        elements, scales = mxfp8.quantize(x)
        assert codes(scales).tolist() == [127 + k]
        got = values(elements)
        assert np.array_equal(got[:16], np.concatenate([np.full(8, 448.0), np.full(8, -448.0)]))
        assert_matches_spec(x)


def test_random_blocks_match_spec():
    """Random data over fp32's whole range (subnormal blocks, blocks of mixed magnitudes)."""
    assert_matches_spec(varied_blocks((6, 5, 128), seed=0))
    assert_matches_spec(varied_blocks((4, 3, 72), seed=1))


def test_large_input_matches_spec(path, recwarn):
    """Past the compile threshold the elementwise core runs through TorchInductor on CPU (the
    ``path`` fixture runs it both compiled and eager): the same bits as the spec either way."""
    x = varied_blocks((66, 1000), seed=15)  # 66000 elements, a tail block of 8 per row
    x[0, :40:3] = torch.tensor([math.nan, math.inf, -0.0, 2.0**-149, 464.0, -480.0, 1e38, 0.0, -math.inf, 3.0,
                                -2.0**-130, 5.5, 2.0**-120, 1.0])
    assert x.numel() >= fp8.COMPILE_MIN_ELEMENTS
    assert_matches_spec(x)
    assert not [w for w in recwarn if "torch.compile of" in str(w.message)]  # no silent eager fallback


def test_zero_block_gets_the_smallest_scale_and_keeps_signs():
    x = torch.zeros(2, 64)
    x[0, 1::2] = -0.0
    x[1, 32:] = torch.linspace(-1, 1, 32)
    x[1, 40] = -0.0
    x[1, 41] = -2.0**-20  # rounds to -0 at scale 2^-8
    elements, scales = mxfp8.quantize(x)
    assert codes(scales).tolist() == [[0, 0], [0, 127 - 8]]
    bits = elements.view(torch.uint8)
    assert bits[0, 0::2].eq(0x00).all() and bits[0, 1::2].eq(0x80).all() and bits[1, :32].eq(0).all()
    assert bits[1, 40] == 0x80 and bits[1, 41] == 0x80
    assert_matches_spec(x)


def test_fp32_subnormal_amax():
    """A block of fp32 subnormals: exponent below -126, clamped: scale 2^-127, elements x * 2^127."""
    x = torch.tensor([2.0**-149, -(2.0**-140), 3 * 2.0**-135, 2.0**-127 * 1.5] + [0.0] * 28)
    elements, scales = mxfp8.quantize(x)
    assert codes(scales).tolist() == [0]
    assert values(elements)[:4].tolist() == [0.0, -0.0, 3 * 2.0**-8, 1.5]
    assert_matches_spec(x)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_inf_block_gets_nan_scale(bad):
    x = torch.linspace(-3, 3, 96).view(1, 96)
    x[0, 40] = bad
    elements, scales = mxfp8.quantize(x)
    assert codes(scales).tolist() == [[127 - 7, 0xFF, 127 - 7]]
    assert torch.isnan(elements[0, 32:64].float()).all() and elements.view(torch.uint8)[0, 32:64].eq(0x7F).all()
    back = mxfp8.dequantize(elements, scales)
    assert torch.isnan(back[0, 32:64]).all() and torch.isfinite(back[0, :32]).all() and torch.isfinite(back[0, 64:]).all()
    assert_matches_spec(x)


def test_block_tail_d72():
    """D = 72: two full blocks and a tail of 8 whose scale comes from those 8 alone."""
    x = torch.full((3, 72), 96.0)  # 2^-2 * 384, on the grid
    x[:, 64:] = torch.tensor([0.001, -0.002, 0.003, 0.0, 0.0005, -0.0007, 0.0001, 0.00299])
    elements, scales = mxfp8.quantize(x)
    assert scales.shape == (3, 3)
    assert codes(scales)[:, 2].tolist() == [127 - 9 - 8] * 3  # floor(log2 0.003) = -9
    assert_matches_spec(x)
    assert_matches_spec(varied_blocks((2, 72), seed=4))
    back = mxfp8.dequantize(elements, scales)
    assert back.shape == (3, 72) and torch.equal(back[:, :64], x[:, :64])


@pytest.mark.parametrize("axis", [0, 1, -2])
def test_other_axes(axis):
    """Blocks along any axis: the same as quantising with that axis moved last."""
    x = varied_blocks((40, 3, 72), seed=5).movedim(-1, 0)  # (72, 40, 3)
    elements, scales = mxfp8.quantize(x, axis=axis)
    want_e, want_s = mxfp8.quantize(x.movedim(axis, -1).contiguous())
    assert torch.equal(elements.view(torch.uint8), want_e.movedim(-1, axis).view(torch.uint8))
    assert torch.equal(scales.view(torch.uint8), want_s.movedim(-1, axis).view(torch.uint8))
    expected_shape = list(x.shape)
    expected_shape[axis] = -(-x.shape[axis] // 32)
    assert list(scales.shape) == expected_shape
    assert_matches_spec(x.movedim(axis, -1))
    back = mxfp8.dequantize(elements, scales, axis=axis)
    assert torch.equal(back, mxfp8.dequantize(want_e, want_s).movedim(-1, axis))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_equal_fp32(dtype):
    x = varied_blocks((8, 96), seed=6)
    if dtype == torch.float16:
        x = torch.ldexp(torch.randn(8, 96, generator=torch.Generator().manual_seed(7)),
                        torch.randint(-26, 14, (8, 96), generator=torch.Generator().manual_seed(8)).float())
    xh = x.to(dtype)
    xh[0, :5] = torch.tensor([0.0, -0.0, float("inf"), 1.0, -1.0], dtype=dtype)
    eh, sh = mxfp8.quantize(xh)
    ef, sf = mxfp8.quantize(xh.float())
    assert torch.equal(eh.view(torch.uint8), ef.view(torch.uint8)) and torch.equal(sh.view(torch.uint8), sf.view(torch.uint8))
    back = mxfp8.dequantize(eh, sh, dtype=dtype)
    assert back.dtype == dtype and torch.equal(back[1:].float(), mxfp8.dequantize(ef, sf)[1:].to(dtype).float())


def test_non_contiguous_input_and_input_not_modified():
    x = varied_blocks((64, 72), seed=9)
    keep = x.clone()
    e1, s1 = mxfp8.quantize(x.t(), axis=0)
    e2, s2 = mxfp8.quantize(x.t().contiguous(), axis=0)
    assert torch.equal(x, keep)
    assert torch.equal(e1.view(torch.uint8), e2.view(torch.uint8)) and torch.equal(s1.view(torch.uint8), s2.view(torch.uint8))


def within_half_a_step(back: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> bool:
    """|x - back| <= 2^-4 |x| in E4M3's normal range (|x| >= 2^-6 * scale), <= 2^-10 * scale
    below it (half the subnormal step), and <= |x| - 448 * scale above 448 * scale: amax / scale
    lies in [256, 512), so a block's largest values can saturate, losing up to 12.5 %."""
    x, scale = x.double(), scale.double()
    err = (back.double() - x).abs()
    return bool((err <= torch.maximum(torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * scale), x.abs() - 448 * scale)).all())


def test_dequantize_error_within_half_a_step():
    x = varied_blocks((16, 128), seed=10)
    elements, scales = mxfp8.quantize(x)
    back = mxfp8.dequantize(elements, scales, dtype=torch.float64)
    assert within_half_a_step(back, x, scales.to(torch.float64).repeat_interleave(32, -1))
    assert not within_half_a_step(back * (1 + 2.0**-3), x, scales.to(torch.float64).repeat_interleave(32, -1))


# --- Bad input -------------------------------------------------------------------------------


def test_bad_input():
    x = torch.randn(4, 64)
    with pytest.raises(TypeError, match=r"x must be float32.*float64.*double-round"):
        mxfp8.quantize(x.double())
    with pytest.raises(TypeError, match="x must be float32"):
        mxfp8.quantize(torch.ones(4, 64, dtype=torch.int32))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        mxfp8.quantize([1.0, 2.0])
    with pytest.raises(ValueError, match=r"axis must be in \[-2, 2\).*got 2"):
        mxfp8.quantize(x, axis=2)
    with pytest.raises(TypeError, match="axis must be an int"):
        mxfp8.quantize(x, axis=1.0)
    with pytest.raises(ValueError, match="x must have at least one axis"):
        mxfp8.quantize(torch.tensor(1.0))
    e, s = mxfp8.quantize(x)
    with pytest.raises(TypeError, match="elements must be torch.float8_e4m3fn"):
        mxfp8.dequantize(e.view(torch.uint8), s)
    with pytest.raises(TypeError, match="scales must be torch.float8_e8m0fnu"):
        mxfp8.dequantize(e, s.view(torch.uint8))
    with pytest.raises(ValueError, match=r"scales must have shape \(4, 2\)"):
        mxfp8.dequantize(e, s[:, :1])
    with pytest.raises(ValueError, match=r"scales must have shape \(1, 64\)"):
        mxfp8.dequantize(e, s, axis=0)
    for dtype in (torch.int32, "float32", torch.float8_e4m3fn):
        with pytest.raises(TypeError, match="dtype must be one of"):
            mxfp8.dequantize(e, s, dtype=dtype)


def test_layout_bad_input():
    s = mxfp8.quantize(torch.randn(5, 8, 72))[1]
    with pytest.raises(ValueError, match="layout must be one of"):
        mxfp8.pack_q_descale(s, "BSND")
    with pytest.raises(ValueError, match="num_heads_kv must be a positive int"):
        mxfp8.pack_q_descale(s, "N2TGD")
    with pytest.raises(ValueError, match="num_heads_kv must divide Q_N = 8, got 3"):
        mxfp8.pack_q_descale(s, "N2TGD", num_heads_kv=3)
    with pytest.raises(TypeError, match="scales must be torch.float8_e8m0fnu"):
        mxfp8.pack_q_descale(s.view(torch.uint8))
    with pytest.raises(ValueError, match="head_dim 200 needs 4 scale pairs, the descale holds 2"):
        mxfp8.unpack_q_descale(mxfp8.pack_q_descale(s), 200)
    with pytest.raises(ValueError, match="layout_kv must be one of"):
        mxfp8.pack_k_descale(s, "PA_BSND")
    v = mxfp8.quantize(torch.randn(2, 96, 3, 64), axis=1)[1]  # Bs = 96: not a multiple of 64
    with pytest.raises(ValueError, match="number of 32-key blocks per paged block must be a multiple of 2, got 3"):
        mxfp8.pack_v_descale(v, "PA_BBND")
    with pytest.raises(TypeError, match="sequence of per-sequence tensors"):
        mxfp8.pack_v_descale(s, "TND")
    packed = mxfp8.pack_v_descale([mxfp8.quantize(torch.randn(70, 2, 64), axis=0)[1]])
    with pytest.raises(ValueError, match=r"kv_lens \[200\] need 4 rows"):
        mxfp8.unpack_v_descale(packed, kv_lens=[200])
    with pytest.raises(ValueError, match="kv_lens must be given"):
        mxfp8.unpack_v_descale(packed)
    with pytest.raises(ValueError, match=r"kv_lens must be key counts >= 0, got \[-70, 200\]"):
        mxfp8.unpack_v_descale(packed, kv_lens=(-70, 200))
    two, three = (mxfp8.quantize(torch.randn(40, n, 64), axis=0)[1] for n in (2, 3))
    with pytest.raises(ValueError, match=r"scales\[1\] must be \(ceil\(kv_len/32\), KV_N, D\) with scales\[0\]'s "
                                         r"\(KV_N, D\) = \(2, 64\) on cpu, got \(2, 3, 64\) on cpu"):
        mxfp8.pack_v_descale([two, three])
    with pytest.raises(ValueError, match="paired must have a last axis of 2"):
        mxfp8.unpair_scales(s, 3)
    with pytest.raises(ValueError, match="count must be 3 or 4"):
        mxfp8.unpair_scales(mxfp8.pair_scales(s), 5)


# --- Upstream's paired descale layouts, index by index ----------------------------------------


def random_scales(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 255, shape, generator=g, dtype=torch.int32).to(torch.uint8).view(E8M0)


def _u8(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


@pytest.mark.parametrize("d", [64, 72, 128, 256])
def test_q_descale_tnd_and_n2tgd(d):
    qt, nq, nkv = 5, 8, 2
    g = nq // nkv
    nb = -(-d // 32)
    s = random_scales((qt, nq, nb), seed=d)
    tnd, n2 = mxfp8.pack_q_descale(s), mxfp8.pack_q_descale(s, "N2TGD", num_heads_kv=nkv)
    assert tnd.shape == (qt, nq, -(-d // 64), 2) and n2.shape == (nkv, qt, g, -(-d // 64), 2)
    a, t, p = _u8(s), _u8(tnd), _u8(n2)
    for ti in range(qt):
        for h in range(nq):
            for i in range(-(-d // 64)):
                for j in range(2):
                    want = a[ti, h, 2 * i + j] if 2 * i + j < nb else mxfp8.PAIR_PAD_CODE
                    assert t[ti, h, i, j] == want and p[h // g, ti, h % g, i, j] == want
    assert np.array_equal(_u8(mxfp8.unpack_q_descale(tnd, d)), a)
    assert np.array_equal(_u8(mxfp8.unpack_q_descale(n2, d, "N2TGD")), a)


def _q_descale_views(d: int) -> list[torch.Tensor]:
    """TND q_descales of head dim d: contiguous, one token with an odd stride on its size-1 axis,
    no tokens, and views that are not contiguous (a head slice, a step over tokens, transposed)."""
    packed = mxfp8.pack_q_descale(random_scales((6, 4, -(-d // 32)), seed=d))
    pairs = packed.shape[2]
    odd = packed.view(torch.uint8).as_strided((1, 4, pairs, 2), (999, 2 * pairs, 2, 1)).view(E8M0)
    return [packed, packed[2:3], odd, packed[:0], packed[:, 1:3], packed[::2],
            packed.transpose(0, 1).contiguous().transpose(0, 1)]


@pytest.mark.parametrize("d", [64, 72, 128, 256])
def test_unpack_q_descale_shortcut_is_the_general_path(d):
    """unpack_q_descale's shortcut (TND, D a multiple of 64, a contiguous descale: no pad slot to
    drop) returns what the general path returns: the same bytes, shape, strides and dtype, a view
    of the descale where the general path gives one."""
    for packed in _q_descale_views(d):
        got, want = mxfp8.unpack_q_descale(packed, d), mxfp8._unpack_q_descale(packed, d, "TND")
        assert got.dtype == want.dtype == E8M0
        assert got.shape == want.shape and got.stride() == want.stride()
        assert np.array_equal(_u8(got), _u8(want))
        if want.numel():  # a view of the descale's bytes exactly where the general path gives one
            assert (got.data_ptr() == packed.data_ptr()) == (want.data_ptr() == packed.data_ptr())
        if d % 64 == 0 and packed.is_contiguous():
            assert got._base is not None  # the shortcut's view, never a copy


def test_unpack_q_descale_shortcut_keeps_the_checks():
    """Inputs the shortcut does not take reach the general path's checks, with their messages."""
    packed = mxfp8.pack_q_descale(random_scales((3, 4, 4), seed=1))  # D = 128: 2 pairs
    with pytest.raises(ValueError, match="head_dim 192 needs 3 scale pairs, the descale holds 2"):
        mxfp8.unpack_q_descale(packed, 192)
    with pytest.raises(ValueError, match="head_dim 64 needs 1 scale pairs, the descale holds 2"):
        mxfp8.unpack_q_descale(packed, 64)
    for bad in (True, 128.0, -128, 0):
        with pytest.raises(ValueError, match="head_dim must be a positive int"):
            mxfp8.unpack_q_descale(packed, bad)
    with pytest.raises(TypeError, match="descale must be torch.float8_e8m0fnu, got torch.uint8"):
        mxfp8.unpack_q_descale(packed.view(torch.uint8), 128)
    with pytest.raises(ValueError, match=r"descale must be 5-D q_descale in layout N2TGD, got shape \(3, 4, 2, 2\)"):
        mxfp8.unpack_q_descale(packed, 128, "N2TGD")
    with pytest.raises(ValueError, match="layout must be one of"):
        mxfp8.unpack_q_descale(packed, 128, "BSND")
    with pytest.raises(ValueError, match=r"descale must be 4-D q_descale in layout TND, got shape \(12, 2, 2\)"):
        mxfp8.unpack_q_descale(packed.flatten(0, 1), 128)
    triple = packed.view(torch.uint8).unflatten(-1, (1, 2)).expand(3, 4, 2, 3, 2)[..., 0].contiguous()
    with pytest.raises(ValueError, match="paired must have a last axis of 2"):
        mxfp8.unpack_q_descale(triple.view(E8M0), 128)


@pytest.mark.parametrize("layout", ["TND", "PA_BBND", "PA_BNBD"])
def test_k_descale_nd_layouts(layout):
    shape = {"TND": (37, 3, 72), "PA_BBND": (4, 64, 3, 72), "PA_BNBD": (4, 3, 64, 72)}[layout]
    s = mxfp8.quantize(varied_blocks(shape, seed=11))[1]
    packed = mxfp8.pack_k_descale(s, layout)
    assert packed.shape == (*shape[:-1], 2, 2)
    a, p = _u8(s).reshape(-1, 3), _u8(packed).reshape(-1, 2, 2)
    assert np.array_equal(p[:, 0, :], a[:, :2]) and np.array_equal(p[:, 1, 0], a[:, 2])
    assert (p[:, 1, 1] == mxfp8.PAIR_PAD_CODE).all()
    assert np.array_equal(_u8(mxfp8.unpack_k_descale(packed, 72, layout)), _u8(s))


def test_k_descale_pa_nz():
    """k in PA_NZ (Bn, KV_N, D/32, Bs, 32): its 32-channel blocks are the last axis; k_descale
    (Bn, KV_N, Bs/16, ceil(D/64), 16, 2) holds token s16 * 16 + s, channel block 2 * i + j."""
    bn, n, d, bs = 2, 3, 96, 32
    k = varied_blocks((bn, n, d // 32, bs, 32), seed=12)
    s = mxfp8.quantize(k)[1]
    packed = mxfp8.pack_k_descale(s, "PA_NZ")
    assert packed.shape == (bn, n, bs // 16, 2, 16, 2)
    a, p = _u8(s), _u8(packed)
    for b in range(bn):
        for h in range(n):
            for tok in range(bs):
                for blk in range(4):
                    want = a[b, h, blk, tok, 0] if blk < d // 32 else mxfp8.PAIR_PAD_CODE
                    assert p[b, h, tok // 16, blk // 2, tok % 16, blk % 2] == want
    assert np.array_equal(_u8(mxfp8.unpack_k_descale(packed, d, "PA_NZ")), a)


def test_v_descale_tnd_pads_each_sequence_to_64_keys():
    lens = [5, 64, 65, 130]
    v = varied_blocks((sum(lens), 2, 72), seed=13)
    starts = np.cumsum([0] + lens)
    per_seq = [mxfp8.quantize(v[starts[b] : starts[b + 1]], axis=0)[1] for b in range(len(lens))]
    packed = mxfp8.pack_v_descale(per_seq)
    pairs = [-(-n // 64) for n in lens]
    assert packed.shape == (sum(pairs), 2, 72, 2)
    p = _u8(packed)
    row = 0
    for n, pb, s in zip(lens, pairs, per_seq):
        a = _u8(s)
        for i in range(pb):
            for j in range(2):
                want = a[2 * i + j] if 2 * i + j < a.shape[0] else np.full(a.shape[1:], mxfp8.PAIR_PAD_CODE)
                assert np.array_equal(p[row + i, :, :, j], want)
        row += pb
    back = mxfp8.unpack_v_descale(packed, kv_lens=torch.tensor(lens))
    assert all(np.array_equal(_u8(x), _u8(y)) for x, y in zip(back, per_seq))
    # each sequence's elements dequantise with its unpacked scales (within half a step of v)
    for b, s in enumerate(back):
        seq = v[starts[b] : starts[b + 1]]
        deq = mxfp8.dequantize(mxfp8.quantize(seq, axis=0)[0], s, axis=0, dtype=torch.float64)
        assert within_half_a_step(deq, seq, s.to(torch.float64).repeat_interleave(32, 0)[: seq.shape[0]])


@pytest.mark.parametrize("layout", ["PA_BBND", "PA_BNBD", "PA_NZ"])
def test_v_descale_paged(layout):
    bn, n, bs, d = 3, 2, 128, 64
    shape = {"PA_BBND": (bn, bs, n, d), "PA_BNBD": (bn, n, bs, d), "PA_NZ": (bn, n, d // 32, bs, 32)}[layout]
    v = varied_blocks(shape, seed=14)
    s = mxfp8.quantize(v, axis=mxfp8.V_KEY_AXIS[layout])[1]
    packed = mxfp8.pack_v_descale(s, layout)
    a, p = _u8(s), _u8(packed)
    want_shape = {"PA_BBND": (bn, bs // 64, n, d, 2), "PA_BNBD": (bn, n, bs // 64, d, 2),
                  "PA_NZ": (bn, n, d // 16, bs // 64, 16, 2)}[layout]
    assert packed.shape == want_shape
    for b in range(bn):
        for h in range(n):
            for kb in range(bs // 32):
                for c in range(d):
                    want = {"PA_BBND": lambda: a[b, kb, h, c], "PA_BNBD": lambda: a[b, h, kb, c],
                            "PA_NZ": lambda: a[b, h, c // 32, kb, c % 32]}[layout]()
                    got = {"PA_BBND": lambda: p[b, kb // 2, h, c, kb % 2], "PA_BNBD": lambda: p[b, h, kb // 2, c, kb % 2],
                           "PA_NZ": lambda: p[b, h, c // 16, kb // 2, c % 16, kb % 2]}[layout]()
                    assert got == want
    assert np.array_equal(_u8(mxfp8.unpack_v_descale(packed, layout)), a)


# --- The mode-1 attention reference against exact attention ---------------------------------


def mx_inputs(nq, nkv, sq, skv, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(nq, sq, d, generator=g) * torch.rand(1, 1, d, generator=g) * 4  # channel spread
    k = torch.randn(nkv, skv, d, generator=g) + torch.randn(1, 1, d, generator=g)  # a channel offset
    v = torch.randn(nkv, skv, d, generator=g) * torch.exp(torch.randn(nkv, skv, 1, generator=g))
    (qe, qs), (ke, ks), (ve, vs) = mxfp8.quantize(q), mxfp8.quantize(k), mxfp8.quantize(v, axis=1)
    deq = [m16.decode_e4m3(e) * np.repeat(m16.decode_e8m0(s), 32, axis=ax)[tuple(slice(0, n) for n in e.shape)]
           for e, s, ax in ((qe, qs, 2), (ke, ks, 2), (ve, vs, 1))]
    return (qe, ke, ve, qs, ks, vs), deq


@pytest.mark.parametrize(
    "nq,nkv,sq,skv,d,p_scale,causal,block_n",
    [(2, 1, 7, 600, 72, 1.0, False, 512), (4, 2, 40, 1100, 128, 448.0, True, 512),
     (2, 2, 30, 20, 64, 104.0, True, 512), (2, 1, 33, 97, 256, 1.0, False, 32)],
    ids=["d72-600keys", "gqa-1100keys-causal-p448", "sq>skv-causal-p104", "d256-block32"],
)
def test_mxfp8_reference_vs_exact_attention(nq, nkv, sq, skv, d, p_scale, causal, block_n):
    args, (q, k, v) = mx_inputs(nq, nkv, sq, skv, d, seed=d + skv)
    out, lse = m16.mxfp8_attention(*args, p_scale=p_scale, causal=causal, block_n=block_n)
    worst = m16.check_against_exact(out, lse, q, k, v, p_scale=p_scale, scale=1 / math.sqrt(d), causal=causal,
                                block_n=block_n)
    assert worst > 0  # P was really rounded (the bound is not met by exact equality)


def test_mxfp8_reference_block_size_matters_only_through_p():
    """Key blocks of 32, 64 and 512 give results within the bound of each other's exact
    attention (checked above) and differ: P is quantised relative to the running max."""
    args, _ = mx_inputs(2, 1, 9, 300, 64, seed=3)
    outs = [m16.mxfp8_attention(*args, block_n=b)[0] for b in (32, 64, 512)]
    assert not np.array_equal(outs[0], outs[2])
    with pytest.raises(ValueError, match="block_n must be a multiple of 32"):
        m16.mxfp8_attention(*args, block_n=48)


def test_e4m3_round_is_the_grid_rule():
    """mode16_reference's vectorised P rounding equals the grid search (ties, saturation, signs)."""
    grid = np.array(m16.E4M3_GRID)
    mids = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    rng = np.random.default_rng(0)
    x = np.concatenate([grid, -grid, mids, -mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e9)),
                        rng.random(4000).astype(np.float32) * 512, np.float32([449, 464, 480, 1e30, np.inf, -np.inf, np.nan,
                                                                               2.0**-10, 2.0**-10 * 1.0001, -0.0, 1e-45])])
    x = x.astype(np.float32)
    want = np.array([m16.e4m3_nearest(float(t)) for t in x])
    got = m16.e4m3_round(x)
    assert np.array_equal(got, want, equal_nan=True) and np.array_equal(np.signbit(got), np.signbit(want))
    assert ref.bf16_round_half_away is m16.bf16_round_half_away  # one bf16 rule for every mode


def test_an_empty_axis_has_no_blocks():
    """A sequence with no keys (TND v of length 0) quantises to no elements and no scales."""
    elements, scales = mxfp8.quantize(torch.zeros(0, 2, 64), 0)
    assert elements.shape == (0, 2, 64) and scales.shape == (0, 2, 64) and scales.dtype == mxfp8.E8M0
    assert mxfp8.quantize(torch.zeros(3, 0, 64), -1)[1].shape == (3, 0, 2)
