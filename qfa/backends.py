"""Which backend runs an op: a small registry keyed by device, overridable by the caller.

``torch`` runs anywhere torch runs and is the golden reference. ``triton`` runs the kernels in
``qfa.kernels``: on CUDA with upstream Triton, on Ascend NPUs with triton-ascend, and on CPU
only under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests run it.
"""

from __future__ import annotations

import importlib.util

import torch

from qfa import _environ

BACKENDS = ("torch", "triton")
ENV_VAR = "QFA_BACKEND"
#: Device types whose default is the Triton kernels (when Triton is installed).
_TRITON_DEVICES = ("cuda", "npu")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    return _environ.read("TRITON_INTERPRET", "0") not in ("", "0")


def resolve(device: torch.device, requested: str | None = None) -> str:
    """The backend for tensors on ``device``: ``requested``, else ``$QFA_BACKEND``, else by device."""
    source = "backend"
    if requested is None:
        requested = _environ.read(ENV_VAR, "") or None
        source = ENV_VAR
    if requested is None:
        return "triton" if device.type in _TRITON_DEVICES and triton_available() else "torch"
    if requested not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS}, got {requested!r}")
    if requested == "triton":
        if not triton_available():
            raise ValueError(f"{source}='triton' needs the triton package: pip install 'qfa[triton]'")
        if device.type == "cpu" and not triton_interpreting():
            raise ValueError(
                f"{source}='triton' on CPU tensors needs TRITON_INTERPRET=1 (Triton's interpreter); "
                "use backend='torch' for CPU work"
            )
    return requested
