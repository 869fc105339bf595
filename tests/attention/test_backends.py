"""Which backend runs an op (``qfa.backends.resolve``), and that the op really goes there."""

from __future__ import annotations

import types

import pytest
import torch

import attention_reference as ref
from qfa import backends
from qfa.attention import quant_flash_attn
from qfa.attention.backends import torch_path

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


@pytest.mark.parametrize("native", [True, False], ids=["native-available", "no-native"])
def test_default_call_on_cpu_runs_the_torch_backend(monkeypatch, native):
    """``backend=None`` on CPU tensors runs the torch backend, never the Triton kernel: the
    native CPU kernel where it builds, ``torch_path.forward`` otherwise (or with QFA_NATIVE=0)."""
    import qfa.kernels.attention as kernel
    from qfa.attention.backends import cpu_kernel

    calls = []

    def counting(module):
        real = module.forward

        def forward(*args, **kwargs):
            calls.append(module.__name__)
            return real(*args, **kwargs)

        return forward

    def no_kernel(*args, **kwargs):
        raise AssertionError("the Triton kernel ran on CPU tensors without being asked for")

    if native and not cpu_kernel.available():  # builds it, when a compiler is there
        pytest.skip("the native CPU kernel did not build here")
    monkeypatch.setattr(cpu_kernel, "available", lambda: native)
    monkeypatch.setattr(cpu_kernel, "forward", counting(cpu_kernel) if native else no_kernel)
    monkeypatch.setattr(torch_path, "forward", counting(torch_path))
    monkeypatch.setattr(kernel, "forward", no_kernel)
    q, k, v, qd, kd, vd = ref.random_qkv((1, 2, 40, D), (1, 1, 70, D), seed=19)
    out, _ = quant_flash_attn(q, k, v, qd, kd, vd, mask_mode=3, backend=None)
    want = "qfa.attention.backends.cpu_kernel" if native else "qfa.attention.backends.torch_path"
    assert calls == [want] and out.shape == (1, 2, 40, D)
