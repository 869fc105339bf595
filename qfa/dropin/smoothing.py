"""What the drop-in quantises: K smoothing, the Hadamard rotation, and the valid positions.

K smoothing
-----------
Some models (those with K bias terms, e.g. Qwen2) carry large per-channel offsets in K. One
per-tensor scale is then set by the offset and the informative part of K drowns in HiF8's
coarse binades. With ``smooth_k=True`` the per-head, per-channel mean of K over the valid keys
of each sequence, ``mu``, is subtracted before quantising. For every query row the scores shift
by the constant ``softmax_scale * q . mu``, so softmax (the output) is unchanged in exact
arithmetic; the log-sum-exp shifts by the same constant, and the drop-in adds it back
(:func:`lse_shift`, fp32 from the unquantised ``q``), so the returned LSE is that of the
original scores.

Valid positions are those below ``seqused`` (per sequence, any layout): padding past them takes
no part in the K means or in the per-tensor scales (:func:`valid_values`).
"""

from __future__ import annotations

from typing import Optional

import torch

from qfa.dropin import rotation


def _segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Sequence index (int64) of each of ``total`` packed tokens: the b with cu[b] <= t < cu[b+1].

    A binary search rather than ``repeat_interleave(..., output_size=total)``: that one trusts
    the lengths to sum to ``total`` and to be >= 0, and a bad ``cu_seqlens`` (decreasing, still
    summing to the total) corrupted the heap. This reads no value on the host and stays in
    bounds whatever the values (the values are checked elsewhere; this must merely be safe).
    """
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    seg = torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True)
    return seg.clamp_(max=max(cu_seqlens.numel() - 2, 0))


def _valid_mask(length: int, seqused: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """(B, S) bool mask of positions below ``seqused`` (None: all valid)."""
    if seqused is None:
        return None
    return torch.arange(length, device=device)[None, :] < seqused.long()[:, None]


def _tnd_valid(cu_seqlens: torch.Tensor, seqused: Optional[torch.Tensor], total: int) -> Optional[torch.Tensor]:
    """(T,) bool: packed tokens within their sequence's used length (None: all valid)."""
    if seqused is None:
        return None
    seg = _segment_ids(cu_seqlens, total)
    pos = torch.arange(total, device=cu_seqlens.device) - cu_seqlens.long()[seg]
    return pos < seqused.long()[seg]


def key_means(k: torch.Tensor, layout: str = "BNSD", cu_seqlens_kv=None, seqused_kv=None) -> torch.Tensor:
    """fp32 per-head, per-channel mean of K over the valid keys of each sequence.

    Shape: (B, Nkv, D) for BNSD/BSND, (number of sequences, Nkv, D) for TND. Valid keys are
    those below ``seqused_kv`` when given; sequences without keys get 0. The definition: the
    float64 sum of the keys' fp32 values, divided by their count, rounded to fp32 once (the
    native pass, :func:`qfa.dropin.prepare.key_means`, sums each channel in key order; the
    torch ops below in their own order, which can move the float64 sum's last bits, and the fp32
    result only when that sum lies within them of an fp32 rounding boundary).
    """
    from qfa.dropin import prepare  # imports this module's package siblings: import on use

    segs = prepare.segments(k, layout, cu_seqlens_kv, seqused_kv) if prepare.native_rows(k) else None
    if segs is not None:
        return prepare.key_means(k, layout, segs)
    kf = k.double()
    if layout == "TND":
        seg = _segment_ids(cu_seqlens_kv, k.shape[0])
        nseq = cu_seqlens_kv.shape[0] - 1
        valid = _tnd_valid(cu_seqlens_kv, seqused_kv, k.shape[0])
        if valid is None:
            counts = (cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).double()
        else:
            kf = torch.where(valid[:, None, None], kf, 0.0)
            counts = kf.new_zeros(nseq).index_add_(0, seg, valid.double())
        sums = kf.new_zeros((nseq, *k.shape[1:])).index_add_(0, seg, kf)
        return (sums / counts.clamp_min(1)[:, None, None]).float()
    seq_axis = 2 if layout == "BNSD" else 1
    mask = _valid_mask(k.shape[seq_axis], seqused_kv, k.device)
    if mask is None:
        return kf.mean(dim=seq_axis).float()
    m = mask[:, None, :, None] if layout == "BNSD" else mask[:, :, None, None]
    counts = mask.sum(dim=1).double().clamp_min(1)[:, None, None]
    return (torch.where(m, kf, 0.0).sum(dim=seq_axis) / counts).float()


