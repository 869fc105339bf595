"""Which backend runs an op (``qfa.backends.resolve``), and that the op really goes there."""

from __future__ import annotations

import types

import pytest
import torch

import attention_reference as ref
from qfa import backends
from qfa.attention import quant_flash_attn, torch_path

D = 128


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.setenv("QFA_COMPILE", "0")  # eager: one small call, no compile


@pytest.mark.parametrize("triton_installed", [True, False])
def test_default_backend_by_device(monkeypatch, triton_installed):
    """CPU: torch, even with Triton installed and its interpreter on (as in these tests);
    CUDA and NPU: the Triton kernels when Triton is installed, else torch."""
    monkeypatch.setattr(backends, "triton_available", lambda: triton_installed)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.resolve(torch.device("cpu")) == "torch"
    # torch cannot name an NPU device without torch_npu; resolve reads only the device type.
    for device in (torch.device("cuda"), types.SimpleNamespace(type="npu")):
        assert backends.resolve(device) == ("triton" if triton_installed else "torch")


def test_requested_backend_beats_the_environment(monkeypatch):
    monkeypatch.setattr(backends, "triton_available", lambda: True)
    monkeypatch.setenv(backends.ENV_VAR, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.resolve(torch.device("cpu")) == "triton"
    assert backends.resolve(torch.device("cpu"), "torch") == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        backends.resolve(torch.device("cpu"), "triton")


def test_default_call_on_cpu_runs_the_torch_path(monkeypatch):
    """``backend=None`` on CPU tensors reaches ``torch_path.forward`` and never the kernel."""
    import qfa.kernels.attention as kernel

    calls = []
    real_forward = torch_path.forward

    def counting_forward(*args, **kwargs):
        calls.append(args[0])
        return real_forward(*args, **kwargs)

    def no_kernel(*args, **kwargs):
        raise AssertionError("the Triton kernel ran on CPU tensors without being asked for")

    monkeypatch.setattr(torch_path, "forward", counting_forward)
    monkeypatch.setattr(kernel, "forward", no_kernel)
    q, k, v, qd, kd, vd = ref.random_qkv((1, 2, 40, D), (1, 1, 70, D), seed=19)
    out, _ = quant_flash_attn(q, k, v, qd, kd, vd, mask_mode=3, backend=None)
    assert len(calls) == 1 and out.shape == (1, 2, 40, D)
