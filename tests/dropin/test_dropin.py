"""hif8_attention and HiF8Attention: K smoothing, LSE correction, dtypes, GQA, causal alignment,
layouts, padding, the module's calibrate/freeze/state_dict cycle (and static scales at
construction), bad inputs, the same message as quant_flash_attn for the same mistake, and
upstream's argument names with the old ones as deprecated aliases.

Shapes stay small (every tensor under 2^16 elements, so the HiF8 cast runs eagerly) and odd
where it matters (37, 67 keys: not multiples of the op's 256-key block).

Three kinds of reference:
- ``exact``: float64 attention on the original, unquantised inputs (the quantity a user wants);
- ``dequantised``: float64 attention on exactly what the op sees (HiF8 values times their
  scales, K smoothed by the same means). hif8_attention then differs from it only by the op's
  rounding of P to HiF8 and of the output to bf16, which isolates this module's plumbing
  (smoothing, scales, masks, layouts) from quantisation error;
- ``another evaluation``: the same call made another way (GQA by repeated heads, another layout,
  per-sequence calls instead of TND, padding), which must give the same codes, the same output
  bits, and an LSE equal up to the fp32 summation-order bound :func:`lse_error_bound` (GEMM
  blocking, einsum and reduction order differ between shapes and between CPUs).

Tolerances that compare two evaluations are derived from Higham's gamma_n bound on fp32 sums
(:func:`gamma`), never from what one CPU measured.
"""

import functools
import inspect
import math
import warnings

import pytest
import torch

import qfa
from qfa.dropin import calibration as cal
from qfa.dropin import eager as dropin_eager
from qfa.dropin.function import hif8_attention as _hif8_attention
from qfa.dropin.module import HiF8Attention as _HiF8Attention
from qfa.dropin.smoothing import key_means, prepare

# These tests pin the quantise -> op -> dequantise plumbing against references built from the
# un-rotated dequantised inputs, so they switch the (default) Hadamard rotation off;
# tests/dropin/test_rotation.py covers the rotation.
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


def exact_attention(q, k, v, *, causal=False, softmax_scale=SM, bottom_right=True):
    """float64 BNSD attention with GQA; returns (out, lse); rows without keys: out 0, lse +inf."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * softmax_scale
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


# ----------------------------------------------------------------------------- rounding bounds

U32, U64 = 2.0 ** -24, 2.0 ** -53  # unit roundoff of fp32 and float64
#: HiF8 keeps at least 1 mantissa bit in the binades a calibrated tensor uses: a quantised value
#: is within 2^-2 of the original, relatively, so |x_hat| <= 1.25 |x| bounds what the op multiplies.
HIF8_GROWTH = 1.25


def gamma(n: int, u: float = U32) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of an n-term sum or dot
    product evaluated in any order (relative to the sum of the terms' magnitudes)."""
    return n * u / (1 - n * u)


def lse_error_bound(q, k, *, softmax_scale=SM, smooth_k=True, p_scale=1.0, u=U32, growth=HIF8_GROWTH):
    """Bound on the error of one evaluation of the drop-in's LSE against the exact LSE of the
    same scores, per q row: BNSD (B, Nq, Sq). Two evaluations differ by at most twice this.

    With A = softmax_scale * growth^2 * max_j sum_d |q_d| |k_jd| (k smoothed when ``smooth_k``),
    which bounds every |score|, the running max m and lse - ln(Skv):
    - each score: a D-term dot product, gamma_D * A, and its scaling by the descales and the
      softmax scale (3 roundings), 3 u A;
    - lse = m + ln(l): the exponent arguments S - m - ln(p_scale) (2 u (A + |ln p|) relative
      error in each P), exp's last ulp (2 u), the Skv-term row sum l (gamma_Skv), and the
      roundings of m, ln(l) and their sum, u (2 A + 2 ln Skv + |ln p|);
    - with smoothing, the shift softmax_scale * q . mu: a D-term dot product, gamma_D * s with
      s = softmax_scale * sum_d |q_d| |mu_d|; mu's own error (an Skv-term mean, gamma_Skv * the
      mean |k| per channel, plus u |mu| for the division) times softmax_scale |q|; and the
      roundings of the product and of lse + shift, u (2 s + A + ln Skv).
    """
    q, k = q.double(), k.double()
    g, skv = q.shape[1] // k.shape[1], k.shape[2]
    log_skv, log_p = math.log(max(skv, 1)), abs(math.log(p_scale))
    mu = k.mean(dim=2, keepdim=True) if smooth_k else torch.zeros_like(k[:, :, :1])
    ks = (k - mu).abs().repeat_interleave(g, 1)
    a = softmax_scale * growth ** 2 * (q.abs() @ ks.transpose(-1, -2)).amax(dim=-1)
    err = (gamma(q.shape[-1], u) + 3 * u) * a
    err = err + 2 * u * (a + log_p) + 2 * u + gamma(skv, u) + u * (2 * a + 2 * log_skv + log_p)
    if smooth_k:
        mu_abs = mu.abs().repeat_interleave(g, 1)  # (B, Nq, 1, D)
        mu_err = gamma(skv, u) * k.abs().mean(dim=2, keepdim=True).repeat_interleave(g, 1) + u * mu_abs
        s = softmax_scale * (q.abs() * mu_abs).sum(-1)
        err = err + gamma(q.shape[-1], u) * s + softmax_scale * (q.abs() * mu_err).sum(-1)
        err = err + u * (2 * s + a + log_skv)
    return err


