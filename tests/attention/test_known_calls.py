"""Op calls like an earlier successful one, run on its plan (``qfa.attention.known_calls``).

What must hold:
- a known call gives the full path's bits, and its errors with their messages;
- only calls of the module's form are remembered, and only once they have succeeded;
- a call unlike every remembered one takes the full path. Unlike means any difference in an
  operand's type, dtype, shape, strides or device, in an option or its type, or in
  ``QFA_BACKEND``;
- the switches the op reads on every call (``QFA_NATIVE``, ``QFA_BF16_DOT``) still hold;
- a refused call leaves the registry as it was.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import qfa
from qfa.attention import known_calls
from qfa.attention import op
from qfa.attention.backends import cpu_kernel, torch_path
from qfa.tiling.spec import MaskMode, QuantMode

D = 128
needs_kernel = pytest.mark.skipif(not cpu_kernel.available(), reason="native CPU kernel not built here")
pytestmark = needs_kernel  # known calls run on the native kernel alone


def codes(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return qfa.encode_to_hifloat8(torch.empty(shape).uniform_(-2, 2, generator=g))


def scales(q=0.5, k=0.25, v=2.0):
    return [torch.full((1,), s) for s in (q, k, v)]


def case(nq=6, nkv=2, sq=3, skv=70, layout="BNSD", seed=0):
    """q, k, v codes of one call in ``layout`` (BNSD or BSND)."""
    if layout == "BNSD":
        qs, kvs = (1, nq, sq, D), (1, nkv, skv, D)
    else:
        qs, kvs = (1, sq, nq, D), (1, skv, nkv, D)
    return codes(*qs, seed=seed), codes(*kvs, seed=seed + 1), codes(*kvs, seed=seed + 2)


@pytest.fixture
def registry():
    """The test's registry (conftest gives each test an empty one)."""
    return known_calls._plans


@pytest.fixture
def planned(monkeypatch):
    """The calls that took the op's full path (each one plans): a list of their q shapes."""
    seen = []
    full = op.plan_attention
    monkeypatch.setattr(op, "plan_attention", lambda q, *a, **kw: seen.append(tuple(q.shape)) or full(q, *a, **kw))
    return seen


@pytest.fixture
def served(monkeypatch):
    """The calls served as known: a list of their q shapes."""
    seen = []
    run = known_calls.run
    monkeypatch.setattr(known_calls, "run", lambda plan, q, *a: seen.append(tuple(q.shape)) or run(plan, q, *a))
    return seen


def full_path(*args, **kwargs):
    """The op's result or error with no call remembered (the registry restored afterwards)."""
    saved = dict(known_calls._plans)
    known_calls._plans.clear()
    try:
        return "ok", bits(qfa.quant_flash_attn(*args, **kwargs))
    except (TypeError, ValueError) as error:
        return type(error), str(error)
    finally:
        known_calls._plans.clear()
        known_calls._plans.update(saved)


def outcome(*args, **kwargs):
    try:
        return "ok", bits(qfa.quant_flash_attn(*args, **kwargs))
    except (TypeError, ValueError) as error:
        return type(error), str(error)


def bits(out_lse):
    out, lse = out_lse
    return out.view(torch.int16).clone(), lse.clone()


