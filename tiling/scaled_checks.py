"""The argument rules of quant_mode 1 (MXFP8) and 6 (FP8 E4M3 per-token-head).

Shapes, dtypes and layouts are from ``docs/spec/quant-flash-attn.md``; the value
checks (``check_scaled_values``) are host reads, done where they cost no device synchronisation,
and guard the ranges the numerics handle, as :func:`qfa.tiling.attention_checks.check_scale_values`
does for the HiF8 mode. Every message names the argument, what was expected and what was given.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from qfa.cast.fp8 import E4M3, E4M3_MAX
from qfa.cast.mxfp8 import E8M0, E8M0_BIAS, E8M0_NAN_CODE, PAIR, VALUES_PER_PAIR
from qfa.tiling.checks import check_scalar_fp32, require_tensor
from qfa.tiling.spec import QuantMode

if TYPE_CHECKING:
    from qfa.tiling.attention import AttentionPlan

FP32_MAX = torch.finfo(torch.float32).max
#: Valid p_scale in modes 1 and 6: FIA's documented range (P lands in (0, p_scale] on the E4M3
#: grid). Values on the grid (1, 104, 448) avoid the rounding midpoints the doc warns about.
E4M3_P_SCALE_RANGE = (1.0, E4M3_MAX)
#: The largest E8M0 code whose scale keeps every E4M3 element finite in fp32: 448 * 2^119 < 2^128.
MAX_FINITE_E8M0 = E8M0_BIAS + 119


def check_scaled_run_tensors(mode: QuantMode, q, k, v, q_descale, k_descale, v_descale, p_scale) -> None:
    """Static checks of a mode 1 / 6 call's tensors: types and dtypes (no value read)."""
    scale_dtype = E8M0 if mode == QuantMode.MXFP8 else torch.float32
    tensor = torch.Tensor
    if (isinstance(q, tensor) and isinstance(k, tensor) and isinstance(v, tensor) and isinstance(q_descale, tensor)
            and isinstance(k_descale, tensor) and isinstance(v_descale, tensor)
            and q.dtype == E4M3 and k.dtype == E4M3 and v.dtype == E4M3 and q_descale.dtype == scale_dtype
            and k_descale.dtype == scale_dtype and v_descale.dtype == scale_dtype):
        if p_scale is not None:  # the rules below pass all the others: they need not run one by one
            check_scalar_fp32(p_scale, "p_scale")
        return
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        require_tensor(t, name)
        if t.dtype != E4M3:
            raise TypeError(f"{name} must be torch.float8_e4m3fn in quant_mode {int(mode)} ({mode.name}), got {t.dtype}")
    hint = " (qfa.cast.mxfp8.quantize and pack_*_descale make them)" if mode == QuantMode.MXFP8 else ""
    for t, name in ((q_descale, "q_descale"), (k_descale, "k_descale"), (v_descale, "v_descale")):
        require_tensor(t, name)
        if t.dtype != scale_dtype:
            raise TypeError(f"{name} must be {scale_dtype} in quant_mode {int(mode)} ({mode.name}){hint}, got {t.dtype}")
    if p_scale is not None:
        check_scalar_fp32(p_scale, "p_scale")


def kv_segment_lengths(plan: AttentionPlan) -> tuple[int, ...]:
    """TND k/v: each sequence's stored token count (its cu_seqlens_kv segment, seqused aside)."""
    ends = tuple(plan.kv_starts[1:]) + (plan.meta.total_kv,)
    return tuple(e - s for s, e in zip(plan.kv_starts, ends))


