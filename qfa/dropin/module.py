"""``HiF8Attention``: :func:`qfa.hif8_attention` as a module, with dynamic or static scales."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional, Sequence, Union

import torch
from torch import nn

from qfa.dropin import calibration as cal
from qfa.dropin import distributed, inputs as dropin_inputs
from qfa.dropin.function import DEPRECATED_NAMES, _attention, take_deprecated
from qfa.dropin.call import DropinCall as _D
from qfa.dropin.smoothing import prepare, valid_parts
from qfa.tiling.attention import LAYOUTS
from qfa.tiling.checks import check_bool


class HiF8Attention(nn.Module):
    """:func:`hif8_attention` as a module, with dynamic or static (calibrated, frozen) scales.

    Dynamic mode (default): scales are computed on every call by ``calibration``.

    Static mode: observe representative batches, then freeze one scale per tensor into the
    buffers ``q_scale``, ``k_scale``, ``v_scale`` (fp32, shape (1,)); they travel with
    ``state_dict`` and a module that loads finite scales is frozen::

        attn = HiF8Attention(is_causal=True)
        with attn.calibrate():          # forward still computes attention (dynamic scales)...
            for q, k, v in samples:     # ...and records what it quantises
                attn(q, k, v)
        # leaving the block froze the scales (calibrate(freeze=False) leaves that to you)
        torch.save(attn.state_dict(), "attn.pt")

        served = HiF8Attention(is_causal=True)
        served.load_state_dict(torch.load("attn.pt"))   # now static: served.frozen is True

    :meth:`observe` records a batch without computing attention; :meth:`freeze` turns the
    observations into scales; :meth:`unfreeze` returns to dynamic mode. Static scales apply to
    the K that was observed, i.e. the smoothed (and rotated) K (keep the settings). Values
    outside a frozen scale's range saturate to HiF8's MAX.

    ``HiF8Attention(scales=(q_scale, k_scale, v_scale))`` starts static with those scales (as
    :meth:`set_scales` does). Static scales are the op's descales, so the op's valid ranges
    apply (see :func:`~qfa.dropin.function.hif8_attention`'s ``scales`` and ``p_scale``): each
    finite and > 0, ``softmax_scale * q_scale * k_scale <= FLT_MAX / (128 * 32768^2)``,
    ``v_scale * p_scale <= FLT_MAX / (1.25 * 32768 * Skv)``, ``p_scale`` in [2^-15, 2^15]. ``HiF8Attention(static=True)`` demands scales: calling it before
    they are frozen, set or loaded raises ``ValueError``. ``scale=`` is a deprecated alias of
    ``softmax_scale=``.

    ``process_group`` (tensor parallel, see :mod:`qfa.dropin.distributed`): this rank holds a
    contiguous range of the heads, and the group's ranks together hold all of them. Dynamic
    scales are then the whole tensors' (as :func:`hif8_attention`'s ``process_group``), and
    calibration reduces at :meth:`freeze` (every rank must freeze; the context manager does):
    for ``"amax"`` and ``"rms"`` the observers keep their rule's exact statistics (absolute
    maximum; float64 sum of squares and count), all-reduced over the group, so the frozen
    scales equal those of the unsharded module fed the same batches (bit for bit for
    ``"amax"``, and for ``"rms"`` except at a tie of log2(rms) with a half-integer). For
    pool-based rules (``"mse"``, user rules) the ranks' subsample pools are gathered in rank
    order and the rule runs on them: a sample of every shard, but the frozen scale then need
    not equal the unsharded module's. A frozen module runs no collective. The group is not part
    of the ``state_dict``.

    ``format="mxfp8"`` / ``"fp8"`` (see :func:`hif8_attention`): the module runs that format; its
    scales are computed per block / per token on every call, so there is nothing to calibrate,
    set or load: ``static=True``, ``scales=``, :meth:`calibrate`, :meth:`observe` and
    :meth:`set_scales` are ValueErrors there (as are ``rotate=True`` and a non-default
    ``calibration``), and the ``q_scale`` / ``k_scale`` / ``v_scale`` buffers stay NaN (a
    loaded state_dict with finite ones does not make such a module static).
    """

    def __init__(self, *, is_causal: bool = _D.is_causal, softmax_scale: Optional[float] = _D.softmax_scale,
                 layout: str = _D.layout, calibration: cal.RuleLike | None = _D.calibration,
                 smooth_k: bool = _D.smooth_k, p_scale: Union[float, torch.Tensor, None] = None,
                 backend: Optional[str] = _D.backend, static: bool = False, rotate: bool = _D.rotate,
                 scales: Optional[Sequence] = None,
                 process_group: Optional[distributed.ProcessGroup] = None, format: str = _D.format, **deprecated):
        super().__init__()
        self.format = dropin_inputs.check_format(format)
        self.process_group = distributed.check_process_group(process_group)
        if deprecated:
            softmax_scale = take_deprecated(deprecated, {"softmax_scale": softmax_scale}, "HiF8Attention")["softmax_scale"]
        # the deprecated spelling the caller used, if any: errors about the value use it
        self._said = {DEPRECATED_NAMES[old]: old for old in deprecated}
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS} (shared by q, k, v and out), got {layout!r}")
        for flag, name in ((is_causal, "is_causal"), (smooth_k, "smooth_k"), (static, "static"), (rotate, "rotate")):
            check_bool(flag, name)
        dropin_inputs.check_format_options(format, rotate=rotate, calibration=calibration)
        if static:
            self._check_has_per_tensor_scales("static=True")
        self.calibration = dropin_inputs.check_calibration(calibration)
        self.is_causal, self.layout = is_causal, layout
        self.softmax_scale = dropin_inputs.softmax_scale_value(softmax_scale,
                                                               self._said.get("softmax_scale", "softmax_scale"))
        self.smooth_k, self.p_scale, self.backend = smooth_k, p_scale, backend
        self.static, self.rotate = static, rotate
        for name in _SCALE_BUFFERS:
            self.register_buffer(name, torch.full((1,), math.nan, dtype=torch.float32))
        self._has_scales = False
        self._observers: Optional[tuple[cal.ScaleObserver, ...]] = None
        self.register_load_state_dict_post_hook(_after_load)
        if scales is not None:
            if not isinstance(scales, (tuple, list)) or len(scales) != 3:
                raise TypeError(f"scales must be a tuple (q_scale, k_scale, v_scale), got {type(scales).__name__}")
            self._set_scales(scales, dropin_inputs.SCALE_NAMES.values())

    def _check_has_per_tensor_scales(self, what: str) -> None:
        if self.format != "hif8":
            raise ValueError(f"{what}: static per-tensor scales are the HiF8 format's; format {self.format!r} "
                             "computes its per-block / per-token scales on every call (nothing to calibrate)")

    # -- state
    @property
    def frozen(self) -> bool:
        """True when forward uses the stored static scales."""
        return self.static and self._has_scales

    @property
    def calibrating(self) -> bool:
        return self._observers is not None

    def extra_repr(self) -> str:
        mode = "static" if self.static else "dynamic"
        return (f"layout={self.layout!r}, is_causal={self.is_causal}, calibration={self.calibration!r}, "
                f"smooth_k={self.smooth_k}, rotate={self.rotate}, mode={mode}, format={self.format!r}")

    def start_calibration(self) -> None:
        """Begin (or restart) recording batches for :meth:`freeze`."""
        self._check_has_per_tensor_scales("calibration")
        self._observers = tuple(cal.ScaleObserver(self.calibration, process_group=self.process_group)
                                for _ in range(3))

    def observe(self, q, k, v, *, cu_seqlens_q=None, cu_seqlens_kv=None, seqused_q=None, seqused_kv=None) -> None:
        """Record one batch's statistics (what would be quantised) without computing attention."""
        self._check_has_per_tensor_scales("observe()")
        lengths = (cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv)
        dropin_inputs.check_qkv(q, k, v, self.layout, *lengths)
        if q.device.type == "meta":
            raise ValueError("q, k and v are on the meta device, but calibration reads their values: observe "
                             "real tensors (forward on meta tensors outside calibrate() gives meta outputs)")
        dropin_inputs.check_length_values(q, k, self.layout, *lengths)
        if self._observers is None:
            self.start_calibration()
        tensors, _ = prepare(q, k, v, layout=self.layout, cu_seqlens_kv=cu_seqlens_kv, seqused_kv=seqused_kv,
                             smooth_k=self.smooth_k, rotate=self.rotate)
        parts = valid_parts(tensors, self.layout, cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv)
        for obs, part, name in zip(self._observers, parts, "qkv"):
            obs.observe(part, name)

    def freeze(self) -> "HiF8Attention":
        """Turn the observed batches into static scales (buffers) and switch to static mode."""
        if self._observers is None or self._observers[0].batches == 0:
            raise ValueError("freeze() needs observed batches: call observe() or run forward inside calibrate() first")
        scales = [obs.scale() for obs in self._observers]
        with torch.no_grad():
            for buf, s in zip((self.q_scale, self.k_scale, self.v_scale), scales):
                buf.copy_(s.to(buf.device))
        self._observers = None
        self._has_scales = True
        self.static = True
        return self

    def unfreeze(self) -> "HiF8Attention":
        """Back to dynamic scales (the stored buffers are kept but unused)."""
        self.static = False
        return self

    @contextlib.contextmanager
    def calibrate(self, freeze: bool = True) -> Iterator["HiF8Attention"]:
        """Record every forward's batch inside the block; freeze on a normal exit when ``freeze``."""
        self.start_calibration()
        try:
            yield self
        except BaseException:
            self._observers = None
            raise
        if freeze:
            self.freeze()

    def set_scales(self, q_scale, k_scale, v_scale) -> "HiF8Attention":
        """Set static scales by hand (positive floats or fp32 (1,) tensors) and switch to static mode."""
        return self._set_scales((q_scale, k_scale, v_scale), ("q_scale", "k_scale", "v_scale"))

    def _set_scales(self, scales, names) -> "HiF8Attention":
        """:meth:`set_scales` with errors naming the scales as the caller passed them: all three
        are checked before any buffer changes."""
        self._check_has_per_tensor_scales("set_scales() / scales=")
        checked = [cal.check_scale(s, n) for s, n in zip(scales, names)]
        with torch.no_grad():
            for buf, s in zip((self.q_scale, self.k_scale, self.v_scale), checked):
                buf.copy_(s.to(buf.device))
        self._has_scales = True
        self.static = True
        return self

    def _apply(self, fn, recurse: bool = True):
        """``.to(dtype)``, ``.half()``, ``.bfloat16()`` move the scales but keep them fp32: the op
        takes fp32 scales, and a cast would round them (to bf16: another output) or flush them
        (1e-8 to fp16's 0). Devices move as asked."""
        before = {name: self._buffers[name] for name in _SCALE_BUFFERS}
        super()._apply(fn, recurse)
        for name, kept in before.items():
            moved = self._buffers[name]
            if moved is not None and kept is not None and moved.dtype != kept.dtype:
                self._buffers[name] = kept.to(device=moved.device)
        return self

    # -- compute
    def forward(self, q, k, v, *, is_causal: Optional[bool] = None, cu_seqlens_q=None, cu_seqlens_kv=None,
                seqused_q=None, seqused_kv=None, return_softmax_lse: bool = _D.return_softmax_lse,
                metadata=None, **deprecated):
        """:func:`hif8_attention` with this module's settings (``is_causal`` overrides its own for
        one call; ``metadata`` as there); ``return_lse=`` is a deprecated alias of
        ``return_softmax_lse=``."""
        said = self._said
        if deprecated:
            return_softmax_lse = take_deprecated(deprecated, {"return_softmax_lse": return_softmax_lse},
                                                 "HiF8Attention.forward", stacklevel=5)["return_softmax_lse"]
            said = {**said, **{DEPRECATED_NAMES[old]: old for old in deprecated}}
        if self.calibrating:
            self.observe(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                         seqused_q=seqused_q, seqused_kv=seqused_kv)
        scales = None
        if self.static:
            if not self._has_scales:
                raise ValueError(
                    "this HiF8Attention is static but has no scales: calibrate and freeze() it, set_scales(), "
                    "pass scales= at construction, or load a state_dict with frozen scales"
                )
            scales = (self.q_scale, self.k_scale, self.v_scale)
        return _attention(
            q, k, v, is_causal=self.is_causal if is_causal is None else is_causal, softmax_scale=self.softmax_scale,
            layout=self.layout, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, seqused_q=seqused_q,
            seqused_kv=seqused_kv, calibration=self.calibration, smooth_k=self.smooth_k, p_scale=self.p_scale,
            scales=scales, return_softmax_lse=return_softmax_lse, backend=self.backend, rotate=self.rotate,
            metadata=metadata, process_group=self.process_group, format=self.format, said=said,
        )


#: The static per-tensor scales' buffers (fp32 (1,); NaN until set).
_SCALE_BUFFERS = ("q_scale", "k_scale", "v_scale")


def _after_load(module: HiF8Attention, incompatible_keys) -> None:
    """A loaded state_dict with finite scales freezes the module (static serving)."""
    if module.format != "hif8":
        return  # per-block / per-token scales: the buffers are never used
    bufs = (module.q_scale, module.k_scale, module.v_scale)
    finite = all(bool(torch.isfinite(b).all()) and bool((b > 0).all()) for b in bufs)
    module._has_scales = finite
    if finite:
        module.static = True
