"""``quant_flash_attn`` and ``quant_flash_attn_metadata``: QuantFlashAttn with upstream's current
argument names, in its three modes: HiF8 per-tensor (quant_mode 0; 7 is its older number), MXFP8
(1) and FP8 E4M3 per-token-head (6)."""

from __future__ import annotations

import torch

from qfa import _plain_memory, backends
from qfa.attention import known_calls, nz_layout
from qfa.attention.backends import cpu_kernel, paged, torch_path
from qfa.cast.api import as_codes
from qfa.tiling import attention as tiling
from qfa.tiling.attention import AttentionMetadata, AttentionPlan, plan_attention
from qfa.tiling.spec import HEAD_DIM, MaskMode, QuantMode

Metadata = AttentionMetadata | AttentionPlan


def quant_flash_attn_metadata(
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int = HEAD_DIM,
    quant_mode: int = QuantMode.HIF8_PER_TENSOR,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_kv: torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_kv: torch.Tensor | None = None,
    batch_size: int | None = None,
    max_seqlen_q: int = -1,
    max_seqlen_kv: int = -1,
    head_dim_v: int | None = None,
    mask_mode: int = MaskMode.NONE,
    win_left: int = -1,
    win_right: int = -1,
    layout_q: str | None = None,
    layout_q_descale: str | None = None,
    layout_kv: str | None = None,
    layout_out: str | None = None,
    is_grad_enabled: bool = False,
    layout: str | None = None,
) -> AttentionMetadata:
    """Plan once, run many: the call's schedule, for ``quant_flash_attn(..., metadata=...)``.

    Upstream's arguments (its metadata returns an int32 work split; qfa returns the plan object).
    This is where ``cu_seqlens`` / ``seqused`` are read on the host (one device synchronisation);
    every run with the metadata reuses those lengths and makes none. The lengths tensors passed to
    a run must be alike (dtype, shape) to those planned with; their values are not read again.
    Layouts as in :func:`quant_flash_attn` (``layout`` sets all three; default ``"BNSD"``).
    """
    layouts = tiling.resolve_layouts(layout, layout_q, layout_kv, layout_out, layout_q_descale, quant_mode)
    return tiling.plan_metadata(
        num_heads_q, num_heads_kv, head_dim, quant_mode, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
        seqused_q=seqused_q, seqused_kv=seqused_kv, batch_size=batch_size, max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv, head_dim_v=head_dim_v, mask_mode=mask_mode, win_left=win_left,
        win_right=win_right, layout=layouts.q, layout_q_descale=layouts.q_descale, is_grad_enabled=is_grad_enabled,
        layout_kv=layouts.kv, layout_out=layouts.out,
    )


