"""qfa._compile: a failed compile does not change what later good calls compute (issue 9's
"poisoned process"), environmental failures are final, and the recompile-limit scope restores
the user's dynamo config, also when threads overlap."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from attention_reference import random_qkv
from qfa import _compile
from qfa.attention.backends import torch_path
from qfa.tiling.attention import plan_attention


@pytest.fixture
def fresh_state(monkeypatch):
    """Empty failure records (restored afterwards: the test's failures stay the test's)."""
    monkeypatch.setenv(_compile.ENV_VAR, "1")
    monkeypatch.setattr(_compile, "_failed", set())
    monkeypatch.setattr(_compile, "_failed_signatures", {})


def _scale_and_exp(x, y):
    # fullgraph cannot take a graph break: for float64 inputs (only) the compile fails
    if x.dtype == torch.float64:
        torch._dynamo.graph_break()
    return torch.exp(x * y) + 1


def _torch_path_call(seed: int = 0):
    """(out, lse) of the op on the torch path (the step that _compile.call compiles)."""
    q, k, v, qd, kd, vd = random_qkv((1, 4, 300, 128), (1, 2, 300, 128), seed=seed, scale_rule="unit")
    plan = plan_attention(q, k, v, qd, kd, vd, 0, mask_mode=3, return_softmax_lse=True)
    return torch_path.forward(plan, q, k, v, qd, kd, vd, None)


def test_a_failed_signature_leaves_other_signatures_compiled(fresh_state):
    x, y = torch.randn(4096), torch.randn(4096)
    before = _compile.call(_scale_and_exp, x, y, device=x.device)
    with pytest.warns(UserWarning, match="for inputs like these"):
        bad = _compile.call(_scale_and_exp, x.double(), y.double(), device=x.device)
    assert torch.equal(bad, _scale_and_exp(x.double(), y.double()))  # the eager retry's answer
    assert _scale_and_exp not in _compile._failed
    assert _compile.enabled(_scale_and_exp, x.device, (x, y))
    assert not _compile.enabled(_scale_and_exp, x.device, (x.double(), y.double()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the known-bad signature goes eager without trying again
        _compile.call(_scale_and_exp, x.double(), y.double(), device=x.device)
    after = _compile.call(_scale_and_exp, x, y, device=x.device)
    assert torch.equal(after, before)


def test_a_bad_call_does_not_change_later_lse_bits(fresh_state):
    """Provoke a compile failure of the torch path's softmax step with a signature it cannot
    take (float64 scores): later good calls give the bits they gave before, and still run the
    compiled step (the eager one differs in exp's last ulp, so the bits would tell)."""
    out0, lse0 = _torch_path_call()
    s = torch.randn(8, 256, dtype=torch.float64)
    m, l = torch.full((8,), float("-inf")), torch.zeros(8)
    with pytest.raises(Exception), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # eager cannot take it either (an fp32 bit view of float64): the error is the caller's
        _compile.call(torch_path._softmax_block, s, m, l, torch.ones(1), torch.zeros(1),
                      torch.zeros(65536), None, device=s.device)
    assert torch_path._softmax_block not in _compile._failed
    assert torch_path._softmax_block in _compile._failed_signatures
    out1, lse1 = _torch_path_call()
    assert torch.equal(out1.view(torch.int16), out0.view(torch.int16))
    assert torch.equal(lse1.view(torch.int32), lse0.view(torch.int32))


def test_an_environmental_failure_is_final(fresh_state, monkeypatch):
    """No C++ compiler: the function runs eagerly from then on, for every signature."""
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("backend failed") from FileNotFoundError("no such file: 'g++'")
        return run

    monkeypatch.setattr(_compile, "_compiled", {})
    monkeypatch.setattr(torch, "compile", broken_compile)
    x, y = torch.randn(64), torch.randn(64)
    with pytest.warns(UserWarning, match="from now on"):
        got = _compile.call(_scale_and_exp, x, y, device=x.device)
    assert torch.equal(got, _scale_and_exp(x, y))
    assert _scale_and_exp in _compile._failed
    assert not _compile.enabled(_scale_and_exp, x.device, (x.half(), y.half()))


def test_is_environmental_reads_the_cause_chain():
    try:
        try:
            raise FileNotFoundError("cl.exe")
        except FileNotFoundError as inner:
            raise RuntimeError("compile failed") from inner
    except RuntimeError as exc:
        assert _compile.is_environmental(exc)
    assert not _compile.is_environmental(RuntimeError("unsupported graph break"))
    assert not _compile.is_environmental(TypeError("bad dtype"))


def test_signature_tells_apart_what_a_graph_specialises_on():
    x = torch.randn(3, 4)
    sig = _compile.signature((x, None, 1.0))
    assert sig == _compile.signature((torch.randn(7, 9), None, 2.0))  # sizes and values are dynamic
    for other in ((x.double(), None, 1.0), (x[0], None, 1.0), (x.requires_grad_(), None, 1.0),
                  (torch.randn(3, 4), torch.zeros(1), 1.0), (torch.randn(3, 4), None, 1)):
        assert _compile.signature(other) != sig


def test_limit_scopes_in_overlapping_threads_change_only_their_own_thread():
    """Scopes that overlap in two threads (entered A, B, left A, B) each see qfa's limit, and
    leave every thread's setting as it was (dynamo's config is per thread)."""
    user = torch._dynamo.config.recompile_limit
    assert user != _compile.RECOMPILE_LIMIT
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        before = torch._dynamo.config.recompile_limit
        with _compile.limits():
            a_in.set()
            b_in.wait(5)
            seen["a"] = torch._dynamo.config.recompile_limit
        seen["a after"] = torch._dynamo.config.recompile_limit == before
        a_out.set()

    def b():
        a_in.wait(5)
        before = torch._dynamo.config.recompile_limit
        with _compile.limits():
            b_in.set()
            a_out.wait(5)
            seen["b"] = torch._dynamo.config.recompile_limit
        seen["b after"] = torch._dynamo.config.recompile_limit == before

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"a": _compile.RECOMPILE_LIMIT, "b": _compile.RECOMPILE_LIMIT, "a after": True, "b after": True}
    assert torch._dynamo.config.recompile_limit == user