def tnd_lse_error_bound(q, k, lens_q, lens_kv, **kw):
    """:func:`lse_error_bound` for packed TND q, k (per sequence), in the LSE's TND shape (Nq, Tq)."""
    parts, a, b = [], 0, 0
    for nq_, nkv_ in zip(lens_q, lens_kv):
        qs, ks = q[a:a + nq_].transpose(0, 1)[None], k[b:b + nkv_].transpose(0, 1)[None]
        parts.append(lse_error_bound(qs, ks, **kw)[0] if nkv_ else torch.zeros(q.shape[1], nq_, dtype=torch.float64))
        a, b = a + nq_, b + nkv_
    return torch.cat(parts, dim=1)


def assert_lse_within(got, want, bound):
    """|got - want| <= bound where finite, and +inf (rows that see no key) in the same places."""
    got, want = got.double(), want.double()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    excess = (got - want).abs()[finite] - bound.expand(want.shape)[finite]
    assert (excess <= 0).all(), f"exceeds the rounding bound by {excess.max().item():.3g}"


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ----------------------------------------------------------------------------- K smoothing

def test_smoothing_is_exact_for_softmax_in_exact_arithmetic():
    q, k, v = make_qkv(b=2, nq=6, nkv=2, sq=19, skv=41, k_offset=5.0)
    mu = key_means(k)  # (B, Nkv, D)
    assert mu.shape == (2, 2, D)
    # an fp32 mean of 41 keys: gamma_41 * mean |k| per channel, plus the division's rounding
    mu_exact = k.double().mean(dim=2)
    assert ((mu.double() - mu_exact).abs() <= gamma(41) * k.double().abs().mean(dim=2) + U32 * mu_exact.abs()).all()
    for causal in (False, True):
        out, lse = exact_attention(q, k, v, causal=causal)
        out_s, lse_s = exact_attention(q, k.double() - mu.double()[:, :, None, :], v, causal=causal)
        # float64 on both sides: they differ only by rounding, bounded as for fp32 with u = 2^-53
        # (and no quantisation); P moves by twice the LSE bound relatively, so out by that times max|v|
        bound = lse_error_bound(q, k, u=U64, growth=1.0, smooth_k=False)
        bound = bound + lse_error_bound(q, k, u=U64, growth=1.0, smooth_k=True)
        out_bound = (2 * bound + gamma(41, U64))[..., None] * v.double().abs().max()
        assert ((out_s - out).abs() <= out_bound).all()
        shift = SM * torch.einsum("bhgsd,bhd->bhgs", q.double().view(2, 2, 3, 19, D), mu.double()).reshape(2, 6, 19)
        assert_lse_within(lse_s + shift, lse, bound)


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
    out, lse = hif8_attention(q, k, v, is_causal=True, smooth_k=smooth_k, return_softmax_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 37)
    # 1) Given what the op quantises, the LSE is exact up to fp32 summation and exp's last ulp:
    #    compare with the float64 LSE of the dequantised scores, shifted back by scale * q . mu
    #    (q unquantised, as the correction is computed).
    qd, kd, vd = dequantised_inputs(q, k, v, smooth_k=smooth_k)
    _, lse_deq = exact_attention(qd, kd, vd, causal=True)
    if smooth_k:
        mu = key_means(k).double()
        lse_deq = lse_deq + SM * torch.einsum("bhgsd,bhd->bhgs", q.double().view(2, 2, 2, 37, D), mu).reshape(2, 4, 37)
    # one fp32 evaluation against float64: the bound once (plus float64's own, far smaller)
    assert_lse_within(lse, lse_deq, lse_error_bound(q, k, smooth_k=smooth_k)
                      + lse_error_bound(q, k, smooth_k=smooth_k, u=U64))
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
    out, lse = hif8_attention(q, k, v, is_causal=True, return_softmax_lse=True)
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
    out, lse = hif8_attention(q, k, v, return_softmax_lse=True)
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32


