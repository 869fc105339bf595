"""The drop-in's computation on a checked :class:`DropinCall`: smooth, rotate, scale, quantise,
call ``quant_flash_attn``, rotate back, correct the LSE.

This is what the custom op ``qfa::hif8_attention`` runs, and what :func:`qfa.hif8_attention`
runs directly outside ``torch.compile``. Everything data-dependent is here (the values of
cu_seqlens and seqused, the calibration rules, the per-sequence means), out of any traced graph.
"""

from __future__ import annotations

import torch

from qfa.attention import calibration as cal
from qfa.attention import rotation
from qfa.attention.dropin_call import DropinCall
from qfa.attention.dropin_inputs import check_length_values
from qfa.attention.op import quant_flash_attn
from qfa.attention.smoothing import lse_shift, prepare, valid_parts
from qfa.tiling.spec import MaskMode, QuantMode, default_softmax_scale


def _scales(c: DropinCall, tensors) -> list[torch.Tensor]:
    """The given static scales (checked), the others from the calibration rule on valid values."""
    rule = cal.get_rule(c.calibration)
    parts = valid_parts(tensors, c.layout, c.cu_seqlens_q, c.cu_seqlens_kv, c.seqused_q, c.seqused_kv)
    out = []
    for part, t, s, name in zip(parts, tensors, (c.q_scale, c.k_scale, c.v_scale), ("q", "k", "v")):
        if s is None:
            out.append(cal.check_scale(rule(part), f"{name} scale from calibration rule"))
        else:
            out.append(cal.check_scale(s, f"{name}_scale", t.device))
    return out


def run(c: DropinCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one call; ``lse`` is an empty fp32 (0,) tensor unless requested."""
    check_length_values(c.q, c.k, c.layout, c.cu_seqlens_q, c.cu_seqlens_kv, c.seqused_q, c.seqused_kv)
    tensors, mu = prepare(c.q, c.k, c.v, layout=c.layout, cu_seqlens_kv=c.cu_seqlens_kv, seqused_kv=c.seqused_kv,
                          smooth_k=c.smooth_k, rotate=c.rotate)
    scales = _scales(c, tensors)
    codes = [cal.quantize(t, s) for t, s in zip(tensors, scales)]
    del tensors
    softmax_scale = default_softmax_scale(c.q.shape[-1]) if c.softmax_scale is None else c.softmax_scale
    out, lse = quant_flash_attn(
        *codes, *scales, QuantMode.HIF8_PER_TENSOR, p_scale=c.p_scale, layout=c.layout,
        cu_seqlens_q=c.cu_seqlens_q, cu_seqlens_kv=c.cu_seqlens_kv, seqused_q=c.seqused_q, seqused_kv=c.seqused_kv,
        mask_mode=MaskMode.CAUSAL if c.is_causal else MaskMode.NONE, softmax_scale=softmax_scale,
        return_softmax_lse=c.return_softmax_lse, backend=c.backend,
    )
    out = (rotation.rotate(out) if c.rotate else out).to(c.q.dtype)  # H is its own inverse
    if not c.return_softmax_lse:
        return out, c.q.new_empty((0,), dtype=torch.float32)
    if mu is not None:
        shift = lse_shift(c.q, mu, c.layout, c.cu_seqlens_q, softmax_scale)
        lse = torch.where(torch.isinf(lse), lse, lse + shift)  # rows that see no key keep +inf
    return out, lse
