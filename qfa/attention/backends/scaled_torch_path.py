"""The torch path of quant_flash_attn's quant_mode 1 (MXFP8) and 6 (FP8 E4M3 per-token-head):
the golden reference of those modes, on any device.

The numerics (``docs/spec/quant-flash-attn.md``), per query row over its visible keys in
512-key blocks (``spec.KEY_BLOCK``) in ascending order, are mode 0's online softmax with E4M3 in
place of HiF8:

    mode 1: S = sum over 32-channel groups g of (Q_g . K_g) * 2^(eq_g + ek_g)
    mode 6: S = (Q . K) * q_descale[i] * k_descale[j]
    m_new = max(m, rowmax(S) * softmax_scale - ln p_scale);  P = exp(S * softmax_scale - m_new)
    l = alpha * l + rowsum(P);  O = alpha * O + E4M3(P) @ V_j   (V_j's scales: below)
    mode 1: per channel, each 32-key group of P8 @ V scaled by its E8M0 scale 2^ev
    mode 6: (P8 @ V_j) * v_descale[head]

How it is computed. An E8M0 scale is a power of two, so scaling an E4M3 element by it is exact
in fp32 (the plan's checks keep every scaled element finite): mode 1 multiplies Q, K and V by
their scales first and runs plain fp32 GEMMs on the results. Every product in them is then the
exact product the doc's grouped form scales, and the two differ only in fp32 summation order,
the one freedom every implementation has. Mode 6's fp32 scales are not powers of two, so they
are applied where the doc applies them: the scores are scaled after the GEMM (per row by
q_descale, per column by k_descale), P8 @ V by the head's v_descale. E4M3 values have 4
significant bits, so Q . K and P8 . V of E4M3 elements have exact products in fp32 too.

The loop is mode 0's (:mod:`qfa.attention.backends.torch_path`): per batch, per kv head, its GQA group's
rows in (position, group) order, tiles of query positions, causal blocks only where they cross
the diagonal, keys past a sequence's length never read; the online-softmax step is the same
function with ``qfa.cast.fp8``'s E4M3 rounding (nearest even, saturating at 448) in place of
HiF8's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from qfa import _compile
from qfa.attention.backends.cpu_gemm import matmul_nt
from qfa.attention.backends.torch_path import _per_batch, _pv_with_specials, _Tile, softmax_block_for
from qfa.cast import mxfp8
from qfa.cast.fp8 import on_e4m3_grid
from qfa.tiling import attention as tiling
from qfa.tiling.attention import AttentionPlan
from qfa.tiling.scaled_checks import kv_segment_lengths
from qfa.tiling.spec import MX_GROUP, QuantMode

#: ``forward`` takes paged K/V (``block_table``) itself.
READS_PAGED_KV = True

_softmax_block = softmax_block_for(on_e4m3_grid)


def _values(elements: torch.Tensor) -> torch.Tensor:
    """fp32 values of float8_e4m3fn elements (exact: every E4M3 value is an fp32 value)."""
    return elements.to(torch.float32)


def _gather_blocks(t: torch.Tensor, layout_kv: str, blocks: torch.Tensor) -> torch.Tensor:
    """(heads, blocks * per_block, C) from a paged 4-D ``t`` in ``layout_kv``: PA_BBND
    (Bn, per_block, heads, C) or PA_BNBD (Bn, heads, per_block, C), its rows in logical order."""
    bits = t.view(torch.uint8) if t.element_size() == 1 else t  # float8 index_select: via the bytes
    pages = bits.index_select(0, blocks)
    pages = pages.permute(2, 0, 1, 3) if layout_kv == "PA_BBND" else pages.transpose(0, 1)
    return pages.reshape(pages.shape[0], -1, pages.shape[-1]).view(t.dtype)


def _expand(scales: torch.Tensor, axis: int, n: int) -> torch.Tensor:
    """fp32 per-element scales from per-32 E8M0 scales along ``axis``, cut to ``n`` entries."""
    return scales.to(torch.float32).repeat_interleave(MX_GROUP, dim=axis).narrow(axis, 0, n)


@dataclass
class _Operands:
    """Where each batch's fp32 operands come from, with the scales not folded into them.

    ``q``: (Nq, Tq or Sq..., D) fp32 values in the plan's q layout (normalised strides
    ``q_strides``); ``q_scale`` (same rows, no D) or None. ``keys(b, n)`` / ``values(b, n)``:
    (Nkv, n, D) fp32 of batch b's first n keys; ``key_scale(b, n)``: (Nkv, n) or None;
    ``v_scale``: (Nkv,) or None.
    """

    q: torch.Tensor
    q_strides: tuple[int, int, int, int]
    q_scale: torch.Tensor | None
    keys: Callable[[int, int], torch.Tensor]
    key_scale: Callable[[int, int], torch.Tensor | None]
    values: Callable[[int, int], torch.Tensor]
    v_scale: torch.Tensor | None


def _mxfp8_operands(plan: AttentionPlan, q, k, v, q_descale, k_descale, v_descale, block_table) -> _Operands:
    meta, d = plan.meta, plan.head_dim
    q_scales = mxfp8.unpack_q_descale(q_descale, d, meta.layout_q_descale)  # (Tq, Nq, ceil(D/32))
    q_values = _values(q) * _expand(q_scales, -1, d)
    k_scales = mxfp8.unpack_k_descale(k_descale, d, meta.layout_kv)  # k's layout, ceil(D/32) last
    if meta.layout_kv == "TND":
        v_scales = mxfp8.unpack_v_descale(v_descale, "TND", kv_lens=kv_segment_lengths(plan))

        def keys(b, n):
            start = plan.kv_starts[b]
            return (_values(k[start : start + n]) * _expand(k_scales[start : start + n], -1, d)).transpose(0, 1)

        def values(b, n):
            start = plan.kv_starts[b]
            return (_values(v[start : start + n]) * _expand(v_scales[b], 0, n)).transpose(0, 1)
    else:
        v_scales = mxfp8.unpack_v_descale(v_descale, meta.layout_kv)  # per 32 keys of each block

        def blocks(b, n):
            return block_table[b, : -(-n // plan.block_size)].long()

        def keys(b, n):
            got = _gather_blocks(k, meta.layout_kv, blocks(b, n))[:, :n]
            return _values(got) * _expand(_gather_blocks(k_scales, meta.layout_kv, blocks(b, n))[:, :n], -1, d)

        def values(b, n):
            got = _gather_blocks(v, meta.layout_kv, blocks(b, n))[:, :n]
            return _values(got) * _expand(_gather_blocks(v_scales, meta.layout_kv, blocks(b, n)), 1, n)
    return _Operands(q=q_values, q_strides=tiling.normalised_strides(q_values, plan.layout), q_scale=None,
                     keys=keys, key_scale=lambda b, n: None, values=values, v_scale=None)


def _fp8_operands(plan: AttentionPlan, q, k, v, q_descale, k_descale, v_descale, block_table) -> _Operands:
    layout_kv = plan.meta.layout_kv  # PA_BNBD: (Bn, Nkv, 128, D); k_descale (Bn, Nkv, 128)
    q_values = _values(q)

    def blocks(b, n):
        return block_table[b, : -(-n // plan.block_size)].long()

    return _Operands(
        q=q_values, q_strides=tiling.normalised_strides(q_values, plan.layout), q_scale=q_descale,
        keys=lambda b, n: _values(_gather_blocks(k, layout_kv, blocks(b, n))[:, :n]),
        key_scale=lambda b, n: _gather_blocks(k_descale.unsqueeze(-1), layout_kv, blocks(b, n))[:, :n, 0],
        values=lambda b, n: _values(_gather_blocks(v, layout_kv, blocks(b, n))[:, :n]),
        v_scale=v_descale,
    )


def forward(
    plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_descale: torch.Tensor, k_descale: torch.Tensor, v_descale: torch.Tensor, p_scale: torch.Tensor | None,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a mode 1 / 6 plan; returns (out bf16 TND, lse fp32 (Nq, Tq) or an empty tensor)."""
    build = _mxfp8_operands if plan.meta.quant_mode == QuantMode.MXFP8 else _fp8_operands
    ops = build(plan, q, k, v, q_descale, k_descale, v_descale, block_table)
    with _compile.limits():
        return _forward(plan, ops, p_scale)


