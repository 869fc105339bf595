"""Encoding into a KV cache with a frozen per-tensor scale: saturating, and counted.

A KV cache fixes each layer's scale when its first tokens arrive; later tokens are encoded with
that scale. Values beyond HiF8's range then saturate to +-MAX (the encode's default) instead of
becoming Inf: :func:`encode` reports how many did, so a bad calibration is visible.
"""

from __future__ import annotations

import torch

from qfa.dropin import calibration as cal
from qfa.cast import format as fmt


def encode(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, saturated)``: the HiF8 codes of ``x / scale`` (saturating) and the number of
    finite elements whose magnitude reached the overflow threshold (those clamped to +-MAX), as
    a 0-d int64 tensor on x's device (a cache adds them up there: no device sync per token)."""
    codes = cal.quantize(x, scale)
    scaled = x.detach().float() / cal.check_scale(scale, "scale", x.device)  # quantize's own division
    saturated = ((scaled.abs() >= fmt.OVERFLOW_THRESHOLD) & torch.isfinite(scaled)).sum()
    return codes, saturated
