"""fp32 ``a @ b.T`` for the torch path, through oneDNN on CPU.

torch's own fp32 matmul on CPU goes to its BLAS, which on this project's reference machine (an
AMD EPYC with AVX-512) runs at ~190 GFLOP/s on the attention's block shapes; oneDNN's fp32
kernels, the ones TorchInductor itself calls for linear layers, run the same shapes at ~420
(``python -m qfa bench attention`` measures the end-to-end effect). Both accumulate in fp32, so
they differ only in summation order. Elsewhere (no oneDNN, other devices) this is plain matmul.
"""

from __future__ import annotations

import torch

from qfa import _environ

#: ``QFA_ONEDNN=0`` sends the GEMMs to torch's default matmul instead.
ENV_VAR = "QFA_ONEDNN"
_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def onednn_enabled(device: torch.device) -> bool:
    return _LINEAR is not None and device.type == "cpu" and _environ.read(ENV_VAR, "1") != "0"


def matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` in fp32 for ``a`` (..., K) and 2-D ``b`` (N, K); either may be a strided view."""
    if onednn_enabled(a.device):
        return _LINEAR(a, b, None, "none", [], "")
    return a @ b.t()
