"""The drop-in's MXFP8 and FP8 formats: float Q/K/V quantised with scales computed on the fly,
then ``quant_flash_attn`` in quant_mode 1 or 6 (``docs/spec/quant-flash-attn.md``).

* ``"mxfp8"`` (mode 1): Q and K in MXFP8 blocks of 32 channels along D (one E8M0 scale per
  token, head and 32 channels), V in blocks of 32 keys of one sequence per channel
  (:mod:`qfa.cast.mxfp8`); q, k, v and out in TND with ``cu_seqlens``.
* ``"fp8"`` (mode 6): Q and K in FP8 E4M3 with one fp32 scale per token and head, V with one
  per head over the valid keys of every sequence of the call (:mod:`qfa.cast.fp8`); q in NTD, k and v in PA_BNBD blocks of 128 keys (each
  sequence's keys padded to a multiple of 128, an identity ``block_table``, ``seqused_kv``),
  out in TND.

Both modes take their inputs packed, so the caller's BNSD / BSND / TND tensors are gathered into
one token axis first, valid tokens only (those below ``seqused``, per sequence): padding takes no
part in any scale, as in the HiF8 format. Sequences without a valid query or key are left out
of the op's call; their rows get what the op gives such rows (0, LSE +inf). The outputs are
scattered back into the caller's layout.

``p_scale`` (where the dominant P lands on the E4M3 grid) defaults to :data:`E4M3_P_SCALE`, 448:
E4M3's largest value, so on the grid (the doc's midpoint warning: a p_scale between two E4M3
values flips the row's largest P by a grid step on one ulp of exp), and the top of its range,
so the small P of long rows keep the most binades before E4M3's subnormals (2^-9) flush them:
with 448 a P down to 2^-9 / 448 of the row's largest stays nonzero, with 1 only down to 2^-9.
Every P between is rounded with the same 3 mantissa bits either way.

NaN and Inf are not an error here (unlike HiF8's per-tensor scale, which they would poison):
the codecs give the 32-value block (MXFP8) or the token's head (FP8 Q/K; the whole head for FP8
V) the NaN scale, and the op carries it to the outputs that read it, as exact attention would.
"""

from __future__ import annotations

from typing import Final

import torch

from qfa.dropin.call import DropinCall
from qfa.attention.op import quant_flash_attn
from qfa.cast import fp8, mxfp8
from qfa.cast.fp8 import E4M3, E4M3_MAX
from qfa.tiling.spec import MaskMode, QuantMode, default_softmax_scale

#: The drop-in's default p_scale in the E4M3 formats (see the module docstring).
E4M3_P_SCALE: Final = E4M3_MAX
#: Mode 6's only block size (keys per PA_BNBD block).
FP8_BLOCK_SIZE: Final = 128


def _tokens(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t`` as (tokens, N, D): BNSD and BSND batch-major (b * S + s), TND as it is."""
    if layout == "BNSD":
        return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[-1])
    if layout == "BSND":
        return t.reshape(-1, t.shape[2], t.shape[-1])
    return t


def _valid_lengths(t: torch.Tensor, layout: str, cu_seqlens, seqused) -> tuple[list[int], list[int]]:
    """(start, used length) per sequence in :func:`_tokens` order (host reads of the lengths)."""
    if layout == "TND":
        cu = cu_seqlens.tolist()
        starts, lens = cu[:-1], [b - a for a, b in zip(cu[:-1], cu[1:])]
    else:
        s = t.shape[2] if layout == "BNSD" else t.shape[1]
        starts, lens = [b * s for b in range(t.shape[0])], [s] * t.shape[0]
    if seqused is not None:
        lens = [min(n, u) for n, u in zip(lens, seqused.tolist())]
    return starts, lens


def _rows(starts: list[int], lens: list[int], keep: list[int], device) -> torch.Tensor:
    """int64 token indices of the kept sequences' valid tokens, in order."""
    parts = [torch.arange(starts[b], starts[b] + lens[b], device=device) for b in keep]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)


def _cumulative(lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + lens, dtype=torch.int64, device=device).cumsum(0).to(torch.int32)


def _mxfp8_call(q, k, v, q_lens, kv_lens):
    """Mode 1's operands from packed fp32 q (Tq, Nq, D), k, v (Tkv, Nkv, D)."""
    qe, qs = mxfp8.quantize(q, -1)
    ke, ks = mxfp8.quantize(k, -1)
    v_parts, start = [], 0
    for n in kv_lens:  # V's 32-key blocks start at each sequence's first key
        v_parts.append(mxfp8.quantize(v[start:start + n], 0))
        start += n
    ve = torch.cat([e.view(torch.uint8) for e, _ in v_parts]).view(E4M3)  # float8 has no cat
    args = (qe, ke, ve, mxfp8.pack_q_descale(qs), mxfp8.pack_k_descale(ks),
            mxfp8.pack_v_descale([s for _, s in v_parts]), QuantMode.MXFP8)
    options = dict(cu_seqlens_q=_cumulative(q_lens, q.device), cu_seqlens_kv=_cumulative(kv_lens, q.device),
                   layout="TND", layout_q_descale="TND")
    return args, options