def test_gqa_equals_repeated_kv_heads():
    q, k, v = make_qkv(nq=6, nkv=2, sq=21, skv=33, k_offset=2.0, seed=7)
    # "rms" scales depend only on the mean square, which repeating heads does not change, and
    # the K means are per kv head: the op then sees identical codes and must agree bit for bit.
    o1, l1 = hif8_attention(q, k, v, is_causal=True, calibration="rms", return_softmax_lse=True)
    o2, l2 = hif8_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True,
                            calibration="rms", return_softmax_lse=True)
    assert torch.equal(o1, o2)
    # the op's GEMMs and the LSE shift's einsum run on other shapes: another summation order
    assert_lse_within(l1, l2, 2 * lse_error_bound(q, k))


@pytest.mark.parametrize("sq,skv", [(1, 37), (5, 37), (37, 37), (40, 12)])
def test_causal_is_aligned_bottom_right(sq, skv):
    q, k, v = make_qkv(nq=4, nkv=2, sq=sq, skv=skv, seed=8, k_offset=1.0)
    out, lse = hif8_attention(q, k, v, is_causal=True, return_softmax_lse=True)
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
    o1, l1 = hif8_attention(q, k, v, is_causal=True, return_softmax_lse=True)
    o2, l2 = hif8_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, layout="BSND", return_softmax_lse=True)
    # same elements -> same scales and means -> same codes; the op's layouts agree bit for bit
    assert torch.equal(o1, o2.transpose(1, 2))
    assert_lse_within(l1, l2, 2 * lse_error_bound(q, k))


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
    (_, ks, _), _ = prepare(q, k, v, layout="TND", cu_seqlens_kv=cu_kv, rotate=False)
    scales = (scales[0], cal.compute_scale(ks), scales[2])
    out, lse = hif8_attention(q, k, v, is_causal=True, layout="TND", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                              scales=scales, return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    for i, (sq_, sk_, vv) in enumerate(seqs):
        if lens_q[i] == 0:
            continue
        o, l = hif8_attention(sq_, sk_, vv, is_causal=True, scales=scales, return_softmax_lse=True)
        a, b = cu_q[i].item(), cu_q[i + 1].item()
        assert torch.equal(out[a:b], o[0].transpose(0, 1))
        # TND sums in other orders (index_add for the K means, GEMMs on other shapes)
        assert_lse_within(lse[:, a:b], l[0], 2 * lse_error_bound(sq_, sk_)[0])
        ref, lse_ref = exact_attention(sq_, sk_, vv, causal=True)
        assert rel_l2(out[a:b], ref[0].transpose(0, 1)) < 0.08  # quantisation error, see the smoothing test
        sigma = score_error_sigma(sq_, key_means(sk_)[:, :, None, :], sk_)
        assert (lse[:, a:b].double() - lse_ref[0]).abs().max().item() < 5 * sigma  # see the LSE test


def test_padding_through_seqused_is_ignored():
    q, k, v = make_qkv(b=2, nq=4, nkv=2, sq=20, skv=30, seed=11, k_offset=2.0)
    qp, kp, vp = (torch.cat([t, 1e4 * torch.ones_like(t[:, :, :6])], dim=2) for t in (q, k, v))  # garbage tail
    used_q = torch.tensor([20, 20], dtype=torch.int32)
    used_kv = torch.tensor([30, 30], dtype=torch.int32)
    o1, l1 = hif8_attention(q, k, v, is_causal=True, return_softmax_lse=True)
    o2, l2 = hif8_attention(qp, kp, vp, is_causal=True, seqused_q=used_q, seqused_kv=used_kv, return_softmax_lse=True)
    # the padding takes no part in scales, K means or attention
    assert torch.equal(o1, o2[:, :, :20])
    assert_lse_within(l1, l2[:, :, :20], 2 * lse_error_bound(q, k))


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
                            return_softmax_lse=True)
    o2, l2 = hif8_attention(padded(q, lens_q), padded(k, lens_kv), padded(v, lens_kv), is_causal=True, layout="TND",
                            cu_seqlens_q=cu([n + pad for n in lens_q]), cu_seqlens_kv=cu([n + pad for n in lens_kv]),
                            seqused_q=torch.tensor(lens_q, dtype=torch.int32),
                            seqused_kv=torch.tensor(lens_kv, dtype=torch.int32), return_softmax_lse=True)
    keep = torch.cat([torch.arange(a, a + n) for a, n in zip([0, lens_q[0] + pad], lens_q)])
    assert torch.equal(o1, o2[keep])
    assert_lse_within(l1, l2[:, keep], 2 * tnd_lse_error_bound(q, k, lens_q, lens_kv))


