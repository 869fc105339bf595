"""Native code takes only plain CPU memory while nothing intercepts torch (qfa._plain_memory).

A wrapper subclass, a fake tensor, a TorchDispatchMode or a default-device context used to reach
the native passes, which then read or wrote address 0 (a segfault) or a meta / CUDA pointer. Now
each gets the torch paths, whose numbers the native code matches, and leaves no trace on later
plain calls: not in the lookup tables, not in the compile records, not in the known calls."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

import attention_reference
import qfa
from qfa import _compile, _plain_memory
from qfa.attention.backends import cpu_prepare
from qfa.cast import luts
from qfa.dropin import rotation

needs_native = pytest.mark.skipif(not cpu_prepare.available(), reason="the native CPU code is not built here")


class Wrapped(torch.Tensor):
    """A wrapper subclass with no memory of its own (data pointer 0): every op runs on the
    wrapped tensor and wraps its results."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                   device=inner.device)

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, Wrapped) else t  # noqa: E731
        out = func(*_pytree.tree_map(unwrap, args), **_pytree.tree_map(unwrap, kwargs or {}))
        return _pytree.tree_map(lambda t: Wrapped(t) if isinstance(t, torch.Tensor) else t, out)


def inner(t):
    return t.inner if isinstance(t, Wrapped) else t


class Seen(TorchDispatchMode):
    """Records the ops it sees."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@pytest.fixture
def eager_torch_path(monkeypatch):
    """A function running its argument on the eager torch path (what a dispatch mode gets:
    dynamo compiles nothing under one, and exp's last bit is eager torch's there)."""
    def run(fn):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("QFA_NATIVE", "0")
            mp.setenv(_compile.ENV_VAR, "0")
            return fn()
    return run


@pytest.fixture
def fresh_constants(monkeypatch):
    """No lookup table or Hadamard matrix made yet: the test's first use makes them."""
    monkeypatch.setattr(luts, "_cache", {})
    rotation._hadamard_cpu.cache_clear()
    rotation._hadamard_on.cache_clear()
    yield
    rotation._hadamard_cpu.cache_clear()
    rotation._hadamard_on.cache_clear()


def _qkv(seed: int = 0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, 80, 128, generator=g).to(dtype) for n in (4, 2, 2))
    return q, k, v


