"""qfa's ops registered with ``torch.library``, so ``torch.compile(fullgraph=True)`` can trace them.

Registered (importing this module, which ``qfa.attention.dropin`` does, registers them once):

``torch.ops.qfa.encode_hif8(x, overflow="saturate") -> uint8``
    :func:`qfa.encode_to_hifloat8`.
``torch.ops.qfa.decode_hif8(codes, dtype) -> dtype``
    :func:`qfa.decode_from_hifloat8`.
``torch.ops.qfa.quant_flash_attn(q, k, v, q_descale, k_descale, v_descale, quant_mode, p_scale,
layout, cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv, attn_mask, mask_mode, softmax_scale,
return_softmax_lse, backend) -> (out, lse)``
    :func:`qfa.attention.op.quant_flash_attn`, all arguments positional.
``torch.ops.qfa.hif8_attention(q, k, v, q_scale, k_scale, v_scale, p_scale, cu_seqlens_q,
cu_seqlens_kv, seqused_q, seqused_kv, is_causal, scale, layout, calibration, smooth_k,
return_lse, backend) -> (out, lse)``
    The whole drop-in computation (scales, K smoothing, encode, attention, LSE correction):
    what :func:`qfa.hif8_attention` calls while ``torch.compile`` traces it. One opaque op keeps
    the data-dependent parts (scale rules, per-sequence means, the cast's own compiled kernels)
    out of the traced graph.

Each has a fake (meta) implementation that gives only shapes and dtypes. The ops are for
inference: no autograd formula is registered. ``lse`` is an empty fp32 tensor of shape (0,)
when not requested.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from qfa.cast import decode_from_hifloat8, encode_to_hifloat8


def _lse_shape(q: Tensor, layout: str) -> tuple:
    if layout == "BNSD":
        return (q.shape[0], q.shape[1], q.shape[2])
    if layout == "BSND":
        return (q.shape[0], q.shape[2], q.shape[1])
    return (q.shape[1], q.shape[0])  # TND: (Nq, Tq)


def _empty_lse(q: Tensor) -> Tensor:
    return q.new_empty((0,), dtype=torch.float32)


# ----------------------------------------------------------------------------- cast

@torch.library.custom_op("qfa::encode_hif8", mutates_args=())
def encode_hif8(x: Tensor, overflow: str = "saturate") -> Tensor:
    return encode_to_hifloat8(x.contiguous(), overflow=overflow).clone()


@encode_hif8.register_fake
def _(x: Tensor, overflow: str = "saturate") -> Tensor:
    return x.new_empty(x.shape, dtype=torch.uint8)


@torch.library.custom_op("qfa::decode_hif8", mutates_args=())
def decode_hif8(codes: Tensor, dtype: torch.dtype) -> Tensor:
    return decode_from_hifloat8(codes.contiguous(), dtype).clone()


@decode_hif8.register_fake
def _(codes: Tensor, dtype: torch.dtype) -> Tensor:
    return codes.new_empty(codes.shape, dtype=dtype)


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
    lse = q.new_empty(_lse_shape(q, layout), dtype=torch.float32) if return_softmax_lse else _empty_lse(q)
    return out, lse


# ----------------------------------------------------------------------------- the drop-in

@torch.library.custom_op("qfa::hif8_attention", mutates_args=())
def hif8_attention(
    q: Tensor, k: Tensor, v: Tensor, q_scale: Optional[Tensor], k_scale: Optional[Tensor],
    v_scale: Optional[Tensor], p_scale: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
    cu_seqlens_kv: Optional[Tensor], seqused_q: Optional[Tensor], seqused_kv: Optional[Tensor], is_causal: bool,
    scale: Optional[float], layout: str, calibration: str, smooth_k: bool, return_lse: bool,
    backend: Optional[str], rotate: bool = False,
) -> tuple[Tensor, Tensor]:
    from qfa.attention.dropin import hif8_attention_eager

    out, lse = hif8_attention_eager(q, k, v, q_scale, k_scale, v_scale, p_scale, cu_seqlens_q, cu_seqlens_kv,
                                    seqused_q, seqused_kv, is_causal, scale, layout, calibration, smooth_k,
                                    return_lse, backend, rotate)
    return out.contiguous(), lse.contiguous()


@hif8_attention.register_fake
def _(q, k, v, q_scale, k_scale, v_scale, p_scale, cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv,
      is_causal, scale, layout, calibration, smooth_k, return_lse, backend, rotate=False):
    out = q.new_empty(q.shape)
    lse = q.new_empty(_lse_shape(q, layout), dtype=torch.float32) if return_lse else _empty_lse(q)
    return out, lse