def quant_flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_descale: torch.Tensor,
    k_descale: torch.Tensor,
    v_descale: torch.Tensor,
    quant_mode: int = QuantMode.HIF8_PER_TENSOR,
    *,
    block_table: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_kv: torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_kv: torch.Tensor | None = None,
    p_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    metadata: Metadata | None = None,
    softmax_scale: float | None = None,
    mask_mode: int = MaskMode.NONE,
    win_left: int = -1,
    win_right: int = -1,
    max_seqlen_q: int = -1,
    max_seqlen_kv: int = -1,
    layout_q: str | None = None,
    layout_q_descale: str | None = None,
    layout_kv: str | None = None,
    layout_out: str | None = None,
    return_softmax_lse: bool = False,
    layout: str | None = None,
    backend: str | None = None,
    _rotated_output: cpu_kernel.RotatedOutput | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention on 8-bit Q/K/V with their descales; bf16 output.

    The arguments below describe the HiF8 mode (quant_mode 0). Modes 1 and 6 take what
    ``docs/spec/quant-flash-attn.md`` lists (all checked, with the mode named in errors):

    * quant_mode 1, MXFP8: q, k, v ``torch.float8_e4m3fn``; q and out TND; k/v TND (with
      ``cu_seqlens_kv``) or paged ``PA_BBND`` / ``PA_BNBD`` (block size 64 .. 1024, a power of
      two); D in {64, 72, 128, 256}; E8M0 (``torch.float8_e8m0fnu``) descales in upstream's
      paired layouts (``PA_NZ`` too: converted to a PA_BNBD copy per call, see
      :mod:`qfa.attention.nz_layout`): q_descale (Tq, Nq, ceil(D/64), 2) (``layout_q_descale="TND"``) or
      (Nkv, Tq, G, ceil(D/64), 2) (``"N2TGD"``), k_descale per key and 32 channels, v_descale per
      channel and 32 keys of each sequence (``qfa.cast.mxfp8.quantize`` and ``pack_*_descale``
      make them). TND v_descale counts each sequence's stored keys (its cu_seqlens_kv segment).
    * quant_mode 6, FP8 per-token-head: q ``float8_e4m3fn`` in ``NTD`` (Nq, Tq, 128) with fp32
      q_descale (Nq, Tq) (``layout_q_descale="NT"``); k, v paged ``PA_BNBD`` (blocks, Nkv, 128,
      128) with fp32 k_descale (blocks, Nkv, 128) and v_descale (Nkv,); out TND
      (``qfa.cast.fp8.quantize_per_token_head`` / ``quantize_per_head``).

    In both, P is cast to E4M3 (nearest even, saturating at 448) with ``p_scale`` in [1, 448]:
    prefer values on the E4M3 grid (1, 104, 448), since a p_scale on a rounding midpoint (100)
    makes each row's largest P depend on exp's last bit. Softmax blocks are 512 keys
    (``qfa.tiling.spec.KEY_BLOCK``). Unset layouts are the mode's defaults. They run on the native
    kernel on CPU (:func:`qfa.attention.backends.cpu_kernel.forward_scaled`; the torch path,
    :mod:`qfa.attention.backends.scaled_torch_path`, where it is not built, with ``QFA_NATIVE=0``,
    or for a head dim its vectors do not divide) and the Triton kernel on devices.

    Args:
        q, k, v: HiF8 codes (``torch.uint8``, or ``torch_npu.hifloat8``) in one layout:
            ``BNSD`` (B, N, S, 128), ``BSND`` (B, S, N, 128) or ``TND`` (T, N, 128); k and v
            may instead be paged (``block_table``). GQA: the q head count is a multiple of the
            k/v head count; q head h reads kv head h // (Nq/Nkv).
        q_descale, k_descale, v_descale: fp32 tensors of shape (1,): the real value of a code is
            ``decode(code) * descale``. q and k descales are folded into the softmax scale.
        quant_mode: 0 (``QuantMode.HIF8_PER_TENSOR``); 7, its older number, is accepted.
        block_table: int32 (B, max blocks per sequence) for paged k / v (``layout_kv``
            ``PA_BBND``: (blocks, block_size, Nkv, 128); ``PA_BNBD``: (blocks, Nkv, block_size,
            128); block_size a multiple of 16 up to 1024), with ``seqused_kv``: row b lists the
            blocks of sequence b's keys in order. Bit for bit the call on those keys laid out
            contiguously.
        sinks, win_left, win_right: attention sinks and sliding windows (upstream's names); not
            supported: rejected unless None / -1.
        cu_seqlens_q, cu_seqlens_kv: int32 (B+1,) cumulative lengths with a leading 0; required
            for TND and rejected otherwise.
        seqused_q, seqused_kv: optional int32 (B,) used lengths per batch, in every layout (e.g.
            right padding); zero-length batches are allowed.
        p_scale: fp32 (1,) or None (1.0): where P lands on the HiF8 grid before P @ V. It cancels
            in the output and in the LSE; 1.0 is usually most accurate (3 mantissa bits near 1).
        attn_mask, mask_mode: mask_mode 0 is no mask; 3 is causal aligned bottom-right with the
            per-batch lengths (key j is masked for query i iff j > i + Skv_b - Sq_b). For mode 3
            an int8 [2048, 2048] compressed mask may be passed for upstream compatibility; the
            causal pattern is computed, never read from it.
        metadata: a plan from :func:`quant_flash_attn_metadata` (or the ``AttentionPlan`` of an
            earlier call): the tensors are checked against it (shapes, dtypes, devices) and its
            lengths are used without reading the length tensors again, so on a GPU the call makes
            no host synchronisation.
        softmax_scale: None means 1/sqrt(128) (the SDPA convention). Upstream's default is 1.0
            (``qfa.compat.cann_ops_transformer`` keeps upstream's defaults).
        max_seqlen_q, max_seqlen_kv: optional upper bounds of the used lengths (-1: not given);
            checked when given.
        layout_q, layout_kv, layout_out: per-operand layouts (upstream's names); in this mode
            all three must be equal, except a paged layout_kv. ``layout`` is the shorthand that
            sets all three; unset, they are ``"BNSD"``. ``layout_q_descale`` must be ``"BSND"`` (a per-tensor scale).
        return_softmax_lse: also return the natural-log LSE of the scaled scores, fp32
            (B, Nq, Sq) or (Nq, Tq) for TND; otherwise an empty tensor is returned in its place.
        backend: ``"torch"`` or ``"triton"``; None picks by device (``$QFA_BACKEND`` overrides).
            On CPU ``"torch"`` runs the native kernel where it is built (``QFA_NATIVE=0``: the
            pure-torch path; the same numbers up to fp32 summation order and exp's last bit).

    Every tensor argument is read through its own strides and storage offset: any view
    (transposed, sliced with a step, at an offset, expanded) gives the bits of its contiguous
    copy, except that paged k / v must not have a zero stride (their blocks would alias). Inputs
    are never modified.

    Returns:
        ``(out, lse)``: out is bf16 in q's layout and shape, rounded half away from zero. Rows
        that see no key (padding, or the first Sq - Skv rows of a causal call) give 0 and lse +inf.
    """
    key = None  # a call of the form known_calls runs: its key, to run or remember it
    if (metadata is None and block_table is None and cu_seqlens_q is None and cu_seqlens_kv is None
            and seqused_q is None and seqused_kv is None and p_scale is None and sinks is None and attn_mask is None
            and _unset(win_left) and _unset(win_right) and _unset(max_seqlen_q) and _unset(max_seqlen_kv)):
        key = known_calls.key_of(q, k, v, q_descale, k_descale, v_descale, quant_mode, mask_mode, softmax_scale,
                                 return_softmax_lse, (layout, layout_q, layout_kv, layout_out, layout_q_descale),
                                 backend)
        known = known_calls.plan_of(key) if key is not None else None
        if known is not None:
            result = known_calls.run(known, q, k, v, q_descale, k_descale, v_descale, _rotated_output)
            if result is not None:
                return result
    layouts = tiling.resolved_layouts(layout, layout_q, layout_kv, layout_out, layout_q_descale, quant_mode)
    if layouts.kv == "PA_NZ":  # MXFP8's NZ blocks: the same call on a PA_BNBD copy (bit for bit)
        mode = tiling.check_call_tensors(quant_mode, q, k, v, q_descale, k_descale, v_descale, p_scale)
        k, v, k_descale, v_descale = nz_layout.to_bnbd(mode, k, v, k_descale, v_descale)
        layouts = layouts._replace(kv="PA_BNBD")
    chosen, chosen_kv = layouts.q, layouts.kv
    if metadata is None:
        plan = plan_attention(
            q, k, v, q_descale, k_descale, v_descale, quant_mode, p_scale=p_scale, layout=chosen,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, seqused_q=seqused_q, seqused_kv=seqused_kv,
            attn_mask=attn_mask, mask_mode=mask_mode, softmax_scale=softmax_scale,
            return_softmax_lse=return_softmax_lse, block_table=block_table, sinks=sinks, win_left=win_left,
            win_right=win_right, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, layout_kv=chosen_kv,
            layout_out=layouts.out, layout_q_descale=layouts.q_descale,
        )
    else:
        plan = _plan_from_metadata(
            metadata, q, k, v, q_descale, k_descale, v_descale, quant_mode, p_scale, layouts, cu_seqlens_q,
            cu_seqlens_kv, seqused_q, seqused_kv, attn_mask, mask_mode, softmax_scale, return_softmax_lse,
            block_table, sinks, win_left, win_right, max_seqlen_q, max_seqlen_kv,
        )
    if plan.device.type == "meta":  # shapes only, as a meta tensor promises
        return plan.new_outputs()
    tensors = (q, k, v, q_descale, k_descale, v_descale, p_scale, block_table, cu_seqlens_q, cu_seqlens_kv, seqused_q,
               seqused_kv, attn_mask, sinks)
    if plan.meta.quant_mode != QuantMode.HIF8_PER_TENSOR:
        kernel = _scaled_backend(plan, backend, tensors)
        if kernel is cpu_kernel:
            # Fresh outputs, the descales read as values: no graph to keep out (no no_grad).
            # supports_scaled has just seen available() say True.
            return kernel.forward_scaled(plan, q, k, v, q_descale, k_descale, v_descale, p_scale,
                                         block_table=block_table, known_available=True)
        with torch.no_grad():
            return kernel.forward(plan, q, k, v, q_descale, k_descale, v_descale, p_scale, block_table=block_table)
    if q.dtype != torch.uint8:  # the plan checked that q, k and v share one HiF8 dtype
        q, k, v = as_codes(q, "q"), as_codes(k, "k"), as_codes(v, "v")
    kernel = _backend(plan, backend, tensors)
    if kernel is cpu_kernel and not plan.paged:  # reads the descales' values, builds no graph: no no_grad
        # _rotated_output: the HiF8 drop-in's epilogue (qfa.dropin.eager), for no one else
        result = kernel.forward(plan, q, k, v, q_descale, k_descale, v_descale, p_scale, known_available=True,
                                rotated=_rotated_output)
        if key is not None:  # a later call like this one runs on this plan
            known_calls.remember(key, plan)
        return result
    with torch.no_grad():  # an inference op: a descale that requires grad must not build a graph
        if not plan.paged:
            return kernel.forward(plan, q, k, v, q_descale, k_descale, v_descale, p_scale)
        if not getattr(kernel, "READS_PAGED_KV", False):  # contiguous K/V only: gather the blocks' codes
            flat_plan, k, v = paged.contiguous(plan, k, v, block_table)
            return kernel.forward(flat_plan, q, k, v, q_descale, k_descale, v_descale, p_scale)
        return kernel.forward(plan, q, k, v, q_descale, k_descale, v_descale, p_scale, block_table=block_table)


def _unset(value) -> bool:
    """An int argument at its -1 default (another type, even one equal to -1, takes its checks)."""
    return type(value) is int and value == -1


def _backend(plan: AttentionPlan, requested: str | None, tensors: tuple):
    """The HiF8 mode's kernel: Triton on devices; on CPU the native kernel where it builds and
    ``tensors`` (every tensor argument) are plain memory it may use (:mod:`qfa._plain_memory`),
    else the torch path (same contract)."""
    if backends.resolve(plan.device, requested) == "triton":
        from qfa.kernels import attention as kernel

        return kernel
    return cpu_kernel if plan.device.type == "cpu" and cpu_kernel.available() and _plain_memory.tensors(*tensors) \
        else torch_path


def _scaled_backend(plan: AttentionPlan, requested: str | None, tensors: tuple):
    """Modes 1 and 6: the Triton kernel on devices; on CPU the native kernel where it builds and
    takes the head dim (``cpu_kernel.forward_scaled``), else the torch path (same contract)."""
    if backends.resolve(plan.device, requested) == "triton":
        from qfa.kernels import scaled_attention as kernel
    elif cpu_kernel.supports_scaled(plan) and _plain_memory.tensors(*tensors):
        kernel = cpu_kernel
    else:
        from qfa.attention.backends import scaled_torch_path as kernel
    return kernel


def _plan_from_metadata(metadata, q, k, v, q_descale, k_descale, v_descale, quant_mode, p_scale, layouts,
                        cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv, attn_mask, mask_mode, softmax_scale,
                        return_softmax_lse, block_table, sinks, win_left, win_right, max_seqlen_q,
                        max_seqlen_kv) -> AttentionPlan:
    """The plan of a run with ready metadata: static checks only, no host read on devices."""
    if isinstance(metadata, AttentionPlan):
        metadata = metadata.meta
    if not isinstance(metadata, AttentionMetadata):
        raise TypeError(f"metadata must come from qfa.quant_flash_attn_metadata (or be an AttentionPlan), "
                        f"got {type(metadata).__name__}")
    if tiling.check_quant_mode(quant_mode) != metadata.quant_mode:
        raise ValueError(f"quant_mode must be the metadata's {int(metadata.quant_mode)}, got {quant_mode!r}")
    tiling.check_call_tensors(metadata.quant_mode, q, k, v, q_descale, k_descale, v_descale, p_scale)
    tiling.check_unsupported(win_left, win_right, sinks=sinks)
    for value, planned, name in ((max_seqlen_q, metadata.max_seqlen_q, "max_seqlen_q"),
                                 (max_seqlen_kv, metadata.max_seqlen_kv, "max_seqlen_kv")):
        if value not in (-1, planned):
            raise ValueError(f"{name} must be -1 or the metadata's {planned}, got {value!r}")
    tiling.check_against_metadata(metadata, layout=layouts.q, mask_mode=mask_mode, cu_seqlens_q=cu_seqlens_q,
                                  cu_seqlens_kv=cu_seqlens_kv, seqused_q=seqused_q, seqused_kv=seqused_kv,
                                  layout_kv=layouts.kv, layout_out=layouts.out, layout_q_descale=layouts.q_descale)
    tiling.check_call_devices(q, {"k": k, "v": v, "q_descale": q_descale, "k_descale": k_descale,
                                  "v_descale": v_descale, "p_scale": p_scale, "attn_mask": attn_mask})
    plan = tiling.bind(metadata, q, k, v, softmax_scale=softmax_scale, return_softmax_lse=return_softmax_lse,
                       attn_mask=attn_mask, block_table=block_table)
    reads_free = tiling.host_reads_are_free(q.device)
    if reads_free and plan.paged:  # first: the scale checks read the blocks the table names
        tiling.check_block_table_values(plan, block_table)
    tiling.check_call_scales(plan, q_descale, k_descale, v_descale, p_scale, read_values=reads_free,
                             block_table=block_table)
    return plan
