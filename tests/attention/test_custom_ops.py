"""torch.library registration: the ops pass torch's own custom-op checks (schema, fake/meta
implementations vs the real ones), the drop-in's op is built from the one argument list
(``DropinCall``) that every drop-in entry point takes its names and defaults from, the modules
that register ops import each other one way only, and hif8_attention / HiF8Attention run inside
``torch.compile(fullgraph=True)`` with results identical to eager.

Compiling is slow on a 2-core CPU, so there are only three compiled functions and small shapes."""

import dataclasses
import functools
import inspect
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import qfa  # noqa: F401  (registers torch.ops.qfa.*)
from qfa.dropin.function import hif8_attention as _hif8_attention
from qfa.dropin.module import HiF8Attention as _HiF8Attention

from qfa.dropin import call as dropin_call, smoothing
from qfa.dropin.call import DropinCall
from qfa.cast import encode_to_hifloat8

# The compiled paths are compared with eager ones, with the (default) Hadamard rotation off to
# keep them small; tests/dropin/test_rotation.py compiles the rotated module.
hif8_attention = functools.partial(_hif8_attention, rotate=False)
HiF8Attention = functools.partial(_HiF8Attention, rotate=False)

D = 128
# opcheck's default list minus the autograd checks: the ops are inference-only (no backward).
OPCHECK_TESTS = ("test_schema", "test_faketensor", "test_aot_dispatch_static")


