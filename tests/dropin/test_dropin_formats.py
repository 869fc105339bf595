"""The drop-in's ``format=``: MXFP8 (quant_mode 1) and FP8 E4M3 per-token-head (quant_mode 6)
beside HiF8 per-tensor, on float inputs.

* Numerics against exact attention on the *dequantised* inputs, within
  ``mode16_reference.p8_error_bound``, the bound derived from the arithmetic (E4M3's rounding
  of P, fp32 exp/accumulation, the bf16 output): the test quantises q, k, v itself with the
  codecs, the way the drop-in's docs say each format does (MXFP8: Q/K per token, head and 32
  channels, V per channel and 32 keys of each sequence; FP8: Q/K per token and head, V per head
  over the valid keys of all sequences), so the input quantisation is measured exactly and the
  rest bounded.
* Plumbing exactly: BNSD, BSND and TND give the same bits; padding (seqused) equals the
  unpadded call; rows that see nothing give 0 and LSE +inf.
* K smoothing exactly: with K = K0 + mu (mu the exact per-head per-channel key mean), smoothing
  gives the bits of the unsmoothed call on K0 in every format; the LSE moves by q . mu exactly
  as the shift says.
* format="hif8" is today's default bit for bit (rebuilt here from the public pieces).
* Errors: bad format names, the options only HiF8 takes, the op's shared messages.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import mode16_reference as m16
import qfa
from qfa.dropin import calibration as cal
from qfa.dropin import rotation, scaled as dropin_scaled, smoothing
from qfa.dropin.call import FORMATS
from qfa.cast import fp8, mxfp8
from qfa.tiling.spec import KEY_BLOCK, QuantMode, default_softmax_scale

E4M3_FORMATS = ("mxfp8", "fp8")
P_SCALE = dropin_scaled.E4M3_P_SCALE


def _qkv(b=2, nq=4, nkv=2, sq=37, skv=70, d=128, offset=2.0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, sq, d, generator=g)
    k = torch.randn(b, nkv, skv, d, generator=g) + offset * torch.randn(1, nkv, 1, d, generator=g)
    v = torch.randn(b, nkv, skv, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _bsnd(t):
    return t.transpose(1, 2).contiguous()


def _tnd(t):
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[-1]).contiguous()


def _call(fmt, *args, **kw):
    return qfa.hif8_attention(*args, format=fmt, rotate=fmt == "hif8", **kw)


# ----------------------------------------------------------------------------- numerics

def _dequantised(fmt, qs, ks, vs):
    """Per sequence (N, S, D) float32 q, k, v -> float64 numpy of their quantised values, by the
    format's rule (FP8's V scale spans every sequence's keys: one per head)."""
    if fmt == "mxfp8":
        deq = lambda t, axis: mxfp8.dequantize(*mxfp8.quantize(t, axis), axis)  # noqa: E731
        return ([deq(q, -1) for q in qs], [deq(k, -1) for k in ks], [deq(v, 1) for v in vs])
    deq_tok = lambda t: fp8.dequantize_per_token_head(*fp8.quantize_per_token_head(t))  # noqa: E731
    _, v_scale = fp8.quantize_per_head(torch.cat(vs, dim=1), 0)  # (Nkv,)
    v_deq = [fp8.dequantize_per_head(_e4m3(v / v_scale[:, None, None]), v_scale, 0) for v in vs]
    return [deq_tok(q) for q in qs], [deq_tok(k) for k in ks], v_deq


def _e4m3(x):
    return fp8.round_to_e4m3(x).to(fp8.E4M3)


