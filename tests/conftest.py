"""Test-wide setup. Triton's interpreter must be chosen before triton is first imported, so the
Triton-backend tests can run on CPU tensors; the default backend on CPU stays the torch path."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402

from qfa import _compile  # noqa: E402


@pytest.fixture
def torch_backend():
    """Run on the torch path even when the environment sets ``QFA_BACKEND``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("QFA_BACKEND", raising=False)
        yield


@pytest.fixture(params=["compiled", "eager"])
def path(request, monkeypatch):
    """Run a torch-path test both through TorchInductor and in eager torch."""
    monkeypatch.setenv(_compile.ENV_VAR, "0" if request.param == "eager" else "1")
    return request.param
