"""Review of quant_flash_attn's quant_mode 1 (MXFP8) and 6 (FP8 per-token-head).

The "Findings" tests pin the review's findings (F1-F7: value checks only of the scales a call
reads, score overflow before softmax_scale, head dims agreeing, HiF8 layouts, PA_NZ messages,
zero strides, mode-neutral messages), each failing before its fix. The others are extra
coverage on shapes and cases ``test_attention_scaled_modes`` does not have, checked against the
spec-level oracle ``mode16_reference`` with ``check_against_reference``'s band.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mode16_reference as ref
from qfa import quant_flash_attn, quant_flash_attn_metadata
from qfa.cast import mxfp8
from qfa.tiling.attention import check_shapes
from test_attention_reference import check_against_reference
from test_attention_scaled_modes import (
    E4M3_NAN, _to_nz, fp8_call, fp8_case, fp8_keys, mx_call, mx_case, mx_reference, page_mx, per_sequence,
)

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