def _forward(plan: AttentionPlan, ops: _Operands, p_scale):
    device = plan.device
    Nq, Nkv, G, D, BN = plan.heads_q, plan.heads_kv, plan.group, plan.head_dim, plan.block_n
    scale = torch.tensor([plan.softmax_scale], dtype=torch.float32, device=device)
    ln_p = torch.log(p_scale) if p_scale is not None else torch.zeros(1, dtype=torch.float32, device=device)

    out, lse = plan.new_outputs()
    out.zero_()
    lse.fill_(float("inf"))
    for b, offset in enumerate(plan.causal_offsets):
        q_len, kv_len = plan.q_lens[b], plan.kv_lens[b]
        if q_len == 0 or kv_len == 0:
            continue
        q_start = plan.q_starts[b]
        q_b = _per_batch(ops.q, ops.q_strides, Nq, b, q_start, q_len)  # (Nq, q_len, D)
        qs_b = None
        if ops.q_scale is not None:  # (Nq, Tq) -> (Nq, q_len)
            qs_b = ops.q_scale[:, q_start : q_start + q_len]
        keys, values = ops.keys(b, kv_len), ops.values(b, kv_len)
        ks_b = ops.key_scale(b, kv_len)
        k_blocks = [keys[:, j0 : j0 + BN].contiguous() for j0 in range(0, kv_len, BN)]
        v_blocks = [values[:, j0 : j0 + BN].contiguous() for j0 in range(0, kv_len, BN)]
        # NaN in V (an E4M3 NaN, or a NaN scale) needs the masked sum; a host read, so only on CPU.
        special = ([bool((~torch.isfinite(blk)).any()) for blk in v_blocks] if tiling.host_reads_are_free(device)
                   else [True] * len(v_blocks))
        out_b = _per_batch(out, plan.out_strides, Nq, b, q_start, q_len)
        lse_b = lse[:, q_start : q_start + q_len] if plan.return_lse else None
        for t0 in range(0, q_len, plan.torch_rows):
            t1 = min(q_len, t0 + plan.torch_rows)
            T = t1 - t0
            key_end = min(kv_len, t1 + offset) if plan.causal else kv_len
            if key_end <= 0:
                continue
            # (Nq, T, D) -> (Nkv, T * G, D): each kv head's GQA group as one matrix, rows in
            # (position, group) order, so the rows from any position on are a suffix.
            q_tile = q_b[:, t0:t1].reshape(Nkv, G, T, D).transpose(1, 2).reshape(Nkv, T * G, D)
            row_scale = None
            if qs_b is not None:
                row_scale = qs_b[:, t0:t1].reshape(Nkv, G, T).transpose(1, 2).reshape(Nkv, T * G)
            state = _Tile(Nkv, T * G, D, device)
            for j0, k_blk, v_blk, v_special in zip(range(0, key_end, BN), k_blocks, v_blocks, special):
                j1 = j0 + k_blk.shape[1]
                r0 = max(t0, j0 - offset) if plan.causal else t0
                lo = (r0 - t0) * G
                last_key = None
                if plan.causal and j1 - 1 > r0 + offset:
                    last_key = torch.arange(r0 + offset - j0, t1 + offset - j0, device=device).repeat_interleave(G)
                visible = None
                if v_special and last_key is not None:
                    visible = torch.arange(j1 - j0, device=device) <= last_key.unsqueeze(-1)
                for h in range(Nkv):
                    s = matmul_nt(q_tile[h, lo:], k_blk[h])
                    if row_scale is not None:  # mode 6: S = dot * (q_descale[i] * k_descale[j])
                        s = s * (row_scale[h, lo:, None] * ks_b[h, None, j0:j1])
                    p8, alpha, m_new, l_new = _compile.call(_softmax_block, s, state.m[h, lo:], state.l[h, lo:],
                                                            scale, ln_p, last_key, device=device)
                    state.m[h, lo:], state.l[h, lo:] = m_new, l_new
                    pv = _pv_with_specials(p8, v_blk[h], visible) if v_special else matmul_nt(p8, v_blk[h].t())
                    if ops.v_scale is not None:
                        pv = pv.mul_(ops.v_scale[h])
                    state.o[h, lo:].mul_(alpha.unsqueeze(-1)).add_(pv)
            positions = torch.arange(t0, t1, device=device)
            sees = (positions + offset >= 0) if plan.causal else torch.ones_like(positions, dtype=torch.bool)
            tile_out, tile_lse = state.finish(sees.repeat_interleave(G))
            out_b[:, t0:t1] = tile_out.view(Nkv, T, G, D).transpose(1, 2).reshape(Nq, T, D)
            if lse_b is not None:
                lse_b[:, t0:t1] = tile_lse.view(Nkv, T, G).transpose(1, 2).reshape(Nq, T)
    return out, lse


__all__ = ["READS_PAGED_KV", "forward"]
