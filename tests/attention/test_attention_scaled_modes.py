"""quant_flash_attn quant_mode 1 (MXFP8) and 6 (FP8 E4M3 per-token-head) on the torch path.

* against the spec-level oracle ``mode16_reference`` (loops in the doc's order, its own E4M3 and
  E8M0 decoding), with the band of ``test_attention_reference`` (same steps, different fp32
  summation order and exp ulp);
* against exact float64 attention on the dequantised inputs, within the bound
  ``mode16_reference.check_against_exact`` derives from the arithmetic (E4M3 rounding of P);
* paged K/V bit for bit the contiguous call (mode 1: TND vs PA_BBND / PA_BNBD, several block
  sizes, blocks in shuffled order, a strided block axis); mode 6's shuffled table vs an ordered one;
* keys a row cannot see (past seqused_kv, behind the causal diagonal) poisoned with NaN elements
  and NaN scales leave that row's bits alone;
* a bad-input test for each constraint the plan checks in these modes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mode16_reference as ref
from qfa import quant_flash_attn, quant_flash_attn_metadata
from qfa.cast import fp8, mxfp8
from test_attention_reference import check_against_reference
from qfa.tiling.attention import check_shapes

E4M3_NAN = 0x7F


def _cu(lens) -> torch.Tensor:
    return torch.tensor(np.cumsum((0,) + tuple(lens)), dtype=torch.int32)


def _cat8(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.view(torch.uint8) for p in parts]).view(parts[0].dtype)


# --- Inputs --------------------------------------------------------------------------------------


def mx_case(q_lens, kv_lens, *, nq=4, nkv=2, d=128, seed=0, spread=2.0):
    """MXFP8 inputs in TND: float q/k/v (log-normal magnitudes per token so the block scales
    differ), their quantisation, and the packed descales."""
    g = torch.Generator().manual_seed(seed)

    def rand(t, n):
        mag = torch.exp(spread * torch.randn(t, n, 1, generator=g))
        return torch.randn(t, n, d, generator=g) * mag

    q, k, v = rand(sum(q_lens), nq), rand(sum(kv_lens), nkv), rand(sum(kv_lens), nkv)
    qe, qs = mxfp8.quantize(q, -1)
    ke, ks = mxfp8.quantize(k, -1)
    starts = np.cumsum((0,) + tuple(kv_lens))
    v_parts = [mxfp8.quantize(v[a:b], 0) for a, b in zip(starts[:-1], starts[1:])]
    ve = _cat8([e for e, _ in v_parts])
    return dict(q=qe, k=ke, v=ve, q_scales=qs, k_scales=ks, v_scales=[s for _, s in v_parts],
                q_lens=tuple(q_lens), kv_lens=tuple(kv_lens), nq=nq, nkv=nkv, d=d)


def mx_call(case, *, causal=False, p_scale=1.0, softmax_scale=None, q_layout="TND", lse=True, **extra):
    qd = mxfp8.pack_q_descale(case["q_scales"], q_layout, num_heads_kv=case["nkv"] if q_layout == "N2TGD" else None)
    args = (case["q"], case["k"], case["v"], qd, mxfp8.pack_k_descale(case["k_scales"]),
            mxfp8.pack_v_descale(case["v_scales"]), 1)
    kwargs = dict(cu_seqlens_q=_cu(case["q_lens"]), cu_seqlens_kv=_cu(case["kv_lens"]), mask_mode=3 if causal else 0,
                  p_scale=torch.tensor([float(p_scale)]), softmax_scale=softmax_scale, return_softmax_lse=lse,
                  layout_q_descale=q_layout, backend="torch")
    kwargs.update(extra)
    return args, kwargs


def mx_reference(case, b, *, causal, p_scale, softmax_scale=None):
    qa, ka = np.cumsum((0,) + case["q_lens"])[b], np.cumsum((0,) + case["kv_lens"])[b]
    sq, skv = case["q_lens"][b], case["kv_lens"][b]
    t = lambda x: x.transpose(0, 1)  # noqa: E731  (T, N, ...) -> (N, T, ...)
    return ref.mxfp8_attention(
        t(case["q"][qa : qa + sq]), t(case["k"][ka : ka + skv]), t(case["v"][ka : ka + skv]),
        t(case["q_scales"][qa : qa + sq]), t(case["k_scales"][ka : ka + skv]), t(case["v_scales"][b]),
        p_scale=p_scale, softmax_scale=softmax_scale, causal=causal)


def fp8_case(q_lens, kv_lens, *, nq=4, nkv=2, seed=0, spare=2, shuffle=True):
    """FP8 inputs: q NTD, k/v PA_BNBD blocks of 128 (in shuffled physical order, plus spare
    blocks no sequence uses), per-token-head q/k scales, per-head v scales."""
    g = torch.Generator().manual_seed(seed)
    d, bs = 128, 128
    per_seq = [-(-n // bs) for n in kv_lens]
    n_blocks = sum(per_seq) + spare
    mag = lambda *s: torch.exp(2 * torch.randn(*s, 1, generator=g))  # noqa: E731
    q = torch.randn(nq, sum(q_lens), d, generator=g) * mag(nq, sum(q_lens))
    k = torch.randn(n_blocks, nkv, bs, d, generator=g) * mag(n_blocks, nkv, bs)
    v = torch.randn(n_blocks, nkv, bs, d, generator=g) * 3
    qe, qs = fp8.quantize_per_token_head(q)
    ke, ks = fp8.quantize_per_token_head(k)
    ve, vs = fp8.quantize_per_head(v, 1)
    order = torch.randperm(n_blocks, generator=g) if shuffle else torch.arange(n_blocks)
    width = max(per_seq + [1])
    table = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = order[used : used + n].to(torch.int32)
        used += n
    return dict(q=qe, k=ke, v=ve, q_scales=qs, k_scales=ks, v_scales=vs, table=table, q_lens=tuple(q_lens),
                kv_lens=tuple(kv_lens), nq=nq, nkv=nkv)


def fp8_call(case, *, causal=False, p_scale=448.0, lse=True, **extra):
    args = (case["q"], case["k"], case["v"], case["q_scales"], case["k_scales"], case["v_scales"], 6)
    kwargs = dict(block_table=case["table"], cu_seqlens_q=_cu(case["q_lens"]),
                  seqused_kv=torch.tensor(case["kv_lens"], dtype=torch.int32), mask_mode=3 if causal else 0,
                  p_scale=torch.tensor([float(p_scale)]), return_softmax_lse=lse, backend="torch")
    kwargs.update(extra)
    return args, kwargs


def fp8_keys(case, b):
    """Sequence b's (Nkv, Skv, ...) k, v codes and k scales, gathered from its blocks."""
    n = case["kv_lens"][b]
    blocks = case["table"][b, : -(-n // 128)].long()
    gather = lambda t: t.view(torch.uint8)[blocks].transpose(0, 1).flatten(1, 2)[:, :n]  # noqa: E731
    ks = case["k_scales"][blocks].transpose(0, 1).flatten(1, 2)[:, :n].contiguous()
    return gather(case["k"]), gather(case["v"]), ks


def fp8_reference(case, b, *, causal, p_scale):
    qa, sq = np.cumsum((0,) + case["q_lens"])[b], case["q_lens"][b]
    k, v, ks = fp8_keys(case, b)
    return ref.fp8_attention(case["q"][:, qa : qa + sq], k, v, case["q_scales"][:, qa : qa + sq].contiguous(), ks,
                             case["v_scales"], p_scale=p_scale, causal=causal)


def per_sequence(out, lse, q_lens):
    """(out bf16 (N, Sq, D), lse (N, Sq)) of each sequence of a TND result."""
    starts = np.cumsum((0,) + tuple(q_lens))
    return [(out[a:b].transpose(0, 1).contiguous(), lse[:, a:b].contiguous()) for a, b in zip(starts[:-1], starts[1:])]


# --- Against the spec reference --------------------------------------------------------------------

MX_CASES = [
    # id, q_lens, kv_lens, heads, d, causal, p_scale, softmax_scale, q_layout
    ("1x1", (1,), (1,), (1, 1), 128, False, 1.0, None, "TND"),
    ("gqa2-d72-causal", (37, 5), (600, 5), (4, 2), 72, True, 104.0, None, "TND"),
    ("d64-mha-p448-ss1", (40,), (513,), (2, 2), 64, False, 448.0, 0.05, "TND"),
    ("d256-gqa4-causal-empty", (3, 0, 20), (1030, 7, 0), (4, 1), 256, True, 1.0, None, "TND"),
    ("n2tgd-gqa3-decode", (1, 1), (700, 64), (6, 2), 128, True, 448.0, None, "N2TGD"),
]


@pytest.mark.parametrize("case_id,q_lens,kv_lens,heads,d,causal,p_scale,softmax_scale,q_layout", MX_CASES,
                         ids=[c[0] for c in MX_CASES])
def test_mxfp8_matches_the_spec_reference(case_id, q_lens, kv_lens, heads, d, causal, p_scale, softmax_scale,
                                          q_layout):
    case = mx_case(q_lens, kv_lens, nq=heads[0], nkv=heads[1], d=d, seed=len(case_id))
    args, kwargs = mx_call(case, causal=causal, p_scale=p_scale, softmax_scale=softmax_scale, q_layout=q_layout)
    out, lse = quant_flash_attn(*args, **kwargs)
    assert out.shape == (sum(q_lens), heads[0], d) and out.dtype == torch.bfloat16
    assert lse.shape == (heads[0], sum(q_lens))
    for b, (got, got_lse) in enumerate(per_sequence(out, lse, q_lens)):
        if q_lens[b] == 0:
            continue
        ref_out, ref_lse = mx_reference(case, b, causal=causal, p_scale=p_scale, softmax_scale=softmax_scale)
        v_max = max(float(np.abs(ref_out).max()), 1e-30)
        check_against_reference(got, got_lse, ref_out, ref_lse, v_max, True)


FP8_CASES = [
    ("decode-gqa2", (1, 1), (300, 129), (4, 2), True, 448.0),
    ("prefill-causal", (40, 3), (700, 3), (4, 2), True, 104.0),
    ("mha-p1-empty", (5, 0, 7), (128, 50, 0), (2, 2), False, 1.0),
]


@pytest.mark.parametrize("case_id,q_lens,kv_lens,heads,causal,p_scale", FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_fp8_matches_the_spec_reference(case_id, q_lens, kv_lens, heads, causal, p_scale):
    case = fp8_case(q_lens, kv_lens, nq=heads[0], nkv=heads[1], seed=len(case_id))
    args, kwargs = fp8_call(case, causal=causal, p_scale=p_scale)
    out, lse = quant_flash_attn(*args, **kwargs)
    assert out.shape == (sum(q_lens), heads[0], 128) and lse.shape == (heads[0], sum(q_lens))
    for b, (got, got_lse) in enumerate(per_sequence(out, lse, q_lens)):
        if q_lens[b] == 0:
            continue
        ref_out, ref_lse = fp8_reference(case, b, causal=causal, p_scale=p_scale)
        v_max = max(float(np.abs(ref_out).max()), 1e-30)
        check_against_reference(got, got_lse, ref_out, ref_lse, v_max, True)


def test_rows_that_see_no_key_are_zero_with_lse_inf():
    case = mx_case((6,), (3,), d=64)
    out, lse = quant_flash_attn(*mx_call(case, causal=True)[0], **mx_call(case, causal=True)[1])
    assert (out[:3] == 0).all() and torch.isposinf(lse[:, :3]).all()  # Sq > Skv: 3 rows see nothing
    assert torch.isfinite(lse[:, 3:]).all()


# --- Against exact attention -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [1, 6])
@pytest.mark.parametrize("causal", [False, True])
def test_within_the_derived_bound_of_exact_attention(mode, causal):
    if mode == 1:
        case = mx_case((20,), (700,), d=128, seed=3)
        args, kwargs = mx_call(case, causal=causal, p_scale=448.0)
        q = mxfp8.dequantize(case["q"], case["q_scales"], -1).transpose(0, 1).double().numpy()
        k = mxfp8.dequantize(case["k"], case["k_scales"], -1).transpose(0, 1).double().numpy()
        v = mxfp8.dequantize(case["v"], case["v_scales"][0], 0).transpose(0, 1).double().numpy()
        p = 448.0
    else:
        case = fp8_case((20,), (700,), seed=3)
        args, kwargs = fp8_call(case, causal=causal, p_scale=104.0)
        kc, vc, ks = fp8_keys(case, 0)
        q = (ref.decode_e4m3(case["q"]) * case["q_scales"].double().numpy()[..., None])
        k = ref.decode_e4m3(kc) * ks.double().numpy()[..., None]
        v = ref.decode_e4m3(vc) * case["v_scales"].double().numpy()[:, None, None]
        p = 104.0
    out, lse = quant_flash_attn(*args, **kwargs)
    (got, got_lse), = per_sequence(out, lse, case["q_lens"])
    ratio = ref.check_against_exact(got.double().numpy(), got_lse.numpy(), q, k, v, p_scale=p, scale=128**-0.5, causal=causal,
                                    block_n=ref.BLOCK_N)
    assert 0 < ratio <= 1


# --- Paged equals contiguous -------------------------------------------------------------------------


def page_mx(case, layout_kv: str, block_size: int, gen, spare: int = 2):
    """The TND keys of ``case`` in ``layout_kv`` blocks (shuffled, spare blocks filled with NaN
    elements and NaN scales no sequence may read): k, v, k_descale, v_descale, block_table."""
    nkv, d = case["nkv"], case["d"]
    per_seq = [-(-n // block_size) for n in case["kv_lens"]]
    n_blocks = sum(per_seq) + spare
    order = torch.randperm(n_blocks, generator=gen)
    k = torch.full((n_blocks, block_size, nkv, d), E4M3_NAN, dtype=torch.uint8)
    v = k.clone()
    ks = torch.full((n_blocks, block_size, nkv, -(-d // 32)), mxfp8.E8M0_NAN_CODE, dtype=torch.uint8)
    vs = torch.full((n_blocks, block_size // 32, nkv, d), mxfp8.E8M0_NAN_CODE, dtype=torch.uint8)
    table = torch.zeros(len(per_seq), max(per_seq + [1]), dtype=torch.int32)
    starts = np.cumsum((0,) + case["kv_lens"])
    used = 0
    for b, (n, nb) in enumerate(zip(case["kv_lens"], per_seq)):
        for j in range(nb):
            blk = int(order[used + j])
            table[b, j] = blk
            lo, hi = j * block_size, min(n, (j + 1) * block_size)
            k[blk, : hi - lo] = case["k"].view(torch.uint8)[starts[b] + lo : starts[b] + hi]
            v[blk, : hi - lo] = case["v"].view(torch.uint8)[starts[b] + lo : starts[b] + hi]
            ks[blk, : hi - lo] = case["k_scales"].view(torch.uint8)[starts[b] + lo : starts[b] + hi]
            g0, g1 = lo // 32, -(-hi // 32)
            vs[blk, : g1 - g0] = case["v_scales"][b].view(torch.uint8)[g0:g1]
        used += nb
    if layout_kv == "PA_BNBD":
        k, v, ks, vs = (t.transpose(1, 2).contiguous() for t in (k, v, ks, vs))
    e4m3, e8m0 = torch.float8_e4m3fn, mxfp8.E8M0
    return (k.view(e4m3), v.view(e4m3), mxfp8.pack_k_descale(ks.view(e8m0), layout_kv),
            mxfp8.pack_v_descale(vs.view(e8m0), layout_kv), table)


@pytest.mark.parametrize("layout_kv", ["PA_BBND", "PA_BNBD"])
@pytest.mark.parametrize("block_size", [64, 128, 512])
@pytest.mark.parametrize("causal", [False, True])
def test_mxfp8_paged_equals_contiguous(layout_kv, block_size, causal):
    case = mx_case((3, 1, 30), (600, 1, 190), d=72, seed=block_size)
    args, kwargs = mx_call(case, causal=causal, p_scale=104.0)
    flat_out, flat_lse = quant_flash_attn(*args, **kwargs)
    k, v, kd, vd, table = page_mx(case, layout_kv, block_size, torch.Generator().manual_seed(1))
    kwargs.pop("cu_seqlens_kv")
    out, lse = quant_flash_attn(args[0], k, v, args[3], kd, vd, 1, block_table=table, layout_kv=layout_kv,
                                seqused_kv=torch.tensor(case["kv_lens"], dtype=torch.int32), **kwargs)
    assert torch.equal(out.view(torch.int16), flat_out.view(torch.int16))
    assert torch.equal(lse, flat_lse)


def test_mxfp8_paged_kv_strided_along_the_block_axis():
    case = mx_case((4,), (300,), d=64, seed=9)
    args, kwargs = mx_call(case, p_scale=104.0)
    flat_out, _ = quant_flash_attn(*args, **kwargs)
    k, v, kd, vd, table = page_mx(case, "PA_BNBD", 64, torch.Generator().manual_seed(2))
    wide = lambda t: torch.stack([t.view(torch.uint8), t.view(torch.uint8)], 1)[:, 0].view(t.dtype)  # noqa: E731
    k2, v2 = wide(k), wide(v)
    assert not k2.is_contiguous()
    kwargs.pop("cu_seqlens_kv")
    out, _ = quant_flash_attn(args[0], k2, v2, args[3], kd, vd, 1, block_table=table, layout_kv="PA_BNBD",
                              seqused_kv=torch.tensor(case["kv_lens"], dtype=torch.int32), **kwargs)
    assert torch.equal(out.view(torch.int16), flat_out.view(torch.int16))


def test_fp8_block_order_does_not_change_a_bit():
    shuffled = fp8_case((9, 1), (500, 260), seed=4, shuffle=True)
    ordered = dict(shuffled)
    # The same keys in blocks 0, 1, 2, ...: move each sequence's blocks into table order.
    blocks = torch.cat([shuffled["table"][b, : -(-n // 128)] for b, n in enumerate(shuffled["kv_lens"])]).long()
    ordered["k"] = shuffled["k"].view(torch.uint8)[blocks].view(torch.float8_e4m3fn)
    ordered["v"] = shuffled["v"].view(torch.uint8)[blocks].view(torch.float8_e4m3fn)
    ordered["k_scales"] = shuffled["k_scales"][blocks]
    ordered["table"] = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 0]], dtype=torch.int32)
    a = quant_flash_attn(*fp8_call(shuffled, causal=True)[0], **fp8_call(shuffled, causal=True)[1])
    b = quant_flash_attn(*fp8_call(ordered, causal=True)[0], **fp8_call(ordered, causal=True)[1])
    assert torch.equal(a[0].view(torch.int16), b[0].view(torch.int16)) and torch.equal(a[1], b[1])


# --- Keys a row cannot see ---------------------------------------------------------------------------


def test_poisoned_keys_past_seqused_and_behind_the_diagonal_change_no_bit():
    case = fp8_case((4,), (300,), seed=5, spare=0)
    args, kwargs = fp8_call(case, causal=True)
    clean_out, clean_lse = quant_flash_attn(*args, **kwargs)
    k, v, ks = (t.clone() for t in (case["k"].view(torch.uint8), case["v"].view(torch.uint8), case["k_scales"]))
    blocks = case["table"][0].tolist()
    # Keys 300.. (past seqused_kv, inside the last block) and key 299 (seen only by the last row).
    for j in range(299, 3 * 128):
        blk, pos = blocks[j // 128], j % 128
        k[blk, :, pos], v[blk, :, pos] = E4M3_NAN, E4M3_NAN
        ks[blk, :, pos] = float("nan")
    poisoned = dict(case, k=k.view(torch.float8_e4m3fn), v=v.view(torch.float8_e4m3fn), k_scales=ks)
    out, lse = quant_flash_attn(*fp8_call(poisoned, causal=True)[0], **fp8_call(poisoned, causal=True)[1])
    assert torch.equal(out[:3].view(torch.int16), clean_out[:3].view(torch.int16))
    assert torch.equal(lse[:, :3], clean_lse[:, :3])
    assert torch.isnan(out[3].float()).all()  # the last row sees key 299: NaN, as exact softmax gives


def test_a_nan_block_scale_makes_only_its_rows_nan():
    case = mx_case((2, 2), (64, 64), d=64, seed=6)
    case["k_scales"] = case["k_scales"].clone()
    case["k_scales"].view(torch.uint8)[70, 0, 1] = mxfp8.E8M0_NAN_CODE  # sequence 1, kv head 0, key 6
    out, _ = quant_flash_attn(*mx_call(case)[0], **mx_call(case)[1])
    assert torch.isnan(out[2:, :2].float()).all()  # q heads 0, 1 of sequence 1 read kv head 0
    assert torch.isfinite(out[:2].float()).all() and torch.isfinite(out[2:, 2:].float()).all()


# --- Metadata ---------------------------------------------------------------------------------------


def test_metadata_runs_give_the_bits_of_planned_calls():
    case = mx_case((3, 9), (100, 300), d=128, seed=7)
    args, kwargs = mx_call(case, causal=True, p_scale=104.0)
    planned = quant_flash_attn(*args, **kwargs)
    meta = quant_flash_attn_metadata(4, 2, 128, 1, cu_seqlens_q=kwargs["cu_seqlens_q"],
                                     cu_seqlens_kv=kwargs["cu_seqlens_kv"], mask_mode=3, layout_q="TND",
                                     layout_kv="TND", layout_out="TND", layout_q_descale="TND")
    run = quant_flash_attn(*args, metadata=meta, **kwargs)
    assert torch.equal(planned[0].view(torch.int16), run[0].view(torch.int16)) and torch.equal(planned[1], run[1])
    with pytest.raises(ValueError, match=r"^layout_q_descale must be the metadata's 'TND', got 'N2TGD'"):
        quant_flash_attn(*args, metadata=meta, **dict(kwargs, layout_q_descale="N2TGD"))
    fp = fp8_case((2,), (200,))
    a6, k6 = fp8_call(fp)
    meta6 = quant_flash_attn_metadata(4, 2, 128, 6, cu_seqlens_q=k6["cu_seqlens_q"], seqused_kv=k6["seqused_kv"])
    assert meta6.layout == "NTD" and meta6.layout_kv == "PA_BNBD" and meta6.out_layout == "TND"
    assert torch.equal(quant_flash_attn(*a6, metadata=meta6, **k6)[0].view(torch.int16),
                       quant_flash_attn(*a6, **k6)[0].view(torch.int16))


# --- Bad input ----------------------------------------------------------------------------------------


def _changed_call(args, kwargs, change: dict):
    """quant_flash_attn on ``args`` / ``kwargs`` with ``change`` applied: a tensor argument
    (q .. v_descale) replaced by a value or by a function of the good one; keywords updated."""
    args = list(args)
    for i, name in enumerate(("q", "k", "v", "q_descale", "k_descale", "v_descale")):
        if name in change:
            value = change.pop(name)
            args[i] = value(args[i]) if callable(value) else value
    return quant_flash_attn(*args, **{**kwargs, **change})


def _mx_bad(**change):
    return _changed_call(*mx_call(mx_case((2,), (64,), d=64, seed=8)), change)


def _e8m0_bump(code):
    def bump(t):
        t = t.clone()
        t.view(torch.uint8).view(-1)[0] = code
        return t
    return bump


MX_BAD = [
    (dict(q=lambda t: t.view(torch.uint8)), TypeError, r"^q must be torch.float8_e4m3fn in quant_mode 1 \(MXFP8\), got torch.uint8"),
    (dict(k=lambda t: t.to(torch.bfloat16)), TypeError, r"^k must be torch.float8_e4m3fn in quant_mode 1"),
    (dict(q_descale=lambda t: t.float()), TypeError, r"^q_descale must be torch.float8_e8m0fnu in quant_mode 1 "
                                                     r"\(MXFP8\) \(qfa.cast.mxfp8"),
    (dict(q_descale=lambda t: t[..., :1]), ValueError, r"^q_descale must have shape \(2, 4, 1, 2\) in quant_mode 1 "
                                                       r"\(MXFP8, layout TND\), got \(2, 4, 1, 1\)"),
    (dict(k_descale=lambda t: t[:63]), ValueError, r"^k_descale must have shape \(64, 2, 1, 2\)"),
    (dict(v_descale=lambda t: torch.cat([t, t])), ValueError, r"^v_descale must have shape \(1, 2, 64, 2\)"),
    (dict(q=lambda t: t[..., :48]), ValueError, r"^head dim D of q must be one of \(64, 72, 128, 256\), got 48"),
    (dict(layout_q="BSND"), ValueError, r"^layout_q must be one of \('TND',\) in quant_mode 1 \(MXFP8\), got 'BSND'"),
    (dict(layout_q_descale="BSND"), ValueError, r"^layout_q_descale must be one of \('TND', 'N2TGD'\)"),
    (dict(layout_kv="BSND"), ValueError, r"^layout_kv must be one of \('TND', 'PA_BBND', 'PA_BNBD', 'PA_NZ'\)"),
    (dict(layout="BNSD"), ValueError, r"^layout='BNSD' sets layout_q, layout_kv and layout_out, but in quant_mode 1"),
    (dict(p_scale=torch.tensor([0.5])), ValueError, r"^p_scale must be in \[1, 448\] in quant_mode 1 .*got 0.5"),
    (dict(p_scale=torch.tensor([500.0])), ValueError, r"^p_scale must be in \[1, 448\]"),
    (dict(q_descale=_e8m0_bump(250)), ValueError, r"^q_descale must hold E8M0 scales <= 2\^119 \(code 246; .*got "
                                                  r"2\^123 \(code 250\)"),
    (dict(q_descale=_e8m0_bump(200), k_descale=_e8m0_bump(200)), ValueError,
     r"^q_descale and k_descale are too large for fp32 scores"),
    (dict(v_descale=_e8m0_bump(246)), ValueError, r"^v_descale is too large for this call"),
    (dict(sinks=torch.zeros(4)), ValueError, r"^sinks: attention sinks are not supported"),
    (dict(mask_mode=4), ValueError, r"^mask_mode must be 0 \(none\) or 3 \(causal\), got 4"),
    (dict(cu_seqlens_kv=None), ValueError, r"^layout 'TND' needs cu_seqlens_q and cu_seqlens_kv"),
]


@pytest.mark.parametrize("change,error,match", MX_BAD, ids=range(len(MX_BAD)))
def test_bad_mxfp8_arguments(change, error, match):
    with pytest.raises(error, match=match):
        _mx_bad(**change)


def test_bad_mxfp8_paged_block_size():
    case = mx_case((2,), (64,), d=64)
    args, kwargs = mx_call(case)
    k = torch.zeros(2, 48, 2, 64, dtype=torch.float8_e4m3fn)
    kd = mxfp8.pack_k_descale(torch.zeros(2, 48, 2, 2, dtype=torch.uint8).view(mxfp8.E8M0), "PA_BBND")
    kwargs.pop("cu_seqlens_kv")
    with pytest.raises(ValueError, match=r"^block size of paged k/v must be one of \(64, 128, 256, 512, 1024\) in "
                                         r"quant_mode 1 \(MXFP8\), got 48"):
        quant_flash_attn(args[0], k, k, args[3], kd, args[5], 1, block_table=torch.zeros(1, 2, dtype=torch.int32),
                         layout_kv="PA_BBND", seqused_kv=torch.tensor([64], dtype=torch.int32), **kwargs)


def _fp8_bad(**change):
    return _changed_call(*fp8_call(fp8_case((2,), (130,), seed=8)), change)


def _set_first(value):
    def set_first(t):
        t = t.clone()
        t.view(-1)[0] = value
        return t
    return set_first


FP8_BAD = [
    (dict(v=lambda t: t.view(torch.uint8)), TypeError, r"^v must be torch.float8_e4m3fn in quant_mode 6"),
    (dict(k_descale=lambda t: t.double()), TypeError, r"^k_descale must be torch.float32 in quant_mode 6 "
                                                      r"\(FP8_PER_TOKEN_HEAD\), got torch.float64"),
    (dict(q_descale=lambda t: t.t().contiguous()), ValueError, r"^q_descale must have shape \(4, 2\) in quant_mode 6"),
    (dict(v_descale=lambda t: t[:1]), ValueError, r"^v_descale must have shape \(2,\)"),
    (dict(k_descale=lambda t: t[..., :64]), ValueError, r"^k_descale must have shape \(4, 2, 128\)"),
    (dict(k=lambda t: t[:, :, :64], v=lambda t: t[:, :, :64]), ValueError,
     r"^block size of paged k/v must be one of \(128,\) in quant_mode 6"),
    (dict(layout_kv="PA_BBND"), ValueError, r"^layout_kv must be one of \('PA_BNBD',\) in quant_mode 6"),
    (dict(layout_out="BSND"), ValueError, r"^layout_out must be one of \('TND',\) in quant_mode 6"),
    (dict(layout="TND"), ValueError, r"^layout='TND' sets layout_q, layout_kv and layout_out, but in quant_mode 6"),
    (dict(block_table=None), ValueError, r"^layout_kv 'PA_BNBD' needs block_table"),
    (dict(seqused_kv=None), ValueError, r"^paged k/v \(block_table\) needs seqused_kv"),
    (dict(q_descale=_set_first(-1.0)), ValueError, r"^q_descale must hold finite scales > 0 \(or NaN, .*got -1"),
    (dict(k_descale=lambda t: torch.full_like(t, float("inf"))), ValueError, r"^k_descale must hold finite scales > 0"),
    (dict(v_descale=_set_first(0.0)), ValueError, r"^v_descale must hold finite scales > 0"),
    (dict(q_descale=_set_first(1e30), k_descale=lambda t: torch.full_like(t, 1e30)), ValueError,
     r"^q_descale and k_descale are too large for fp32 scores"),
    (dict(block_table=torch.tensor([[0, 9]], dtype=torch.int32)), ValueError,
     r"^block_table\[0, 1\] must be a block index in \[0, 4\), got 9"),
]


@pytest.mark.parametrize("change,error,match", FP8_BAD, ids=range(len(FP8_BAD)))
def test_bad_fp8_arguments(change, error, match):
    with pytest.raises(error, match=match):
        _fp8_bad(**change)


def _spare_block(case) -> int:
    """A block of the FP8 case's pool that no sequence's table row uses."""
    used = {int(x) for b, n in enumerate(case["kv_lens"]) for x in case["table"][b, : -(-n // 128)]}
    return min(set(range(case["k"].shape[0])) - used)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), 0.0])
def test_fp8_scales_of_a_spare_block_are_not_judged(bad):
    """The value checks read the whole scale tensors first and, when those fail, the scales the
    call reads: a bad scale in a block no sequence uses changes nothing, one in a used block fails."""
    case = fp8_case((3, 1), (200, 130), seed=12)
    want = quant_flash_attn(*fp8_call(case)[0], **fp8_call(case)[1])
    spare = dict(case, k_scales=case["k_scales"].clone())
    spare["k_scales"][_spare_block(case)] = bad
    got = quant_flash_attn(*fp8_call(spare)[0], **fp8_call(spare)[1])
    assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16)) and torch.equal(got[1], want[1])
    used = dict(case, k_scales=case["k_scales"].clone())
    used["k_scales"][int(case["table"][0, 0]), 1, 5] = bad
    with pytest.raises(ValueError, match=r"^k_descale must hold finite scales > 0"):
        quant_flash_attn(*fp8_call(used)[0], **fp8_call(used)[1])


def test_mxfp8_scales_of_a_spare_block_are_not_judged():
    case = mx_case((3, 1), (300, 70), d=128, seed=13)
    args, kwargs = mx_call(case, p_scale=104.0)
    kwargs.pop("cu_seqlens_kv")
    k, v, kd, vd, table = page_mx(case, "PA_BBND", 128, torch.Generator().manual_seed(3), spare=2)
    seqused = torch.tensor(case["kv_lens"], dtype=torch.int32)
    call = lambda kd_: quant_flash_attn(args[0], k, v, args[3], kd_, vd, 1, block_table=table,  # noqa: E731
                                        layout_kv="PA_BBND", seqused_kv=seqused, **kwargs)
    want = call(kd)
    used_blocks = {int(x) for b, n in enumerate(case["kv_lens"]) for x in table[b, : -(-n // 128)]}
    spare = min(set(range(k.shape[0])) - used_blocks)
    beyond = kd.clone()
    beyond.view(torch.uint8)[spare] = 250  # 2^123: out of range, but no call reads it
    got = call(beyond)
    assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16)) and torch.equal(got[1], want[1])
    beyond.view(torch.uint8)[int(table[0, 0]), 0] = 250
    with pytest.raises(ValueError, match=r"^k_descale must hold E8M0 scales <= 2\^119"):
        call(beyond)


def test_inputs_are_not_modified():
    case = fp8_case((3,), (200,), seed=11)
    args, kwargs = fp8_call(case, causal=True)
    before = [t.view(torch.uint8).clone() if t.element_size() == 1 else t.clone() for t in args[:6]]
    quant_flash_attn(*args, **kwargs)
    for t, b in zip(args[:6], before):
        assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t, b)


def _to_nz(t: torch.Tensor) -> torch.Tensor:
    """(Bn, N, S, D) -> (Bn, N, D/32, S, 32): rows into 32-channel slabs."""
    bn, n, s, d = t.shape
    return t.view(torch.uint8).view(bn, n, s, d // 32, 32).permute(0, 1, 3, 2, 4).contiguous().view(t.dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_mxfp8_pa_nz_equals_pa_bnbd(causal):
    case = mx_case((5, 2), (300, 64), d=128, seed=12)
    args, kwargs = mx_call(case, causal=causal, p_scale=104.0)
    kwargs.pop("cu_seqlens_kv")
    k, v, kd, vd, table = page_mx(case, "PA_BNBD", 128, torch.Generator().manual_seed(3))
    used = torch.tensor(case["kv_lens"], dtype=torch.int32)
    bnbd = quant_flash_attn(args[0], k, v, args[3], kd, vd, 1, block_table=table, layout_kv="PA_BNBD",
                            seqused_kv=used, **kwargs)
    k_scales = mxfp8.unpack_k_descale(kd, 128, "PA_BNBD")  # (Bn, N, Bs, D/32)
    v_scales = mxfp8.unpack_v_descale(vd, "PA_BNBD")  # (Bn, N, Bs/32, D)
    nz_k_scales = k_scales.view(torch.uint8).transpose(2, 3).unsqueeze(-1).contiguous().view(mxfp8.E8M0)
    nz = quant_flash_attn(args[0], _to_nz(k), _to_nz(v), args[3], mxfp8.pack_k_descale(nz_k_scales, "PA_NZ"),
                          mxfp8.pack_v_descale(_to_nz(v_scales), "PA_NZ"), 1, block_table=table, layout_kv="PA_NZ",
                          seqused_kv=used, **kwargs)
    assert torch.equal(nz[0].view(torch.int16), bnbd[0].view(torch.int16)) and torch.equal(nz[1], bnbd[1])


def test_pa_nz_shape_rules():
    case = mx_case((2,), (64,), d=64)
    args, kwargs = mx_call(case)
    kwargs.pop("cu_seqlens_kv")
    k = torch.zeros(2, 2, 64, 64, dtype=torch.float8_e4m3fn)  # a PA_BNBD-shaped k
    with pytest.raises(ValueError, match=r"^k must be 5-D \(blocks, Nkv, D/32, block_size, 32\) for layout_kv "
                                         r"PA_NZ, got shape \(2, 2, 64, 64\)"):
        quant_flash_attn(args[0], k, k, args[3], args[4], args[5], 1, block_table=torch.zeros(1, 1, dtype=torch.int32),
                         layout_kv="PA_NZ", seqused_kv=torch.tensor([64], dtype=torch.int32), **kwargs)


# ---- more shapes against the spec oracle, the value checks of only the scales a call reads, score
# overflow before softmax_scale, head dims, HiF8 layouts, PA_NZ messages, zero strides ------------

E4M3 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv("QFA_BACKEND", raising=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _same(a, b) -> bool:
    """out bit for bit, lse equal (NaN where the other has NaN: NaN rows are part of the result)."""
    return torch.equal(_bits(a[0]), _bits(b[0])) and torch.allclose(a[1], b[1], rtol=0, atol=0, equal_nan=True)


def _paged_mx(case, layout_kv, block_size, seed, **call):
    """(args, kwargs) of the paged call holding ``case``'s keys in shuffled blocks."""
    args, kwargs = mx_call(case, **call)
    kwargs.pop("cu_seqlens_kv")
    k, v, kd, vd, table = page_mx(case, layout_kv, block_size, torch.Generator().manual_seed(seed))
    kwargs.update(block_table=table, layout_kv=layout_kv,
                  seqused_kv=torch.tensor(case["kv_lens"], dtype=torch.int32))
    return (args[0], k, v, args[3], kd, vd, 1), kwargs


# --- Extra coverage against the spec oracle (passes) ------------------------------------------------

MX_PAGED = [
    # id, q_lens, kv_lens, heads, d, causal, p_scale, softmax_scale, q_layout, layout_kv, block_size
    ("d256-bs1024-gqa8-sq>skv-p1-ss1", (30, 2), (12, 1100), (8, 1), 256, True, 1.0, 1.0, "TND", "PA_BNBD", 1024),
    ("n2tgd-gqa8-bbnd-bs512-decode", (1, 1, 1), (1030, 64, 1), (16, 2), 128, True, 104.0, None, "N2TGD",
     "PA_BBND", 512),
]


@pytest.mark.parametrize("case_id,q_lens,kv_lens,heads,d,causal,p_scale,softmax_scale,q_layout,layout_kv,bs",
                         MX_PAGED, ids=[c[0] for c in MX_PAGED])
def test_mxfp8_paged_matches_the_spec_reference(case_id, q_lens, kv_lens, heads, d, causal, p_scale, softmax_scale,
                                                q_layout, layout_kv, bs):
    case = mx_case(q_lens, kv_lens, nq=heads[0], nkv=heads[1], d=d, seed=len(case_id), spread=0.7)
    args, kwargs = _paged_mx(case, layout_kv, bs, 5, causal=causal, p_scale=p_scale, softmax_scale=softmax_scale,
                             q_layout=q_layout)
    out, lse = quant_flash_attn(*args, **kwargs)
    for b, (got, got_lse) in enumerate(per_sequence(out, lse, q_lens)):
        ref_out, ref_lse = mx_reference(case, b, causal=causal, p_scale=p_scale, softmax_scale=softmax_scale)
        check_against_reference(got, got_lse, ref_out, ref_lse, max(float(np.abs(ref_out).max()), 1e-30), True)
    if causal and q_lens[0] > kv_lens[0]:  # Sq > Skv: the first rows see no key
        hidden = q_lens[0] - kv_lens[0]
        assert (out[:hidden].float() == 0).all() and torch.isposinf(lse[:, :hidden]).all()


def test_mxfp8_tnd_seqused_keeps_v_scale_groups_at_the_segment_start():
    """seqused_kv / seqused_q shorter than the TND segments: v's 32-key groups still count from
    each segment's first key, padding rows are 0 / +inf."""
    q_lens, kv_lens, used_q, used_kv = (9, 40), (700, 100), (9, 30), (650, 10)
    case = mx_case(q_lens, kv_lens, nq=8, nkv=1, d=128, seed=21, spread=0.7)
    args, kwargs = mx_call(case, causal=True, p_scale=1.0, softmax_scale=1.0)
    out, lse = quant_flash_attn(*args, seqused_q=torch.tensor(used_q, dtype=torch.int32),
                                seqused_kv=torch.tensor(used_kv, dtype=torch.int32), **kwargs)
    qa, ka = np.cumsum((0,) + q_lens), np.cumsum((0,) + kv_lens)
    t = lambda x: x.transpose(0, 1)  # noqa: E731
    for b in range(2):
        sq, skv = used_q[b], used_kv[b]
        ref_out, ref_lse = ref.mxfp8_attention(
            t(case["q"][qa[b]:qa[b] + sq]), t(case["k"][ka[b]:ka[b] + skv]), t(case["v"][ka[b]:ka[b] + skv]),
            t(case["q_scales"][qa[b]:qa[b] + sq]), t(case["k_scales"][ka[b]:ka[b] + skv]),
            t(case["v_scales"][b][: -(-skv // 32)]), p_scale=1.0, softmax_scale=1.0, causal=True)
        got = out[qa[b]:qa[b] + sq].transpose(0, 1).contiguous()
        check_against_reference(got, lse[:, qa[b]:qa[b] + sq].contiguous(), ref_out, ref_lse,
                                max(float(np.abs(ref_out).max()), 1e-30), True)
        assert (out[qa[b] + sq:qa[b + 1]].float() == 0).all() and torch.isposinf(lse[:, qa[b] + sq:qa[b + 1]]).all()


def test_fp8_gqa8_sq_over_skv_p1_ss1_matches_the_spec_reference():
    case = fp8_case((150, 3), (100, 1), nq=8, nkv=1, seed=4)
    args, kwargs = fp8_call(case, causal=True, p_scale=1.0, softmax_scale=1.0)
    out, lse = quant_flash_attn(*args, **kwargs)
    for b, (got, got_lse) in enumerate(per_sequence(out, lse, case["q_lens"])):
        qa, sq = np.cumsum((0,) + case["q_lens"])[b], case["q_lens"][b]
        k, v, ks = fp8_keys(case, b)
        ref_out, ref_lse = ref.fp8_attention(case["q"][:, qa:qa + sq], k, v, case["q_scales"][:, qa:qa + sq].contiguous(),
                                             ks, case["v_scales"], p_scale=1.0, softmax_scale=1.0, causal=True)
        check_against_reference(got, got_lse, ref_out, ref_lse, max(float(np.abs(ref_out).max()), 1e-30), True)


def test_mxfp8_nan_v_group_and_k_scales_behind_the_diagonal_change_no_bit():
    """A NaN v scale for keys 32..63, NaN k scales for keys 40..63 and an E4M3 NaN in v at key 50:
    rows 0..31 (causal, Sq = Skv = 64) see none of them; TND and paged agree bit for bit."""
    case = mx_case((64,), (64,), nq=2, nkv=1, d=64, seed=5)
    clean = quant_flash_attn(*mx_call(case, causal=True)[0], **mx_call(case, causal=True)[1])
    v_scales = [s.clone() for s in case["v_scales"]]
    v_scales[0].view(torch.uint8)[1] = mxfp8.E8M0_NAN_CODE
    k_scales = case["k_scales"].clone()
    k_scales.view(torch.uint8)[40:] = mxfp8.E8M0_NAN_CODE
    v = case["v"].clone()
    v.view(torch.uint8)[50] = E4M3_NAN
    poisoned = dict(case, v_scales=v_scales, k_scales=k_scales, v=v)
    out, lse = quant_flash_attn(*mx_call(poisoned, causal=True)[0], **mx_call(poisoned, causal=True)[1])
    assert torch.equal(_bits(out[:32]), _bits(clean[0][:32])) and torch.equal(lse[:, :32], clean[1][:, :32])
    assert torch.isnan(out[32:].float()).all()
    args, kwargs = _paged_mx(poisoned, "PA_BBND", 64, 0, causal=True)
    assert _same(quant_flash_attn(*args, **kwargs), (out, lse))


def test_mxfp8_pa_nz_and_metadata_runs_modify_no_input():
    case = mx_case((5, 2), (300, 64), d=128, seed=12)
    args, kwargs = _paged_mx(case, "PA_BNBD", 128, 3, causal=True, p_scale=104.0)
    k_scales = mxfp8.unpack_k_descale(args[4], 128, "PA_BNBD")
    v_scales = mxfp8.unpack_v_descale(args[5], "PA_BNBD")
    nz_ks = mxfp8.pack_k_descale(k_scales.view(torch.uint8).transpose(2, 3).unsqueeze(-1).contiguous()
                                 .view(mxfp8.E8M0), "PA_NZ")
    nz = (args[0], _to_nz(args[1]), _to_nz(args[2]), args[3], nz_ks, mxfp8.pack_v_descale(_to_nz(v_scales), "PA_NZ"), 1)
    nz_kwargs = dict(kwargs, layout_kv="PA_NZ")
    tensors = [*nz[:6], kwargs["block_table"], kwargs["seqused_kv"], kwargs["cu_seqlens_q"], kwargs["p_scale"]]
    before = [t.view(torch.uint8).clone() if t.element_size() == 1 else t.clone() for t in tensors]
    meta = quant_flash_attn_metadata(4, 2, 128, 1, cu_seqlens_q=kwargs["cu_seqlens_q"],
                                     seqused_kv=kwargs["seqused_kv"], mask_mode=3, layout_kv="PA_NZ")
    planned = quant_flash_attn(*nz, **nz_kwargs)
    assert _same(quant_flash_attn(*nz, metadata=meta, **nz_kwargs), planned)
    assert _same(quant_flash_attn(*args, **kwargs), planned)  # PA_NZ is the PA_BNBD call, bit for bit
    for t, b in zip(tensors, before):
        assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t, b)


@pytest.mark.parametrize("change,match", [
    (dict(layout_kv="PA_BBND"), r"^layout_kv must be the metadata's 'PA_BNBD', got 'PA_BBND'"),
    (dict(seqused_kv=torch.tensor([300, 64, 1], dtype=torch.int32)), r"^seqused_kv must be like the one"),
    (dict(mask_mode=0), r"^mask_mode must be the metadata's 3, got 0"),
    (dict(layout_q_descale="N2TGD"), r"^layout_q_descale must be the metadata's 'TND', got 'N2TGD'"),
    (dict(max_seqlen_kv=5), r"^max_seqlen_kv must be -1 or the metadata's -1, got 5"),
], ids=["layout_kv", "seqused_kv", "mask", "q_descale_layout", "max_seqlen_kv"])
def test_paged_mxfp8_metadata_runs_refuse_a_mismatch(change, match):
    case = mx_case((5, 2), (300, 64), d=128, seed=12)
    args, kwargs = _paged_mx(case, "PA_BNBD", 128, 3, causal=True)
    meta = quant_flash_attn_metadata(4, 2, 128, 1, cu_seqlens_q=kwargs["cu_seqlens_q"],
                                     seqused_kv=kwargs["seqused_kv"], mask_mode=3, layout_kv="PA_BNBD")
    with pytest.raises(ValueError, match=match):
        quant_flash_attn(*args, metadata=meta, **{**kwargs, **change})


# --- Findings (fixed) ------------------------------------------------------------------------------


def test_fp8_scales_no_sequence_reads_are_not_checked():
    case = fp8_case((2,), (130,), seed=8, spare=2)
    args, kwargs = fp8_call(case)
    clean = quant_flash_attn(*args, **kwargs)
    k_scales = case["k_scales"].clone()
    used = case["table"][0].tolist()
    spare = [b for b in range(k_scales.shape[0]) if b not in used]
    k_scales[spare] = 0.0  # blocks no sequence holds, as a torch.zeros cache leaves them
    k_scales[used[1], :, 2:] = 0.0  # keys 130..255: past seqused_kv, never read
    got = quant_flash_attn(*args[:4], k_scales, *args[5:], **kwargs)
    assert _same(got, clean)


def test_mxfp8_scales_of_unused_blocks_are_not_checked():
    case = mx_case((2,), (100,), d=64, seed=1)
    args, kwargs = _paged_mx(case, "PA_BNBD", 64, 0)
    clean = quant_flash_attn(*args, **kwargs)
    spare = [b for b in range(args[1].shape[0]) if b not in kwargs["block_table"][0].tolist()][0]
    kd, vd = args[4].clone(), args[5].clone()
    kd.view(torch.uint8)[spare] = 250
    vd.view(torch.uint8)[spare] = 250
    assert _same(quant_flash_attn(*args[:4], kd, vd, 1, **kwargs), clean)


def test_fp8_q_descale_of_padding_rows_is_not_checked():
    case = fp8_case((4,), (200,), seed=3, spare=0)
    args, kwargs = fp8_call(case)
    used = torch.tensor([2], dtype=torch.int32)
    clean = quant_flash_attn(*args, seqused_q=used, **kwargs)
    q_descale = case["q_scales"].clone()
    q_descale[:, 2:] = 0.0
    assert _same(quant_flash_attn(args[0], args[1], args[2], q_descale, *args[4:], seqused_q=used, **kwargs), clean)


def _mx_score_overflow_call():
    """One query and 4 keys of 448s, D = 64, q scale 2^119: S = 64 * 448^2 * 2^119 ~ 2^142.6
    overflows fp32 before softmax_scale 2^-30 is applied (S * scale would be ~ 2^112.6)."""
    d, n = 64, 4
    cu = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    q = torch.full((1, 1, d), 448.0).to(E4M3)
    k = torch.full((n, 1, d), 448.0).to(E4M3)
    v = torch.randn(n, 1, d, generator=torch.Generator().manual_seed(0)).to(E4M3)
    qs = torch.full((1, 1, 2), 246, dtype=torch.uint8).view(mxfp8.E8M0)
    ks = torch.full((n, 1, 2), 127, dtype=torch.uint8).view(mxfp8.E8M0)
    vs = torch.full((1, 1, d), 127, dtype=torch.uint8).view(mxfp8.E8M0)
    return quant_flash_attn(q, k, v, mxfp8.pack_q_descale(qs), mxfp8.pack_k_descale(ks), mxfp8.pack_v_descale([vs]), 1,
                            cu_seqlens_q=cu(0, 1), cu_seqlens_kv=cu(0, n), softmax_scale=2.0**-30,
                            return_softmax_lse=True, backend="torch")


def test_mxfp8_scores_that_overflow_before_softmax_scale_are_refused():
    with pytest.raises(ValueError, match=r"^q_descale and k_descale are too large for fp32 scores"):
        out, _ = _mx_score_overflow_call()
        assert torch.isnan(out.float()).all()  # what happens today: silent NaN (exact: the mean of v)


def test_fp8_scores_that_overflow_before_softmax_scale_are_refused():
    case = fp8_case((1,), (4,), nq=1, nkv=1, seed=0, spare=0)
    big = dict(case, q=torch.full((1, 1, 128), 448.0).to(E4M3), k=torch.full(case["k"].shape, 448.0).to(E4M3),
               q_scales=torch.full((1, 1), 1e20), k_scales=torch.full(case["k_scales"].shape, 1e20))
    args, kwargs = fp8_call(big, softmax_scale=1e-12)
    with pytest.raises(ValueError, match=r"^q_descale and k_descale are too large for fp32 scores"):
        quant_flash_attn(*args, **kwargs)


def test_mxfp8_q_and_kv_head_dims_must_match():
    q_case, kv_case = mx_case((2,), (64,), d=128, seed=1), mx_case((2,), (64,), d=72, seed=2)
    (q, _, _, qd, _, _, _), kwargs = mx_call(q_case)
    (_, k, v, _, kd, vd, _), _ = mx_call(kv_case)
    v_descale_for_q = torch.full((1, 2, 128, 2), 127, dtype=torch.uint8).view(mxfp8.E8M0)
    with pytest.raises(ValueError, match=r"head dim"):  # today: RuntimeError from a torch op
        quant_flash_attn(q, k, v, qd, kd, v_descale_for_q, 1, **kwargs)
    with pytest.raises(ValueError, match=r"head dim"):  # today: "v_descale must have shape (1, 2, 128, 2)"
        quant_flash_attn(q, k, v, qd, kd, vd, 1, **kwargs)


def test_mxfp8_metadata_head_dim_must_match_the_tensors():
    case = mx_case((2,), (64,), d=72, seed=2)
    args, kwargs = mx_call(case)
    meta = quant_flash_attn_metadata(4, 2, 128, 1, cu_seqlens_q=kwargs["cu_seqlens_q"],
                                     cu_seqlens_kv=kwargs["cu_seqlens_kv"], layout_q="TND", layout_kv="TND")
    with pytest.raises(ValueError, match=r"head dim"):
        quant_flash_attn(*args, metadata=meta, **kwargs)


def test_hif8_shape_rules_still_refuse_ntd():
    q, k = torch.zeros(4, 3, 128), torch.zeros(2, 3, 128)
    with pytest.raises(ValueError, match=r"^layout must be one of \('BNSD', 'BSND', 'TND'\), got 'NTD'"):
        check_shapes(q, k, k, "NTD")


def _nz_call(**change):
    case = mx_case((5,), (300,), d=128, seed=12)
    args, kwargs = _paged_mx(case, "PA_BNBD", 128, 3)
    k_scales = mxfp8.unpack_k_descale(args[4], 128, "PA_BNBD")
    v_scales = mxfp8.unpack_v_descale(args[5], "PA_BNBD")
    nz = dict(k=_to_nz(args[1]), v=_to_nz(args[2]),
              k_descale=mxfp8.pack_k_descale(k_scales.view(torch.uint8).transpose(2, 3).unsqueeze(-1).contiguous()
                                             .view(mxfp8.E8M0), "PA_NZ"),
              v_descale=mxfp8.pack_v_descale(_to_nz(v_scales), "PA_NZ"))
    for name, f in change.items():
        nz[name] = f(nz[name])
    return quant_flash_attn(args[0], nz["k"], nz["v"], args[3], nz["k_descale"], nz["v_descale"], 1,
                            **dict(kwargs, layout_kv="PA_NZ"))


@pytest.mark.parametrize("name,cut", [("k_descale", lambda t: t[:, :, :4]), ("v_descale", lambda t: t[:, :, :, :1]),
                                      ("k_descale", lambda t: t[..., 0])], ids=["k-bs16", "v-bs64", "k-ndim"])
def test_pa_nz_descale_errors_name_the_pa_nz_shape(name, cut):
    expected = {"k_descale": r"\(5, 2, 8, 2, 16, 2\)", "v_descale": r"\(5, 2, 8, 2, 16, 2\)"}[name]
    with pytest.raises(ValueError, match=rf"^{name} must have shape {expected} .*PA_NZ"):
        _nz_call(**{name: cut})


def test_paged_kv_with_a_zero_stride_is_refused():
    case = mx_case((2,), (300,), d=64, seed=9)
    args, kwargs = _paged_mx(case, "PA_BNBD", 64, 2)
    k = args[1]
    aliased = k.view(torch.uint8)[:1].expand(k.shape).view(E4M3)  # every block is block 0
    with pytest.raises(ValueError, match=r"^k .*stride"):
        quant_flash_attn(args[0], aliased, *args[2:], **kwargs)


def test_window_errors_name_the_mode():
    case = mx_case((2,), (64,), d=64, seed=8)
    args, kwargs = mx_call(case)
    with pytest.raises(ValueError, match=r"^win_left must be -1") as err:
        quant_flash_attn(*args, win_left=0, **kwargs)
    assert "HiF8" not in str(err.value)


# --- Descale layouts written from the doc's words, not from qfa.cast.mxfp8 (passes) ----------------


def _codes(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


def _hand_packed(case, table: torch.Tensor, num_blocks: int, block_size: int) -> dict[str, np.ndarray]:
    """Every quant_mode 1 descale of ``case`` as the family doc states its layout, by index
    arithmetic alone (pair slot j of pair p holds the scale of group 2p + j; unused slots 127):
    q TND (Q_T, Q_N, ceil(D/64), 2) and N2TGD (KV_N, Q_T, G, ceil(D/64), 2) with h = n * G + g;
    k TND (KV_T, KV_N, ceil(D/64), 2); v TND (sum_b ceil(kv_len_b/64), KV_N, D, 2) of 32-key groups
    counted from each sequence's start; paged k / v of the sequences' keys in ``table``'s blocks
    (unfilled slots 255) in PA_BBND, PA_BNBD and PA_NZ (k (Bn, KV_N, Bs/16, D/64, 16, 2): token
    16 i + r of the block at [.., i, .., r, ..]; v (Bn, KV_N, D/16, Bs/64, 16, 2): channel 16 i + r)."""
    qs, ks = _codes(case["q_scales"]), _codes(case["k_scales"])
    tq, nq, groups = qs.shape
    tk, nkv, _ = ks.shape
    d, g_q = case["d"], nq // nkv
    pairs = -(-groups // 2)
    out = {"q_TND": np.full((tq, nq, pairs, 2), 127, np.uint8), "q_N2TGD": np.full((nkv, tq, g_q, pairs, 2), 127, np.uint8),
           "k_TND": np.full((tk, nkv, pairs, 2), 127, np.uint8)}
    for g in range(groups):
        out["q_TND"][:, :, g // 2, g % 2] = qs[:, :, g]
        out["k_TND"][:, :, g // 2, g % 2] = ks[:, :, g]
        for h in range(nq):
            out["q_N2TGD"][h // g_q, :, h % g_q, g // 2, g % 2] = qs[:, h, g]
    rows = sum(-(-n // 64) for n in case["kv_lens"])
    out["v_TND"] = np.full((rows, nkv, d, 2), 127, np.uint8)
    row = 0
    for b, n in enumerate(case["kv_lens"]):
        vs = _codes(case["v_scales"][b])
        for t in range(vs.shape[0]):
            out["v_TND"][row + t // 2, :, :, t % 2] = vs[t]
        row += -(-n // 64)
    bn, bs = num_blocks, block_size
    out["k_PA_BBND"] = np.full((bn, bs, nkv, pairs, 2), 255, np.uint8)
    out["k_PA_BNBD"] = np.full((bn, nkv, bs, pairs, 2), 255, np.uint8)
    out["k_PA_NZ"] = np.full((bn, nkv, bs // 16, pairs, 16, 2), 255, np.uint8)
    out["v_PA_BBND"] = np.full((bn, bs // 64, nkv, d, 2), 255, np.uint8)
    out["v_PA_BNBD"] = np.full((bn, nkv, bs // 64, d, 2), 255, np.uint8)
    out["v_PA_NZ"] = np.full((bn, nkv, d // 16, bs // 64, 16, 2), 255, np.uint8)
    start = 0
    for b, n in enumerate(case["kv_lens"]):
        vs = _codes(case["v_scales"][b])
        for j in range(-(-n // bs)):
            blk = int(table[b, j])
            for s in range(min(bs, n - j * bs)):  # key j * bs + s of sequence b
                for g in range(groups):
                    code = ks[start + j * bs + s, :, g]
                    out["k_PA_BBND"][blk, s, :, g // 2, g % 2] = code
                    out["k_PA_BNBD"][blk, :, s, g // 2, g % 2] = code
                    out["k_PA_NZ"][blk, :, s // 16, g // 2, s % 16, g % 2] = code
            for t in range(-(-min(bs, n - j * bs) // 32)):  # 32-key group t of the block
                code = vs[j * bs // 32 + t]  # (KV_N, D)
                out["v_PA_BBND"][blk, t // 2, :, :, t % 2] = code
                out["v_PA_BNBD"][blk, :, t // 2, :, t % 2] = code
                for c in range(d):
                    out["v_PA_NZ"][blk, :, c // 16, t // 2, c % 16, t % 2] = code[:, c]
        start += n
    return out


def test_descale_layouts_are_the_docs_and_the_op_reads_them_so():
    case = mx_case((3, 2), (200, 70), nq=6, nkv=2, d=128, seed=31)
    args, kwargs = mx_call(case, causal=True, p_scale=104.0)
    k, v, kd, vd, table = page_mx(case, "PA_BBND", 64, torch.Generator().manual_seed(4))
    hand = _hand_packed(case, table, k.shape[0], 64)
    e8m0 = lambda a: torch.from_numpy(np.ascontiguousarray(a)).view(mxfp8.E8M0)  # noqa: E731
    qfa_packed = {"q_TND": args[3], "q_N2TGD": mxfp8.pack_q_descale(case["q_scales"], "N2TGD", num_heads_kv=2),
                  "k_TND": args[4], "v_TND": args[5], "k_PA_BBND": kd, "v_PA_BBND": vd}
    for layout in ("PA_BNBD",):
        _, _, qfa_packed[f"k_{layout}"], qfa_packed[f"v_{layout}"], _ = page_mx(case, layout, 64,
                                                                             torch.Generator().manual_seed(4))
    for name, t in qfa_packed.items():
        assert np.array_equal(_codes(t), hand[name]), name
    # The op on the hand-made N2TGD q_descale and PA_NZ k/v descales: the TND call's bits.
    tnd = quant_flash_attn(*args, **kwargs)
    kwargs.pop("cu_seqlens_kv")
    bnbd_k, bnbd_v = (t.view(torch.uint8).transpose(1, 2).contiguous().view(E4M3) for t in (k, v))
    nz = quant_flash_attn(args[0], _to_nz(bnbd_k), _to_nz(bnbd_v), e8m0(hand["q_N2TGD"]), e8m0(hand["k_PA_NZ"]),
                          e8m0(hand["v_PA_NZ"]), 1, block_table=table, layout_kv="PA_NZ",
                          seqused_kv=torch.tensor(case["kv_lens"], dtype=torch.int32),
                          **dict(kwargs, layout_q_descale="N2TGD"))
    assert _same(nz, tnd)
