"""Test-wide setup. Triton's interpreter must be chosen before triton is first imported, so the
Triton-backend tests can run on CPU tensors; the default backend on CPU stays the torch path."""

import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
# What pyproject's pythonpath gives the tests, for the scripts they run in subprocesses too.
_HERE = Path(__file__).resolve().parent
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(_HERE), str(_HERE / "reference"), *filter(None, [os.environ.get("PYTHONPATH")])])


import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from qfa import _compile  # noqa: E402

# Property tests (tests/attention/test_adversarial.py): a fixed, small example budget in CI; a longer
# search with QFA_HYPOTHESIS_PROFILE=long.
settings.register_profile("ci", max_examples=12, derandomize=True, deadline=None, print_blob=True)
settings.register_profile("long", max_examples=300, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("QFA_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _no_known_calls(monkeypatch):
    """Each test starts with no op call remembered (``qfa.attention.known_calls``): its first
    call of a kind takes the op's full path, whatever the tests before it ran."""
    from qfa.attention import known_calls

    monkeypatch.setattr(known_calls, "_plans", {})


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