def test_inputs_are_not_modified():
    q, k, v = make_qkv(nq=4, nkv=2, sq=17, skv=17, k_offset=3.0, dtype=torch.bfloat16)
    copies = [t.clone() for t in (q, k, v)]
    hif8_attention(q, k, v, is_causal=True, return_softmax_lse=True)
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c)


def test_p_scale_and_softmax_scale_are_passed_through():
    q, k, v = make_qkv(nq=2, nkv=2, sq=23, skv=23, seed=12)
    o1, l1 = hif8_attention(q, k, v, softmax_scale=0.05, return_softmax_lse=True)
    _, lse_ref = exact_attention(q, k, v, softmax_scale=0.05)
    err = (l1.double() - lse_ref).abs()
    # as in the LSE test, with this softmax scale
    assert err.max().item() < 5 * score_error_sigma(q, key_means(k)[:, :, None, :], k) * 0.05 / SM
    o2, l2 = hif8_attention(q, k, v, softmax_scale=0.05, p_scale=128.0, return_softmax_lse=True)
    # p_scale cancels in the LSE: the same scores, other roundings of the exponent arguments
    bound = lse_error_bound(q, k, softmax_scale=0.05) + lse_error_bound(q, k, softmax_scale=0.05, p_scale=128.0)
    assert_lse_within(l2, l1, bound)
    # ... and only moves P on the grid: with p_scale 128 the largest P sit in binades 2^4..2^7,
    # where HiF8 keeps 2 mantissa bits (relative error <= 2^-3 instead of 2^-4): about twice
    # the error of p_scale 1 against attention on the dequantised inputs (measured 0.021, 0.042)
    ref, _ = exact_attention(*dequantised_inputs(q, k, v), softmax_scale=0.05)
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
        (lambda q, k, v: (q, k, v), {"softmax_scale": -1.0}, ValueError, "softmax_scale must be a finite number > 0"),
        (lambda q, k, v: (q, k, v), {"is_causal": 1}, TypeError, "is_causal"),
        (lambda q, k, v: (q, k, v), {"cu_seqlens_q": torch.tensor([0, 8], dtype=torch.int32)}, ValueError,
         "only for layout 'TND'"),
        (lambda q, k, v: (q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)), {"layout": "TND"},
         ValueError, "needs cu_seqlens_q"),
        (lambda q, k, v: (q, k, v), {"seqused_kv": torch.tensor([8])}, TypeError,
         "seqused_kv must be torch.int32, got torch.int64"),
        (lambda q, k, v: (q, k, v), {"seqused_kv": torch.tensor([8, 8], dtype=torch.int32)}, ValueError,
         "seqused_kv must have shape"),
        (lambda q, k, v: (q, k, v), {"scales": (1.0, 1.0)}, TypeError, "scales must be a tuple"),
        (lambda q, k, v: (q, k, v), {"scales": (1.0, -1.0, 1.0)}, ValueError, r"^scales\[1\] \(k_scale\) must be"),
        (lambda q, k, v: (q, k, v), {"p_scale": "x"}, TypeError, "p_scale"),
        (lambda q, k, v: (q, k, v), {"p_scale": -2.0}, ValueError, "^p_scale must be"),  # the op's rule
        (lambda q, k, v: (q, k, v), {"softmax_scale": torch.tensor(0.1)}, TypeError,
         "softmax_scale must be a Python float or None, got Tensor"),
        (lambda q, k, v: (q, k, v), {"return_softmax_lse": "no"}, TypeError, "return_softmax_lse must be a bool, got str"),
        (lambda q, k, v: (q, k, v), {"smooth_k": 1}, TypeError, "smooth_k must be a bool, got int"),
        (lambda q, k, v: (q, k, v), {"return_lse": "no"}, TypeError, "^return_lse must be a bool, got str"),  # as passed
        (lambda q, k, v: (q, k, v), {"bogus": 1}, TypeError, "unexpected keyword argument 'bogus'"),
    ],
)
def test_bad_inputs(mutate, kwargs, exc, pattern):
    q, k, v = mutate(*_good())
    with pytest.raises(exc, match=pattern), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # return_lse= warns before it is checked
        hif8_attention(q, k, v, **kwargs)


