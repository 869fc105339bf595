"""quant_flash_attn's torch path against the spec-level reference (``attention_reference``), and
its accuracy against exact attention on the dequantised inputs.

Shapes are small and odd on purpose (1, 37, 255, 256, 257, 513 cross the 256-key blocks and the
128-row tiles at every edge); the reference is slow, so the cases below cover the requested
dimensions (Sq/Skv, head pairs, B <= 3, p_scale, causal both ways, TND, seqused, LSE on/off)
without running their cross product.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

import attention_reference as ref
import spec_reference as spec
from qfa.attention import quant_flash_attn
from qfa.attention.backends.torch_path import round_to_hif8, to_bf16_round_half_away
from qfa.cast.luts import round_lut

D = 128

# Tolerances against the reference. The two implementations run the same steps; they differ in
# fp32 summation order (S = Q K^T and P8 V: the reference sums in float64 and rounds once) and in
# exp's last ulp, so P differs by a few fp32 ulps (more with softmax_scale = 1, where exponent
# arguments are ~10x larger). Two things can then show in out:
# * an fp32 result a few ulps apart can round to neighbouring bf16 values: one bf16 step, at most
#   2^-7 relative (8 significant bits) -> the band's 2^-7 * |ref| term; 1e-4 absolute for the
#   elements near 0 (upstream's atol; summation-order noise is far below it);
# * a P within those ulps of a HiF8 rounding tie rounds the other way: P8 moves by one HiF8 step
#   and its output row by step * v / l. A tie window of a few fp32 ulps (2^-23 relative) against
#   HiF8 steps of >= 2^-3 relative flips ~1e-6 of the P values, so <~1e-3 of the rows at 513 keys,
#   and only some of such a row's 128 elements leave the band.
# Measured over these cases (eager and compiled, two sets of seeds): >= 99.98 % of out elements
# bit-equal, >= 99.99 % in the band, the one outlier seen 3.4e-4 * max|v| beyond it. Asserted:
# 99.9 % in the band (upstream asks 99.5 % against its golden), but at least one row's worth
# (128 elements) may leave it, since one flip on another CPU's summation order moves a whole row
# and the small cases have few rows; and every element within the band plus one worst-case flip.
BAND_ATOL, BAND_RTOL = 1e-4, 2.0**-7
MIN_IN_BAND = 0.999
# One flip's worst case: HiF8 has 1 mantissa bit in [128, 256), so with p_scale 256 a P near the
# tie at 224 moves by 64 while l >= 256 + 224 (the row max contributes p_scale): 64 / 480 < 2^-2
# of max|v| (2^-4 for p_scale <= 15, in 3-bit binades). Asserted: the band + 2^-2 * max|v|.
OUTLIER_FLIPS = 2.0**-2
# lse = m + ln(l): m carries the fp32 rounding of S * dScale (and of S's summation order), ln(l)
# ~1e-7. Measured <= 2.4e-7 relative; asserted rtol 1e-5, plus atol 1e-5 for an lse near 0,
# where the rounding of its two terms (|m| up to ~20 here) does not shrink with |lse|.
LSE_RTOL, LSE_ATOL = 1e-5, 1e-5


@dataclass(frozen=True)
class Case:
    id: str
    nq: int
    nkv: int
    q_lens: tuple[int, ...]  # per batch; BNSD/BSND use one padded length (max) and seqused
    kv_lens: tuple[int, ...]
    layout: str = "BNSD"
    causal: bool = False
    p_scale: float | None = None
    lse: bool = True
    softmax_scale: float | None = None
    scale_rule: str = "upstream"
    seqused_q: tuple[int, ...] | None = None
    seqused_kv: tuple[int, ...] | None = None
    compiled: bool = False  # also run the inductor-compiled elementwise steps (QFA_COMPILE=1)


CASES = [
    Case("1x1", 1, 1, (1,), (1,)),
    Case("1x513-p256-ss1", 1, 1, (1,), (513,), p_scale=256, softmax_scale=1.0),
    Case("gqa4-37x255-causal-bsnd-p15", 4, 1, (37,), (255,), "BSND", True, 15),
    Case("gqa6-37x257-p128-nolse-ss1", 12, 2, (37,), (257,), p_scale=128, lse=False, softmax_scale=1.0),
    Case("mha8-B2-256x256-causal-p1-unit", 8, 8, (256, 256), (256, 256), causal=True, p_scale=1, scale_rule="unit",
         compiled=True),
    Case("gqa4-B2-257x37-causal-p256", 4, 1, (257, 257), (37, 37), causal=True, p_scale=256, compiled=True),
    Case("B3-255x513-causal-bsnd-p15-unit", 1, 1, (255,) * 3, (513,) * 3, "BSND", True, 15, scale_rule="unit"),
    Case("513x256-causal-p128-nolse-ss1", 1, 1, (513,), (256,), causal=True, p_scale=128, lse=False, softmax_scale=1.0),
    Case("gqa6-B2-37x513-bsnd-p1-ss1", 12, 2, (37, 37), (513, 513), "BSND", p_scale=1, softmax_scale=1.0, compiled=True),
    Case("gqa4-513x513-causal-p1-unit", 4, 1, (513,), (513,), causal=True, p_scale=1, scale_rule="unit"),
    Case("gqa6-256x257-causal-p256", 12, 2, (256,), (257,), causal=True, p_scale=256),
    Case("mha8-1x37-bsnd-p15-nolse", 8, 8, (1,), (37,), "BSND", p_scale=15, lse=False),
    # TND: unequal lengths, zero-length q and kv sequences, causal both ways within one call.
    Case("tnd-gqa4-causal-p15", 4, 1, (37, 0, 257), (255, 1, 513), "TND", True, 15, compiled=True),
    Case("tnd-mha8-p256-ss1", 8, 8, (1, 256, 5), (513, 37, 0), "TND", p_scale=256, softmax_scale=1.0),
    Case("tnd-gqa6-causal-p128-nolse", 12, 2, (257, 255), (256, 513), "TND", True, 128, lse=False, scale_rule="unit"),
    # seqused: per-batch used lengths (causal aligned to them), zero-length batches included.
    Case("seqused-bnsd-gqa4-causal", 4, 1, (257,) * 3, (513,) * 3, causal=True, p_scale=15,
         seqused_q=(257, 0, 100), seqused_kv=(513, 300, 0), compiled=True),
    Case("seqused-bsnd-gqa6-kv", 12, 2, (37,) * 2, (256,) * 2, "BSND", p_scale=128, seqused_kv=(1, 255)),
    Case("seqused-tnd-causal", 4, 1, (37, 40), (100, 513), "TND", True, 1, seqused_q=(30, 0), seqused_kv=(100, 257)),
]


def make_inputs(case: Case, seed: int):
    """Codes, descales and keyword arguments for one case."""
    b = len(case.q_lens)
    if case.layout == "TND":
        q_shape, kv_shape = (sum(case.q_lens), case.nq, D), (sum(case.kv_lens), case.nkv, D)
    elif case.layout == "BNSD":
        q_shape, kv_shape = (b, case.nq, max(case.q_lens), D), (b, case.nkv, max(case.kv_lens), D)
    else:
        q_shape, kv_shape = (b, max(case.q_lens), case.nq, D), (b, max(case.kv_lens), case.nkv, D)
    q, k, v, qd, kd, vd = ref.random_qkv(q_shape, kv_shape, seed, case.scale_rule)
    kwargs = dict(layout=case.layout, softmax_scale=case.softmax_scale)
    if case.p_scale is not None:
        kwargs["p_scale"] = torch.tensor([float(case.p_scale)])
    if case.layout == "TND":
        kwargs["cu_seqlens_q"] = torch.tensor(np.cumsum((0,) + case.q_lens), dtype=torch.int32)
        kwargs["cu_seqlens_kv"] = torch.tensor(np.cumsum((0,) + case.kv_lens), dtype=torch.int32)
    for name in ("seqused_q", "seqused_kv"):
        if getattr(case, name) is not None:
            kwargs[name] = torch.tensor(getattr(case, name), dtype=torch.int32)
    return (q, k, v, qd, kd, vd), kwargs


def run_op(args, kwargs, causal: bool, lse: bool):
    return quant_flash_attn(*args, mask_mode=3 if causal else 0, return_softmax_lse=lse, backend="torch", **kwargs)


def check_against_reference(out, lse, ref_out, ref_lse, v_max: float, want_lse: bool) -> dict:
    """Assert the tolerances above; returns the measured statistics."""
    assert out.dtype == torch.bfloat16
    got = out.to(torch.float64).numpy()
    assert got.shape == ref_out.shape
    no_key = ref_out == 0  # includes rows that see no key (exact zeros on both sides)
    diff = np.abs(got - ref_out)
    band = BAND_ATOL + BAND_RTOL * np.abs(ref_out)
    in_band = diff <= band
    stats = {"equal": float((diff == 0).mean()) if diff.size else 1.0,
             "in_band": float(in_band.mean()) if diff.size else 1.0,
             "worst_outlier": float(((diff - band) / v_max).max()) if diff.size else 0.0}
    assert np.isfinite(got).all()
    assert (~in_band).sum() <= max((1 - MIN_IN_BAND) * diff.size, D), stats
    assert (diff <= band + OUTLIER_FLIPS * v_max).all(), stats
    # Zero rows (no key) are exact, and exactly where the reference has them.
    assert (got[no_key.all(axis=-1)] == 0).all()
    if not want_lse:
        assert lse.numel() == 0
        return stats
    assert lse.dtype == torch.float32 and tuple(lse.shape) == ref_lse.shape
    got_lse = lse.numpy()
    assert np.array_equal(np.isposinf(got_lse), np.isposinf(ref_lse)), "rows with no key must have lse +inf"
    finite = np.isfinite(ref_lse)
    assert np.isfinite(got_lse[finite]).all()
    lse_err = np.abs(got_lse[finite].astype(np.float64) - ref_lse[finite])
    assert (lse_err <= LSE_ATOL + LSE_RTOL * np.abs(ref_lse[finite])).all(), lse_err.max()
    stats["lse_rel"] = float((lse_err / np.maximum(np.abs(ref_lse[finite]), 1)).max()) if lse_err.size else 0.0
    return stats


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv("QFA_BACKEND", raising=False)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_torch_path_matches_reference(case, monkeypatch):
    args, kwargs = make_inputs(case, seed=CASES.index(case))
    ref_out, ref_lse = ref.reference_attention(*args, causal=case.causal, **kwargs)
    v_max = float(np.abs(ref.decode(args[2])).max() * float(args[5]))  # largest |v| value
    results = {}
    # Plain eager torch for every case; the inductor-compiled steps (the CPU default, same
    # function, exp may differ in the last ulp) for a subset, to keep compile time down.
    for compiled in ("0", "1") if case.compiled else ("0",):
        monkeypatch.setenv("QFA_COMPILE", compiled)
        out, lse = run_op(args, kwargs, case.causal, case.lse)
        results[compiled] = check_against_reference(out, lse, ref_out, ref_lse, v_max, case.lse)
    print(case.id, results)


def test_hif8_round_matches_spec_module():
    """The reference's vectorised HiF8 rounding of P equals the scalar spec oracle, ties included."""
    rng = np.random.default_rng(1)
    values = ref._VALUES.astype(np.float32)
    mids = ((ref._VALUES[1:] + ref._VALUES[:-1]) / 2).astype(np.float32)
    x = np.concatenate([
        rng.standard_normal(5000).astype(np.float32) * np.exp2(rng.integers(-25, 17, 5000)).astype(np.float32),
        rng.random(5000).astype(np.float32) * 256,  # where P lives: (0, p_scale]
        values, mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf)),
        np.float32([40960, 40959.996, 1e30, 2**-23, 2**-24, 0.0, -0.0, np.inf, -np.inf, np.nan]),
    ]).astype(np.float32)
    expected = np.array([spec.decode(spec.encode(float(v))) for v in x])
    assert np.array_equal(ref.hif8_round(x), expected, equal_nan=True)
    # And the torch path's P rounding (bit operations) and the host table, on the same values.
    got = round_to_hif8(torch.from_numpy(x)).to(torch.float64).numpy()
    assert np.array_equal(got, expected, equal_nan=True)
    index = (torch.from_numpy(x).view(torch.int32) >> 16) & 0xFFFF
    table = torch.index_select(round_lut("cpu"), 0, index).to(torch.float64).numpy()
    assert np.array_equal(table, expected, equal_nan=True)


