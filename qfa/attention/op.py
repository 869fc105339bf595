"""``quant_flash_attn``: QuantFlashAttn in HiF8 per-tensor mode (quant_mode 7)."""

from __future__ import annotations

import torch

from qfa import backends
from qfa.cast.api import as_codes
from qfa.tiling.attention import plan_attention


def quant_flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_descale: torch.Tensor,
    k_descale: torch.Tensor,
    v_descale: torch.Tensor,
    quant_mode: int = 7,
    *,
    p_scale: torch.Tensor | None = None,
    layout: str = "BNSD",
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_kv: torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_kv: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    mask_mode: int = 0,
    softmax_scale: float | None = None,
    return_softmax_lse: bool = False,
    backend: str | None = None,
    block_table: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill attention on HiF8 Q/K/V with fp32 per-tensor descales; bf16 output.

    Args:
        q, k, v: HiF8 codes (``torch.uint8``, or ``torch_npu.hifloat8``) in one layout:
            ``BNSD`` (B, N, S, 128), ``BSND`` (B, S, N, 128) or ``TND`` (T, N, 128). GQA: the
            q head count is a multiple of the k/v head count; q head h reads kv head h // (Nq/Nkv).
        q_descale, k_descale, v_descale: fp32 tensors of shape (1,): the real value of a code is
            ``decode(code) * descale``. q and k descales are folded into the softmax scale.
        quant_mode: 7 (HiF8 per-tensor); 0, upstream's newer number for it, is accepted.
        p_scale: fp32 (1,) or None (1.0): where P lands on the HiF8 grid before P @ V. It cancels
            in the output and in the LSE; 1.0 is usually most accurate (3 mantissa bits near 1).
        layout: ``"BNSD"``, ``"BSND"`` or ``"TND"``, shared by q, k, v and the output.
        cu_seqlens_q, cu_seqlens_kv: int32 (B+1,) cumulative lengths with a leading 0; required
            for TND and rejected otherwise.
        seqused_q, seqused_kv: optional int32 (B,) used lengths per batch, in every layout (e.g.
            right padding); zero-length batches are allowed.
        attn_mask, mask_mode: mask_mode 0 is no mask; 3 is causal aligned bottom-right with the
            per-batch lengths (key j is masked for query i iff j > i + Skv_b - Sq_b). For mode 3
            an int8 [2048, 2048] compressed mask may be passed for upstream compatibility; the
            causal pattern is computed, never read from it.
        softmax_scale: None means 1/sqrt(128) (the SDPA convention). Upstream's default is 1.0.
        return_softmax_lse: also return the natural-log LSE of the scaled scores, fp32
            (B, Nq, Sq) or (Nq, Tq) for TND; otherwise an empty tensor is returned in its place.
        backend: ``"torch"`` or ``"triton"``; None picks by device (``$QFA_BACKEND`` overrides).
        block_table, sinks: paged KV and attention sinks; not supported in this mode (rejected).

    Returns:
        ``(out, lse)``: out is bf16 in q's layout and shape, rounded half away from zero. Rows
        that see no key (padding, or the first Sq - Skv rows of a causal call) give 0 and lse +inf.
    """
    plan = plan_attention(
        q, k, v, q_descale, k_descale, v_descale, quant_mode, p_scale=p_scale, layout=layout,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, seqused_q=seqused_q, seqused_kv=seqused_kv,
        attn_mask=attn_mask, mask_mode=mask_mode, softmax_scale=softmax_scale,
        return_softmax_lse=return_softmax_lse, block_table=block_table, sinks=sinks,
    )
    q, k, v = as_codes(q, "q"), as_codes(k, "k"), as_codes(v, "v")
    if backends.resolve(q.device, backend) == "triton":
        from qfa.kernels import attention as kernel
    else:
        from qfa.attention import torch_path as kernel
    return kernel.forward(plan, q, k, v, q_descale, k_descale, v_descale, p_scale)
