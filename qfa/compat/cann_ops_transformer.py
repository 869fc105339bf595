"""Upstream's ``cann_ops_transformer`` QuantFlashAttn API, with upstream's names *and defaults*.

Code written for the Ascend 950 extension runs unchanged off-NPU with::

    import qfa.compat.cann_ops_transformer as cann_ops_transformer

    out, lse = cann_ops_transformer.quant_flash_attn(
        q, k, v, q_descale, k_descale, v_descale, cann_ops_transformer.QuantMode.HIF8_PER_TENSOR,
        softmax_scale=1 / math.sqrt(128), mask_mode=3, attn_mask=mask, seqused_q=..., ...)

The defaults are upstream's, not qfa's: ``softmax_scale=1.0`` (qfa's own op takes None as
1/sqrt(D)), every layout ``"BSND"`` (qfa's: ``"BNSD"``), ``quant_mode`` positional without a
default. Only the HiF8 per-tensor mode (0; 7 accepted) runs here; upstream's MXFP8 (1) and FP8
(6) modes are rejected with a clear message until qfa implements them. Unlike upstream, bad
*values* of cu_seqlens / seqused are errors (checked where that costs no device synchronisation),
and :func:`quant_flash_attn_metadata` returns qfa's plan object rather than an int32 work split;
pass it back as ``metadata=`` exactly as upstream's code does.
"""

from __future__ import annotations

import torch

from qfa.attention import op
from qfa.tiling.attention import AttentionMetadata
from qfa.tiling.spec import MaskMode, QuantMode

__all__ = ["MaskMode", "QuantMode", "quant_flash_attn", "quant_flash_attn_metadata"]

#: Upstream's default layout for every operand.
DEFAULT_LAYOUT = "BSND"
#: Upstream's default softmax scale (its tests pass 1/sqrt(D) explicitly).
DEFAULT_SOFTMAX_SCALE = 1.0


def quant_flash_attn_metadata(
    num_heads_q: int, num_heads_kv: int, head_dim: int, quant_mode: int, *,
    cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_kv: torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None, seqused_kv: torch.Tensor | None = None, batch_size: int | None = None,
    max_seqlen_q: int = -1, max_seqlen_kv: int = -1, head_dim_v: int | None = None, mask_mode: int = MaskMode.NONE,
    win_left: int = -1, win_right: int = -1, layout_q: str = DEFAULT_LAYOUT, layout_q_descale: str = DEFAULT_LAYOUT,
    layout_kv: str = DEFAULT_LAYOUT, layout_out: str = DEFAULT_LAYOUT, is_grad_enabled: bool = False,
) -> AttentionMetadata:
    """Upstream's ``quant_flash_attn_metadata``: see :func:`qfa.quant_flash_attn_metadata`."""
    return op.quant_flash_attn_metadata(
        num_heads_q, num_heads_kv, head_dim, quant_mode, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
        seqused_q=seqused_q, seqused_kv=seqused_kv, batch_size=batch_size, max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv, head_dim_v=head_dim_v, mask_mode=mask_mode, win_left=win_left,
        win_right=win_right, layout_q=layout_q, layout_q_descale=layout_q_descale, layout_kv=layout_kv,
        layout_out=layout_out, is_grad_enabled=is_grad_enabled,
    )


def quant_flash_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: torch.Tensor, k_descale: torch.Tensor,
    v_descale: torch.Tensor, quant_mode: int, *, block_table: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_kv: torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None, seqused_kv: torch.Tensor | None = None,
    p_scale: torch.Tensor | None = None, sinks: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
    metadata: AttentionMetadata | None = None, softmax_scale: float = DEFAULT_SOFTMAX_SCALE,
    mask_mode: int = MaskMode.NONE, win_left: int = -1, win_right: int = -1, max_seqlen_q: int = -1,
    max_seqlen_kv: int = -1, layout_q: str = DEFAULT_LAYOUT, layout_q_descale: str = DEFAULT_LAYOUT,
    layout_kv: str = DEFAULT_LAYOUT, layout_out: str = DEFAULT_LAYOUT, return_softmax_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's ``quant_flash_attn``: see :func:`qfa.quant_flash_attn` (same numerics)."""
    return op.quant_flash_attn(
        q, k, v, q_descale, k_descale, v_descale, quant_mode, block_table=block_table, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_kv=cu_seqlens_kv, seqused_q=seqused_q, seqused_kv=seqused_kv, p_scale=p_scale, sinks=sinks,
        attn_mask=attn_mask, metadata=metadata, softmax_scale=softmax_scale, mask_mode=mask_mode,
        win_left=win_left, win_right=win_right, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
        layout_q=layout_q, layout_q_descale=layout_q_descale, layout_kv=layout_kv, layout_out=layout_out,
        return_softmax_lse=return_softmax_lse,
    )