@pytest.mark.parametrize("skv", [1, 513])
def test_output_rounds_bf16_ties_away_from_zero(skv):
    """out is rounded to bf16 half away from zero, not to even: with identical keys every P8 is
    exactly 1 (= p_scale) and l = Skv, so out = v * v_descale exactly; v_descale = 1 + 2^-8
    makes that an exact bf16 tie for v = +-1, which must go to +-(1 + 2^-7) (even would be 1)."""
    one = spec.encode(1.0)
    q, k, _, qd, kd, _ = ref.random_qkv((1, 2, 3, D), (1, 1, 1, D), seed=5)
    k = k.expand(1, 1, skv, D).contiguous()
    v = torch.full((1, 1, skv, D), one, dtype=torch.uint8)
    v[..., 1::2] = one | 0x80  # -1.0
    v[..., 2::4] = spec.encode(1.5)  # 1.5 * (1 + 2^-8) = 1.5 + 1.5 * 2^-8: no tie, rounds to 1.5 + 2^-7
    out, _ = quant_flash_attn(q, k, v, qd, kd, torch.tensor([1 + 2.0**-8]), backend="torch")
    want = torch.tensor([1 + 2.0**-7, -(1 + 2.0**-7), 1.5 + 2.0**-7, -(1 + 2.0**-7)]).repeat(D // 4)
    assert torch.equal(out.float(), want.expand(1, 2, 3, D))


def test_bf16_round_half_away():
    """The reference's and the torch path's bf16 rounding: ties away from zero, not to even."""
    x = np.float32([1 + 2**-8, -(1 + 2**-8), 1 + 3 * 2**-8, 1 + 2**-8 - 2**-20, 3.0e38, 1e-40, 0.0])
    want = np.array([1 + 2**-7, -(1 + 2**-7), 1 + 2**-6, 1.0])
    assert np.array_equal(ref.bf16_round_half_away(x)[:4], want)
    rng = np.random.default_rng(2)
    y = np.concatenate([x, (rng.standard_normal(20000) * np.exp2(rng.integers(-130, 120, 20000))).astype(np.float32)])
    got = to_bf16_round_half_away(torch.from_numpy(y)).to(torch.float64).numpy()
    assert np.array_equal(got, ref.bf16_round_half_away(y))


def dequantised(q, k, v, qd, kd, vd):
    """Real-valued BNSD tensors the codes stand for (decode * descale), float64."""
    return [torch.from_numpy(ref.decode(t)) * float(s) for t, s in ((q, qd), (k, kd), (v, vd))]


def rel_l2(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).norm() / y.norm())