def descale_shapes(plan: AttentionPlan) -> dict[str, tuple[int, ...]]:
    """The shapes q_descale, k_descale and v_descale must have for ``plan`` (mode 1 or 6)."""
    meta = plan.meta
    nq, nkv, d = plan.heads_q, plan.heads_kv, plan.head_dim
    tq = meta.total_q
    if meta.quant_mode == QuantMode.FP8_PER_TOKEN_HEAD:
        return {"q_descale": (nq, tq), "k_descale": (plan.num_blocks, nkv, plan.block_size), "v_descale": (nkv,)}
    pairs = -(-d // VALUES_PER_PAIR)
    q_shape = (tq, nq, pairs, PAIR) if meta.layout_q_descale == "TND" else (nkv, tq, plan.group, pairs, PAIR)
    if meta.layout_kv == "TND":
        k_shape = (meta.total_kv, nkv, pairs, PAIR)
        v_shape = (sum(-(-n // VALUES_PER_PAIR) for n in kv_segment_lengths(plan)), nkv, d, PAIR)
    else:
        bn, bs = plan.num_blocks, plan.block_size
        k_shape = (bn, bs, nkv, pairs, PAIR) if meta.layout_kv == "PA_BBND" else (bn, nkv, bs, pairs, PAIR)
        v_shape = ((bn, bs // VALUES_PER_PAIR, nkv, d, PAIR) if meta.layout_kv == "PA_BBND"
                   else (bn, nkv, bs // VALUES_PER_PAIR, d, PAIR))
    return {"q_descale": q_shape, "k_descale": k_shape, "v_descale": v_shape}


def check_descale_shapes(plan: AttentionPlan, q_descale, k_descale, v_descale) -> None:
    expected = plan.derived.get("descale_shapes")
    if expected is None:  # a function of the plan alone: derived once per plan
        expected = plan.derived.setdefault("descale_shapes", tuple(descale_shapes(plan).values()))
    if q_descale.shape == expected[0] and k_descale.shape == expected[1] and v_descale.shape == expected[2]:
        return
    layouts = {"q_descale": plan.meta.layout_q_descale, "k_descale": plan.meta.layout_kv,
               "v_descale": plan.meta.layout_kv}
    for (name, expected), t in zip(descale_shapes(plan).items(), (q_descale, k_descale, v_descale)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must have shape {expected} in quant_mode {int(plan.meta.quant_mode)} "
                             f"({plan.meta.quant_mode.name}, layout {layouts[name]}), got {tuple(t.shape)}")


def _e8m0_max(codes: torch.Tensor, name: str) -> int:
    """The largest finite-scale exponent among E8M0 ``codes`` (uint8; NaN scales mark NaN blocks
    and are allowed)."""
    top = codes.max().item() if codes.numel() else E8M0_BIAS
    if top == E8M0_NAN_CODE:  # the NaN code is the largest byte: look past it (rare: NaN blocks only)
        finite = codes[codes != E8M0_NAN_CODE]
        top = int(finite.max()) if finite.numel() else E8M0_BIAS
    if top > MAX_FINITE_E8M0:
        raise ValueError(f"{name} must hold E8M0 scales <= 2^{MAX_FINITE_E8M0 - E8M0_BIAS} (code {MAX_FINITE_E8M0}; "
                         f"beyond it 448 * scale overflows fp32), got 2^{top - E8M0_BIAS} (code {top})")
    return top - E8M0_BIAS


def _fp32_scale_max(t: torch.Tensor, name: str) -> float:
    """The largest of fp32 scales that must be > 0 and finite, or NaN (a NaN group's scale)."""
    if t.numel():  # one pass when no scale is NaN (min and max both propagate NaN)
        lo, hi = torch.aminmax(t)
        lo, hi = lo.item(), hi.item()
        if lo > 0 and math.isfinite(hi):
            return hi
    known = t[~torch.isnan(t)]
    if known.numel() and not (torch.isfinite(known).all() and (known > 0).all()):
        bad = known[~(torch.isfinite(known) & (known > 0))][0].item()
        raise ValueError(f"{name} must hold finite scales > 0 (or NaN, for a group that held NaN/Inf), got {bad:g}")
    return float(known.max()) if known.numel() else 1.0


def _flat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in parts]) if parts else like.new_empty(0)


def _used_rows(t: torch.Tensor, axis: int, starts, lens) -> torch.Tensor:
    """The entries of ``t`` along ``axis`` that the sequences (start, length) use."""
    return _flat([t.narrow(axis, s, n) for s, n in zip(starts, lens) if n], t)


def _used_paged(t: torch.Tensor, slot_axis: int, keys_per_slot: int, kv_lens, rows: list[list[int]]) -> torch.Tensor:
    """The entries of paged ``t`` (block axis 0; ``slot_axis`` holds a block's slots of
    ``keys_per_slot`` keys each) that the sequences' keys use: their blocks' slots up to each
    sequence's length, no spare block and no slot past ``seqused_kv``."""
    t = t.movedim(slot_axis, 1)
    per_block, parts = t.shape[1], []
    for b, n in enumerate(kv_lens):
        full, rest = divmod(-(-n // keys_per_slot), per_block)
        if full:
            parts.append(t.index_select(0, torch.tensor(rows[b][:full], dtype=torch.long, device=t.device)))
        if rest:
            parts.append(t[rows[b][full], :rest])
    return _flat(parts, t)


def _used_scales(plan: AttentionPlan, q_descale, k_descale, v_descale, block_table) -> tuple[torch.Tensor, ...]:
    """Flat (q, k, v) scales the call reads (E8M0 as uint8 codes, FP8 as fp32): what the value
    checks look at, so that spare blocks, slots past seqused and padding rows (a cache made with
    torch.zeros or torch.empty) never fail a call."""
    from qfa.cast import mxfp8  # the unpacking of the paired layouts is the codec's

    meta, d = plan.meta, plan.head_dim
    rows = block_table.tolist() if meta.paged else []
    codes = lambda t: t.view(torch.uint8)  # noqa: E731
    if meta.quant_mode == QuantMode.FP8_PER_TOKEN_HEAD:  # q (Nq, Tq); k (Bn, Nkv, 128); v (Nkv,)
        return (_used_rows(q_descale, 1, plan.q_starts, plan.q_lens),
                _used_paged(k_descale, 2, 1, plan.kv_lens, rows), v_descale)
    q = _used_rows(codes(mxfp8.unpack_q_descale(q_descale, d, meta.layout_q_descale)), 0, plan.q_starts, plan.q_lens)
    k_scales = codes(mxfp8.unpack_k_descale(k_descale, d, meta.layout_kv))
    if meta.layout_kv == "TND":
        k = _used_rows(k_scales, 0, plan.kv_starts, plan.kv_lens)
        per_seq = mxfp8.unpack_v_descale(v_descale, "TND", kv_lens=kv_segment_lengths(plan))
        v = _flat([codes(s)[: -(-n // mxfp8.BLOCK)] for s, n in zip(per_seq, plan.kv_lens)], codes(v_descale))
        return q, k, v
    slot_axis = 1 if meta.layout_kv == "PA_BBND" else 2
    k = _used_paged(k_scales, slot_axis, 1, plan.kv_lens, rows)
    v = _used_paged(codes(mxfp8.unpack_v_descale(v_descale, meta.layout_kv)), slot_axis, mxfp8.BLOCK, plan.kv_lens,
                    rows)
    return q, k, v


def check_scaled_values(plan: AttentionPlan, q_descale, k_descale, v_descale, p_scale, block_table=None) -> None:
    """The values of a mode 1 / 6 call's scales (host reads; done on CPU, and on devices when a
    call plans without ready metadata). Only the scales the call reads are looked at (the used
    rows of q, the keys below each ``seqused_kv`` in the table's blocks):

    * p_scale in [1, 448] (FIA's range);
    * MXFP8: every E8M0 scale <= 2^119, so no element overflows fp32 when scaled;
    * FP8: every fp32 scale finite and > 0, or NaN (the quantiser's mark of a group with NaN/Inf);
    * 448^2 * D * max q scale * max k scale * max(1, softmax_scale) <= FLT_MAX / 2: the scores are
      formed in fp32 before softmax_scale multiplies them, so neither S nor S * softmax_scale
      can overflow before the running max is subtracted;
    * 448 * p_scale * max v scale * max Skv <= FLT_MAX, so P8 @ V cannot overflow.
    """
    if plan.device.type == "meta":
        return
    p = 1.0 if p_scale is None else float(p_scale.item())
    if not (math.isfinite(p) and E4M3_P_SCALE_RANGE[0] <= p <= E4M3_P_SCALE_RANGE[1]):
        raise ValueError(f"p_scale must be in [1, 448] in quant_mode {int(plan.meta.quant_mode)} (P lies in "
                         f"(0, p_scale] on the E4M3 grid), got {p:g}")
    # A bound every stored scale meets is met by the scales the call reads: the whole tensors
    # take one reduction each, where gathering the used ones costs a copy per sequence. Only when
    # they fail (a spare block, padding or a real error) are the used scales gathered and judged.
    if plan.meta.quant_mode == QuantMode.MXFP8:
        whole = (q_descale.view(torch.uint8), k_descale.view(torch.uint8), v_descale.view(torch.uint8))
    else:
        whole = (q_descale, k_descale, v_descale)
    try:
        _check_scale_bounds(plan, p, whole)
        return
    except ValueError:
        pass
    _check_scale_bounds(plan, p, _used_scales(plan, q_descale, k_descale, v_descale, block_table))


def _check_scale_bounds(plan: AttentionPlan, p: float, scales: tuple[torch.Tensor, ...]) -> None:
    """check_scaled_values' rules on (q, k, v) scales: E8M0 codes as uint8, FP8's fp32."""
    q, k, v = scales
    if plan.meta.quant_mode == QuantMode.MXFP8:
        q_max = 2.0 ** _e8m0_max(q, "q_descale")
        k_max = 2.0 ** _e8m0_max(k, "k_descale")
        v_max = 2.0 ** _e8m0_max(v, "v_descale")
    else:
        q_max = _fp32_scale_max(q, "q_descale")
        k_max = _fp32_scale_max(k, "k_descale")
        v_max = _fp32_scale_max(v, "v_descale")
    score = E4M3_MAX**2 * plan.head_dim * q_max * k_max * max(1.0, plan.softmax_scale)
    if score > FP32_MAX / 2:
        raise ValueError(f"q_descale and k_descale are too large for fp32 scores: 448^2 * D * max q scale * max k "
                         f"scale * max(1, softmax_scale) = {score:.3g} > FLT_MAX / 2")
    out = E4M3_MAX * p * v_max * max(max(plan.kv_lens, default=1), 1)
    if out > FP32_MAX:
        raise ValueError(f"v_descale is too large for this call: 448 * p_scale * max v scale * max Skv = {out:.3g} "
                         f"> FLT_MAX (P8 @ V would overflow fp32)")
