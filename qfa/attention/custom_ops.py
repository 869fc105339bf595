"""``torch.ops.qfa.quant_flash_attn``, registered with ``torch.library`` so ``torch.compile(fullgraph=True)``
can trace it (``import qfa`` registers it once).

``torch.ops.qfa.quant_flash_attn(q, k, v, q_descale, k_descale, v_descale, quant_mode, p_scale,
layout, cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv, attn_mask, mask_mode, softmax_scale,
return_softmax_lse, backend) -> (out, lse)``
    :func:`qfa.attention.op.quant_flash_attn`, all arguments positional.

Its fake (meta) implementation gives only shapes and dtypes. The op is for inference: no
autograd formula is registered. ``lse`` is an empty fp32 tensor of shape (0,) when not
requested. The cast's ops are in :mod:`qfa.cast.custom_ops`, the drop-in's
(``torch.ops.qfa.hif8_attention``) in :mod:`qfa.dropin.custom_op`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from qfa.tiling.attention import lse_shape


def _empty_lse(q: Tensor) -> Tensor:
    return q.new_empty((0,), dtype=torch.float32)


# ----------------------------------------------------------------------------- the op

@torch.library.custom_op("qfa::quant_flash_attn", mutates_args=())
def quant_flash_attn(
    q: Tensor, k: Tensor, v: Tensor, q_descale: Tensor, k_descale: Tensor, v_descale: Tensor, quant_mode: int,
    p_scale: Optional[Tensor], layout: str, cu_seqlens_q: Optional[Tensor], cu_seqlens_kv: Optional[Tensor],
    seqused_q: Optional[Tensor], seqused_kv: Optional[Tensor], attn_mask: Optional[Tensor], mask_mode: int,
    softmax_scale: Optional[float], return_softmax_lse: bool, backend: Optional[str],
) -> tuple[Tensor, Tensor]:
    from qfa.attention import op

    out, lse = op.quant_flash_attn(
        q, k, v, q_descale, k_descale, v_descale, quant_mode, p_scale=p_scale, layout=layout,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, seqused_q=seqused_q, seqused_kv=seqused_kv,
        attn_mask=attn_mask, mask_mode=mask_mode, softmax_scale=softmax_scale,
        return_softmax_lse=return_softmax_lse, backend=backend,
    )
    # fakes promise contiguous outputs: make that true whatever the backend returns
    return out.contiguous(), (lse.contiguous() if return_softmax_lse else _empty_lse(q))


@quant_flash_attn.register_fake
def _(q, k, v, q_descale, k_descale, v_descale, quant_mode, p_scale, layout, cu_seqlens_q, cu_seqlens_kv,
      seqused_q, seqused_kv, attn_mask, mask_mode, softmax_scale, return_softmax_lse, backend):
    out = q.new_empty(q.shape, dtype=torch.bfloat16)
    lse = q.new_empty(lse_shape(q.shape, layout), dtype=torch.float32) if return_softmax_lse else _empty_lse(q)
    return out, lse
