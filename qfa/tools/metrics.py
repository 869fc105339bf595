"""Error of an attention output (or any tensor) against a reference, as every tool reports it.

All three figures are computed in float64 on the flattened tensors, so the metric itself adds no
rounding worth mentioning next to the fp8 errors it measures.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ErrorMetrics(NamedTuple):
    """``(cosine, rel_l2, max_abs)`` of an output against its reference."""

    cosine: float
    rel_l2: float
    max_abs: float


def error_metrics(out: torch.Tensor, ref: torch.Tensor) -> ErrorMetrics:
    """Cosine similarity, relative L2 error ``|out - ref| / |ref|`` and max abs error of ``out``."""
    if out.shape != ref.shape:
        raise ValueError(f"out and ref must have the same shape, got {tuple(out.shape)} and {tuple(ref.shape)}")
    o, r = out.double().flatten(), ref.double().flatten()
    diff = o - r
    cosine = torch.nn.functional.cosine_similarity(o, r, dim=0).item()
    return ErrorMetrics(cosine, (diff.norm() / r.norm()).item(), diff.abs().max().item())


def relative_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``|out - ref| / |ref|`` in float64."""
    return error_metrics(out, ref).rel_l2