def _qkv(b=1, nq=4, nkv=2, s=19, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, s, D, generator=g)
    k = torch.randn(b, nkv, s, D, generator=g) + 2 * torch.randn(D, generator=g)
    v = torch.randn(b, nkv, s, D, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def test_cast_ops_pass_opcheck():
    x = torch.randn(3, 50)
    torch.library.opcheck(torch.ops.qfa.encode_hif8.default, (x, "saturate"), test_utils=OPCHECK_TESTS)
    codes = encode_to_hifloat8(x)
    torch.library.opcheck(torch.ops.qfa.decode_hif8.default, (codes, torch.bfloat16), test_utils=OPCHECK_TESTS)
    assert torch.equal(torch.ops.qfa.encode_hif8(x, "saturate"), codes)


@pytest.mark.parametrize("layout", ["BNSD", "TND"])
def test_quant_flash_attn_op_passes_opcheck(layout):
    q, k, v = (encode_to_hifloat8(t) for t in _qkv(s=13))
    cu = None
    if layout == "TND":
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
        cu = torch.tensor([0, 6, 13], dtype=torch.int32)
    one = torch.ones(1)
    for lse in (True, False):
        args = (q, k, v, one, one, one, 7, None, layout, cu, cu, None, None, None, 3, None, lse, None)
        torch.library.opcheck(torch.ops.qfa.quant_flash_attn.default, args, test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("rotate", [False, True])
def test_hif8_attention_op_passes_opcheck(rotate):
    q, k, v = _qkv(s=11, dtype=torch.bfloat16)
    call = DropinCall(q, k, v, is_causal=True, return_softmax_lse=True, rotate=rotate)
    args = tuple(call.as_kwargs().values())
    assert len(args) == 20
    torch.library.opcheck(torch.ops.qfa.hif8_attention.default, args, test_utils=OPCHECK_TESTS)


# ----------------------------------------------------------------------------- one argument list

def _defaults(fn, skip=()):
    return {n: p.default for n, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty and n not in skip}


def test_the_drop_in_op_schema_is_the_dropin_call():
    fields = dataclasses.fields(DropinCall)
    args = torch.ops.qfa.hif8_attention.default._schema.arguments
    assert [a.name for a in args] == [f.name for f in fields]
    for a, f in zip(args, fields):
        want = None if f.default is dataclasses.MISSING else f.default
        assert a.default_value == want, f.name
    assert str(torch.ops.qfa.hif8_attention.default._schema).endswith(dropin_call.schema())


def test_the_public_entry_points_take_the_dropin_calls_names_and_defaults():
    """Drift guard: every option of hif8_attention, HiF8Attention (and its forward) and prepare
    that the call has too carries the call's default, and the public function has every one of
    the call's fields (the three scales as ``scales``)."""
    call = {f.name: f.default for f in dataclasses.fields(DropinCall) if f.default is not dataclasses.MISSING}
    public = _defaults(_hif8_attention)
    assert set(call) - {"q_scale", "k_scale", "v_scale"} <= set(public) and "scales" in public
    module = _defaults(_HiF8Attention)
    forward = _defaults(_HiF8Attention.forward, skip=("is_causal",))  # None there: the module's own
    prepare = _defaults(smoothing.prepare)
    for defaults in (public, module, forward, prepare):
        for name, value in defaults.items():
            if name in call:
                assert value == call[name], name
    assert set(dropin_call.OPTIONS) <= set(call)
    # the one default of rotate, everywhere
    assert call["rotate"] is True and public["rotate"] is module["rotate"] is prepare["rotate"] is True
    assert _HiF8Attention().rotate is True


def test_the_op_with_defaults_equals_the_public_function():
    """Called with only q, k, v the op runs the call's defaults, which are the public function's."""
    q, k, v = _qkv(s=9, dtype=torch.bfloat16)
    out, lse = torch.ops.qfa.hif8_attention(q, k, v)
    assert torch.equal(out, _hif8_attention(q, k, v)) and lse.shape == (0,)


def test_cast_ops_live_in_qfa_cast():
    from qfa.cast import custom_ops as cast_ops

    assert torch.ops.qfa.encode_hif8.default._schema.name == "qfa::encode_hif8"
    x = torch.randn(5)
    assert torch.equal(cast_ops.encode_hif8(x), encode_to_hifloat8(x))


@pytest.mark.parametrize("layout,shape,lse_shape", [
    ("BNSD", (2, 4, 9, D), (2, 4, 9)),
    ("BSND", (2, 9, 4, D), (2, 4, 9)),
    ("TND", (9, 4, D), (4, 9)),
])
def test_fake_implementations_give_shapes_and_dtypes(layout, shape, lse_shape):
    with FakeTensorMode():
        q = torch.empty(shape, dtype=torch.float16)
        kshape = list(shape)
        kshape[{"BNSD": 1, "BSND": 2, "TND": 1}[layout]] = 2
        k = torch.empty(kshape, dtype=torch.float16)
        cu = torch.empty(3, dtype=torch.int32) if layout == "TND" else None
        out, lse = torch.ops.qfa.hif8_attention(q, k, k, cu_seqlens_q=cu, cu_seqlens_kv=cu, is_causal=True,
                                                layout=layout, return_softmax_lse=True)
        assert out.shape == shape and out.dtype == torch.float16
        assert lse.shape == lse_shape and lse.dtype == torch.float32
        _, no_lse = torch.ops.qfa.hif8_attention(q, k, k, cu_seqlens_q=cu, cu_seqlens_kv=cu, is_causal=True,
                                                 layout=layout)
        assert no_lse.shape == (0,)
        codes = torch.empty(shape, dtype=torch.uint8)
        one = torch.empty(1)
        out, lse = torch.ops.qfa.quant_flash_attn(codes, codes, codes, one, one, one, 7, None, layout, cu, cu, None,
                                                  None, None, 0, None, True, None)
        assert out.shape == shape and out.dtype == torch.bfloat16 and lse.shape == lse_shape


class TinyBlock(torch.nn.Module):
    """HiF8 attention (BSND, GQA, causal, LSE) -> output projection, and tensor work on the LSE.

    The attention's inputs come in from outside: a projection before it would be Inductor's
    fp32 GEMM in the compiled block, whose last bits may differ from eager's and flip a HiF8 code."""

    def __init__(self):
        super().__init__()
        self.o_proj = torch.nn.Linear(4 * D, D, bias=False)

    def forward(self, q, k, v):
        b, s = q.shape[:2]
        out, lse = hif8_attention(q, k, v, is_causal=True, layout="BSND", return_softmax_lse=True)
        return out, self.o_proj(out.float().reshape(b, s, 4 * D)), lse * 2


def test_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    block = TinyBlock().eval()
    q, k, v = (t.transpose(1, 2) for t in _qkv(s=19, dtype=torch.bfloat16))  # BSND
    with torch.no_grad():
        eager = block(q, k, v)
        compiled = torch.compile(block, fullgraph=True)(q, k, v)
    # the attention is one opaque custom op: identical bits, and so is lse * 2 (exact)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[2], eager[2])
    # the projection is Inductor's own fp32 GEMM, which may sum its 512 terms in another order:
    # each evaluation is within gamma_512 * sum |out| |W| of the exact value
    u = 2.0 ** -24
    gamma = 512 * u / (1 - 512 * u)
    magnitude = eager[0].float().abs().reshape(1, 19, 4 * D) @ block.o_proj.weight.abs().T
    assert ((compiled[1] - eager[1]).abs() <= 2 * gamma * magnitude).all()


def test_compile_frozen_module_fullgraph_matches_eager():
    q, k, v = _qkv(s=16, dtype=torch.bfloat16)
    attn = HiF8Attention(is_causal=True)
    with attn.calibrate():
        attn(q, k, v)
    with torch.no_grad():
        eager = attn(q, k, v)
        compiled = torch.compile(attn, fullgraph=True)(q, k, v)
    assert torch.equal(compiled, eager)
    assert math.isfinite(float(attn.k_scale))


def test_callable_calibration_is_refused_under_compile():
    q, k, v = _qkv(s=8)

    def f(q, k, v):
        return hif8_attention(q, k, v, calibration=lambda x: torch.ones(1))

    with pytest.raises(Exception, match="registered rule name under torch.compile"):
        torch.compile(f, fullgraph=True)(q, k, v)
