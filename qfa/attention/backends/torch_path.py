"""The torch path of quant_flash_attn: the golden reference, and fast on CPU.

The numerics are the op's (``quant-flash-attn.md``), for each query row, over its visible keys
in 256-key blocks in ascending order:

    S = Q @ K_j^T (exact HiF8 products, fp32 accumulation); keys the row cannot see are -inf
    m_new = max(m, rowmax(S) * dScale - ln p_scale);  P = exp(S * dScale - m_new)
    l = alpha * l + rowsum(P);  O = alpha * O + (HiF8(P) @ V_j) * v_descale

The work is cut the way a CPU flash-attention kernel cuts it, so that each step's operands stay
in cache: for each batch, a tile of query rows (``plan.torch_rows``) walks its key blocks, and
within a block each kv head handles its whole GQA group of q heads as one matrix (G * rows, D).
A tile only visits the blocks its rows can see (causal), only the blocks that cross the
diagonal are masked, and keys past a batch's length are never read. Memory is O(tile), never
Sq x Skv.

The products are exact in fp32 (a HiF8 value has at most 4 significant bits), so the result
depends only on fp32 summation order: on CPU the GEMMs go to oneDNN, whose fp32 kernels are
2x the default BLAS here (see :mod:`qfa.attention.backends.cpu_gemm`).
"""

from __future__ import annotations

import torch

from qfa import _compile
from qfa.attention.backends import paged
from qfa.attention.backends.cpu_gemm import matmul_nt
from qfa.cast import format as fmt
from qfa.cast import luts, rounding
from qfa.cast import torch_path as cast_torch
from qfa.tiling import attention as tiling
from qfa.tiling.attention import AttentionPlan

_BF16_ROUND_BIT = 0x8000
#: ``forward`` takes paged K/V (``block_table``) itself.
READS_PAGED_KV = True


def round_to_hif8(x: torch.Tensor) -> torch.Tensor:
    """HiF8 values nearest to fp32 ``x`` (ties away from zero, saturating), as fp32: integer and
    bit operations that inductor vectorises (``qfa.cast.rounding``), not a 65536-entry fp32
    table gather (256 KiB, beyond L1: 3x the rest of the softmax step on an Intel Xeon)."""
    return rounding.round_hif8_top16(x)


