"""hif8_attention and HiF8Attention: K smoothing, LSE correction, dtypes, GQA, causal alignment,
layouts, padding, the module's calibrate/freeze/state_dict cycle, bad inputs.

Shapes stay small (every tensor under 2^16 elements, so the HiF8 cast runs eagerly) and odd
where it matters (37, 67 keys: not multiples of the op's 256-key block).

Two kinds of reference:
- ``exact``: float64 attention on the original, unquantised inputs (the quantity a user wants);
- ``dequantised``: float64 attention on exactly what the op sees (HiF8 values times their
  scales, K smoothed by the same means). hif8_attention then differs from it only by the op's
  rounding of P to HiF8 and of the output to bf16, which isolates this module's plumbing
  (smoothing, scales, masks, layouts) from quantisation error.
"""

import math

import functools

import pytest
import torch

from qfa.attention import calibration as cal
from qfa.attention.dropin import HiF8Attention as _HiF8Attention, hif8_attention as _hif8_attention, key_means

# These tests pin the quantise -> op -> dequantise plumbing against references built from the
# un-rotated dequantised inputs, so they switch the (default) Hadamard rotation off;
# tests/test_rotation.py covers the rotation.
hif8_attention = functools.partial(_hif8_attention, rotate=False)
HiF8Attention = functools.partial(_HiF8Attention, rotate=False)

D = 128
SM = 1 / math.sqrt(D)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def make_qkv(b=1, nq=4, nkv=2, sq=37, skv=37, seed=0, k_offset=0.0, dtype=torch.float32, layout="BNSD"):
    """LLM-like Q/K/V in BNSD (or BSND): unit Gaussians, K optionally with a per-channel offset."""
    g = _gen(seed)
    q = torch.randn(b, nq, sq, D, generator=g)
    k = torch.randn(b, nkv, skv, D, generator=g)
    v = torch.randn(b, nkv, skv, D, generator=g)
    if k_offset:
        k = k + k_offset * torch.randn(D, generator=g)  # the same offset on every key: like a K bias
    if layout == "BSND":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def causal_mask(sq, skv, bottom_right=True):
    i = torch.arange(sq)[:, None]
    j = torch.arange(skv)[None, :]
    return j > i + (skv - sq) if bottom_right else j > i