def _codes(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (qfa.encode_to_hifloat8(torch.randn(1, n, 80, 128, generator=g)) for n in (4, 2, 2))
    d = torch.full((1,), 0.5)
    return q, k, v, d, d, d


# --- the predicate -------------------------------------------------------------------------------

def test_tensors_takes_plain_cpu_tensors_only():
    x = torch.randn(4, 128)
    assert _plain_memory.tensors(x, None, torch.nn.Parameter(x.clone()), x.t(), x[::2])
    assert not _plain_memory.tensors(x, Wrapped(x))
    assert not _plain_memory.tensors(x.to_sparse())
    assert not _plain_memory.tensors(torch.empty(4, 128, device="meta"))
    with warnings.catch_warnings():  # (torch's prototype warning, once per process)
        warnings.simplefilter("ignore", UserWarning)
        nested = torch.nested.nested_tensor([x, x])
    assert not _plain_memory.tensors(nested)
    with Seen():
        assert not _plain_memory.tensors(x) and not _plain_memory.now()
    assert _plain_memory.now()


def test_address_names_an_operand_without_memory():
    x = torch.randn(64)
    assert _plain_memory.address(x, "x") == x.data_ptr()
    assert _plain_memory.address(Wrapped(torch.empty(0)), "empty") == 0  # nothing to read
    with pytest.raises(RuntimeError, match=r"^k_cache: a tensor with memory of its own, got one without \(a Wrapped"):
        _plain_memory.address(Wrapped(x), "k_cache")


@needs_native
def test_native_entry_points_refuse_an_operand_without_memory():
    """The last line: a native pass called directly with a wrapper raises, naming it."""
    x = torch.randn(4096)
    with pytest.raises(RuntimeError, match=r"^x: a tensor with memory"):
        cpu_prepare.encode_flat(Wrapped(x))
    with pytest.raises(RuntimeError, match=r"^x: a tensor with memory"):
        cpu_prepare.rotate_rows(Wrapped(x.view(32, 128)), torch.float32, rotation.normalisation(128))


# --- wrapper subclasses --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("overflow", ["saturate", "inf"])
def test_cast_of_a_wrapper_subclass_is_the_plain_cast(dtype, overflow):
    x = (torch.randn(5000) * 1000).to(dtype)
    codes = qfa.encode_to_hifloat8(Wrapped(x), overflow=overflow)
    assert type(codes) is Wrapped and torch.equal(inner(codes), qfa.encode_to_hifloat8(x, overflow=overflow))
    back = qfa.decode_from_hifloat8(codes, dtype)
    assert type(back) is Wrapped and torch.equal(bits(inner(back)), bits(qfa.decode_from_hifloat8(inner(codes), dtype)))


def test_op_on_wrapper_subclasses_is_the_torch_path(eager_torch_path):
    """Subclassed operands run the torch path: its answer (each subclass compiles or fails to for
    itself, so eager here is what a failed compile leaves), and a later plain call still gets
    the bits it got before."""
    args = _codes()
    before = qfa.quant_flash_attn(*args, return_softmax_lse=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(_compile.ENV_VAR, "0")
        # (descales wrapped too would be refused: torch's tolist() takes no subclass)
        out, lse = qfa.quant_flash_attn(*(Wrapped(t) for t in args[:3]), *args[3:], return_softmax_lse=True)
    want = eager_torch_path(lambda: qfa.quant_flash_attn(*args, return_softmax_lse=True))
    assert torch.equal(bits(inner(out)), bits(want[0])) and torch.equal(inner(lse), want[1])
    after = qfa.quant_flash_attn(*args, return_softmax_lse=True)
    assert torch.equal(bits(after[0]), bits(before[0])) and torch.equal(after[1], before[1])


def test_a_subclass_compile_failure_is_its_own(monkeypatch):
    """A compile that fails for a subclass is remembered for that subclass only."""
    monkeypatch.setenv(_compile.ENV_VAR, "1")
    x = torch.randn(3, 4)
    assert _compile.signature((Wrapped(x), 1.0)) != _compile.signature((x, 1.0))


# --- a fake tensor mode, a dispatch mode, a default device ---------------------------------------

def test_cast_under_fake_tensor_mode_is_shapes_and_leaves_real_tables(fresh_constants):
    """Under FakeTensorMode the cast gives a fake result of the right shape (it used to hand the
    fake tensor's address to the native encoder), and the tables its first use made there are
    real ones that later calls read."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    x = torch.randn(4096, dtype=torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = qfa.encode_to_hifloat8(torch.empty(64, 128, dtype=torch.bfloat16))
    assert isinstance(fake, FakeTensor) and fake.shape == (64, 128) and fake.dtype == torch.uint8
    assert luts._cache and all(type(t) is torch.Tensor and t.device.type == "cpu" for t in luts._cache.values())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QFA_NATIVE", "0")  # the table path itself, on the tables made under the mode
        got = qfa.encode_to_hifloat8(x)
    assert torch.equal(got, torch.from_numpy(attention_reference.encode(x.float().numpy())))  # the spec's rounding


@pytest.mark.parametrize("context", ["meta", "dispatch_mode"])
def test_dropin_under_a_context_is_right_and_leaves_no_trace(context, fresh_constants, eager_torch_path):
    """``qfa.hif8_attention`` inside ``torch.device("meta")`` (a default-device context) gives the
    same bits as outside, on the CPU; inside a TorchDispatchMode the mode sees the torch path's
    ops and the answer is that path's. The first use of the constants is inside the context,
    and the same call afterwards gives the bits it gave before."""
    q, k, v = _qkv()
    mode = Seen()
    with (torch.device("meta") if context == "meta" else mode):
        got = qfa.hif8_attention(q, k, v)
        first_h = rotation.hadamard(128)
    assert got.device.type == "cpu" and type(got) is torch.Tensor
    if context == "meta":
        want = qfa.hif8_attention(q, k, v)
    else:
        assert any("aten." in op for op in mode.ops)
        want = eager_torch_path(lambda: qfa.hif8_attention(q, k, v))
    assert torch.equal(bits(got), bits(want))
    again = qfa.hif8_attention(q, k, v)
    assert torch.equal(bits(again), bits(qfa.hif8_attention(q, k, v)))
    assert rotation.hadamard(128) is first_h and type(first_h) is torch.Tensor and first_h.device.type == "cpu"
    assert torch.allclose(first_h @ first_h, torch.eye(128), rtol=0, atol=1e-6)  # H is its own inverse


@pytest.mark.parametrize("context", ["meta", "dispatch_mode"])
def test_op_under_a_context_is_right_and_leaves_no_trace(context, eager_torch_path):
    """The op inside a context, after a plain call like it was remembered (qfa.attention.known_calls):
    under a default device the same bits on the CPU; under a dispatch mode the torch path,
    which the mode sees; either way the next plain call gives the bits of the first."""
    args = _codes(1)
    first = qfa.quant_flash_attn(*args, return_softmax_lse=True)
    mode = Seen()
    with (torch.device("meta") if context == "meta" else mode):
        out, lse = qfa.quant_flash_attn(*args, return_softmax_lse=True)
    assert out.device.type == "cpu" and lse.device.type == "cpu"
    want = first if context == "meta" else eager_torch_path(lambda: qfa.quant_flash_attn(*args, return_softmax_lse=True))
    if context == "dispatch_mode":
        assert any("aten." in op for op in mode.ops)
    assert torch.equal(bits(out), bits(want[0])) and torch.equal(lse, want[1])
    after = qfa.quant_flash_attn(*args, return_softmax_lse=True)
    assert torch.equal(bits(after[0]), bits(first[0])) and torch.equal(after[1], first[1])


def test_a_dispatch_mode_does_not_mark_a_compile_failed(monkeypatch):
    """Dynamo refuses to compile under a dispatch mode; that call runs eagerly and is not
    remembered as a failed signature (later plain calls still compile)."""
    monkeypatch.setenv(_compile.ENV_VAR, "1")
    monkeypatch.setattr(_compile, "_failed", set())
    monkeypatch.setattr(_compile, "_failed_signatures", {})
    x = torch.randn(1000)

    def double_exp(t):
        return torch.exp(t) * 2

    with Seen() as mode:
        assert not _compile.enabled(double_exp, x.device, (x,))
        got = _compile.call(double_exp, x, device=x.device)
    assert mode.ops and torch.equal(got, double_exp(x))
    assert not _compile._failed and not _compile._failed_signatures
    assert _compile.enabled(double_exp, x.device, (x,))


@needs_native
def test_prepare_passes_under_a_default_device_allocate_on_the_cpu():
    """The native passes name their outputs' device: under torch.device("meta") they used to
    allocate meta outputs and write through a null pointer."""
    x = torch.randn(8, 4, 128)
    want = cpu_prepare.encode_flat(x.contiguous())
    with torch.device("meta"):
        got = cpu_prepare.encode_flat(x.contiguous())
        rotated = cpu_prepare.rotate_rows(x.contiguous(), torch.float32, rotation.normalisation(128))
    assert got.device.type == "cpu" and torch.equal(got, want)
    assert rotated.device.type == "cpu"
    assert torch.equal(rotated, cpu_prepare.rotate_rows(x.contiguous(), torch.float32, rotation.normalisation(128)))


# --- negative views ------------------------------------------------------------------------------

def neg_view(x: torch.Tensor) -> torch.Tensor:
    """x as a view with the negative bit set: its memory holds -x."""
    view = torch._neg_view(-x)
    assert view.is_neg() and torch.equal(view, x)
    return view


def test_a_negative_view_is_not_plain_memory():
    x = torch.randn(4, 128)
    public = torch.complex(torch.zeros_like(x), -x).conj().imag  # the same by public calls (fp32 / fp64 only)
    assert public.is_neg() and not _plain_memory.tensors(public)
    assert not _plain_memory.tensors(neg_view(x)) and _plain_memory.tensors(neg_view(x).resolve_neg())
    with pytest.raises(RuntimeError, match=r"^x: a tensor whose memory holds its values, got a negative"):
        _plain_memory.address(neg_view(x), "x")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cast_of_a_negative_view_is_the_cast_of_its_values(dtype):
    """The native encoder read a negative view's memory (the codes of -x); the torch path's bit
    view refused it."""
    x = (torch.randn(3000) * 100).to(dtype)
    assert torch.equal(qfa.encode_to_hifloat8(neg_view(x)), qfa.encode_to_hifloat8(x))
    assert torch.equal(qfa.encode_to_hifloat8(torch._neg_view(x)), qfa.encode_to_hifloat8(-x))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QFA_NATIVE", "0")
        assert torch.equal(qfa.encode_to_hifloat8(neg_view(x)), qfa.encode_to_hifloat8(x))


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_dropin_takes_a_negative_view_as_its_values(which):
    q, k, v = _qkv(2)
    want = qfa.hif8_attention(q, k, v)
    args = {"q": q, "k": k, "v": v}
    args[which] = neg_view(args[which])
    assert torch.equal(bits(qfa.hif8_attention(**args)), bits(want))


def _fp8_call(seed: int = 3):
    """A small mode 6 call (one sequence of 200 queries and keys): args and options."""
    from qfa.cast import fp8

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(4, 200, 128, generator=g) * torch.exp(torch.randn(4, 200, 1, generator=g))
    k = torch.randn(2, 2, 128, 128, generator=g) * torch.exp(torch.randn(2, 2, 128, 1, generator=g))
    v = torch.randn(2, 2, 128, 128, generator=g)
    (qe, qs), (ke, ks), (ve, vs) = fp8.quantize_per_token_head(q), fp8.quantize_per_token_head(k), \
        fp8.quantize_per_head(v, 1)
    options = dict(block_table=torch.tensor([[0, 1]], dtype=torch.int32),
                   cu_seqlens_q=torch.tensor([0, 200], dtype=torch.int32),
                   seqused_kv=torch.tensor([200], dtype=torch.int32), p_scale=torch.tensor([448.0]),
                   return_softmax_lse=True)
    return [qe, ke, ve, qs, ks, vs, 6], options


@pytest.mark.parametrize("which", [3, 4])
def test_mode_6_takes_a_negative_view_descale_as_its_values(which, monkeypatch):
    """Mode 6's fp32 descales went to the kernel with their strides and no copy: a negative view
    gave scores of the wrong sign (an output off by up to 15 and another LSE). Now it takes the
    torch path, which reads its values: the plain call's bits on that path."""
    args, options = _fp8_call()
    viewed = list(args)
    viewed[which] = neg_view(args[which])
    got = qfa.quant_flash_attn(*viewed, **options)
    monkeypatch.setenv("QFA_NATIVE", "0")
    want = qfa.quant_flash_attn(*args, **options)
    assert torch.equal(bits(got[0]), bits(want[0])) and torch.equal(got[1], want[1])


def test_bound_passes_take_a_negative_view_after_a_plain_call():
    """An engine's bound passes (the query encoder, the key/value writer) compared only the
    geometry of later tokens: a negative view like the first call's was refused by the native
    pass's address check. Now it takes the torch path: the plain call's codes and cache."""
    from qfa.dropin import prepare

    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 2, 128, generator=g)
    queries = prepare.StaticEncoding(2.0 ** -5)
    first = queries.encode(x)
    assert torch.equal(queries.encode(neg_view(x))[0], first[0])
    keys = prepare.StaticEncoding(2.0 ** -6, mean=torch.randn(2, 128, generator=g))
    values = prepare.StaticEncoding(2.0 ** -5)

    def cache():
        return torch.zeros(4, 2, 16, 128, dtype=torch.uint8), torch.zeros(4, 2, 16, 128, dtype=torch.uint8)

    slots = torch.tensor([3, 17, 40, -1, 9])
    (k_plain, v_plain), (k_neg, v_neg) = cache(), cache()
    prepare.KVWriter(keys, values, k_plain, v_plain).write(x, x * 2, slots)
    writer = prepare.KVWriter(keys, values, k_neg, v_neg)
    writer.write(x, x * 2, torch.tensor([0, 1, 2, 3, 4]))  # binds the native pass to this geometry
    k_neg.zero_(), v_neg.zero_()
    writer.write(neg_view(x), neg_view(x * 2), neg_view(slots))
    assert torch.equal(k_neg, k_plain) and torch.equal(v_neg, v_plain)