def _fp8_call(q, k, v, q_lens, kv_lens):
    """Mode 6's operands from packed fp32 q (Tq, Nq, D), k, v (Tkv, Nkv, D): each sequence's keys
    in its own run of 128-key blocks (zeros past its length, never read: seqused_kv)."""
    device, nkv, d = q.device, k.shape[1], k.shape[2]
    blocks = [-(-n // FP8_BLOCK_SIZE) for n in kv_lens]
    first = [sum(blocks[:b]) for b in range(len(blocks))]
    slots = torch.cat([torch.arange(n, device=device) + f * FP8_BLOCK_SIZE for n, f in zip(kv_lens, first)])
    total = sum(blocks) * FP8_BLOCK_SIZE

    def paged(t):  # (Tkv, Nkv, D) -> PA_BNBD (Bn, Nkv, 128, D)
        flat = t.new_zeros(total, nkv, d).index_copy_(0, slots, t)
        return flat.view(-1, FP8_BLOCK_SIZE, nkv, d).transpose(1, 2).contiguous()

    qe, qs = fp8.quantize_per_token_head(q.transpose(0, 1).contiguous())  # NTD, scales (Nq, Tq)
    ke, ks = fp8.quantize_per_token_head(paged(k))
    ve, vs = fp8.quantize_per_head(paged(v), 1)
    table = torch.zeros(len(blocks), max(blocks), dtype=torch.int32, device=device)
    for b, (f, n) in enumerate(zip(first, blocks)):
        table[b, :n] = torch.arange(f, f + n, dtype=torch.int32, device=device)
    args = (qe, ke, ve, qs, ks, vs, QuantMode.FP8_PER_TOKEN_HEAD)
    options = dict(block_table=table, cu_seqlens_q=_cumulative(q_lens, device),
                   seqused_kv=torch.tensor(kv_lens, dtype=torch.int32, device=device),
                   layout_q="NTD", layout_kv="PA_BNBD", layout_out="TND")
    return args, options


_CALLS = {"mxfp8": _mxfp8_call, "fp8": _fp8_call}


def run(c: DropinCall, tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the call ``c`` in format mxfp8 / fp8 on its prepared (smoothed) float
    ``tensors``: out bf16 in q's layout and shape, lse fp32 in its shape (empty unless asked)."""
    q, k, v = tensors
    layout, device = c.layout, q.device
    q_starts, q_lens = _valid_lengths(q, layout, c.cu_seqlens_q, c.seqused_q)
    kv_starts, kv_lens = _valid_lengths(k, layout, c.cu_seqlens_kv, c.seqused_kv)
    keep = [b for b in range(len(q_lens)) if q_lens[b] > 0 and kv_lens[b] > 0]
    q_tok = _tokens(q, layout)
    out = torch.zeros(q_tok.shape[0], q_tok.shape[1], v.shape[-1], dtype=torch.bfloat16, device=device)
    lse = torch.full((q_tok.shape[1], q_tok.shape[0]), float("inf"), dtype=torch.float32, device=device)
    if keep:
        rows = _rows(q_starts, q_lens, keep, device)
        keys = _rows(kv_starts, kv_lens, keep, device)
        packed = [q_tok.index_select(0, rows).float()] + [
            _tokens(t, layout).index_select(0, keys).float() for t in (k, v)]
        args, options = _CALLS[c.format](*packed, [q_lens[b] for b in keep], [kv_lens[b] for b in keep])
        del packed
        p_scale = c.p_scale if c.p_scale is not None else torch.full((1,), E4M3_P_SCALE, device=device)
        softmax_scale = default_softmax_scale(q.shape[-1]) if c.softmax_scale is None else c.softmax_scale
        got, got_lse = quant_flash_attn(
            *args, **options, p_scale=p_scale, mask_mode=MaskMode.CAUSAL if c.is_causal else MaskMode.NONE,
            softmax_scale=softmax_scale, return_softmax_lse=c.return_softmax_lse, backend=c.backend)
        out.index_copy_(0, rows, got)
        if c.return_softmax_lse:
            lse[:, rows] = got_lse
    if layout == "BNSD":
        out = out.view(q.shape[0], q.shape[2], q.shape[1], -1).transpose(1, 2).contiguous()
    elif layout == "BSND":
        out = out.view(*q.shape[:3], -1)
    if not c.return_softmax_lse:
        return out, lse.new_empty((0,))
    if layout != "TND":  # (Nq, B * S) -> (B, Nq, S)
        lse = lse.view(q_tok.shape[1], q.shape[0], -1).transpose(0, 1).contiguous()
    return out, lse