def test_non_finite_inputs_are_rejected_by_dynamic_scales():
    q, k, v = _good()
    q = q.clone()
    q[0, 0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        hif8_attention(q, k, v)


# ----------------------------------------------------------------------------- one rule set with the op

def _tnd(t):
    return t[0].transpose(0, 1).contiguous()  # (1, N, S, D) -> (S, N, D)


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


#: (layout, what to change, kwargs): each a mistake that quant_flash_attn and hif8_attention can
#: both be given; they must reject it with the same exception and message. S = 8 tokens, B = 1.
SAME_MISTAKES = [
    ("BNSD", None, {"cu_seqlens_q": _i32(0, 8)}),
    ("TND", None, {"cu_seqlens_q": _i32(0, 8)}),
    ("TND", None, {"cu_seqlens_q": torch.tensor([0, 8]), "cu_seqlens_kv": _i32(0, 8)}),
    ("TND", None, {"cu_seqlens_q": _i32(0, 8).view(1, 2), "cu_seqlens_kv": _i32(0, 8)}),
    ("TND", None, {"cu_seqlens_q": [0, 8], "cu_seqlens_kv": _i32(0, 8)}),
    ("TND", None, {"cu_seqlens_q": _i32(0, 8), "cu_seqlens_kv": _i32(0, 4, 8)}),
    ("TND", None, {"cu_seqlens_q": _i32(0, 8).to("meta"), "cu_seqlens_kv": _i32(0, 8)}),
    ("BNSD", None, {"seqused_kv": _i32(8, 8)}),
    ("BNSD", None, {"seqused_q": torch.tensor([8])}),
    ("BNSD", None, {"seqused_kv": _i32(8).to("meta")}),
    ("TND", None, {"cu_seqlens_q": _i32(0, 8), "cu_seqlens_kv": _i32(0, 8), "seqused_kv": _i32(8, 8)}),
    # values: read on the host by both
    ("TND", None, {"cu_seqlens_q": _i32(1, 8), "cu_seqlens_kv": _i32(0, 8)}),
    ("TND", None, {"cu_seqlens_q": _i32(0, 7), "cu_seqlens_kv": _i32(0, 8)}),
    ("TND", None, {"cu_seqlens_q": _i32(0, 5, 8), "cu_seqlens_kv": _i32(0, 6, 3)}),
    ("BNSD", None, {"seqused_kv": _i32(9)}),
    ("TND", None, {"cu_seqlens_q": _i32(0, 8), "cu_seqlens_kv": _i32(0, 8), "seqused_q": _i32(-1)}),
    # shapes
    ("BNSD", lambda q, k, v: (q[..., :64], k[..., :64], v[..., :64]), {}),
    ("BNSD", lambda q, k, v: (q, k, v[:, :, :5]), {}),
    ("BNSD", lambda q, k, v: (q[:, :3], k, v), {}),
    ("BNSD", lambda q, k, v: (q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1)), {}),
    ("BNSD", lambda q, k, v: (q[0], k[0], v[0]), {}),
    ("BSND", lambda q, k, v: (q, k[:, :, :, :1], v[:, :, :, :1]), {}),
    ("NSD", None, {}),
    # scalars
    ("BNSD", None, {"softmax_scale": -1.0}),
    ("BNSD", None, {"softmax_scale": torch.tensor(0.1)}),
    ("BNSD", None, {"p_scale": torch.tensor([0.0])}),
    ("BNSD", None, {"p_scale": torch.tensor([1e38])}),
    ("BNSD", None, {"p_scale": torch.tensor([1.0], dtype=torch.float64)}),
    ("BNSD", None, {"return_softmax_lse": "no"}),
]
#: Cases (index: why) whose messages still differ between the op and the drop-in; strict, so
#: they fail loudly once both use one check and the mark can go.
OP_NOT_YET_SHARED: dict[int, str] = {}


