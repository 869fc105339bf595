"""qfa.cast.fp8: the E4M3 rounding against the grid rule of ``mode16_reference``, quant_mode 6's
per-token-head and per-head scales against a spec-level quantiser written here (numpy fp32
division, Python floats), and the mode-6 attention reference against exact attention."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import mode16_reference as m16
from qfa.cast import fp8

E4M3 = torch.float8_e4m3fn


def grid_round(x: np.ndarray) -> np.ndarray:
    return np.array([m16.e4m3_nearest(float(t)) for t in np.asarray(x, dtype=np.float32).reshape(-1)]).reshape(np.shape(x))


def spec_quantize(x: torch.Tensor, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(element values, fp32 scale per group) by the rule: scale = fp32(amax / 448), 1 where that
    is 0, NaN for a group with NaN/Inf (elements NaN too); elements = E4M3(fp32(x / scale)).
    ``groups`` labels each element of x with its scale's index."""
    a = x.to(torch.float32).numpy().reshape(-1)
    g = groups.reshape(-1)
    n = int(g.max()) + 1
    scale = np.empty(n, dtype=np.float32)
    elems = np.empty(a.shape)
    for i in range(n):
        member = a[g == i]
        if not np.isfinite(member).all():
            scale[i] = np.nan
            elems[g == i] = np.nan
            continue
        s = np.float32(np.abs(member).max()) / np.float32(448)  # numpy fp32 division: IEEE, rounded once
        scale[i] = s if s != 0 else np.float32(1)
        elems[g == i] = grid_round((member / scale[i]).astype(np.float32))
    return elems.reshape(x.shape), scale


def values(elements: torch.Tensor) -> np.ndarray:
    return elements.to(torch.float64).numpy()


def same(got: np.ndarray, want: np.ndarray) -> bool:
    number = ~np.isnan(want)
    return np.array_equal(got, want, equal_nan=True) and np.array_equal(np.signbit(got[number]), np.signbit(want[number]))