def upstream_rule_fraction(out: torch.Tensor, golden: torch.Tensor) -> float:
    """Fraction of elements within upstream's out tolerance: rtol 2^-7, atol 1e-4."""
    return float(((out - golden).abs() <= 1e-4 + 2.0**-7 * golden.abs()).double().mean())


# Accuracy against exact attention on the dequantised inputs (upstream's test data: fp16
# uniform(-1, 1), per-tensor descale amax / 32768). Measured on this CPU (2 seeds per config):
# * upstream's acceptance rule (>= 99.5 % within rtol 2^-7 / atol 1e-4) does NOT hold against
#   exact attention: only 12-39 % of elements pass with the default softmax_scale (38-53 % with
#   softmax_scale 1). HiF8 keeps 3 mantissa bits near P's maximum (1 bit for p_scale 128/256),
#   so each P carries up to 2^-4 (2^-2) relative rounding error and out ~2-6 % relative L2 error.
#   Upstream applies the rule against a golden that quantises P the same way, which is what
#   test_torch_path_matches_reference checks (tighter: 99.9 %).
# * FlashAttention-3's criterion does hold: the op's error is at most ~the error of a reference
#   that only quantises P (exact otherwise, one global row max, fp64 out). Measured ratio of
#   relative L2 errors 0.967-1.003 and of max abs errors 0.95-1.11 over 52 configurations
#   (p_scale 1/15/128/256, causal and not, GQA, Skv up to 2048, both scale rules). The bf16
#   output and the per-256-key-block quantisation add nothing visible. Asserted with ~5 % and
#   ~35 % headroom: a different BLAS summation order only moves a handful of tie flips.
# * lse uses the unquantised P, so it is the exact LSE to fp32 precision (measured <= 3e-7
#   relative); asserted at 1e-5, far inside upstream's rtol 0.005 / atol 2.5e-5.
FA3_L2_RATIO, FA3_MAX_RATIO = 1.05, 1.5


