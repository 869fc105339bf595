"""The drop-in's computation on a checked :class:`DropinCall`: smooth, rotate, scale, quantise,
call ``quant_flash_attn``, rotate back, correct the LSE. The HiF8 format's scales and call are
here; MXFP8's and FP8's (scales per block / per token, computed on the fly) are
:mod:`qfa.dropin.scaled`. Smoothing, the output cast and the LSE correction are one
code path for every format.

This is what the custom op ``qfa::hif8_attention`` runs, and what :func:`qfa.hif8_attention`
runs directly outside ``torch.compile``. Everything data-dependent is here (the values of
cu_seqlens and seqused, the calibration rules, the per-sequence means), out of any traced graph.
"""

from __future__ import annotations

import torch

from qfa.dropin import calibration as cal
from qfa.dropin import distributed, prepare as fused, rotation, scaled as dropin_scaled
from qfa.dropin.call import DropinCall
from qfa.dropin.inputs import SCALE_NAMES, check_length_values
from qfa.attention.backends import cpu_kernel
from qfa.attention.op import Metadata, quant_flash_attn
from qfa.dropin.smoothing import lse_shift, prepare, valid_parts, valid_values
from qfa.tiling.attention import lse_shape
from qfa.tiling.spec import MaskMode, QuantMode, default_softmax_scale

_LENGTHS = ("cu_seqlens_q", "cu_seqlens_kv", "seqused_q", "seqused_kv")


