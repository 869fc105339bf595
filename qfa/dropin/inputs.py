"""The drop-in's argument checks on float inputs, before any work on them.

The rules the drop-in shares with ``quant_flash_attn`` (shapes, per-sequence lengths, devices,
softmax_scale, p_scale) are the op's own, from ``qfa.tiling``: the same mistake gets the same
message from both. What is the drop-in's alone (float dtypes, the per-tensor scales, the
calibration rule, the ``format`` and what each format takes) is here. Nothing but
:func:`check_length_values` reads a tensor's value, so ``torch.compile`` traces the rest; that
one runs in the computation, before the K means use the lengths (inside the custom op under
``torch.compile``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from qfa.dropin import calibration as cal
from qfa.dropin.call import FORMAT_MODES, FORMATS
from qfa.tiling import checks
from qfa.tiling.attention import MAX_BATCH, check_shapes
from qfa.tiling.spec import HEAD_DIMS


def check_qkv(q, k, v, layout: str, cu_seqlens_q=None, cu_seqlens_kv=None, seqused_q=None,
              seqused_kv=None, format: str = "hif8") -> int:
    """Float q, k, v of one dtype on one device, the op's shape and length rules (the head
    sizes of ``format``'s mode); returns B."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        checks.check_float_tensor(t, name)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    checks.check_device(k, "k", q.device)
    checks.check_device(v, "v", q.device)
    check_shapes(q, k, v, layout, head_dims=HEAD_DIMS[FORMAT_MODES[format]])
    return checks.check_sequence_lengths(layout, batch=None if layout == "TND" else q.shape[0], device=q.device,
                                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                                         seqused_q=seqused_q, seqused_kv=seqused_kv, max_batch=MAX_BATCH)


def check_length_values(q, k, layout: str, cu_seqlens_q=None, cu_seqlens_kv=None, seqused_q=None,
                        seqused_kv=None) -> None:
    """The values of cu_seqlens and seqused (a host read), by the op's rules and messages."""
    if layout == "TND":
        batch = cu_seqlens_q.shape[0] - 1
        q_lens = checks.cumulative_lengths(checks.int32_vector(cu_seqlens_q, "cu_seqlens_q", batch + 1),
                                           "cu_seqlens_q", q.shape[0])
        kv_lens = checks.cumulative_lengths(checks.int32_vector(cu_seqlens_kv, "cu_seqlens_kv", batch + 1),
                                            "cu_seqlens_kv", k.shape[0])
    else:
        seq_axis = 2 if layout == "BNSD" else 1
        q_lens, kv_lens = [q.shape[seq_axis]] * q.shape[0], [k.shape[seq_axis]] * q.shape[0]
    for lens, used, name in ((q_lens, seqused_q, "seqused_q"), (kv_lens, seqused_kv, "seqused_kv")):
        if used is not None:
            checks.apply_seqused(lens, checks.int32_vector(used, name, len(lens)), name)


def softmax_scale_value(softmax_scale, name: str = "softmax_scale") -> Optional[float]:
    """``softmax_scale`` as a float (None stays None: the op's default 1/sqrt(D) applies);
    ``name``: what the caller called it (``scale`` for the deprecated alias)."""
    return None if softmax_scale is None else checks.check_positive_float(softmax_scale, name)


def p_scale_tensor(p_scale, device: torch.device) -> Optional[torch.Tensor]:
    """``p_scale`` as the op takes it: None, or an fp32 (1,) tensor (a number is put in one).
    Its value is the op's to check, so the rule (and its message) stays in one place."""
    if p_scale is None:
        return None
    if isinstance(p_scale, torch.Tensor):
        checks.check_device(p_scale, "p_scale", device)
        return checks.check_scalar_fp32(p_scale, "p_scale")
    if isinstance(p_scale, bool) or not isinstance(p_scale, (int, float)):
        raise TypeError(f"p_scale must be None, a float or an fp32 tensor of shape (1,), got {type(p_scale).__name__}")
    return torch.full((1,), float(p_scale), dtype=torch.float32, device=device)