def exact_attention(q, k, v, *, causal=False, scale=SM, bottom_right=True):
    """float64 BNSD attention with GQA; returns (out, lse); rows without keys: out 0, lse +inf."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(causal_mask(q.shape[2], k.shape[2], bottom_right), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    lse = torch.where(torch.isneginf(lse), math.inf, lse)
    return p @ v, lse


def dequantised_inputs(q, k, v, rule=None, smooth_k=True):
    """What the op computes on, in float64: HiF8 values times the per-tensor scales."""
    mu = key_means(k)[:, :, None, :] if smooth_k else 0.0
    ks = k.float() - mu
    out = []
    for t in (q, ks, v):
        s = cal.compute_scale(t, rule)
        out.append(cal.hif8_roundtrip(t, s).double())
    return out


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ----------------------------------------------------------------------------- K smoothing

def test_smoothing_is_exact_for_softmax_in_exact_arithmetic():
    q, k, v = make_qkv(b=2, nq=6, nkv=2, sq=19, skv=41, k_offset=5.0)
    mu = key_means(k)  # (B, Nkv, D)
    assert mu.shape == (2, 2, D)
    torch.testing.assert_close(mu, k.double().mean(dim=2).float(), rtol=1e-6, atol=1e-6)
    for causal in (False, True):
        out, lse = exact_attention(q, k, v, causal=causal)
        out_s, lse_s = exact_attention(q, k.double() - mu.double()[:, :, None, :], v, causal=causal)
        # float64: the only differences are rounding in the score sums (|s| < ~1e3, eps 2^-52)
        torch.testing.assert_close(out_s, out, rtol=1e-10, atol=1e-10)
        shift = SM * torch.einsum("bhgsd,bhd->bhgs", q.double().view(2, 2, 3, 19, D), mu.double()).reshape(2, 6, 19)
        torch.testing.assert_close(lse_s + shift, lse, rtol=1e-10, atol=1e-10)


def test_smoothing_rescues_k_with_a_channel_offset():
    # A K offset 20x larger than K's informative part sets the per-tensor scale; without
    # smoothing the informative part gets a couple of mantissa bits at best.
    q, k, v = make_qkv(nq=4, nkv=2, sq=67, skv=67, k_offset=20.0, seed=3)
    ref, _ = exact_attention(q, k, v, causal=True)
    err_plain = rel_l2(hif8_attention(q, k, v, is_causal=True, smooth_k=False), ref)
    err_smooth = rel_l2(hif8_attention(q, k, v, is_causal=True, smooth_k=True), ref)
    # measured about 0.04 vs 0.6; demand a factor 4 and an absolute level (3-bit mantissas on
    # Q, K, V and P give a few % relative error on random data)
    assert err_smooth < 0.08
    assert err_smooth * 4 < err_plain


@pytest.mark.parametrize("smooth_k", [False, True])
def test_output_matches_attention_on_the_dequantised_inputs(smooth_k):
    q, k, v = make_qkv(nq=4, nkv=2, sq=37, skv=37, k_offset=3.0, seed=4)
    out = hif8_attention(q, k, v, is_causal=True, smooth_k=smooth_k)
    ref, _ = exact_attention(*dequantised_inputs(q, k, v, smooth_k=smooth_k), causal=True)
    # Left: P's HiF8 rounding (relative <= 2^-4 per element, errors of independent keys average
    # out) and the bf16 output (2^-9). 0.03 is ~3x what is observed.
    assert rel_l2(out, ref) < 0.03


# ----------------------------------------------------------------------------- LSE

@pytest.mark.parametrize("smooth_k", [False, True])
@pytest.mark.parametrize("k_offset", [0.0, 4.0])
def test_lse_is_the_lse_of_the_original_scores(smooth_k, k_offset):
    q, k, v = make_qkv(b=2, nq=4, nkv=2, sq=37, skv=37, k_offset=k_offset, seed=5)
    out, lse = hif8_attention(q, k, v, is_causal=True, smooth_k=smooth_k, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 37)
    # 1) Given what the op quantises, the LSE is exact up to fp32 summation and exp's last ulp:
    #    compare with the float64 LSE of the dequantised scores, shifted back by scale * q . mu
    #    (q unquantised, as the correction is computed).
    qd, kd, vd = dequantised_inputs(q, k, v, smooth_k=smooth_k)
    _, lse_deq = exact_attention(qd, kd, vd, causal=True)
    if smooth_k:
        mu = key_means(k).double()
        lse_deq = lse_deq + SM * torch.einsum("bhgsd,bhd->bhgs", q.double().view(2, 2, 2, 37, D), mu).reshape(2, 4, 37)
    torch.testing.assert_close(lse.double(), lse_deq, rtol=1e-5, atol=1e-4)
    # 2) Against the exact LSE of the unquantised scores the difference is the softmax-weighted
    #    mean of the score errors, which cannot exceed their spread. See score_error_sigma.
    _, lse_exact = exact_attention(q, k, v, causal=True)
    err = (lse.double() - lse_exact).abs()
    sigma = score_error_sigma(q, key_means(k)[:, :, None, :] if smooth_k else None, k)
    assert err.max().item() < 5 * sigma and err.mean().item() < sigma, (err.max().item(), sigma)
    if smooth_k and k_offset:
        # without the correction the error would be SM * |q . mu|, far outside the tolerance
        mu = key_means(k).double()
        shift = SM * torch.einsum("bhgsd,bhd->bhgs", q.double().view(2, 2, 2, 37, D), mu).reshape(2, 4, 37)
        assert shift.abs().mean().item() > 10 * sigma


def score_error_sigma(q, mu, k):
    """Expected spread of a score's quantisation error, SM * (q . k)'s error.

    HiF8 keeps 3 mantissa bits near 1: a value in binade 2^e is rounded to a multiple of
    2^(e-3), an error uniform in +-2^(e-4), whose RMS relative to |x| is at most 2^-4 / sqrt(3).
    Errors of q and k enter the D products independently:
    sigma ~ SM * 2^-4 / sqrt(3) * sqrt(2 * D) * rms(q) * rms(k as quantised).
    """
    kq = k.double() - (0.0 if mu is None else mu.double())
    rms = lambda t: t.double().square().mean().sqrt().item()  # noqa: E731
    return SM * 2.0 ** -4 / math.sqrt(3) * math.sqrt(2 * D) * rms(q) * rms(kq)


def test_lse_rows_without_keys_are_inf_and_out_is_zero():
    q, k, v = make_qkv(nq=2, nkv=1, sq=12, skv=7, seed=6, k_offset=2.0)
    out, lse = hif8_attention(q, k, v, is_causal=True, return_lse=True)
    # Sq > Skv, bottom-right: the first Sq - Skv = 5 rows see no key
    assert torch.isinf(lse[:, :, :5]).all() and (lse[:, :, :5] > 0).all()
    assert (out[:, :, :5] == 0).all()
    assert torch.isfinite(lse[:, :, 5:]).all()


def test_without_return_lse_only_the_output_comes_back():
    q, k, v = make_qkv(nq=2, nkv=2, sq=5, skv=5)
    out = hif8_attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape


# ----------------------------------------------------------------------------- dtypes, GQA, causal, layouts

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtype_in_is_dtype_out(dtype):
    q, k, v = make_qkv(nq=2, nkv=1, sq=9, skv=9, dtype=dtype)
    out, lse = hif8_attention(q, k, v, return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32


def test_gqa_equals_repeated_kv_heads():
    q, k, v = make_qkv(nq=6, nkv=2, sq=21, skv=33, k_offset=2.0, seed=7)
    # "rms" scales depend only on the mean square, which repeating heads does not change, and
    # the K means are per kv head: the op then sees identical codes and must agree bit for bit.
    o1, l1 = hif8_attention(q, k, v, is_causal=True, calibration="rms", return_lse=True)
    o2, l2 = hif8_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True,
                            calibration="rms", return_lse=True)
    assert torch.equal(o1, o2)
    torch.testing.assert_close(l1, l2, rtol=0, atol=1e-5)  # the LSE shift is an fp32 einsum: order may differ


@pytest.mark.parametrize("sq,skv", [(1, 37), (5, 37), (37, 37), (40, 12)])
def test_causal_is_aligned_bottom_right(sq, skv):
    q, k, v = make_qkv(nq=4, nkv=2, sq=sq, skv=skv, seed=8, k_offset=1.0)
    out, lse = hif8_attention(q, k, v, is_causal=True, return_lse=True)
    deq = dequantised_inputs(q, k, v)
    ref, _ = exact_attention(*deq, causal=True)
    # see test_output_matches_attention_on_the_dequantised_inputs for the 0.03
    assert rel_l2(out, ref) < 0.03
    if sq > 1 and sq != skv:
        wrong, _ = exact_attention(*deq, causal=True, bottom_right=False)
        assert rel_l2(out, wrong) > 0.1  # the test can tell the two alignments apart
    if sq == 1:  # decode: one query sees every cached key
        full, _ = exact_attention(*deq, causal=False)
        assert rel_l2(out, full) < 0.03


def test_bsnd_equals_bnsd():
    q, k, v = make_qkv(b=2, nq=4, nkv=2, sq=19, skv=29, k_offset=2.0, seed=9)
    o1, l1 = hif8_attention(q, k, v, is_causal=True, return_lse=True)
    o2, l2 = hif8_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, layout="BSND", return_lse=True)
    # same elements -> same scales and means -> same codes; the op's layouts agree bit for bit
    assert torch.equal(o1, o2.transpose(1, 2))
    torch.testing.assert_close(l1, l2, rtol=0, atol=1e-5)


def test_tnd_equals_per_sequence_calls():
    lens_q, lens_kv = [5, 19, 0, 11], [23, 19, 4, 30]
    g = _gen(10)
    seqs = [make_qkv(nq=4, nkv=2, sq=a, skv=b, seed=20 + i, k_offset=3.0 * (i + 1)) for i, (a, b) in
            enumerate(zip(lens_q, lens_kv))]
    q = torch.cat([s[0][0].transpose(0, 1) for s in seqs])  # (T, N, D)
    k = torch.cat([s[1][0].transpose(0, 1) for s in seqs])
    v = torch.cat([s[2][0].transpose(0, 1) for s in seqs])
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_kv = torch.tensor([0, *torch.tensor(lens_kv).cumsum(0).tolist()], dtype=torch.int32)
    scales = tuple(cal.compute_scale(t) for t in (q, k, v))  # shared, so per-sequence calls quantise alike
    # K's scale applies to the smoothed K; take it from the packed smoothed K
    from qfa.attention.dropin import prepare

    (_, ks, _), _ = prepare(q, k, v, layout="TND", cu_seqlens_kv=cu_kv)
    scales = (scales[0], cal.compute_scale(ks), scales[2])
    out, lse = hif8_attention(q, k, v, is_causal=True, layout="TND", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                              scales=scales, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    for i, (sq_, sk_, vv) in enumerate(seqs):
        if lens_q[i] == 0:
            continue
        o, l = hif8_attention(sq_, sk_, vv, is_causal=True, scales=scales, return_lse=True)
        a, b = cu_q[i].item(), cu_q[i + 1].item()
        assert torch.equal(out[a:b], o[0].transpose(0, 1))
        torch.testing.assert_close(lse[:, a:b], l[0], rtol=0, atol=1e-5)
        ref, lse_ref = exact_attention(sq_, sk_, vv, causal=True)
        assert rel_l2(out[a:b], ref[0].transpose(0, 1)) < 0.08  # quantisation error, see the smoothing test
        sigma = score_error_sigma(sq_, key_means(sk_)[:, :, None, :], sk_)
        assert (lse[:, a:b].double() - lse_ref[0]).abs().max().item() < 5 * sigma  # see the LSE test


def test_padding_through_seqused_is_ignored():
    q, k, v = make_qkv(b=2, nq=4, nkv=2, sq=20, skv=30, seed=11, k_offset=2.0)
    qp, kp, vp = (torch.cat([t, 1e4 * torch.ones_like(t[:, :, :6])], dim=2) for t in (q, k, v))  # garbage tail
    used_q = torch.tensor([20, 20], dtype=torch.int32)
    used_kv = torch.tensor([30, 30], dtype=torch.int32)
    o1, l1 = hif8_attention(q, k, v, is_causal=True, return_lse=True)
    o2, l2 = hif8_attention(qp, kp, vp, is_causal=True, seqused_q=used_q, seqused_kv=used_kv, return_lse=True)
    # the padding takes no part in scales, K means or attention
    assert torch.equal(o1, o2[:, :, :20])
    torch.testing.assert_close(l1, l2[:, :, :20], rtol=0, atol=1e-5)


def test_tnd_padding_through_seqused_is_ignored():
    lens_q, lens_kv, pad = [7, 12], [15, 12], 5
    q, k, v = make_qkv(nq=4, nkv=2, sq=19, skv=27, seed=14, k_offset=2.0)
    q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # (T, N, D)

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    def padded(t, lens):  # each sequence followed by `pad` garbage tokens
        parts, start = [], 0
        for n in lens:
            parts += [t[start:start + n], torch.full((pad, *t.shape[1:]), 3e3)]
            start += n
        return torch.cat(parts)

    o1, l1 = hif8_attention(q, k, v, is_causal=True, layout="TND", cu_seqlens_q=cu(lens_q), cu_seqlens_kv=cu(lens_kv),
                            return_lse=True)
    o2, l2 = hif8_attention(padded(q, lens_q), padded(k, lens_kv), padded(v, lens_kv), is_causal=True, layout="TND",
                            cu_seqlens_q=cu([n + pad for n in lens_q]), cu_seqlens_kv=cu([n + pad for n in lens_kv]),
                            seqused_q=torch.tensor(lens_q, dtype=torch.int32),
                            seqused_kv=torch.tensor(lens_kv, dtype=torch.int32), return_lse=True)
    keep = torch.cat([torch.arange(a, a + n) for a, n in zip([0, lens_q[0] + pad], lens_q)])
    assert torch.equal(o1, o2[keep])
    torch.testing.assert_close(l1, l2[:, keep], rtol=0, atol=1e-5)


def test_inputs_are_not_modified():
    q, k, v = make_qkv(nq=4, nkv=2, sq=17, skv=17, k_offset=3.0, dtype=torch.bfloat16)
    copies = [t.clone() for t in (q, k, v)]
    hif8_attention(q, k, v, is_causal=True, return_lse=True)
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c)


def test_p_scale_and_softmax_scale_are_passed_through():
    q, k, v = make_qkv(nq=2, nkv=2, sq=23, skv=23, seed=12)
    o1, l1 = hif8_attention(q, k, v, scale=0.05, return_lse=True)
    _, lse_ref = exact_attention(q, k, v, scale=0.05)
    err = (l1.double() - lse_ref).abs()
    # as in the LSE test, with this softmax scale
    assert err.max().item() < 5 * score_error_sigma(q, key_means(k)[:, :, None, :], k) * 0.05 / SM
    o2, l2 = hif8_attention(q, k, v, scale=0.05, p_scale=128.0, return_lse=True)
    torch.testing.assert_close(l2, l1, rtol=0, atol=1e-4)  # p_scale cancels in the LSE
    # ... and only moves P on the grid: with p_scale 128 the largest P sit in binades 2^4..2^7,
    # where HiF8 keeps 2 mantissa bits (relative error <= 2^-3 instead of 2^-4): about twice
    # the error of p_scale 1 against attention on the dequantised inputs (measured 0.021, 0.042)
    ref, _ = exact_attention(*dequantised_inputs(q, k, v), scale=0.05)
    assert rel_l2(o1, ref) < 0.04 and rel_l2(o2, ref) < 0.08


# ----------------------------------------------------------------------------- module

def test_module_dynamic_equals_functional():
    q, k, v = make_qkv(nq=4, nkv=2, sq=16, skv=16, seed=13)
    attn = HiF8Attention(is_causal=True, calibration="mse")
    assert not attn.frozen
    assert torch.equal(attn(q, k, v), hif8_attention(q, k, v, is_causal=True, calibration="mse"))


def test_module_calibrate_freeze_and_state_dict_round_trip():
    batches = [make_qkv(nq=4, nkv=2, sq=16, skv=16, seed=s, k_offset=2.0) for s in range(3)]
    attn = HiF8Attention(is_causal=True, calibration="amax")
    with attn.calibrate():
        for q, k, v in batches:
            attn(q, k, v)
    assert attn.frozen
    # amax observers are exact: the frozen scales are the rule on all observed batches
    q_all = torch.cat([b[0].reshape(-1) for b in batches])
    k_all = torch.cat([(b[1] - key_means(b[1])[:, :, None, :]).reshape(-1) for b in batches])
    assert torch.equal(attn.q_scale, cal.amax_scale(q_all))
    assert torch.equal(attn.k_scale, cal.amax_scale(k_all))
    sd = attn.state_dict()
    assert set(sd) == {"q_scale", "k_scale", "v_scale"}

    q, k, v = make_qkv(nq=4, nkv=2, sq=16, skv=16, seed=99, k_offset=2.0)
    expected = attn(q, k, v)
    assert torch.equal(expected, hif8_attention(q, k, v, is_causal=True, calibration="amax",
                                                scales=(attn.q_scale, attn.k_scale, attn.v_scale)))
    served = HiF8Attention(is_causal=True, calibration="amax")
    served.load_state_dict(sd)
    assert served.frozen
    assert torch.equal(served(q, k, v), expected)
    # and it stays static: a different batch uses the stored scales, not fresh ones
    q2 = q * 100
    assert torch.equal(served(q2, k, v), hif8_attention(q2, k, v, is_causal=True, scales=(sd["q_scale"], sd["k_scale"], sd["v_scale"])))

    attn.unfreeze()
    assert not attn.frozen
    assert torch.equal(attn(q2, k, v), hif8_attention(q2, k, v, is_causal=True, calibration="amax"))


def test_frozen_scales_load_through_a_parent_module():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = HiF8Attention(is_causal=True)

    src = Layer()
    src.attn.set_scales(0.5, 0.25, 2.0)
    dst = Layer()
    dst.load_state_dict(src.state_dict())
    assert dst.attn.frozen and float(dst.attn.k_scale) == 0.25


def test_module_observe_then_freeze():
    attn = HiF8Attention(calibration="rms")
    with pytest.raises(ValueError, match="freeze\\(\\) needs observed batches"):
        attn.freeze()
    for s in range(2):
        attn.observe(*make_qkv(nq=2, nkv=1, sq=8, skv=8, seed=s))
    attn.freeze()
    assert attn.frozen and all(math.frexp(float(b))[0] == 0.5 for b in (attn.q_scale, attn.k_scale, attn.v_scale))


def test_static_module_without_scales_raises():
    attn = HiF8Attention(static=True)
    with pytest.raises(ValueError, match="static but has no scales"):
        attn(*make_qkv(nq=2, nkv=1, sq=8, skv=8))
    # loading a fresh (unfrozen) module's state leaves it without scales
    attn.load_state_dict(HiF8Attention().state_dict())
    assert not attn.frozen
    attn.set_scales(1.0, 0.5, 0.25)
    assert attn.frozen


def test_module_bad_configuration():
    with pytest.raises(ValueError, match="calibration"):
        HiF8Attention(calibration="nope")
    with pytest.raises(ValueError, match="layout"):
        HiF8Attention(layout="NSD")


# ----------------------------------------------------------------------------- bad inputs

def _good():
    return make_qkv(nq=4, nkv=2, sq=8, skv=8)


@pytest.mark.parametrize(
    "mutate,kwargs,exc,pattern",
    [
        (lambda q, k, v: (q.double(), k, v), {}, TypeError, "q must be float16, bfloat16 or float32"),
        (lambda q, k, v: (q, k.to(torch.int8), v), {}, TypeError, "k must be float16"),
        (lambda q, k, v: (q, k.half(), v), {}, TypeError, "share one dtype"),
        (lambda q, k, v: ([1.0], k, v), {}, TypeError, "q must be a torch.Tensor"),
        (lambda q, k, v: (q[..., :64], k[..., :64], v[..., :64]), {}, ValueError, "head dim D of q must be 128, got 64"),
        (lambda q, k, v: (q, k, v[:, :, :5]), {}, ValueError, "k and v must have the same shape"),
        (lambda q, k, v: (q[:, :3], k, v), {}, ValueError, "q heads must be a multiple of k/v heads"),
        (lambda q, k, v: (q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1)), {}, ValueError, "batch size of k must equal q's"),
        (lambda q, k, v: (q[0], k[0], v[0]), {}, ValueError, "must be 4-D"),
        (lambda q, k, v: (q, k, v), {"layout": "NSD"}, ValueError, "layout must be one of"),
        (lambda q, k, v: (q, k, v), {"calibration": "bogus"}, ValueError, "calibration must be one of"),
        (lambda q, k, v: (q, k, v), {"calibration": 3}, TypeError, "calibration"),
        (lambda q, k, v: (q, k, v), {"scale": -1.0}, ValueError, "scale must be positive"),
        (lambda q, k, v: (q, k, v), {"is_causal": 1}, TypeError, "is_causal"),
        (lambda q, k, v: (q, k, v), {"cu_seqlens_q": torch.tensor([0, 8], dtype=torch.int32)}, ValueError,
         "only for layout 'TND'"),
        (lambda q, k, v: (q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)), {"layout": "TND"},
         ValueError, "needs cu_seqlens_q"),
        (lambda q, k, v: (q, k, v), {"seqused_kv": torch.tensor([8])}, TypeError, "seqused_kv must be int32"),
        (lambda q, k, v: (q, k, v), {"seqused_kv": torch.tensor([8, 8], dtype=torch.int32)}, ValueError,
         "seqused_kv must have shape"),
        (lambda q, k, v: (q, k, v), {"scales": (1.0, 1.0)}, TypeError, "scales must be a tuple"),
        (lambda q, k, v: (q, k, v), {"scales": (1.0, -1.0, 1.0)}, ValueError, "k_scale"),
        (lambda q, k, v: (q, k, v), {"p_scale": "x"}, TypeError, "p_scale"),
    ],
)
def test_bad_inputs(mutate, kwargs, exc, pattern):
    q, k, v = mutate(*_good())
    with pytest.raises(exc, match=pattern):
        hif8_attention(q, k, v, **kwargs)


def test_non_finite_inputs_are_rejected_by_dynamic_scales():
    q, k, v = _good()
    q = q.clone()
    q[0, 0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        hif8_attention(q, k, v)
