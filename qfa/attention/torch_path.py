"""The torch path of quant_flash_attn: the golden reference, vectorised, O(block) memory.

All batches, heads and query rows go through each step at once; the only loop is over 256-key
blocks in ascending order, exactly as the op's numerics prescribe (``quant-flash-attn.md``):

    S = Q @ K_j^T (exact HiF8 products, fp32 accumulation); S[masked] = -inf
    m_new = max(m, rowmax(S) * dScale - ln p_scale);  P = exp(S * dScale - m_new)
    l = alpha * l + rowsum(P);  O = alpha * O + (HiF8(P) @ V_j) * v_descale

Memory is a (B * Nq, rows, 256) score block at a time, never Sq x Skv. With causal masking a
block only visits the query rows that can see one of its keys.
"""

from __future__ import annotations

import torch

from qfa import _compile
from qfa.cast import api as cast_api
from qfa.cast import luts
from qfa.tiling.attention import AttentionPlan

_BF16_ROUND_BIT = 0x8000


def round_to_hif8(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """HiF8 values nearest to fp32 ``x`` (ties away from zero, saturating), as fp32."""
    index = (x.view(torch.int32) >> 16) & 0xFFFF
    return torch.index_select(table, 0, index.view(-1)).view(x.shape)


def to_bf16_round_half_away(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 rounding half away from zero (torch's own cast rounds half to even)."""
    bits = x.view(torch.int32)
    rounded = ((bits + _BF16_ROUND_BIT) >> 16).to(torch.int16).view(torch.bfloat16)
    return torch.where(torch.isnan(x), torch.full_like(rounded, float("nan")), rounded)


def _to_bnsd(codes: torch.Tensor, plan: AttentionPlan, starts, lens, seq: int) -> torch.Tensor:
    """fp32 (B, N, S, D) view of HiF8 codes in the plan's layout; TND is padded per batch."""
    values = cast_api.decode_from_hifloat8(codes, torch.float32, backend="torch")
    if plan.layout == "BNSD":
        return values
    if plan.layout == "BSND":
        return values.transpose(1, 2).contiguous()
    padded = values.new_zeros(plan.batch, values.shape[1], seq, values.shape[2])
    for b, (start, n) in enumerate(zip(starts, lens)):
        padded[b, :, :n] = values[start : start + n].transpose(0, 1)
    return padded


def _from_bnsd(out: torch.Tensor, plan: AttentionPlan, total_q: int) -> torch.Tensor:
    if plan.layout == "BNSD":
        return out
    if plan.layout == "BSND":
        return out.transpose(1, 2).contiguous()
    packed = out.new_zeros(total_q, plan.heads_q, plan.head_dim)
    for b, (start, n) in enumerate(zip(plan.q_starts, plan.q_lens)):
        packed[start : start + n] = out[b, :, :n].transpose(0, 1)
    return packed


def _lse_layout(lse: torch.Tensor, plan: AttentionPlan, total_q: int) -> torch.Tensor:
    if plan.layout != "TND":
        return lse
    packed = lse.new_full((plan.heads_q, total_q), float("inf"))
    for b, (start, n) in enumerate(zip(plan.q_starts, plan.q_lens)):
        packed[:, start : start + n] = lse[b, :, :n]
    return packed


def _mask_block(plan: AttentionPlan, s: torch.Tensor, r0: int, j0: int, q_lens, kv_lens, offsets, max_offset: int) -> None:
    """Set the scores of (query, key) pairs that the plan masks to -inf, in place.

    ``s`` is (B, Nq, rows from r0, keys from j0). With uniform lengths only the rows crossing
    the causal diagonal can hold a masked key, so only they are touched.
    """
    rows_end = s.shape[2] + r0
    keys_end = s.shape[3] + j0
    if plan.uniform:
        if not plan.causal:
            return
        rows_end = min(rows_end, max(r0, keys_end - 1 - max_offset))
        if rows_end <= r0:
            return
    device = s.device
    rows = torch.arange(r0, rows_end, device=device).view(1, 1, -1, 1)
    keys = torch.arange(j0, keys_end, device=device).view(1, 1, 1, -1)
    masked = keys > rows + offsets if plan.causal else None
    if not plan.uniform:
        outside = (keys >= kv_lens) | (rows >= q_lens)
        masked = outside if masked is None else masked | outside
    s[:, :, : rows_end - r0].masked_fill_(masked, float("-inf"))


def _softmax_block(s, m_old, l_old, dscale, ln_p, table):
    """One 256-key block of the online softmax: (HiF8(P), m_new, l_new, alpha)."""
    m_new = torch.maximum(m_old, s.amax(dim=-1) * dscale - ln_p)
    # Rows that have seen no key yet keep m = -inf; subtract 0 there so exp gives 0, not NaN.
    m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
    p = torch.exp(s * dscale - m_safe.unsqueeze(-1))
    alpha = torch.exp(m_old - m_safe)
    l_new = alpha * l_old + p.sum(dim=-1)
    return round_to_hif8(p, table), m_new, l_new, alpha


def _rescale_accumulate(o_old, alpha, pv, v_descale):
    return o_old * alpha.unsqueeze(-1) + pv * v_descale


def forward(
    plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_descale: torch.Tensor, k_descale: torch.Tensor, v_descale: torch.Tensor, p_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the plan; returns (out bf16 in q's layout, lse fp32 or an empty tensor)."""
    device = q.device
    B, Nq, Nkv, G, D = plan.batch, plan.heads_q, plan.heads_kv, plan.group, plan.head_dim
    Sq, Skv = plan.seq_q, plan.seq_kv
    qf = _to_bnsd(q, plan, plan.q_starts, plan.q_lens, Sq).reshape(B * Nq, Sq, D)
    kf = _to_bnsd(k, plan, plan.kv_starts, plan.kv_lens, Skv)
    vf = _to_bnsd(v, plan, plan.kv_starts, plan.kv_lens, Skv)
    if not plan.uniform:
        # Masked keys get P = 0, but 0 * NaN is NaN: padding past seqused_kv must not be read.
        for b, n in enumerate(plan.kv_lens):
            vf[b, :, n:] = 0

    dscale = (q_descale * k_descale) * plan.softmax_scale
    ln_p = torch.log(p_scale) if p_scale is not None else torch.zeros(1, device=device)
    table = luts.round_lut(device)

    m = torch.full((B * Nq, Sq), float("-inf"), device=device)
    l = torch.zeros(B * Nq, Sq, device=device)
    o = torch.zeros(B * Nq, Sq, D, device=device)
    q_lens = torch.tensor(plan.q_lens, device=device).view(B, 1, 1, 1)
    kv_lens = torch.tensor(plan.kv_lens, device=device).view(B, 1, 1, 1)
    offsets = torch.tensor(plan.causal_offsets, device=device).view(B, 1, 1, 1)
    # A causal block's first key j0 is first visible to row j0 - max offset.
    max_offset = max(plan.causal_offsets, default=0)
    kv_end = max(plan.kv_lens, default=0)

    for j0 in range(0, kv_end, plan.block_n):
        j1 = min(j0 + plan.block_n, kv_end)
        r0 = max(0, j0 - max_offset) if plan.causal else 0
        if r0 >= Sq:
            break
        # (B, Nkv, K, D) -> (B * Nq, K, D): the kv head of q head h is h // G.
        k_blk = kf[:, :, j0:j1].repeat_interleave(G, dim=1).reshape(B * Nq, j1 - j0, D)
        v_blk = vf[:, :, j0:j1].repeat_interleave(G, dim=1).reshape(B * Nq, j1 - j0, D)
        s = torch.bmm(qf[:, r0:], k_blk.transpose(1, 2))
        _mask_block(plan, s.view(B, Nq, Sq - r0, j1 - j0), r0, j0, q_lens, kv_lens, offsets, max_offset)

        # Flat, contiguous operands keep the compiled graph's shape guards (and recompiles) few.
        rows_k = s.view(-1, j1 - j0)
        p8, m_new, l_new, alpha = _compile.call(_softmax_block, rows_k, m[:, r0:].reshape(-1),
                                                l[:, r0:].reshape(-1), dscale, ln_p, table, device=device)
        m[:, r0:] = m_new.view(B * Nq, -1)
        l[:, r0:] = l_new.view(B * Nq, -1)
        pv = torch.bmm(p8.view_as(s), v_blk).mul_(v_descale)
        o[:, r0:].mul_(alpha.view(B * Nq, -1, 1)).add_(pv)

    seen = l != 0  # a NaN row (NaN codes in q) stays NaN instead of reading as 'saw no key'
    out = torch.where(seen.unsqueeze(-1), o / torch.where(seen, l, torch.ones_like(l)).unsqueeze(-1), torch.zeros_like(o))
    out = to_bf16_round_half_away(out).view(B, Nq, Sq, D)
    total_q = q.shape[0] if plan.layout == "TND" else 0
    out = _from_bnsd(out, plan, total_q)
    if not plan.return_lse:
        return out, torch.empty(0, device=device)
    lse = torch.where(seen, m + torch.log(l), torch.full_like(l, float("inf"))).view(B, Nq, Sq)
    return out, _lse_layout(lse, plan, total_q)