def to_bf16_round_half_away(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 rounding half away from zero (torch's own cast rounds half to even)."""
    bits = x.view(torch.int32)
    rounded = ((bits + _BF16_ROUND_BIT) >> 16).to(torch.int16).view(torch.bfloat16)
    return torch.where(torch.isnan(x), torch.full_like(rounded, float("nan")), rounded)


def softmax_block_for(round_p):
    """The online-softmax step of one key block, with P rounded to the 8-bit grid by
    ``round_p`` (fp32 -> fp32 values): HiF8 here, E4M3 in modes 1 and 6."""

    def softmax_block(s, m, l, dscale, ln_p, last_key=None):
        """One key block of the online softmax on the rows of ``s``.

        ``last_key`` (causal blocks that cross the diagonal): per row, the last column it may see;
        the others count as -inf. Returns (P8, alpha, m_new, l_new) and modifies nothing, so an
        eager retry of a failed compiled call cannot apply an update twice.
        """
        hidden = None
        if last_key is not None:
            # Built here from an index ramp rather than passed in as a bool tensor, and applied to
            # the exponent and P rather than as -inf scores: a bool load, or an exp that meets -inf
            # or overflows, drops the compiled loop off its fast vectorised path.
            hidden = torch.arange(s.shape[-1], device=s.device) > last_key.unsqueeze(-1)
        row_max = (s if hidden is None else s.masked_fill(hidden, float("-inf"))).amax(dim=-1)
        m_new = torch.maximum(m, row_max * dscale - ln_p)
        # Rows that have seen no key yet keep m = -inf; subtract 0 there so exp gives 0, not NaN.
        m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        exponent = s * dscale - m_safe.unsqueeze(-1)
        if hidden is None:
            p = torch.exp(exponent)
        else:
            p = torch.exp(exponent.masked_fill(hidden, 0.0)).masked_fill(hidden, 0.0)
        alpha = torch.exp(m - m_safe)
        return round_p(p), alpha, m_new, alpha * l + p.sum(dim=-1)

    return softmax_block


_softmax_block = softmax_block_for(round_to_hif8)


def _pv_with_specials(p8: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """``P8 @ V`` for a V block holding NaN or Inf, summing only the keys each row can see.

    A plain GEMM would add 0 * NaN = NaN for keys a row cannot see (P8 = 0 there), so masked
    keys would reach it. Here the finite part is one GEMM on V with its specials zeroed, and the
    specials follow IEEE sums over the visible keys alone: any NaN term, 0 * Inf, or +Inf with
    -Inf gives NaN; otherwise an Inf term gives that Inf. ``visible`` (rows, keys) bool, or None
    when every row sees every key of the block.
    """
    finite = torch.isfinite(v)
    pv = matmul_nt(p8, torch.where(finite, v, torch.zeros_like(v)).t())
    vis = torch.ones_like(p8, dtype=torch.bool) if visible is None else visible
    hits = lambda rows, cols: matmul_nt(rows.to(torch.float32), cols.to(torch.float32).t()) > 0  # noqa: E731
    pos_inf, neg_inf = v == float("inf"), v == float("-inf")
    positive = vis & (p8 > 0)
    plus, minus = hits(positive, pos_inf), hits(positive, neg_inf)
    nan = hits(vis, torch.isnan(v)) | hits(vis & (p8 == 0), pos_inf | neg_inf) | (plus & minus)
    pv = torch.where(plus, float("inf"), torch.where(minus, float("-inf"), pv))
    return torch.where(nan, float("nan"), pv)


def _special_blocks(v_b: torch.Tensor, block: int) -> list[bool]:
    """Per key block of a batch's V codes: whether it holds NaN or Inf (one pass over the bytes,
    one host read per batch)."""
    special = (v_b == fmt.NAN_CODE) | ((v_b & (0xFF ^ fmt.SIGN_BIT)) == fmt.POS_INF_CODE)
    keys = v_b.shape[1]
    padded = torch.zeros(-(-keys // block) * block, dtype=torch.bool, device=v_b.device)
    padded[:keys] = special.any(dim=-1).any(dim=0)
    return padded.view(-1, block).any(dim=-1).tolist()


def _per_batch(t: torch.Tensor, strides, heads: int, b: int, start: int, length: int) -> torch.Tensor:
    """(heads, length, D) view of batch ``b`` of a tensor in any layout, from its plan strides."""
    sb, sn, ss, sd = strides
    return t.as_strided((heads, length, t.shape[-1]), (sn, ss, sd), t.storage_offset() + b * sb + start * ss)


def _decode(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Contiguous fp32 values of (possibly strided) HiF8 codes: the cast's own decode step,
    without the public API's argument checks and backend resolution (once per key block)."""
    flat = codes.contiguous().view(-1)
    return cast_torch.run(cast_torch.decode_codes, flat, table).view(torch.float32).view(codes.shape)


class _Tile:
    """Online-softmax state of one query tile: per kv head, running m, l and O of its rows.

    Rows are in (position, group) order: the rows from any position on form a suffix, so a
    block that the tile's first positions cannot see skips them with a slice.
    """

    def __init__(self, heads_kv: int, rows: int, dim: int, device: torch.device) -> None:
        self.m = torch.full((heads_kv, rows), float("-inf"), dtype=torch.float32, device=device)
        self.l = torch.zeros(heads_kv, rows, dtype=torch.float32, device=device)
        self.o = torch.zeros(heads_kv, rows, dim, dtype=torch.float32, device=device)

    def finish(self, sees: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(out bf16, lse fp32) of the tile; ``sees`` (rows,) bool: the rows that see any key."""
        return _compile.call(_normalise, self.o, self.m, self.l, sees, device=self.o.device)


def _normalise(o, m, l, sees):
    """Final O / l as bf16 (ties away) and lse = m + ln l; rows that see no key get 0 and +inf.

    Whether a row sees a key is structural (lengths, mask), never read from ``l``: a row whose
    visible scores are all -inf has l = 0 and gets 0 / 0 = NaN (lse -inf), as the exact
    softmax does, and a NaN row stays NaN.
    """
    out = to_bf16_round_half_away(torch.where(sees.unsqueeze(-1), o / l.unsqueeze(-1), torch.zeros_like(o)))
    lse = torch.where(sees, m + torch.log(l), torch.full_like(l, float("inf")))
    return out, lse


def forward(
    plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_descale: torch.Tensor, k_descale: torch.Tensor, v_descale: torch.Tensor, p_scale: torch.Tensor | None,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the plan; returns (out bf16 in q's layout, lse fp32 or an empty tensor).
    ``block_table``: the paged plans' (B, max blocks) int32 table of physical blocks."""
    with _compile.limits():
        return _forward(plan, q, k, v, q_descale, k_descale, v_descale, p_scale, block_table)


def _forward(plan, q, k, v, q_descale, k_descale, v_descale, p_scale, block_table=None):
    device = plan.device
    Nq, Nkv, G, D, BN = plan.heads_q, plan.heads_kv, plan.group, plan.head_dim, plan.block_n
    dscale, ln_p, v_descale = plan.scalars(q_descale, k_descale, v_descale, p_scale).split(1)
    dec = luts.decode_lut(torch.float32, device)

    # Rows no batch reaches (seqused_q, TND tails) and rows that see no key: out 0, lse +inf.
    out, lse = plan.new_outputs()
    out.zero_()
    lse.fill_(float("inf"))

    for b, offset in enumerate(plan.causal_offsets):
        q_len, kv_len = plan.q_lens[b], plan.kv_lens[b]
        if q_len == 0 or kv_len == 0:
            continue
        q_start = plan.q_starts[b]
        q_b = _per_batch(q, plan.strides_q, Nq, b, q_start, q_len)
        # fp32 K and V one block of keys at a time: each block is a separate allocation small
        # enough to be recycled from call to call (a 32 MiB one would be page-faulted in anew).
        if plan.paged:
            k_b = paged.keys_of(k, plan.strides_kv, plan, block_table, b, kv_len)
            v_b = paged.keys_of(v, plan.strides_v, plan, block_table, b, kv_len)
        else:
            k_b = _per_batch(k, plan.strides_kv, Nkv, b, plan.kv_starts[b], kv_len)
            v_b = _per_batch(v, plan.strides_v, Nkv, b, plan.kv_starts[b], kv_len)
        k_blocks = [_decode(k_b[:, j0 : j0 + BN], dec) for j0 in range(0, kv_len, BN)]
        v_blocks = [_decode(v_b[:, j0 : j0 + BN], dec) for j0 in range(0, kv_len, BN)]
        # NaN/Inf in V need a masked sum (see _pv_with_specials); a host read, so only on CPU:
        # on devices every block takes that path.
        special = _special_blocks(v_b, BN) if tiling.host_reads_are_free(device) else [True] * len(v_blocks)
        out_b = _per_batch(out, plan.out_strides, Nq, b, q_start, q_len)
        if plan.return_lse:
            lse_b = lse[:, q_start : q_start + q_len] if plan.layout == "TND" else lse[b, :, :q_len]
        for t0 in range(0, q_len, plan.torch_rows):
            t1 = min(q_len, t0 + plan.torch_rows)
            T = t1 - t0
            # Keys the tile's last row sees; with Sq > Skv some causal tiles see none at all.
            key_end = min(kv_len, t1 + offset) if plan.causal else kv_len
            if key_end <= 0:
                continue
            # (Nq, T, D) -> (Nkv, T * G, D): each kv head's GQA group as one matrix.
            q_tile = _decode(q_b[:, t0:t1].view(Nkv, G, T, D).transpose(1, 2), dec).view(Nkv, T * G, D)
            state = _Tile(Nkv, T * G, D, device)
            # Blocks end at kv_len, never at the tile's causal edge (that part is masked), so
            # every row sums the same block whatever the tile: the tile does not change a bit.
            for j0, k_blk, v_blk, v_special in zip(range(0, key_end, BN), k_blocks, v_blocks, special):
                j1 = j0 + k_blk.shape[1]
                # Positions before j0 - offset see no key of this block: for them the block is a
                # no-op (P = 0, alpha = 1), so they are left out.
                r0 = max(t0, j0 - offset) if plan.causal else t0
                lo = (r0 - t0) * G
                # Only blocks that cross the diagonal hold keys some row cannot see.
                last_key = None
                if plan.causal and j1 - 1 > r0 + offset:
                    last_key = torch.arange(r0 + offset - j0, t1 + offset - j0, device=device).repeat_interleave(G)
                visible = None
                if v_special and last_key is not None:
                    visible = torch.arange(j1 - j0, device=device) <= last_key.unsqueeze(-1)
                for h in range(Nkv):
                    s = matmul_nt(q_tile[h, lo:], k_blk[h])
                    p8, alpha, m_new, l_new = _compile.call(_softmax_block, s, state.m[h, lo:], state.l[h, lo:],
                                                            dscale, ln_p, last_key, device=device)
                    state.m[h, lo:], state.l[h, lo:] = m_new, l_new
                    pv = _pv_with_specials(p8, v_blk[h], visible) if v_special else matmul_nt(p8, v_blk[h].t())
                    state.o[h, lo:].mul_(alpha.unsqueeze(-1)).add_(pv.mul_(v_descale))
            positions = torch.arange(t0, t1, device=device)
            sees = (positions + offset >= 0) if plan.causal else torch.ones_like(positions, dtype=torch.bool)
            tile_out, tile_lse = state.finish(sees.repeat_interleave(G))
            out_b[:, t0:t1] = tile_out.view(Nkv, T, G, D).transpose(1, 2).reshape(Nq, T, D)
            if plan.return_lse:
                lse_b[:, t0:t1] = tile_lse.view(Nkv, T, G).transpose(1, 2).reshape(Nq, T)
    return out, lse