def scale_tensor(s, name: str, device: torch.device) -> Optional[torch.Tensor]:
    """A static per-tensor scale as an fp32 (1,) tensor; a tensor's value is checked later, in
    the computation (``calibration.check_scale``), where reading it costs no graph break."""
    if s is None:
        return None
    if isinstance(s, torch.Tensor):
        if s.numel() != 1 or not s.is_floating_point():
            raise ValueError(f"{name} must be a float or a floating tensor with one element, got {s.dtype} {tuple(s.shape)}")
        if s.device.type == "meta" and device.type != "meta":
            raise ValueError(f"{name} is on the meta device, which holds no value, and q is on {device}: pass a "
                             f"float or a tensor with a value")
        return s.reshape(1).to(device=device, dtype=torch.float32)
    if isinstance(s, bool) or not isinstance(s, (int, float)):
        raise TypeError(f"{name} must be None, a float or an fp32 tensor of shape (1,), got {type(s).__name__}")
    return cal.check_scale(s, name, device)


#: What errors call the entries of ``scales=`` (the caller passed ``scales``, not ``q_scale``).
SCALE_NAMES = {"q": "scales[0] (q_scale)", "k": "scales[1] (k_scale)", "v": "scales[2] (v_scale)"}


def static_scales(scales: Optional[Sequence], device: torch.device) -> tuple[Optional[torch.Tensor], ...]:
    """``scales=(q_scale, k_scale, v_scale)`` as three fp32 (1,) tensors or None (computed)."""
    if scales is None:
        return (None, None, None)
    if not isinstance(scales, (tuple, list)) or len(scales) != 3:
        raise TypeError(f"scales must be a tuple (q_scale, k_scale, v_scale); each may be None (computed), got {_describe(scales)}")
    return tuple(scale_tensor(s, n, device) for s, n in zip(scales, SCALE_NAMES.values()))


def _describe(value) -> str:
    size = f" of length {len(value)}" if isinstance(value, (tuple, list)) else ""
    return f"{type(value).__name__}{size}"


def check_calibration(calibration: cal.RuleLike | None) -> cal.RuleLike:
    """A registered rule's name or a callable (None: the default rule); unknown names fail here."""
    if calibration is None:
        return cal.DEFAULT_RULE
    cal.get_rule(calibration)  # ValueError for an unknown name, TypeError for anything else
    return calibration


def check_format(format) -> str:
    """``format`` if it is one of :data:`~qfa.dropin.call.FORMATS`."""
    if not isinstance(format, str):
        raise TypeError(f"format must be a str, one of {FORMATS}, got {type(format).__name__}")
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    return format


def check_format_options(format: str, *, rotate: bool = False, scales=None, calibration=None,
                         metadata=None) -> None:
    """What only the HiF8 format takes. MXFP8 and FP8 compute their per-block / per-token scales
    from the values on every call, so per-tensor scales (static ``scales``, a ``calibration``
    rule) have nothing to apply to, and the Hadamard rotation (which exists to even out a
    per-tensor scale) is HiF8's option; a ``metadata`` plan is of the caller's mode-0 call,
    while these formats repack q/k/v and plan their own. Each is a ValueError, not ignored."""
    if format == "hif8":
        return
    why = f"format {format!r} computes its scales on the fly (per 32 values or per token)"
    if rotate:
        raise ValueError(f"rotate=True is the HiF8 format's option (the rotation evens out a per-tensor scale); "
                         f"{why}: pass rotate=False (qfa.{format}_attention does)")
    if scales is not None:
        raise ValueError(f"scales=(q_scale, k_scale, v_scale) are the HiF8 format's per-tensor scales; {why}: "
                         f"pass scales=None")
    if calibration is not None and calibration != cal.DEFAULT_RULE:
        raise ValueError(f"calibration={calibration!r} chooses the HiF8 format's per-tensor scales; {why}: "
                         f"leave calibration unset")
    if metadata is not None:
        raise ValueError(f"metadata plans the HiF8 format's call in the caller's layout; format {format!r} repacks "
                         f"q, k and v for its own mode and plans that itself: pass metadata=None")
