"""The kernel's rotated epilogue (cpu_kernel.RotatedOutput): the HiF8 drop-in's output un-rotated
as the kernel writes it. Exact by construction (one definition, csrc/row_rotation.h, serves the
kernel and the preparation's un-rotation pass), so exact tests: every bit of the epilogue's output
is the bit the two passes give, ``cpu_prepare.rotate_rows`` of the op's bf16 out, in every dtype,
layout, mask, thread count and shape class (decode, split decode, prefill), with NaN, saturation
and rows that see no key; where it does not apply the op's out is returned untouched. A NaN is
compared as a NaN (its sign and payload are not part of the rotation's contract: the SIMD levels
differ there, see tests/dropin/test_prepare.py)."""

from __future__ import annotations

import pytest
import torch

from qfa.attention.backends import cpu_kernel, cpu_prepare
from qfa.dropin import prepare, rotation
from test_cpu_kernel import make

pytestmark = pytest.mark.skipif(not (cpu_kernel.available() and cpu_prepare.available()),
                                reason="the native CPU kernel or preparation is not built here")

C = prepare.ROTATION_C
DTYPES = cpu_kernel.ROTATED_DTYPES
#: HiF8's NaN code (a NaN in V reaches every row that sees its key).
NAN_CODE = 0x80
SHAPES = {
    "decode": dict(nq=12, nkv=2, q_lens=(1, 1, 1), kv_lens=(300, 1, 77)),
    "split-decode": dict(nq=8, nkv=2, q_lens=(16,), kv_lens=(4100,)),
    "prefill-causal": dict(nq=6, nkv=2, q_lens=(300,), kv_lens=(300,), causal=True),
    "bsnd-causal-unseen": dict(nq=4, nkv=1, q_lens=(40, 9), kv_lens=(30, 9), layout="BSND", causal=True),
    "tnd": dict(nq=4, nkv=2, q_lens=(130, 1, 17), kv_lens=(257, 64, 17), layout="TND"),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits where either is not NaN (so -0 differs from +0), NaN where the other is."""
    nan = torch.isnan(a)
    return a.dtype == b.dtype and torch.equal(nan, torch.isnan(b)) and torch.equal(bits(a)[~nan], bits(b)[~nan])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_the_epilogue_writes_the_two_passes_bits(shape, dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plan, args = make(**SHAPES[shape])
        plain, plain_lse = cpu_kernel.forward(plan, *args)
        epilogue = cpu_kernel.RotatedOutput(dtype, C)
        out, lse = cpu_kernel.forward(plan, *args, rotated=epilogue)
    finally:
        torch.set_num_threads(before)
    assert epilogue.applied and out.dtype == dtype and out.shape == plain.shape and out.is_contiguous()
    want = cpu_prepare.rotate_rows(plain, dtype, C)
    assert same(out, want)
    assert torch.equal(lse, plain_lse)


@pytest.mark.parametrize("where", ["v", "k"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_keys_and_saturation_reach_the_same_bits(dtype, where):
    plan, (q, k, v, qd, kd, vd, ps) = make(nq=4, nkv=1, q_lens=(64,), kv_lens=(200,), causal=True)
    k, v = k.clone(), v.clone()
    (v if where == "v" else k)[0, 0, 150, 5] = NAN_CODE  # causal bottom-right: rows from 14 on see key 150
    vd = vd * 2.0**20                              # |out| up to ~2^17 (vd 32): past fp16's 65504
    args = (q, k, v, qd, kd, vd, ps)
    plain, _ = cpu_kernel.forward(plan, *args)
    out, _ = cpu_kernel.forward(plan, *args, rotated=cpu_kernel.RotatedOutput(dtype, C))
    want = cpu_prepare.rotate_rows(plain, dtype, C)
    assert same(out, want)
    nan_rows = torch.isnan(out.float()).any(-1)[0]  # (heads, rows): a NaN spreads over its rotated row
    assert nan_rows[:, 14:].all() and not nan_rows[:, :14].any()
    if dtype == torch.float16:
        assert (out.float().abs() == 65504).any()  # saturated, not inf


def test_the_epilogue_is_the_drop_ins_own_definition():
    # rotate_rows is itself held to rotation.rotate (tests/dropin/test_prepare.py); here the
    # epilogue against the definition directly, with the drop-in's saturating cast.
    from qfa.dropin.eager import saturating_cast

    plan, args = make(nq=4, nkv=2, q_lens=(33,), kv_lens=(90,))
    plain, _ = cpu_kernel.forward(plan, *args)
    for dtype in DTYPES:
        out, _ = cpu_kernel.forward(plan, *args, rotated=cpu_kernel.RotatedOutput(dtype, C))
        assert same(out, saturating_cast(rotation.rotate(plain), dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32], ids=str)
def test_an_unsupported_dtype_leaves_the_ops_out(dtype):
    plan, args = make(nq=2, nkv=1, q_lens=(5,), kv_lens=(20,))
    epilogue = cpu_kernel.RotatedOutput(dtype, C)
    out, _ = cpu_kernel.forward(plan, *args, rotated=epilogue)
    assert not epilogue.applied and out.dtype == torch.bfloat16
    assert torch.equal(out, cpu_kernel.forward(plan, *args)[0])


def test_the_op_applies_it_on_the_native_path_and_not_to_paged_kv():
    import qfa
    from test_attention_paged import make_case, page_out

    plan, (q, k, v, qd, kd, vd, ps) = make(nq=4, nkv=2, q_lens=(20,), kv_lens=(50,))
    epilogue = cpu_kernel.RotatedOutput(torch.float32, C)
    out, _ = qfa.quant_flash_attn(q, k, v, qd, kd, vd, 0, layout="BNSD", _rotated_output=epilogue)
    plain, _ = qfa.quant_flash_attn(q, k, v, qd, kd, vd, 0, layout="BNSD")
    assert epilogue.applied and same(out, cpu_prepare.rotate_rows(plain, torch.float32, C))
    # Paged K/V (the cache's reads, not the drop-in's): the op's bf16 out, as without the epilogue
    q, ks, vs, q_args, _, gen = make_case((3,), (40,))
    pool_k, table = page_out(ks, 16, "PA_BNBD", gen)
    pool_v, _ = page_out(vs, 16, "PA_BNBD", gen, table=table)
    one = torch.ones(1)
    call = dict(layout_kv="PA_BNBD", block_table=table, seqused_kv=torch.tensor([40], dtype=torch.int32), **q_args)
    paged_epilogue = cpu_kernel.RotatedOutput(torch.float32, C)
    out, _ = qfa.quant_flash_attn(q, pool_k, pool_v, one, one, one, _rotated_output=paged_epilogue, **call)
    assert not paged_epilogue.applied and out.dtype == torch.bfloat16
    assert torch.equal(out, qfa.quant_flash_attn(q, pool_k, pool_v, one, one, one, **call)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_drop_in_uses_it_and_keeps_its_bits(monkeypatch, dtype):
    import qfa

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 8, 200, 128, generator=gen).to(dtype)
    k, v = (torch.randn(1, 2, 200, 128, generator=gen).to(dtype) for _ in range(2))
    q[0, 3, 7, 9] = 0.0  # a -0 / +0 difference would show in the bits
    seen = []
    real = cpu_kernel.forward

    def spy(*a, **kw):
        out = real(*a, **kw)
        seen.append(kw.get("rotated"))
        return out

    monkeypatch.setattr(cpu_kernel, "forward", spy)
    fused = qfa.hif8_attention(q, k, v, is_causal=True)
    assert seen and seen[-1] is not None and seen[-1].applied
    # The same call with the epilogue refused: the op's bf16 out and the separate pass
    monkeypatch.setattr(cpu_kernel, "ROTATED_DTYPES", ())
    separate = qfa.hif8_attention(q, k, v, is_causal=True)
    assert not seen[-1].applied
    assert fused.dtype == dtype and same(fused, separate)


@pytest.mark.parametrize("layout, empty_q", [("BNSD", (1, 4, 0, 128)), ("BSND", (2, 0, 4, 128))])
def test_the_drop_in_on_no_query_rows(layout, empty_q):
    """No row to write (the out's storage has no pointer): the op's empty out, as before."""
    import qfa

    q = torch.zeros(empty_q, dtype=torch.bfloat16)
    kv_shape = (1, 2, 5, 128) if layout == "BNSD" else (2, 5, 2, 128)
    k = torch.randn(kv_shape).bfloat16()
    out = qfa.hif8_attention(q, k, k.clone(), layout=layout)
    assert out.shape == q.shape and out.dtype == q.dtype


def test_a_run_that_raises_leaves_the_request_unapplied(monkeypatch):
    plan, args = make(nq=2, nkv=1, q_lens=(5,), kv_lens=(20,))
    epilogue = cpu_kernel.RotatedOutput(torch.float32, C)

    def broken(*a, **kw):
        raise RuntimeError("the kernel failed")

    monkeypatch.setattr(cpu_kernel, "_run", broken)
    with pytest.raises(RuntimeError, match="the kernel failed"):
        cpu_kernel.forward(plan, *args, rotated=epilogue)
    assert not epilogue.applied
