"""Attention on a :class:`~qfa.serving.hif8_cache.HiF8Cache`'s codes: the attention backend's call.

:func:`cached_attention` encodes the tokens the layer queued (with the attention mask, so
padding is left out), quantises only the query (rotated when the cache rotates), and runs
``quant_flash_attn`` on the stored codes in place: BNSD, each sequence's valid queries first
(``seqused_q``) against its compacted keys (``seqused_kv``), causal aligned bottom-right. No
stored token is dequantised or re-encoded. An attention function registered with transformers
hands over to it when its keys are a cache's placeholders::

    found = hif8_cache_of(key)
    if found is not None:
        cache, layer_idx = found
        out = cached_attention(module, query, cache, layer_idx, softmax_scale=scaling,
                               attention_mask=attention_mask, is_causal=is_causal)
        return out, None

A call is all-or-nothing: the queued tokens are encoded into a staged state
(:meth:`HiF8Layer.stage`) that attention reads and the layer takes only when the call returns;
one that raises (NaN in the prefill keys, a refused query or option) leaves the layer as it
was, its tokens still queued.

Each sequence's query rows, rotations and key means are handled on that sequence's own tensors,
so with equal scales a sequence gets the same bits in a padded batch as alone. The per-tensor
scales are batch statistics: K and V are fixed by the prefill batch, and q (unless static) is
scaled per call over the batch's valid rows.
"""

from __future__ import annotations

import torch

from qfa.dropin import calibration as cal
from qfa.dropin import rotation
from qfa.dropin.inputs import p_scale_tensor
from qfa.attention.op import quant_flash_attn, quant_flash_attn_metadata
from qfa.dropin.smoothing import lse_shift
from qfa.attention.wording import callers_words
from qfa.serving.hif8_cache import STATIC_SCALES, CacheHandle, HiF8Cache, HiF8Layer, Staged
from qfa.tiling.checks import check_bool, check_float_tensor, check_positive_float
from qfa.tiling.spec import HEAD_DIM, MaskMode, QuantMode, default_softmax_scale


#: The op's names for what cached_attention builds itself, in its caller's words.
_OP_NAMES = {"q_descale": "q_scale", "k_descale": "k_scale", "v_descale": "v_scale", "mask_mode": "is_causal"}
_SCALES_NOTE = ("q_scale, k_scale, v_scale: the layer's scales of query, keys and values, given in "
                "HiF8Cache(scales=...) or computed by the calibration rule (query's on this call, the others on the "
                "prefill)")
_OP_NOTES = dict.fromkeys(("q_descale", "k_descale", "v_descale"), _SCALES_NOTE)


def hif8_cache_of(key) -> tuple[HiF8Cache, int] | None:
    """``(cache, layer_idx)`` when ``key`` is a placeholder returned by ``HiF8Cache.update``, else None."""
    if isinstance(key, CacheHandle):
        return key.hif8_cache, key.layer_idx
    return None


def _key_mask(attention_mask, batch: int, seen: int) -> torch.Tensor | None:
    """The 2D key-validity mask (B, seen) as bool, or None (every token real)."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be None or a tensor, got {type(attention_mask).__name__}")
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, seen):
        raise ValueError(f"attention_mask must be None or a 2D key mask (B, keys) = ({batch}, {seen}) (the "
                         f"'qfa_hif8' mask function's), got shape {tuple(attention_mask.shape)}")
    return attention_mask.to(torch.bool)


def _check_query(query, layer: HiF8Layer) -> None:
    check_float_tensor(query, "query")
    if query.dim() != 4 or query.shape[-1] != HEAD_DIM:
        raise ValueError(f"query must be BNSD (B, Nq, Sq, {HEAD_DIM}), got {tuple(query.shape)}")
    b, nkv = layer.keys.shape[:2]
    if query.shape[0] != b or query.shape[1] % nkv:
        raise ValueError(f"query must have the cache's batch {b} and a multiple of its {nkv} kv heads, got "
                         f"{tuple(query.shape)}")
    if query.device != layer.device:
        raise ValueError(f"query must be on the cache's device {layer.device}, got {query.device}")


def cached_attention(module, query: torch.Tensor, cache: HiF8Cache, layer_idx: int, *,
                     softmax_scale: float | None = None, attention_mask: torch.Tensor | None = None,
                     is_causal: bool | None = None, p_scale=None, return_softmax_lse: bool = False,
                     backend: str | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query`` on layer ``layer_idx`` of ``cache``, after encoding its queued tokens.

    Args:
        module: the attention module (its ``is_causal`` is the default of ``is_causal``).
        query: float (B, Nq, Sq, 128), BNSD as transformers passes it; its Sq tokens are the
            last Sq of the layer (those just given to ``update``).
        attention_mask: None (every token real) or the 2D bool key mask (B, keys) over all the
            layer's tokens, padding False, queries its last Sq columns (what the ``qfa_hif8``
            mask function, ``qfa.integrations.transformers.qfa_mask``, builds).
        softmax_scale: None means 1/sqrt(128) (the model's ``scaling``).
        is_causal: bottom-right aligned causal attention; None takes ``module.is_causal``
            (True if it has none).
        p_scale: the op's ``p_scale`` (float, fp32 (1,) tensor or None: 1.0).
        return_softmax_lse: also return the natural-log LSE of the (unsmoothed) scores, fp32
            (B, Nq, Sq); padded rows and rows without keys get +inf.
        backend: the op's backend (None: by device).

    Returns:
        ``out`` (B, Sq, Nq, 128) in the query's dtype (BSND, what transformers' attention
        functions return; padded query rows are 0), or ``(out, lse)``.
    """
    if not isinstance(cache, HiF8Cache):
        raise TypeError(f"cache must be a qfa.serving.HiF8Cache, got {type(cache).__name__}")
    layer = cache.layer(layer_idx)
    if not layer.is_initialized:
        raise ValueError(f"layer {layer_idx} of the cache holds no tokens: give them to cache.update(key_states, "
                         f"value_states, layer_idx) first")
    _check_query(query, layer)
    if is_causal is None:
        is_causal = bool(getattr(module, "is_causal", True))
    check_bool(is_causal, "is_causal")
    check_bool(return_softmax_lse, "return_softmax_lse")
    scale = default_softmax_scale(HEAD_DIM) if softmax_scale is None else check_positive_float(softmax_scale,
                                                                                               "softmax_scale")
    b, nq, sq, d = query.shape
    if sq > layer.seen:
        raise ValueError(f"query has {sq} tokens but layer {layer_idx} holds {layer.seen}; update the cache first")
    mask = _key_mask(attention_mask, b, layer.seen)
    p_scale = p_scale_tensor(p_scale, query.device)
    staged = layer.stage(None if mask is None else mask[:, layer.seen - layer.pending:])
    try:
        with callers_words(_OP_NAMES, _OP_NOTES):
            result = _attend(query, cache, layer, staged, mask, scale, is_causal, p_scale, return_softmax_lse,
                             backend)
    except BaseException:
        layer.discard(staged)
        raise
    layer.apply(staged)
    return result


