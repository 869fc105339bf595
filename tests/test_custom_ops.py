"""torch.library registration: the ops pass torch's own custom-op checks (schema, fake/meta
implementations vs the real ones), and hif8_attention / HiF8Attention run inside
``torch.compile(fullgraph=True)`` with results identical to eager.

Compiling is slow on a 2-core CPU, so there are only two compiled functions and small shapes."""

import math

import functools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from qfa.attention import custom_ops  # noqa: F401  (registers torch.ops.qfa.*)
from qfa.attention.dropin import HiF8Attention as _HiF8Attention, hif8_attention as _hif8_attention

# These tests pin the quantise -> op -> dequantise plumbing against references built from the
# un-rotated dequantised inputs, so they switch the (default) Hadamard rotation off;
# tests/test_rotation.py covers the rotation.
hif8_attention = functools.partial(_hif8_attention, rotate=False)
HiF8Attention = functools.partial(_HiF8Attention, rotate=False)
from qfa.cast import encode_to_hifloat8

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


def test_hif8_attention_op_passes_opcheck():
    q, k, v = _qkv(s=11, dtype=torch.bfloat16)
    args = (q, k, v, None, None, None, None, None, None, None, None, True, None, "BNSD", "rms", True, True, None)
    torch.library.opcheck(torch.ops.qfa.hif8_attention.default, args, test_utils=OPCHECK_TESTS)


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
        out, lse = torch.ops.qfa.hif8_attention(q, k, k, None, None, None, None, cu, cu, None, None, True, None,
                                                layout, "rms", True, True, None)
        assert out.shape == shape and out.dtype == torch.float16
        assert lse.shape == lse_shape and lse.dtype == torch.float32
        _, no_lse = torch.ops.qfa.hif8_attention(q, k, k, None, None, None, None, cu, cu, None, None, True, None,
                                                 layout, "rms", True, False, None)
        assert no_lse.shape == (0,)
        codes = torch.empty(shape, dtype=torch.uint8)
        one = torch.empty(1)
        out, lse = torch.ops.qfa.quant_flash_attn(codes, codes, codes, one, one, one, 7, None, layout, cu, cu, None,
                                                  None, None, 0, None, True, None)
        assert out.shape == shape and out.dtype == torch.bfloat16 and lse.shape == lse_shape


class TinyBlock(torch.nn.Module):
    """Projection -> HiF8 attention (BSND, GQA, causal, LSE) -> projection."""

    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(D, 4 * D, bias=False)
        self.o_proj = torch.nn.Linear(4 * D, D, bias=False)

    def forward(self, x, k, v):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, 4, D).to(torch.bfloat16)
        out, lse = hif8_attention(q, k, v, is_causal=True, layout="BSND", return_lse=True)
        return self.o_proj(out.float().reshape(b, s, 4 * D)), lse * 2


def test_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    block = TinyBlock().eval()
    x = torch.randn(1, 19, D)
    _, k, v = _qkv(s=19, dtype=torch.bfloat16)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # BSND
    with torch.no_grad():
        eager = block(x, k, v)
        compiled = torch.compile(block, fullgraph=True)(x, k, v)
    # the attention is one opaque custom op: identical bits; the projections around it are
    # Inductor's own fp32 kernels, which may sum in another order (tolerance: fp32 rounding)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-6, atol=1e-5)


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