def _same_mistake_params():
    for i, case in enumerate(SAME_MISTAKES):
        marks = [pytest.mark.xfail(strict=True, reason=OP_NOT_YET_SHARED[i])] if i in OP_NOT_YET_SHARED else []
        yield pytest.param(*case, marks=marks, id=f"{i}-{case[0]}-{'+'.join(case[2]) or 'shape'}")


def _raised(fn):
    try:
        fn()
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)
    raise AssertionError("no TypeError or ValueError was raised")


@pytest.mark.parametrize("layout,mutate,kwargs", list(_same_mistake_params()))
def test_the_same_mistake_gets_the_same_message_from_dropin_and_op(layout, mutate, kwargs):
    q, k, v = make_qkv(nq=4, nkv=2, sq=8, skv=8, layout="BSND" if layout == "BSND" else "BNSD")
    if layout == "TND":
        q, k, v = _tnd(q), _tnd(k), _tnd(v)
    if mutate is not None:
        q, k, v = mutate(q, k, v)
    codes = [qfa.encode_to_hifloat8(t.contiguous()) for t in (q, k, v)]
    one = torch.ones(1)
    dropin = _raised(lambda: qfa.hif8_attention(q, k, v, layout=layout, **kwargs))
    op = _raised(lambda: qfa.quant_flash_attn(*codes, one, one, one, 0, layout=layout, **kwargs))
    assert dropin == op


def test_dropin_calls_the_op_with_hif8_per_tensor_mode_0(monkeypatch):
    seen = {}
    real = dropin_eager.quant_flash_attn

    def spy(*args, **kwargs):
        seen["quant_mode"], seen["mask_mode"] = args[6], kwargs["mask_mode"]
        return real(*args, **kwargs)

    monkeypatch.setattr(dropin_eager, "quant_flash_attn", spy)
    hif8_attention(*make_qkv(nq=2, nkv=1, sq=8, skv=8), is_causal=True)
    assert seen["quant_mode"] == 0 and isinstance(seen["quant_mode"], qfa.tiling.spec.QuantMode)
    assert seen["mask_mode"] == 3


# ----------------------------------------------------------------------------- names: upstream's, old ones deprecated

def test_scale_and_return_lse_are_deprecated_aliases():
    q, k, v = make_qkv(nq=2, nkv=1, sq=9, skv=9, seed=3)
    want = hif8_attention(q, k, v, softmax_scale=0.07, return_softmax_lse=True)
    with pytest.warns(DeprecationWarning, match="use softmax_scale="):
        got_scale = hif8_attention(q, k, v, scale=0.07, return_softmax_lse=True)
    with pytest.warns(DeprecationWarning, match="use return_softmax_lse="):
        got_lse = hif8_attention(q, k, v, softmax_scale=0.07, return_lse=True)
    for got in (got_scale, got_lse):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("kwargs", [{"softmax_scale": 0.1, "scale": 0.1},
                                    {"return_softmax_lse": True, "return_lse": True}])