def _attend(query: torch.Tensor, cache: HiF8Cache, layer: HiF8Layer, staged: Staged, mask: torch.Tensor | None,
            scale: float, is_causal: bool, p_scale: torch.Tensor | None, return_softmax_lse: bool,
            backend: str | None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """cached_attention on the ``staged`` state of ``layer`` (checked arguments)."""
    b, nq, sq, d = query.shape
    if mask is None:  # every query real: each sequence's rows are all of its Sq
        rows, counts = None, [sq] * b
    else:
        rows = [torch.nonzero(mask[i, layer.seen - sq:], as_tuple=True)[0] for i in range(b)]
        counts = [int(r.numel()) for r in rows]
    if staged.k_scale is None or max(counts) == 0:  # no stored key, or no real query
        out = query.new_zeros(b, sq, nq, d)
        lse = torch.full((b, nq, sq), float("inf"), dtype=torch.float32, device=query.device)
        return (out, lse) if return_softmax_lse else out
    # (Nq, n_i, D) contiguous: each sequence on its own
    q_seq = [query[i].contiguous() if rows is None else query[i][:, r] for i, r in enumerate(rows or [None] * b)]
    q_rot = [rotation.rotate(t) if layer.rotate else t.float() for t in q_seq]
    q_scale = layer.q_scale
    if q_scale is None:
        flat = q_rot[0].reshape(-1) if b == 1 else torch.cat([t.reshape(-1) for t in q_rot])
        q_scale = cal.apply_rule(layer.rule, flat, "query", STATIC_SCALES)
    q_codes = _rows_to_batch([cal.quantize(t, q_scale) for t in q_rot], counts, max(counts), 1, 0)  # BNSD
    mask_mode = MaskMode.CAUSAL if is_causal else MaskMode.NONE
    seqused_q = torch.tensor(counts, dtype=torch.int32, device=query.device)
    seqused_kv = staged.lengths.to(torch.int32)
    nkv = staged.k_store.shape[1]
    key = (tuple(counts), staged.host_lengths, nq, nkv, int(mask_mode), query.device)
    metadata = cache.shared_plan(key, lambda: quant_flash_attn_metadata(
        nq, nkv, layout="BNSD", seqused_q=seqused_q, seqused_kv=seqused_kv, mask_mode=mask_mode))
    o, l = quant_flash_attn(
        q_codes, staged.keys, staged.values, q_scale, staged.k_scale, staged.v_scale, QuantMode.HIF8_PER_TENSOR,
        p_scale=p_scale, layout="BNSD", seqused_q=seqused_q, seqused_kv=seqused_kv,
        metadata=metadata, mask_mode=mask_mode, softmax_scale=scale, return_softmax_lse=return_softmax_lse,
        backend=backend,
    )
    outs, lses = [], []
    for i in range(b):
        o_i = o[i, :, :counts[i]]
        o_i = rotation.rotate(o_i) if layer.rotate else o_i  # H is its own inverse
        outs.append(o_i.to(query.dtype))
        if return_softmax_lse:
            l_i = l[i, :, :counts[i]]
            if staged.k_mean is not None:  # the scores were q.(k - mu): add q.mu back
                shift = lse_shift(q_seq[i][None], staged.k_mean[i][None], "BNSD", None, scale)[0]
                l_i = torch.where(torch.isinf(l_i), l_i, l_i + shift)
            lses.append(l_i)
    out = _rows_to_batch(outs, counts, sq, 1, 0, rows).transpose(1, 2).contiguous()  # BSND
    if not return_softmax_lse:
        return out
    return out, _rows_to_batch(lses, counts, sq, 1, float("inf"), rows)


def _rows_to_batch(parts: list[torch.Tensor], counts: list[int], width: int, axis: int, fill: float,
                   rows: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Stack per-sequence tensors holding ``counts[i]`` rows along ``axis`` (of the part) into
    one batch of ``width`` rows: at positions ``rows[i]`` (sorted; None: the first counts[i]),
    ``fill`` elsewhere. When every sequence fills every row, they are stacked as they are."""
    if all(c == width for c in counts):
        return torch.stack(parts)
    shape = list(parts[0].shape)
    shape[axis] = width
    batch = parts[0].new_full((len(parts), *shape), fill)
    for i, part in enumerate(parts):
        index = torch.arange(counts[i], device=part.device) if rows is None else rows[i]
        batch[i].index_copy_(axis, index, part)
    return batch