def same(a, b):
    if a[0] != "ok" or b[0] != "ok":
        return a == b
    return all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def bsnd_memory(t):
    """A BNSD tensor with BSND memory: the same shape, other strides."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


# Each form is a valid call; its second run is a known call.
FORMS = {
    "BNSD": dict(),
    "BSND": dict(layout="BSND"),
    "causal": dict(mask_mode=3),
    "causal enum, LSE": dict(mask_mode=MaskMode.CAUSAL, return_softmax_lse=True),
    "softmax_scale": dict(softmax_scale=0.3),
    "quant_mode 7": dict(quant_mode=7),
    "QuantMode": dict(quant_mode=QuantMode.HIF8_PER_TENSOR),
    "per-operand layouts": dict(layout_q="BNSD", layout_kv="BNSD", layout_out="BNSD", layout_q_descale="BSND"),
    "backend torch": dict(backend="torch"),
    "strided k": dict(strided="k"),
    "Sq > Skv, causal": dict(mask_mode=3, sq=9, skv=5, return_softmax_lse=True),
}


def form_call(name, seed=0):
    kw = dict(FORMS[name])
    layout = kw.get("layout", "BNSD")
    q, k, v = case(sq=kw.pop("sq", 3), skv=kw.pop("skv", 70), layout=layout, seed=seed)
    if kw.pop("strided", None):
        k = bsnd_memory(k)
    mode = kw.pop("quant_mode", 0)
    return (q, k, v, *scales(), mode), kw


@pytest.mark.parametrize("name", list(FORMS))
def test_a_known_call_plans_nothing_and_gives_the_full_paths_bits(name, registry, planned):
    args, kw = form_call(name)
    first = outcome(*args, **kw)
    assert first[0] == "ok" and len(registry) == 1 and len(planned) == 1
    again = outcome(*args, **kw)
    assert len(planned) == 1, "the second call planned again"
    assert same(again, first)
    # other codes and descales of the same geometry: still known, the full path's bits
    other, _ = form_call(name, seed=7)
    other = (*other[:3], *scales(0.125, 3.0, 0.75), other[6])
    got = outcome(*other, **kw)
    assert len(planned) == 1 and same(got, full_path(*other, **kw))


BAD_VALUES = {
    "zero q_descale": (0.0, 0.25, 2.0),
    "negative k_descale": (0.5, -0.25, 2.0),
    "inf v_descale": (0.5, 0.25, float("inf")),
    "nan q_descale": (float("nan"), 0.25, 2.0),
    "dscale overflow": (3e30, 3e30, 1.0),
    "huge v_descale": (0.5, 0.25, 3e38),
}


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_a_known_call_with_bad_descales_fails_as_the_full_path_and_leaves_no_trace(name, registry, planned):
    q, k, v = case()
    qfa.quant_flash_attn(q, k, v, *scales())
    before = dict(registry)
    bad = (q, k, v, *scales(*BAD_VALUES[name]))
    got = outcome(*bad)
    assert len(planned) == 1, "a known call's bad values must fail on the known path"
    want = full_path(*bad)
    assert got[0] is ValueError and got == want
    assert registry == before
    planned.clear()
    after = outcome(q, k, v, *scales())
    assert not planned, "the known call was lost"
    assert same(after, full_path(q, k, v, *scales()))


# Each change of a remembered call: another key, so the full path (valid or not).
CHANGES = {
    "Skv": lambda a, kw: ((a[0], *case(skv=71)[1:], *a[3:]), kw),
    "k strides": lambda a, kw: ((a[0], bsnd_memory(a[1]), *a[2:]), kw),
    "on meta": lambda a, kw: (tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in a), kw),
    "k on meta": lambda a, kw: ((a[0], a[1].to("meta"), *a[2:]), kw),
    "v_descale dtype": lambda a, kw: ((*a[:5], a[5].double(), a[6]), kw),
    "q_descale shape": lambda a, kw: ((a[0], a[1], a[2], torch.full((2,), 0.5), *a[4:]), kw),
    "q_descale a subclass": lambda a, kw: ((*a[:3], torch.nn.Parameter(a[3], requires_grad=False), *a[4:]), kw),
    "quant_mode False": lambda a, kw: ((*a[:6], False), kw),
    "mask_mode False": lambda a, kw: (a, kw | {"mask_mode": False}),
    "mask_mode 3.0": lambda a, kw: (a, kw | {"mask_mode": 3.0}),
    "return_softmax_lse 0": lambda a, kw: (a, kw | {"return_softmax_lse": 0}),
    "softmax_scale 1 (int)": lambda a, kw: (a, kw | {"softmax_scale": 1}),
    "softmax_scale list": lambda a, kw: (a, kw | {"softmax_scale": [0.1]}),
    "layout_q given": lambda a, kw: (a, kw | {"layout_q": "BNSD"}),
    "layout bad": lambda a, kw: (a, kw | {"layout": "NTD"}),
    "max_seqlen_q -1.0": lambda a, kw: (a, kw | {"max_seqlen_q": -1.0}),
    "p_scale": lambda a, kw: (a, kw | {"p_scale": torch.ones(1)}),
    "win_left": lambda a, kw: (a, kw | {"win_left": 4}),
}


@pytest.mark.parametrize("name", list(CHANGES))
def test_a_call_unlike_the_known_one_takes_the_full_path(name, registry, served):
    args, kw = (*case(), *scales(), 0), {}
    qfa.quant_flash_attn(*args, **kw)
    known = dict(registry)
    changed, changed_kw = CHANGES[name](args, kw)
    got = outcome(*changed, **changed_kw)
    assert not served, "an unlike call was served the known plan"
    want = full_path(*changed, **changed_kw)
    if name == "on meta":  # shapes only: no bits to compare
        assert got[0] == want[0] == "ok"
    else:
        assert same(got, want)
    if got[0] != "ok" or name in ("on meta", "p_scale"):
        assert registry == known, "a refused or unlike-formed call was remembered"


def test_qfa_backend_is_part_of_the_key(registry, planned, monkeypatch):
    q, k, v = case()
    qfa.quant_flash_attn(q, k, v, *scales())
    monkeypatch.setenv("QFA_BACKEND", "bogus")
    with pytest.raises(ValueError, match="QFA_BACKEND must be one of"):
        qfa.quant_flash_attn(q, k, v, *scales())
    assert len(planned) == 2 and len(registry) == 1


def test_qfa_native_0_sends_a_known_call_to_the_torch_path(registry, planned, monkeypatch):
    q, k, v = case()
    qfa.quant_flash_attn(q, k, v, *scales())
    monkeypatch.setenv(cpu_kernel.ENV_VAR, "0")
    ran = []
    monkeypatch.setattr(cpu_kernel, "forward", lambda *a, **kw: ran.append("kernel"))
    whole = torch_path.forward
    monkeypatch.setattr(torch_path, "forward", lambda *a, **kw: ran.append("torch") or whole(*a, **kw))
    qfa.quant_flash_attn(q, k, v, *scales())
    assert ran == ["torch"] and len(registry) == 1


@pytest.mark.skipif(not cpu_kernel.bf16_dot(), reason=f"no bf16 dot products here (the {cpu_kernel.BF16_FLAG} "
                                                      "build is what QFA_BF16_DOT switches)")
def test_qfa_bf16_dot_0_holds_on_a_known_call(registry, planned, monkeypatch):
    q, k, v = case(sq=32)  # 96 rows a kv head: the many-row blocks
    qfa.quant_flash_attn(q, k, v, *scales())
    assert "AVX512_BF16" in cpu_kernel.last_paths()
    monkeypatch.setenv(cpu_kernel.BF16_ENV_VAR, "0")
    qfa.quant_flash_attn(q, k, v, *scales())
    assert len(planned) == 1 and "AVX512_BF16" not in cpu_kernel.last_paths()


@pytest.mark.parametrize("extra", ["seqused_kv", "metadata", "p_scale"])
def test_calls_of_other_forms_are_not_remembered(extra, registry):
    q, k, v = case()
    kw = {"seqused_kv": dict(seqused_kv=torch.tensor([50], dtype=torch.int32)),
          "metadata": dict(metadata=qfa.quant_flash_attn_metadata(6, 2)),
          "p_scale": dict(p_scale=torch.ones(1))}[extra]
    for _ in range(2):
        qfa.quant_flash_attn(q, k, v, *scales(), **kw)
    assert not registry


def _sparse(t):
    return t.to_sparse()


def _csr(t):
    return t.reshape(-1, t.shape[-1]).to_sparse_csr()


# Tensors of other kinds, each in a call that is otherwise like the remembered one: the known
# path must neither serve them nor fail reading their key before the op's checks name them.
KINDS = {
    "sparse q_descale": lambda a, kw: ((*a[:3], _sparse(a[3]), *a[4:]), kw),
    "mkldnn k_descale": lambda a, kw: ((*a[:4], a[4].to_mkldnn(), *a[5:]), kw),
    "CSR k, bad mask_mode": lambda a, kw: ((a[0], _csr(a[1]), *a[2:]), kw | {"mask_mode": 5}),
    "nested q, bad layout": lambda a, kw: ((torch.nested.nested_tensor([a[0][0]]), *a[1:]), kw | {"layout": "XYZ"}),
}


@pytest.mark.parametrize("name", list(KINDS))
def test_tensors_of_other_kinds_take_the_full_path(name, served, monkeypatch):
    args, kw = (*case(), *scales(), 0), {}
    qfa.quant_flash_attn(*args, **kw)
    changed, changed_kw = KINDS[name](args, kw)
    got = outcome_any(*changed, **changed_kw)
    assert not served
    with monkeypatch.context() as without:  # the op as if it had no known path at all
        without.setattr(known_calls, "key_of", lambda *a: None)
        want = outcome_any(*changed, **changed_kw)
    assert got == want


def outcome_any(*args, **kwargs):
    """``outcome``, with any exception (some tensor kinds fail inside torch, not in the checks)."""
    try:
        return "ok", [x.view(torch.int16).tolist() if x.dtype == torch.bfloat16 else x.tolist()
                      for x in qfa.quant_flash_attn(*args, **kwargs)]
    except Exception as error:  # noqa: BLE001 (the comparison is the point)
        return type(error), str(error)


def test_a_traced_call_takes_the_full_path(registry, served, monkeypatch):
    """Under dynamo (``torch.compiler.is_compiling()``) the known path stands aside."""
    args = (*case(), *scales())
    qfa.quant_flash_attn(*args)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    qfa.quant_flash_attn(*args)
    assert not served


def test_the_kernels_settings_are_read_on_a_known_call(monkeypatch):
    """The key split and tiles the op's module sets now (not when the call was remembered)."""
    args = (*case(sq=1, skv=1300), *scales())
    qfa.quant_flash_attn(*args)
    monkeypatch.setattr(cpu_kernel, "CHUNK_BLOCKS", 1)
    monkeypatch.setattr(cpu_kernel, "SPLIT_ROWS", 0)
    assert same(outcome(*args), full_path(*args))


