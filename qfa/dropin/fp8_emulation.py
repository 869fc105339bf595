"""A per-tensor FP8 E4M3 attention emulation: the baseline HiF8 is measured against.

The FlashAttention-3 FP8 recipe: Q, K and V each quantised to E4M3 with one scale (amax / 448),
scores from the exact products in fp32, P = exp(S - rowmax) scaled by 448 (E4M3's MAX) and cast
to E4M3 before P @ V, the row sum taken from the unquantised P. Rows are processed in chunks
so memory stays bounded. It takes float BNSD tensors (GQA by head counts), like SDPA.
"""

from __future__ import annotations

import torch

from qfa.dropin import rotation
from qfa.cast.fp8 import E4M3, E4M3_MAX
from qfa.tiling.spec import default_softmax_scale

_ROW_CHUNK = 1024


def fake_quant_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to E4M3 with one per-tensor scale amax / 448, returned dequantised in fp32."""
    x = x.float()
    amax = x.abs().amax()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (x / scale).to(E4M3).float() * scale


def fp8_e4m3_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False, scale: float | None = None,
    smooth_k: bool = False, rotate: bool = False,
) -> torch.Tensor:
    """Attention with per-tensor E4M3 Q/K/V and P; float BNSD in, fp32 BNSD out.

    ``smooth_k`` subtracts the per-head, per-channel mean of K over the keys first (exact for
    softmax), and ``rotate`` applies the same Hadamard rotation as :func:`qfa.hif8_attention`
    does, so that comparisons with HiF8 are like for like.
    """
    B, Nq, Sq, D = q.shape
    Nkv, Skv = k.shape[1], k.shape[2]
    scale = default_softmax_scale(D) if scale is None else scale
    if smooth_k:
        k = k.float() - k.float().mean(dim=2, keepdim=True)
    if rotate:
        q, k, v = rotation.rotate(q), rotation.rotate(k), rotation.rotate(v)
    qf, kf, vf = fake_quant_e4m3(q), fake_quant_e4m3(k), fake_quant_e4m3(v)
    group = Nq // Nkv
    kf = kf.repeat_interleave(group, dim=1)
    vf = vf.repeat_interleave(group, dim=1)
    out = torch.empty(B, Nq, Sq, D, device=q.device)
    keys = torch.arange(Skv, device=q.device)
    for r0 in range(0, Sq, _ROW_CHUNK):
        r1 = min(Sq, r0 + _ROW_CHUNK)
        s = qf[:, :, r0:r1] @ kf.transpose(-1, -2) * scale
        if is_causal:  # bottom-right aligned, like the HiF8 op
            rows = torch.arange(r0, r1, device=q.device).unsqueeze(-1)
            s = s.masked_fill(keys > rows + (Skv - Sq), float("-inf"))
        m = s.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
        p = torch.exp(s - m)
        l = p.sum(dim=-1, keepdim=True)
        p8 = (p * E4M3_MAX).to(E4M3).float() / E4M3_MAX
        out[:, :, r0:r1] = torch.where(l > 0, (p8 @ vf) / l.clamp_min(1e-30), torch.zeros((), device=q.device))
    return rotation.rotate(out) if rotate else out
