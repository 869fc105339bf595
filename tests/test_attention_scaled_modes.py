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