def _broadcast_means(mu: torch.Tensor, layout: str, cu_seqlens, total: int) -> torch.Tensor:
    """``mu`` shaped to broadcast against a K (or, per kv head, Q) tensor of ``layout``."""
    if layout == "BNSD":
        return mu[:, :, None, :]
    if layout == "BSND":
        return mu[:, None, :, :]
    return mu[_segment_ids(cu_seqlens, total)]  # (T, Nkv, D)


def lse_shift(q: torch.Tensor, mu: torch.Tensor, layout: str, cu_seqlens_q, softmax_scale: float) -> torch.Tensor:
    """``softmax_scale * q . mu`` per q head and row, in the LSE's shape, fp32 from the unquantised q."""
    qf = q.float()
    nkv = mu.shape[1]
    if layout == "BNSD":
        b, nq, s, d = q.shape
        shift = torch.einsum("bhgsd,bhd->bhgs", qf.view(b, nkv, nq // nkv, s, d), mu).reshape(b, nq, s)
    elif layout == "BSND":
        b, s, nq, d = q.shape
        shift = torch.einsum("bshgd,bhd->bhgs", qf.view(b, s, nkv, nq // nkv, d), mu).reshape(b, nq, s)
    else:
        t, nq, d = q.shape
        mu_tok = _broadcast_means(mu, "TND", cu_seqlens_q, t)  # (Tq, Nkv, D)
        shift = torch.einsum("thgd,thd->hgt", qf.view(t, nkv, nq // nkv, d), mu_tok).reshape(nq, t)
    return shift * softmax_scale


def valid_values(x: torch.Tensor, layout: str, seqused, cu_seqlens=None) -> torch.Tensor:
    """The elements of ``x`` at valid positions (all of them when ``seqused`` is None)."""
    if seqused is None:
        return x
    if layout == "TND":
        return x[_tnd_valid(cu_seqlens, seqused, x.shape[0])]
    seq_axis = 2 if layout == "BNSD" else 1
    mask = _valid_mask(x.shape[seq_axis], seqused, x.device)
    m = mask[:, None, :, None] if layout == "BNSD" else mask[:, :, None, None]
    return x.masked_select(m.expand(x.shape))


def prepare(q, k, v, *, layout: str = "BNSD", cu_seqlens_kv=None, seqused_kv=None, smooth_k: bool = True,
            rotate: bool = True) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], Optional[torch.Tensor]]:
    """The float tensors the drop-in quantises, and the key means: ``((q, k, v), mu)``.

    K is smoothed in fp32 when ``smooth_k`` (``mu`` is then the key means, None otherwise) and
    all three are rotated when ``rotate``; the inputs are never modified. :class:`HiF8Attention`
    observes exactly these tensors when it calibrates.
    """
    mu = None
    k_in = k
    if smooth_k:
        mu = key_means(k, layout, cu_seqlens_kv, seqused_kv)
        k_in = k.float() - _broadcast_means(mu, layout, cu_seqlens_kv, k.shape[0])
    if rotate:
        return (rotation.rotate(q), rotation.rotate(k_in), rotation.rotate(v)), mu
    return (q, k_in, v), mu


def valid_parts(tensors, layout: str, cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv) -> list[torch.Tensor]:
    """The valid elements of the (q, k, v) that :func:`prepare` returned: what a scale is taken from."""
    lengths = ((seqused_q, cu_seqlens_q), (seqused_kv, cu_seqlens_kv), (seqused_kv, cu_seqlens_kv))
    return [valid_values(t, layout, used, cu) for t, (used, cu) in zip(tensors, lengths)]