@pytest.mark.parametrize(
    "b,nq,nkv,sq,skv,causal,p_scales",
    [(1, 4, 1, 513, 513, True, (1.0, 15.0, 128.0, 256.0)), (1, 8, 2, 257, 1024, False, (1.0, 256.0))],
    ids=["gqa4-513-causal", "gqa4-257x1024"],
)
def test_accuracy_vs_exact_attention(b, nq, nkv, sq, skv, causal, p_scales):
    q, k, v, qd, kd, vd = ref.random_qkv((b, nq, sq, D), (b, nkv, skv, D), seed=11)
    real = dequantised(q, k, v, qd, kd, vd)
    exact, exact_lse = ref.exact_attention(*real, causal=causal)
    for p in p_scales:
        out, lse = quant_flash_attn(q, k, v, qd, kd, vd, p_scale=torch.tensor([p]), mask_mode=3 if causal else 0,
                                    return_softmax_lse=True, backend="torch")
        out = out.to(torch.float64)
        p_only, _ = ref.exact_attention(*real, causal=causal, quantise_p=p)
        err, err_p_only = rel_l2(out, exact), rel_l2(p_only, exact)
        assert err <= FA3_L2_RATIO * err_p_only, (p, err, err_p_only)
        max_err, max_err_p_only = float((out - exact).abs().max()), float((p_only - exact).abs().max())
        assert max_err <= FA3_MAX_RATIO * max_err_p_only, (p, max_err, max_err_p_only)
        assert upstream_rule_fraction(out, exact) < 0.995  # documents the first bullet above
        torch.testing.assert_close(lse.to(torch.float64), exact_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p", [1.0, 15.0, 128.0, 256.0])
def test_upstream_rule_holds_where_p_is_exact(p):
    """Where every P is exactly p_scale (a HiF8 value), HiF8(P) loses nothing and upstream's rule
    holds against exact attention on the dequantised inputs: with one key (Skv = 1), and with
    identical keys (all scores in a row equal; causal, several 256-key blocks, GQA)."""
    q, k, v, qd, kd, vd = ref.random_qkv((2, 4, 37, D), (2, 2, 1, D), seed=3)
    k_same = k[:, :, :1].expand(2, 2, 513, D).contiguous()
    _, _, v_long, _, _, vd_long = ref.random_qkv((1, 1, 1, D), (2, 2, 513, D), seed=4)
    for k_, v_, vd_, causal in ((k, v, vd, False), (k_same, v_long, vd_long, True)):
        exact, exact_lse = ref.exact_attention(*dequantised(q, k_, v_, qd, kd, vd_), causal=causal)
        out, lse = quant_flash_attn(q, k_, v_, qd, kd, vd_, p_scale=torch.tensor([p]), mask_mode=3 if causal else 0,
                                    return_softmax_lse=True, backend="torch")
        out = out.to(torch.float64)
        assert upstream_rule_fraction(out, exact) == 1.0
        assert float(((out - exact).abs() / exact.abs().clamp_min(1e-30)).max()) < 10
        torch.testing.assert_close(lse.to(torch.float64), exact_lse, rtol=0.005, atol=2.5e-5)


def test_p_scale_cancels_in_lse():
    """p_scale only moves P on the HiF8 grid: lse is the same true LSE for every p_scale, and
    p_scale None means 1.0."""
    q, k, v, qd, kd, vd = ref.random_qkv((2, 4, 257, D), (2, 2, 300, D), seed=7)
    outs, lses = [], []
    for p in (None, 1.0, 15.0, 128.0, 256.0):
        kwargs = {} if p is None else {"p_scale": torch.tensor([p])}
        out, lse = quant_flash_attn(q, k, v, qd, kd, vd, mask_mode=3, return_softmax_lse=True, backend="torch", **kwargs)
        outs.append(out)
        lses.append(lse.to(torch.float64))
    assert torch.equal(outs[0], outs[1]) and torch.equal(lses[0], lses[1]), "p_scale None must be 1.0"
    assert not torch.equal(outs[1], outs[4]), "p_scale must move P on the HiF8 grid"
    for lse in lses[2:]:
        # m + ln(l) with m shifted by -ln(p) and l scaled by p: equal up to fp32 rounding of
        # ln(p) and of the shifted exponent arguments (measured <= 2.4e-7 relative).
        torch.testing.assert_close(lse, lses[1], rtol=2e-6, atol=2e-6)