@pytest.mark.parametrize("fmt", E4M3_FORMATS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("smooth_k", [False, True])
def test_output_within_the_derived_bound_of_exact_attention_on_the_dequantised_inputs(fmt, causal, smooth_k):
    """Two sequences of different used lengths (seqused), GQA 2, Sq < Skv (bottom-right causal),
    Skv past one 128-key page; K with a per-channel offset."""
    q, k, v = _qkv(sq=37, skv=200)
    used_q = torch.tensor([37, 21], dtype=torch.int32)
    used_kv = torch.tensor([200, 133], dtype=torch.int32)
    scale = default_softmax_scale(128)
    out, lse = _call(fmt, q, k, v, is_causal=causal, smooth_k=smooth_k, seqused_q=used_q, seqused_kv=used_kv,
                     return_softmax_lse=True)
    (qp, kp, vp), mu = smoothing.prepare(q, k, v, seqused_kv=used_kv, smooth_k=smooth_k, rotate=False)
    lens_q, lens_kv = used_q.tolist(), used_kv.tolist()
    qs = [qp[b, :, :lens_q[b]].float() for b in range(2)]
    ks = [kp[b, :, :lens_kv[b]].float() for b in range(2)]
    vs = [vp[b, :, :lens_kv[b]].float() for b in range(2)]
    qd, kd, vd = _dequantised(fmt, qs, ks, vs)
    shift = 0.0
    if smooth_k:  # the drop-in adds back softmax_scale * q . mu (fp32 q, unquantised)
        shift = np.einsum("bhgsd,bhd->bhgs", q.double().view(2, 2, 2, 37, 128).numpy(),
                          mu.double().numpy()).reshape(2, 4, 37) * scale
    ratios = []
    for b in range(2):
        n = lens_q[b]
        got_lse = lse[b, :, :n].double().numpy() - (shift[b, :, :n] if smooth_k else 0.0)
        ratios.append(m16.check_against_exact(
            out[b, :, :n].double().numpy(), got_lse, qd[b].double().numpy(), kd[b].double().numpy(),
            vd[b].double().numpy(), p_scale=P_SCALE, scale=scale, causal=causal,
            block_n=KEY_BLOCK[QuantMode.MXFP8 if fmt == "mxfp8" else QuantMode.FP8_PER_TOKEN_HEAD]))
        # rows past seqused_q: nothing, as the op gives them
        assert (out[b, :, n:] == 0).all() and torch.isposinf(lse[b, :, n:]).all()
    assert max(ratios) > 0  # the bound is exercised, not vacuous


def test_mxfp8_takes_its_other_head_sizes():
    """MXFP8 (mode 1) runs D = 72 (a 32-channel block tail of 8) through the drop-in too."""
    q, k, v = _qkv(b=1, sq=9, skv=40, d=72)
    out, lse = _call("mxfp8", q, k, v, is_causal=True, smooth_k=False, return_softmax_lse=True)
    qd, kd, vd = _dequantised("mxfp8", [q[0]], [k[0]], [v[0]])
    m16.check_against_exact(out[0].double().numpy(), lse[0].double().numpy(), qd[0].double().numpy(),
                            kd[0].double().numpy(), vd[0].double().numpy(), p_scale=P_SCALE,
                            scale=default_softmax_scale(72), causal=True, block_n=KEY_BLOCK[QuantMode.MXFP8])
    with pytest.raises(ValueError, match="head dim D of q must be 128, got 72"):
        _call("fp8", q, k, v)


@pytest.mark.parametrize("fmt", FORMATS)
def test_error_against_exact_float_attention_is_a_few_percent(fmt):
    """End to end against fp32 attention on the original inputs (K with a channel offset, smoothed):
    every format's error is the size its 3 mantissa bits give, a few per cent RMS (one E4M3 /
    HiF8 rounding is <= 2^-4 relative, RMS about 2^-4 / sqrt(3) = 3.6 %), and not zero."""
    q, k, v = _qkv(b=1, sq=64, skv=300, offset=4.0)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    err = float((_call(fmt, q, k, v) - ref).norm() / ref.norm())
    assert 1e-3 < err < 0.1, err


# ----------------------------------------------------------------------------- plumbing

@pytest.mark.parametrize("fmt", E4M3_FORMATS)
def test_layouts_and_padding_give_the_same_bits(fmt):
    """The same tokens in BNSD, BSND, TND, padded or not, are the same op call, to the bit.
    (Without smoothing: the K mean's fp32 sum runs in a layout-dependent order, so with it the
    smoothed K may differ by an ulp between layouts; smoothing has its own exact tests below.)"""
    q, k, v = _qkv(sq=20, skv=150)
    used_q = torch.tensor([20, 11], dtype=torch.int32)
    used_kv = torch.tensor([150, 97], dtype=torch.int32)
    kw = dict(is_causal=True, seqused_q=used_q, seqused_kv=used_kv, return_softmax_lse=True, smooth_k=False)
    out, lse = _call(fmt, q, k, v, **kw)
    out_s, lse_s = _call(fmt, _bsnd(q), _bsnd(k), _bsnd(v), layout="BSND", **kw)
    assert torch.equal(_bsnd(out_s), out) and torch.equal(lse_s, lse)
    cu_q = torch.tensor([0, 20, 40], dtype=torch.int32)
    cu_kv = torch.tensor([0, 150, 300], dtype=torch.int32)
    out_t, lse_t = _call(fmt, _tnd(q), _tnd(k), _tnd(v), layout="TND", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, **kw)
    assert torch.equal(out_t, _tnd(out)) and torch.equal(lse_t, lse.transpose(0, 1).reshape(4, -1))
    # the padded call is the unpadded one: padding (here NaN) enters no scale, mean or sum
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t, n in ((q2, 11), (k2, 97), (v2, 97)):
        t[1, :, n:] = float("nan")
    out2, lse2 = _call(fmt, q2, k2, v2, **kw)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    # FP8's V scale is per head over every sequence, so compare sequence 1 on its own in MXFP8
    if fmt == "mxfp8":
        alone, alone_lse = _call(fmt, q[1:, :, :11], k[1:, :, :97], v[1:, :, :97], is_causal=True,
                                 return_softmax_lse=True, smooth_k=False)
        assert torch.equal(alone[0], out[1, :, :11]) and torch.equal(alone_lse[0], lse[1, :, :11])


@pytest.mark.parametrize("fmt", E4M3_FORMATS)
def test_rows_without_keys_and_dtypes(fmt):
    q, k, v = _qkv(sq=5, skv=9, dtype=torch.float16)
    out, lse = _call(fmt, q, k, v, seqused_kv=torch.tensor([0, 9], dtype=torch.int32), return_softmax_lse=True)
    assert out.dtype == torch.float16 and out.shape == q.shape and lse.shape == (2, 4, 5)
    assert (out[0] == 0).all() and torch.isposinf(lse[0]).all() and torch.isfinite(lse[1]).all()
    out_b = _call(fmt, *(t.to(torch.bfloat16) for t in (q, k, v)))
    assert out_b.dtype == torch.bfloat16
    assert _call(fmt, q, k, v, return_softmax_lse=False).shape == q.shape


@pytest.mark.parametrize("fmt", E4M3_FORMATS)
def test_thin_names_and_the_custom_op_are_the_same_call(fmt):
    q, k, v = _qkv(b=1, sq=9, skv=30)
    want = _call(fmt, q, k, v, is_causal=True)
    thin = qfa.mxfp8_attention if fmt == "mxfp8" else qfa.fp8_attention
    assert torch.equal(thin(q, k, v, is_causal=True), want)
    out, lse = torch.ops.qfa.hif8_attention(q, k, v, is_causal=True, rotate=False, format=fmt)
    assert torch.equal(out, want) and lse.shape == (0,)
    module = qfa.HiF8Attention(is_causal=True, rotate=False, format=fmt)
    assert torch.equal(module(q, k, v), want)


@pytest.mark.parametrize("fmt", E4M3_FORMATS)
def test_under_torch_compile_the_format_crosses_the_custom_op(fmt):
    """fullgraph: the whole call is torch.ops.qfa.hif8_attention with format= in its schema; the
    op's fake gives the shapes (opcheck), and the compiled call gives the eager bits."""
    q, k, v = _qkv(b=1, sq=9, skv=20)
    thin = qfa.mxfp8_attention if fmt == "mxfp8" else qfa.fp8_attention
    compiled = torch.compile(lambda q, k, v: thin(q, k, v, is_causal=True), fullgraph=True)
    assert torch.equal(compiled(q, k, v), thin(q, k, v, is_causal=True))
    torch.library.opcheck(torch.ops.qfa.hif8_attention.default, (q, k, v),
                          dict(rotate=False, format=fmt, return_softmax_lse=True, is_causal=True),
                          test_utils=("test_schema", "test_faketensor"))


def test_a_nan_stays_in_the_rows_that_read_it():
    """MXFP8: a NaN in one query token makes that token's 32-channel block's scale NaN, so only
    its row (for that head) is NaN, as in exact attention."""
    q, k, v = _qkv(b=1, sq=6, skv=40)
    q[0, 1, 3, 5] = float("nan")
    out = _call("mxfp8", q, k, v, smooth_k=False)
    nan_rows = torch.isnan(out).any(-1)
    expected = torch.zeros_like(nan_rows)
    expected[0, 1, 3] = True
    assert torch.equal(nan_rows, expected)


# ----------------------------------------------------------------------------- K smoothing

def _offset_keys(b=2, nkv=2, skv=64, d=128, seed=3):
    """K0 with an exact zero mean per (sequence, head, channel), on a 2^-4 grid, and mu on it too:
    K = K0 + mu, its key mean and K - mean are then exact in fp32 (every partial sum is a
    multiple of 2^-4 far below 2^20)."""
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(-64, 65, (b, nkv, skv // 2, d), generator=g).float() / 16
    k0 = torch.cat([half, -half], dim=2)
    mu = torch.randint(-1024, 1025, (1, nkv, 1, d), generator=g).float() / 16
    return k0, mu


@pytest.mark.parametrize("fmt", FORMATS)
def test_smoothing_is_exact_in_every_format(fmt):
    k0, mu = _offset_keys()
    q, _, v = _qkv(sq=64, skv=64, seed=4)
    kw = dict(is_causal=True, return_softmax_lse=True)
    out_s, lse_s = _call(fmt, q, k0 + mu, v, smooth_k=True, **kw)
    out_0, lse_0 = _call(fmt, q, k0, v, smooth_k=False, **kw)
    assert torch.equal(out_s, out_0)  # the smoothed K is K0 to the bit: the same codes, the same call
    shift = torch.einsum("bhgsd,hd->bhgs", q.double().view(2, 2, 2, 64, 128), mu[0, :, 0].double()).reshape(2, 4, 64)
    shift = shift * default_softmax_scale(128)
    err = (lse_s.double() - (lse_0.double() + shift)).abs()
    # fp32: the shift computed in fp32 (a 128-term dot, <= 128 * 2^-24 relative to sum |q mu|)
    # and the one fp32 addition (2^-24 of the result)
    size = torch.einsum("bhgsd,hd->bhgs", q.double().abs().view(2, 2, 2, 64, 128),
                        mu[0, :, 0].double().abs()).reshape(2, 4, 64) * default_softmax_scale(128)
    assert (err <= 130 * 2.0**-24 * size + 2.0**-23 * lse_s.double().abs()).all()
    # without smoothing the offset costs accuracy in every format (it is not a no-op)
    out_plain = _call(fmt, q, k0 + mu, v, smooth_k=False, is_causal=True)
    assert not torch.equal(out_plain, out_0)


def test_smoothing_excludes_padding_from_the_mean():
    """TND with seqused_kv: the keys past the used length (garbage here) do not enter mu."""
    k0, mu = _offset_keys(b=1)
    q, _, v = _qkv(b=1, sq=16, skv=80, seed=5)
    k = torch.cat([k0 + mu, torch.full((1, 2, 16, 128), 1e4)], dim=2)  # 64 used keys, 16 of padding
    tnd = dict(layout="TND", cu_seqlens_q=torch.tensor([0, 16], dtype=torch.int32),
               cu_seqlens_kv=torch.tensor([0, 80], dtype=torch.int32), seqused_kv=torch.tensor([64], dtype=torch.int32))
    for fmt in E4M3_FORMATS:
        smoothed = _call(fmt, _tnd(q), _tnd(k), _tnd(v), smooth_k=True, **tnd)
        plain = _call(fmt, _tnd(q), _tnd(torch.cat([k0, k[:, :, 64:]], 2)), _tnd(v), smooth_k=False, **tnd)
        assert torch.equal(smoothed, plain)


# ----------------------------------------------------------------------------- HiF8 unchanged

@pytest.mark.parametrize("layout", ["BNSD", "TND"])
def test_hif8_format_is_todays_default_bit_for_bit(layout):
    """format="hif8" (and no format) is the HiF8 per-tensor path as it was: smooth, rotate,
    per-tensor scales from the default rule, quant_mode 0, rotate back, LSE shift."""
    q, k, v = _qkv(sq=33, skv=33, dtype=torch.bfloat16)
    kw = {}
    if layout == "TND":
        q, k, v = _tnd(q), _tnd(k), _tnd(v)
        cu = torch.tensor([0, 33, 66], dtype=torch.int32)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)
    out, lse = qfa.hif8_attention(q, k, v, is_causal=True, layout=layout, return_softmax_lse=True, **kw)
    out_f, lse_f = qfa.hif8_attention(q, k, v, is_causal=True, layout=layout, return_softmax_lse=True,
                                      format="hif8", **kw)
    assert torch.equal(out, out_f) and torch.equal(lse, lse_f)
    tensors, mu = smoothing.prepare(q, k, v, layout=layout, cu_seqlens_kv=kw.get("cu_seqlens_kv"))
    rule = cal.get_rule(cal.DEFAULT_RULE)
    scales = [rule(t) for t in tensors]
    scale = default_softmax_scale(128)
    got, got_lse = qfa.quant_flash_attn(*[cal.quantize(t, s) for t, s in zip(tensors, scales)], *scales, 0,
                                        layout=layout, mask_mode=3, softmax_scale=scale, return_softmax_lse=True, **kw)
    assert torch.equal(out, rotation.rotate(got).to(q.dtype))
    shift = smoothing.lse_shift(q, mu, layout, kw.get("cu_seqlens_q"), scale)
    assert torch.equal(lse, got_lse + shift)


# ----------------------------------------------------------------------------- errors

def test_bad_format_names():
    q, k, v = _qkv(b=1, sq=4, skv=4)
    with pytest.raises(ValueError, match=r"format must be one of \('hif8', 'mxfp8', 'fp8'\), got 'mxfp4'"):
        qfa.hif8_attention(q, k, v, format="mxfp4")
    with pytest.raises(TypeError, match="format must be a str.*got int"):
        qfa.hif8_attention(q, k, v, format=1)
    with pytest.raises(ValueError, match="format must be one of"):
        qfa.HiF8Attention(format="HIF8")


@pytest.mark.parametrize("fmt", E4M3_FORMATS)
def test_what_only_hif8_takes_is_refused_not_ignored(fmt):
    q, k, v = _qkv(b=1, sq=4, skv=4)
    with pytest.raises(ValueError, match="rotate=True is the HiF8 format's option"):
        qfa.hif8_attention(q, k, v, format=fmt)  # rotate's default is HiF8's
    for kw, what in ((dict(scales=(1.0, 1.0, 1.0)), "scales="), (dict(calibration="amax"), "calibration='amax'"),
                     (dict(calibration=lambda t: torch.ones(1)), "calibration=")):
        with pytest.raises(ValueError, match=what):
            _call(fmt, q, k, v, **kw)
    plan = qfa.quant_flash_attn_metadata(4, 2, layout="BNSD", seqused_q=torch.tensor([4], dtype=torch.int32),
                                         seqused_kv=torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="metadata plans the HiF8 format's call"):
        _call(fmt, q, k, v, metadata=plan)
    assert _call(fmt, q, k, v, calibration=cal.DEFAULT_RULE).shape == q.shape  # the default is no choice
    module = qfa.HiF8Attention(format=fmt, rotate=False)
    for action in (lambda: module.calibrate().__enter__(), lambda: module.observe(q, k, v),
                   lambda: module.set_scales(1.0, 1.0, 1.0)):
        with pytest.raises(ValueError, match="static per-tensor scales are the HiF8 format's"):
            action()
    with pytest.raises(ValueError, match="static per-tensor scales"):
        qfa.HiF8Attention(format=fmt, rotate=False, static=True)
    with pytest.raises(ValueError, match="rotate=True"):
        qfa.HiF8Attention(format=fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bad_inputs_get_the_hif8_drop_ins_messages(fmt):
    q, k, v = _qkv(b=1, sq=4, skv=4)
    cases = [
        ((q, k.half(), v), {}, TypeError, "q, k and v must share one dtype"),
        ((q, k[:, :, :3], v), {}, ValueError, "k and v must have the same shape"),
        ((q[:, :3], k, v), {}, ValueError, "head"),
        ((q.int(), k, v), {}, TypeError, "q must be"),
        ((q, k, v), dict(seqused_kv=torch.tensor([5], dtype=torch.int32)), ValueError, "seqused_kv"),
        ((q, k, v), dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    ]
    for args, kw, exc, match in cases:
        with pytest.raises(exc, match=match) as hif8_err:
            _call("hif8", *args, **kw)
        with pytest.raises(exc) as fmt_err:
            _call(fmt, *args, **kw)
        assert str(fmt_err.value) == str(hif8_err.value)


@pytest.mark.parametrize("fmt", E4M3_FORMATS)
def test_p_scale_is_the_ops_to_check(fmt):
    q, k, v = _qkv(b=1, sq=4, skv=4)
    with pytest.raises(ValueError, match=r"p_scale must be in \[1, 448\]"):
        _call(fmt, q, k, v, p_scale=0.5)
    # the default is on the E4M3 grid and the top of its range; 1 (also on the grid) is allowed
    assert fp8.round_to_e4m3(torch.tensor([P_SCALE])).item() == P_SCALE == fp8.E4M3_MAX
    assert torch.isfinite(_call(fmt, q, k, v, p_scale=1.0)).all()
    assert math.isfinite(float(_call(fmt, q, k, v, p_scale=torch.tensor([104.0])).sum()))