def static_scale(s: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    """A given scale of tensor ``name`` ("q", "k" or "v"), checked (positive, finite)."""
    return cal.check_scale(s, SCALE_NAMES[name], device)


def _scales(c: DropinCall, tensors, process_group: distributed.ProcessGroup | None = None) -> list[torch.Tensor]:
    """The given static scales (checked), the others from the calibration rule on valid values
    (with ``process_group``: on the valid values of the whole tensor whose head shards the
    group's ranks hold, see :func:`qfa.dropin.calibration.sharded_scale`)."""
    rule = cal.get_rule(c.calibration)
    parts = valid_parts(tensors, c.layout, c.cu_seqlens_q, c.cu_seqlens_kv, c.seqused_q, c.seqused_kv)
    lengths = ((c.seqused_q, c.cu_seqlens_q), (c.seqused_kv, c.cu_seqlens_kv), (c.seqused_kv, c.cu_seqlens_kv))
    out = []
    for part, t, s, name, (used, cu) in zip(parts, tensors, (c.q_scale, c.k_scale, c.v_scale), ("q", "k", "v"),
                                            lengths):
        if s is not None:
            out.append(static_scale(s, name, t.device))
        elif process_group is None:
            cal.check_finite(part, name)  # before the rule, so the message names the tensor
            out.append(cal.check_scale(rule(part), f"{name} scale from calibration rule"))
        else:
            # The lengths are per sequence, shared by all heads: the gathered tensor's valid
            # values are selected as an unsharded call selects them.
            def whole(t=t, used=used, cu=cu):
                return valid_values(distributed.gather_heads(t, distributed.head_axis(c.layout), process_group),
                                    c.layout, used, cu)
            out.append(cal.sharded_scale(rule, part, name, process_group, whole))
    return out


def empty_outputs(c: DropinCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised ``(out, lse)`` of the call's shapes and dtypes (what the fake and a meta
    call return)."""
    shape = lse_shape(c.q.shape, c.layout) if c.return_softmax_lse else (0,)
    return c.q.new_empty(c.q.shape), c.q.new_empty(shape, dtype=torch.float32)


def saturating_cast(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` in ``dtype``, finite values clamped to its largest finite magnitude.

    The exact output is a convex combination of V's rows, so it fits V's dtype; the quantised
    one can exceed it by HiF8's rounding (up to 2^-4 relative where the bulk of V lies: fp16
    V = 64000 quantises to 65536, past fp16's 65504), and IEEE rounding would make that inf.
    Saturating gives the representable value nearest the exact answer. NaN and +-Inf (from
    NaN/Inf inputs) stay as they are.
    """
    if out.dtype == dtype:
        return out
    limit = torch.finfo(dtype).max
    if torch.finfo(out.dtype).max > limit:
        out = out.float()  # bf16 cannot hold fp16's limit (65504 rounds to 65536 there)
        out = torch.where(torch.isinf(out), out, out.clamp(-limit, limit))
    return out.to(dtype)


def _hif8(c: DropinCall, tensors, softmax_scale: float, metadata: Metadata | None,
          process_group: distributed.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The HiF8 format: per-tensor scales (static or from the calibration rule), quant_mode 0."""
    scales = _scales(c, tensors, process_group)
    codes = [cal.quantize(t, s) for t, s in zip(tensors, scales)]
    return _hif8_op(c, codes, scales, softmax_scale, metadata)


def _hif8_op(c: DropinCall, codes, scales, softmax_scale: float, metadata: Metadata | None,
             rotated: cpu_kernel.RotatedOutput | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return quant_flash_attn(
        *codes, *scales, QuantMode.HIF8_PER_TENSOR, p_scale=c.p_scale, layout=c.layout,
        cu_seqlens_q=c.cu_seqlens_q, cu_seqlens_kv=c.cu_seqlens_kv, seqused_q=c.seqused_q, seqused_kv=c.seqused_kv,
        mask_mode=MaskMode.CAUSAL if c.is_causal else MaskMode.NONE, softmax_scale=softmax_scale,
        return_softmax_lse=c.return_softmax_lse, backend=c.backend, metadata=metadata, _rotated_output=rotated,
    )


def run(c: DropinCall, metadata: Metadata | None = None,
        process_group: distributed.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one call; ``lse`` is an empty fp32 (0,) tensor unless requested.

    ``process_group``: a checked tensor-parallel group whose ranks hold contiguous head shards
    of the call (None: the call is the whole tensor); the computed scales are then the whole
    tensor's. Eager only (a group cannot cross the custom op).

    ``metadata``: a plan of the op for the call's (quantised) tensors and length tensors, as
    :func:`qfa.quant_flash_attn_metadata` makes it; the length values are then not read again
    (the caller vouches that they are those it was planned with). Meta tensors give meta
    outputs, as the op does (length tensors on the meta device are an error: their values are
    read)."""
    if c.q.device.type == "meta":
        for name in _LENGTHS:
            if getattr(c, name) is not None:
                raise ValueError(f"{name} is on the meta device, but the drop-in reads its values: pass real "
                                 f"tensors (or no {name}) to get meta outputs")
        return empty_outputs(c)
    if metadata is None:
        check_length_values(c.q, c.k, c.layout, c.cu_seqlens_q, c.cu_seqlens_kv, c.seqused_q, c.seqused_kv)
    softmax_scale = default_softmax_scale(c.q.shape[-1]) if c.softmax_scale is None else c.softmax_scale
    if c.q.device.type == "cpu" and c.backend != "triton":
        # The op will need the kernel: a first call builds it beside the preparation's build
        # (both compile at once instead of one after the other).
        cpu_kernel.start_build()
    # HiF8 on CPU: two native passes per tensor, no float copies (qfa.dropin.prepare); else
    # the materialised tensors (the same definitions in torch ops).
    done = fused.quantized_inputs(c, static_scale) if process_group is None else None
    rotated = None
    if done is not None:
        codes, scales, mu = done
        # The native kernel un-rotates the output as it writes it (where it runs: the op says)
        rotated = cpu_kernel.RotatedOutput(c.q.dtype, fused.ROTATION_C) if c.rotate else None
        out, lse = _hif8_op(c, codes, scales, softmax_scale, metadata, rotated)
        del codes
    else:
        tensors, mu = prepare(c.q, c.k, c.v, layout=c.layout, cu_seqlens_kv=c.cu_seqlens_kv,
                              seqused_kv=c.seqused_kv, smooth_k=c.smooth_k, rotate=c.rotate)
        if c.format == "hif8":
            out, lse = _hif8(c, tensors, softmax_scale, metadata, process_group)
        else:  # per-block / per-token scales: nothing to reduce across a process group's head shards
            out, lse = dropin_scaled.run(c, tensors)
        del tensors
    if rotated is not None and rotated.applied:
        restored = out
    else:
        restored = fused.restore_output(out, c.q.dtype) if c.rotate else None  # H is its own inverse
    if restored is None:
        restored = saturating_cast(rotation.rotate(out) if c.rotate else out, c.q.dtype)
    out = restored
    if not c.return_softmax_lse:
        return out, c.q.new_empty((0,), dtype=torch.float32)
    if mu is not None:
        shift = lse_shift(c.q, mu, c.layout, c.cu_seqlens_q, softmax_scale)
        lse = torch.where(torch.isinf(lse), lse, lse + shift)  # rows that see no key keep +inf
    return out, lse