def test_remembering_a_known_call_again_evicts_nothing(registry, monkeypatch):
    monkeypatch.setattr(known_calls, "PLAN_CACHE_SIZE", 2)
    for skv in (10, 11):
        qfa.quant_flash_attn(*case(skv=skv), *scales())
    first = list(registry)
    known_calls.remember(first[1], registry[first[1]])  # two threads' first calls alike
    assert list(registry) == first


def test_the_registry_is_bounded_and_keeps_the_newest(registry, monkeypatch):
    monkeypatch.setattr(known_calls, "PLAN_CACHE_SIZE", 3)
    for skv in range(10, 16):
        qfa.quant_flash_attn(*case(skv=skv), *scales())
    assert [key[2][2] for key in registry] == [13, 14, 15]  # k's shape (B, N, S, D): S


def test_inputs_are_not_modified_by_a_known_call():
    args = (*case(), *scales())
    qfa.quant_flash_attn(*args)
    copies = [t.clone() for t in args]
    qfa.quant_flash_attn(*args)
    assert all(torch.equal(a, c) for a, c in zip(args, copies))


def test_the_dropins_repeated_calls_are_known(planned):
    """``qfa.hif8_attention`` (its output rotated back in the kernel's epilogue) plans once."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, 40, D, generator=g).bfloat16() for n in (6, 2, 2))
    first = qfa.hif8_attention(q, k, v)
    again = qfa.hif8_attention(q, k, v)
    assert len(planned) == 1 and torch.equal(again.view(torch.int16), first.view(torch.int16))


#: quant_flash_attn's defaults (what a call that leaves an option out passes).
OP_DEFAULTS = {name: p.default for name, p in inspect.signature(qfa.quant_flash_attn).parameters.items()}


class KnownCallsMachine(RuleBasedStateMachine):
    """Calls of a few geometries and options, some with refused values, with QFA_NATIVE
    switched and the registry cleared at random. Each is compared with the full path run with
    nothing remembered. The registry holds exactly the calls that succeeded on the native kernel
    (a model of their keys), and a refused call leaves it as it was."""

    GEOMETRIES = [dict(sq=1, skv=40), dict(sq=3, skv=70), dict(sq=3, skv=70, layout="BSND"), dict(sq=5, skv=3)]
    OPTIONS = [dict(), dict(mask_mode=3), dict(return_softmax_lse=True), dict(softmax_scale=0.2, mask_mode=3)]
    VALUES = [(0.5, 0.25, 2.0), (0.125, 1.0, 0.5), (0.0, 0.25, 2.0), (0.5, 0.25, float("nan"))]

    def __init__(self):
        super().__init__()
        self.saved = known_calls._plans, os.environ.get(cpu_kernel.ENV_VAR)
        known_calls._plans = {}
        self.model = set()  # the keys of the calls that succeeded on the kernel
        self.native = True
        cpu_kernel_env(True)

    def teardown(self):
        known_calls._plans = self.saved[0]
        if self.saved[1] is None:
            os.environ.pop(cpu_kernel.ENV_VAR, None)
        else:
            os.environ[cpu_kernel.ENV_VAR] = self.saved[1]

    @rule(g=st.integers(0, len(GEOMETRIES) - 1), o=st.integers(0, len(OPTIONS) - 1),
          val=st.integers(0, len(VALUES) - 1), seed=st.integers(0, 50))
    def call(self, g, o, val, seed):
        args = (*case(seed=seed, **self.GEOMETRIES[g]), *scales(*self.VALUES[val]))
        kw = self.OPTIONS[o] | ({"layout": "BSND"} if self.GEOMETRIES[g].get("layout") else {})
        before = dict(known_calls._plans)
        want = full_path(*args, **kw)
        got = outcome(*args, **kw)
        assert same(got, want)
        if got[0] != "ok":
            assert known_calls._plans == before
        elif self.native:
            full = {**OP_DEFAULTS, **kw}
            self.model.add(known_calls.key_of(*args, full["quant_mode"], full["mask_mode"], full["softmax_scale"],
                                              full["return_softmax_lse"], (full["layout"], None, None, None, None),
                                              None))

    @rule()
    def switch_native(self):
        self.native = not self.native
        cpu_kernel_env(self.native)

    @rule()
    def forget(self):
        known_calls.forget()
        self.model.clear()

    @invariant()
    def the_registry_holds_the_models_calls(self):
        assert set(known_calls._plans) == self.model


def cpu_kernel_env(native: bool) -> None:
    if native:
        os.environ.pop(cpu_kernel.ENV_VAR, None)
    else:
        os.environ[cpu_kernel.ENV_VAR] = "0"


TestKnownCallsMachine = KnownCallsMachine.TestCase