def varied_rows(shape, seed: int) -> torch.Tensor:
    """fp32 rows whose magnitudes span fp32's range (one exponent per row, spread within it)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    row_exp = torch.randint(-140, 120, (*shape[:-1], 1), generator=g)
    return torch.ldexp(x, (row_exp + torch.randint(-10, 1, shape, generator=g)).to(torch.float32))


# --- The E4M3 rounding -----------------------------------------------------------------------


def test_round_to_e4m3_is_the_grid_rule():
    """Every E4M3 value, every midpoint and its fp32 neighbours, both signs; random fp32 over the
    whole range (subnormals, huge values); +-Inf, NaN, +-0."""
    grid = np.array(m16.E4M3_GRID)
    mids = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    rng = np.random.default_rng(0)
    rand = (rng.standard_normal(20000) * np.exp2(rng.integers(-150, 128, 20000))).astype(np.float32)
    x = np.concatenate([grid, mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e9)),
                        rng.random(5000) * 520, rand,
                        np.float32([448, 449, 463.99, 464, 479.99, 480, 512, 3e38, np.inf, np.nan, 2.0**-10,
                                    np.nextafter(np.float32(2.0**-10), np.float32(1)), 1e-45, 0.0])]).astype(np.float32)
    x = np.concatenate([x, -x])
    got = values(fp8.round_to_e4m3(torch.from_numpy(x)))
    want = grid_round(x)
    assert same(got, want)
    assert (got[np.isfinite(x)] <= 448).all() and not np.isnan(got[~np.isnan(x)]).any()
    assert np.array_equal(m16.e4m3_round(x), want, equal_nan=True)  # the reference's P rounding too


def test_ties_go_to_even():
    grid = m16.E4M3_GRID
    mids = torch.tensor([(lo + hi) / 2 for lo, hi in zip(grid, grid[1:])], dtype=torch.float32)
    got = values(fp8.round_to_e4m3(mids))
    even = np.array([lo if i % 2 == 0 else hi for i, (lo, hi) in enumerate(zip(grid, grid[1:]))])
    assert np.array_equal(got, even)
    assert got[np.searchsorted(grid, 1.0)] == 1.0  # (1 + 1.125) / 2 -> 1.0, mantissa 000


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_round_half_inputs(dtype):
    x = varied_rows((64, 64), seed=1).to(dtype)
    assert torch.equal(fp8.round_to_e4m3(x).view(torch.uint8), fp8.round_to_e4m3(x.float()).view(torch.uint8))


# --- Per token and head (q, k), per head (v) ---------------------------------------------------


def test_per_token_head_q_matches_spec():
    """q (Q_N, Q_T, D): one scale per (head, token); zero rows, a NaN row and an Inf row."""
    x = varied_rows((4, 9, 128), seed=2)
    x[0, 0] = 0.0
    x[0, 1] = -0.0
    x[1, 2, 5] = float("nan")
    x[2, 3, 7] = float("-inf")
    x[3, 4] = 2.0**-149  # amax / 448 underflows to 0: scale 1, elements 0
    keep = x.clone()
    elements, scale = fp8.quantize_per_token_head(x)
    assert torch.equal(x.view(torch.int32), keep.view(torch.int32))  # the input is not modified
    assert elements.dtype == E4M3 and elements.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (4, 9)
    want_e, want_s = spec_quantize(x, np.arange(4 * 9).repeat(128))
    assert same(values(elements), want_e)
    assert same(scale.numpy().astype(np.float64), want_s.reshape(4, 9).astype(np.float64))
    assert scale[0, 0] == 1 and scale[0, 1] == 1 and scale[3, 4] == 1
    assert elements.view(torch.uint8)[0, 1].eq(0x80).all() and elements.view(torch.uint8)[0, 0].eq(0).all()
    assert torch.isnan(scale[1, 2]) and torch.isnan(scale[2, 3])
    assert elements.view(torch.uint8)[1, 2].eq(fp8.E4M3_NAN_CODE).all()


def test_large_inputs_match_spec(path, recwarn):
    """Past the compile threshold the core runs through TorchInductor on CPU (the ``path``
    fixture runs it both compiled and eager): the same bits as the spec either way."""
    x = varied_rows((4, 130, 128), seed=8)  # 66560 elements
    x[0, 0, :6] = torch.tensor([math.nan, 1.0, 2.0, 3.0, 4.0, 5.0])
    x[1, 1] = 0.0
    assert x.numel() >= fp8.COMPILE_MIN_ELEMENTS
    elements, scale = fp8.quantize_per_token_head(x)
    want_e, want_s = spec_quantize(x, np.arange(4 * 130).repeat(128))
    assert same(values(elements), want_e) and same(scale.numpy().reshape(-1).astype(np.float64), want_s.astype(np.float64))
    elements, scale = fp8.quantize_per_head(x[1:], head_axis=0)
    want_e, want_s = spec_quantize(x[1:], np.arange(3).repeat(130 * 128))
    assert same(values(elements), want_e) and np.array_equal(scale.numpy(), want_s)
    got = values(fp8.round_to_e4m3(x * 1000))
    assert same(got, grid_round((x * 1000).numpy()))
    assert not [w for w in recwarn if "torch.compile of" in str(w.message)]  # no silent eager fallback


def test_per_token_head_paged_k_matches_spec():
    """Paged k (Bn, KV_N, 128, D): scale (Bn, KV_N, 128)."""
    x = varied_rows((3, 2, 128, 64), seed=3)
    elements, scale = fp8.quantize_per_token_head(x)
    assert scale.shape == (3, 2, 128)
    want_e, want_s = spec_quantize(x, np.arange(3 * 2 * 128).repeat(64))
    assert same(values(elements), want_e) and np.array_equal(scale.numpy().reshape(-1), want_s)


def test_row_max_lands_on_448_or_saturates():
    """amax / scale is 448 up to the fp32 rounding of scale and of the quotient: where those
    push it above 448 the element saturates to 448 (never NaN, never 480)."""
    rng = np.random.default_rng(4)
    amax = (rng.random(4000) * 1e3 + 1).astype(np.float32)
    scale = amax / np.float32(448)
    quotient = amax / scale
    assert (quotient > 448).any() and (quotient < 448).any()  # both happen in this sample
    x = torch.zeros(4000, 16)
    x[:, 0] = torch.from_numpy(amax)
    x[:, 1] = -torch.from_numpy(amax)
    elements, got_scale = fp8.quantize_per_token_head(x)
    assert np.array_equal(got_scale.numpy(), scale)
    top = values(elements)[:, 0]
    assert np.array_equal(top, grid_round(quotient)) and (top == 448).all()
    assert (values(elements)[:, 1] == -448).all()


def test_ties_in_a_row_with_unit_scale():
    """A row with amax 448 has scale exactly 1, so its other values round on their own: ties to even."""
    grid = m16.E4M3_GRID
    mids = [(lo + hi) / 2 for lo, hi in zip(grid, grid[1:])]
    x = torch.tensor([448.0] + mids + [-m for m in mids], dtype=torch.float32).unsqueeze(0)
    elements, scale = fp8.quantize_per_token_head(x)
    assert scale.tolist() == [1.0]
    assert same(values(elements), grid_round(x.numpy()))


def test_per_head_v_matches_spec():
    """v in PA_BNBD (Bn, KV_N, 128, D): one scale per kv head over all blocks and tokens."""
    x = varied_rows((3, 4, 128, 32), seed=5)
    x[:, 1] = 0.0
    x[2, 3, 7, 1] = float("inf")
    elements, scale = fp8.quantize_per_head(x)
    assert scale.shape == (4,)
    want_e, want_s = spec_quantize(x, np.broadcast_to(np.arange(4)[None, :, None, None], x.shape).copy())
    assert same(values(elements), want_e) and same(scale.numpy().astype(np.float64), want_s.astype(np.float64))
    assert scale[1] == 1 and torch.isnan(scale[3])
    e0, s0 = fp8.quantize_per_head(x.movedim(1, 0), head_axis=0)
    assert torch.equal(e0.view(torch.uint8), elements.movedim(1, 0).view(torch.uint8)) and same(s0.numpy(), scale.numpy())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_equal_fp32(dtype):
    x = torch.randn(6, 10, 128, generator=torch.Generator().manual_seed(6)).to(dtype)
    for quantise in (fp8.quantize_per_token_head, fp8.quantize_per_head):
        eh, sh = quantise(x)
        ef, sf = quantise(x.float())
        assert torch.equal(eh.view(torch.uint8), ef.view(torch.uint8)) and torch.equal(sh, sf)


def test_dequantize_is_the_fp32_product():
    x = varied_rows((5, 7, 64), seed=7)
    elements, scale = fp8.quantize_per_token_head(x)
    want = values(elements).astype(np.float32) * scale.numpy()[..., None]  # numpy fp32: rounded once
    assert np.array_equal(fp8.dequantize_per_token_head(elements, scale).numpy(), want)
    exact = fp8.dequantize_per_token_head(elements, scale, dtype=torch.float64).numpy()
    assert np.array_equal(exact, values(elements) * scale.numpy().astype(np.float64)[..., None])
    assert fp8.dequantize_per_token_head(elements, scale, dtype=torch.bfloat16).dtype == torch.bfloat16
    ev, sv = fp8.quantize_per_head(x, head_axis=1)
    want = values(ev).astype(np.float32) * sv.numpy()[None, :, None]
    assert np.array_equal(fp8.dequantize_per_head(ev, sv, head_axis=1).numpy(), want)
    # and the round trip is within half a step: 2^-4 relative, 2^-10 * scale for subnormals
    # (elements never exceed 448, so nothing saturates beyond fp32's rounding of the scale)
    back = fp8.dequantize_per_token_head(elements, scale, dtype=torch.float64)
    bound = torch.maximum(2.0**-4 * x.double().abs(), 2.0**-10 * scale.double()[..., None]) * (1 + 2.0**-20)
    assert ((back - x.double()).abs() <= bound).all()


def test_bad_input():
    x = torch.randn(2, 3, 8)
    with pytest.raises(TypeError, match=r"x must be float32.*float64"):
        fp8.quantize_per_token_head(x.double())
    with pytest.raises(TypeError, match="x must be float32"):
        fp8.quantize_per_head(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        fp8.quantize_per_token_head(np.ones((2, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="non-empty last axis"):
        fp8.quantize_per_token_head(torch.ones(2, 0))
    with pytest.raises(ValueError, match=r"head_axis must be in \[-3, 3\)"):
        fp8.quantize_per_head(x, head_axis=3)
    with pytest.raises(TypeError, match="head_axis must be an int"):
        fp8.quantize_per_head(x, head_axis=True)
    with pytest.raises(ValueError, match="non-empty axes besides head_axis"):
        fp8.quantize_per_head(torch.ones(4), head_axis=0)
    e, s = fp8.quantize_per_token_head(x)
    with pytest.raises(TypeError, match="elements must be torch.float8_e4m3fn"):
        fp8.dequantize_per_token_head(e.view(torch.uint8), s)
    with pytest.raises(TypeError, match="scale must be torch.float32"):
        fp8.dequantize_per_token_head(e, s.double())
    with pytest.raises(ValueError, match=r"scale must have shape \(2, 3\), got \(3,\)"):
        fp8.dequantize_per_token_head(e, s[0])
    with pytest.raises(TypeError, match="dtype must be one of"):
        fp8.dequantize_per_token_head(e, s, dtype=torch.int8)
    ev, sv = fp8.quantize_per_head(x)
    with pytest.raises(ValueError, match=r"scale must have shape \(2,\)"):
        fp8.dequantize_per_head(ev, sv, head_axis=0)
    with pytest.raises(TypeError, match="dtype must be one of"):
        fp8.dequantize_per_head(ev, sv, dtype="bf16")


# --- The mode-6 attention reference against exact attention ----------------------------------


def fp8_inputs(nq, nkv, sq, skv, seed, d=128):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(nq, sq, d, generator=g) * torch.exp(torch.randn(nq, sq, 1, generator=g))  # per-token spread
    k = torch.randn(nkv, skv, d, generator=g) + 2 * torch.randn(1, 1, d, generator=g)  # a channel offset
    v = torch.randn(nkv, skv, d, generator=g)
    (qe, qs), (ke, ks) = fp8.quantize_per_token_head(q), fp8.quantize_per_token_head(k)
    ve, vs = fp8.quantize_per_head(v, head_axis=0)
    deq = [m16.decode_e4m3(qe) * qs.double().numpy()[..., None], m16.decode_e4m3(ke) * ks.double().numpy()[..., None],
           m16.decode_e4m3(ve) * vs.double().numpy()[:, None, None]]  # exact float64 products
    return (qe, ke, ve, qs, ks, vs), deq


@pytest.mark.parametrize(
    "nq,nkv,sq,skv,p_scale,causal,block_n",
    [(2, 1, 9, 700, 1.0, False, 512), (4, 2, 33, 600, 448.0, True, 512), (2, 2, 40, 25, 104.0, True, 512),
     (4, 1, 5, 300, 1.0, False, 128)],
    ids=["700keys", "gqa-causal-p448", "sq>skv-causal-p104", "block128"],
)
def test_fp8_reference_vs_exact_attention(nq, nkv, sq, skv, p_scale, causal, block_n):
    args, (q, k, v) = fp8_inputs(nq, nkv, sq, skv, seed=skv)
    out, lse = m16.fp8_attention(*args, p_scale=p_scale, causal=causal, block_n=block_n)
    assert out.shape == (nq, sq, 128) and lse.shape == (nq, sq)
    worst = m16.check_against_exact(out, lse, q, k, v, p_scale=p_scale, scale=1 / math.sqrt(128), causal=causal,
                                    block_n=block_n)
    assert worst > 0


def test_fp8_reference_bad_scale_shape():
    args, _ = fp8_inputs(2, 1, 3, 10, seed=1)
    with pytest.raises(ValueError, match=r"k_scale must have shape \(1, 10\)"):
        m16.fp8_attention(*args[:4], args[4][:, :5], args[5])
    with pytest.raises(TypeError, match="v_scale must be float32"):
        m16.fp8_attention(*args[:5], args[5].double())