def test_passing_both_spellings_is_a_type_error(kwargs):
    with pytest.raises(TypeError, match="deprecated alias"):
        hif8_attention(*make_qkv(nq=2, nkv=1, sq=4, skv=4), **kwargs)


def test_module_takes_upstreams_names_and_the_deprecated_ones():
    q, k, v = make_qkv(nq=2, nkv=1, sq=9, skv=9, seed=4)
    want = hif8_attention(q, k, v, softmax_scale=0.07, return_softmax_lse=True)
    attn = HiF8Attention(softmax_scale=0.07)
    got = attn(q, k, v, return_softmax_lse=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.warns(DeprecationWarning, match="use softmax_scale="):
        old = HiF8Attention(scale=0.07)
    assert old.softmax_scale == 0.07
    with pytest.warns(DeprecationWarning, match="use return_softmax_lse="):
        got = old(q, k, v, return_lse=True)
    assert torch.equal(got[1], want[1])
    with pytest.raises(TypeError, match="deprecated alias"):
        HiF8Attention(softmax_scale=0.1, scale=0.1)
    with pytest.raises(TypeError, match="return_softmax_lse must be a bool, got str"):
        attn(q, k, v, return_softmax_lse="no")


@pytest.mark.parametrize("flag", ["is_causal", "smooth_k", "static", "rotate"])
def test_module_flags_must_be_bools(flag):
    with pytest.raises(TypeError, match=f"{flag} must be a bool, got int"):
        HiF8Attention(**{flag: 1})


def test_module_scales_at_construction_are_static_scales():
    q, k, v = make_qkv(nq=4, nkv=2, sq=16, skv=16, seed=21, k_offset=2.0)
    attn = HiF8Attention(is_causal=True, scales=(0.5, 0.25, 2.0))
    assert attn.frozen and attn.static
    by_hand = HiF8Attention(is_causal=True).set_scales(0.5, 0.25, 2.0)
    assert torch.equal(attn.k_scale, by_hand.k_scale) and float(attn.k_scale) == 0.25
    assert torch.equal(attn(q, k, v), by_hand(q, k, v))
    assert torch.equal(attn(q, k, v), hif8_attention(q, k, v, is_causal=True, scales=(0.5, 0.25, 2.0)))
    assert HiF8Attention(static=True, scales=(1.0, 1.0, 1.0)).frozen  # static= still works with them
    with pytest.raises(TypeError, match="scales must be a tuple"):
        HiF8Attention(scales=(1.0, 1.0))
    with pytest.raises(ValueError, match=r"^scales\[1\] \(k_scale\) must be positive and finite"):
        HiF8Attention(scales=(1.0, -1.0, 1.0))
    with pytest.raises(ValueError, match="^k_scale must be positive and finite"):
        HiF8Attention().set_scales(1.0, -1.0, 1.0)


def test_the_public_names_are_upstreams():
    params = inspect.signature(qfa.hif8_attention).parameters
    assert {"softmax_scale", "return_softmax_lse"} <= set(params) and not {"scale", "return_lse"} & set(params)
    assert "return_softmax_lse" in inspect.signature(qfa.HiF8Attention.forward).parameters
    assert {"softmax_scale", "scales", "static"} <= set(inspect.signature(qfa.HiF8Attention).parameters)


def test_length_checks_read_no_values():
    """check_sequence_lengths on meta tensors (which hold no values: reading one raises) and on
    a q it knows only by shape: the static rules need no device sync."""
    from qfa.tiling.checks import check_sequence_lengths

    meta = torch.device("meta")
    cu = torch.empty(4, dtype=torch.int32, device=meta)
    used = torch.empty(3, dtype=torch.int32, device=meta)
    assert check_sequence_lengths("TND", device=meta, cu_seqlens_q=cu, cu_seqlens_kv=cu, seqused_kv=used) == 3
    assert check_sequence_lengths("BNSD", batch=3, device=meta, seqused_q=used) == 3
    # a caller without q (a plan made before the tensors): B from seqused, one device for all
    assert check_sequence_lengths("BSND", seqused_kv=used) == 3
    assert check_sequence_lengths("BSND") is None
    with pytest.raises(ValueError, match=r"^cu_seqlens and seqused tensors must share one device"):
        check_sequence_lengths("TND", cu_seqlens_q=cu, cu_seqlens_kv=_i32(0, 1, 2, 3))
    with pytest.raises(ValueError, match=r"^batch size B must be in \[1, 2\], got 3"):
        check_sequence_lengths("TND", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_batch=2)
    with pytest.raises(ValueError, match=r"^seqused_q must have shape \(2,\), got \(3,\)"):
        check_sequence_lengths("BNSD", batch=2, seqused_q=_i32(1, 2, 3))


def test_module_observe_checks_the_length_values_like_the_op():
    q, k, v = (_tnd(t) for t in make_qkv(nq=4, nkv=2, sq=8, skv=8))
    attn = HiF8Attention(layout="TND")
    with pytest.raises(ValueError, match=r"^cu_seqlens_kv must be non-decreasing, got \[0, 6, 3\]"):
        attn.observe(q, k, v, cu_seqlens_q=_i32(0, 5, 8), cu_seqlens_kv=_i32(0, 6, 3))


# --- gradients --------------------------------------------------------------------------------

@pytest.mark.parametrize("format", ["hif8", "fp8"])
def test_inputs_that_require_grad_give_an_output_whose_backward_says_why(format):
    """Eager calls used to return an output outside the graph: a loss through it left the
    projections' gradients out without a word. Now, as under torch.compile, the output is in the
    graph and its backward raises, naming the way out; the values are the no-grad call's."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 128)
    x = torch.randn(1, 4, 20, 128)
    q = lin(x)
    options = dict(rotate=False, format=format) if format != "hif8" else {}
    with torch.no_grad():
        want = qfa.hif8_attention(q, q, q, **options)
    out, lse = qfa.hif8_attention(q, q, q, return_softmax_lse=True, **options)
    assert out.requires_grad and lse.requires_grad
    assert torch.equal(out.detach(), want)
    with pytest.raises(RuntimeError, match=r"^qfa.hif8_attention has no gradient: it is an inference operator"):
        (out.float().sum() + lin.weight.sum()).backward()
    with torch.inference_mode():
        assert not qfa.hif8_attention(lin(x), lin(x), lin(x), **options).requires_grad


def test_module_over_projections_refuses_a_backward():
    torch.manual_seed(1)
    proj, attention = torch.nn.Linear(128, 128), qfa.HiF8Attention()
    h = proj(torch.randn(1, 2, 12, 128))
    out = attention(h, h, h)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="no gradient"):
        out.sum().backward()
    assert proj.weight.grad is None  # raised before any gradient was written


@pytest.mark.parametrize("cast", ["bfloat16", "half", "to_bf16"])
def test_module_dtype_casts_keep_its_scales_fp32(cast):
    """``.bfloat16()`` / ``.half()`` / ``.to(dtype)`` used to round the frozen scales (another
    output) or flush a small one to 0 (then refused by name, though the user set 1e-8)."""
    scales = (0.013, 1e-8, 0.017)
    m = qfa.HiF8Attention(scales=scales)
    want = m.q_scale.clone(), m.k_scale.clone(), m.v_scale.clone()
    cast_module = {"bfloat16": lambda: m.bfloat16(), "half": lambda: m.half(),
                   "to_bf16": lambda: m.to(torch.bfloat16)}[cast]
    assert cast_module() is m
    for buf, before in zip((m.q_scale, m.k_scale, m.v_scale), want):
        assert buf.dtype == torch.float32 and torch.equal(buf, before)
    assert m.frozen
    q = torch.randn(1, 2, 16, 128, dtype=torch.bfloat16)
    fresh = qfa.HiF8Attention(scales=scales)
    assert torch.equal(m(q, q, q).view(torch.int16), fresh(q, q, q).view(torch.int16))
    assert m.to(device="meta").q_scale.device.type == "meta"  # devices still move


def test_scales_that_require_grad_also_give_an_output_whose_backward_says_why():
    """Static scale tensors that require grad (q, k and v not) were converted to fp32 for the op,
    leaving the output outside their graph."""
    s = torch.tensor([0.05], requires_grad=True)
    q = torch.randn(1, 2, 16, 128)
    out = qfa.hif8_attention(q, q, q, scales=(s, s.detach(), s.detach()))
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="no gradient"):
        out.sum().backward()
