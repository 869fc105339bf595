"""The Triton kernel of quant_mode 1 (MXFP8) and 6 (FP8) (``qfa.kernels.scaled_attention``)
against the golden torch path (``qfa.attention.backends.scaled_torch_path``).

Runs under Triton's interpreter on CPU tensors (set here, as ``conftest.py`` does, before Triton
is first imported), so shapes stay small; they still cross the 128-row query tile and the
512-key block. Inputs come from ``test_attention_scaled_modes`` (the torch path's tests), so
both backends are checked on the same cases.

Agreement: ``check_against_reference``'s band (``test_attention_reference``): both backends run
the same steps with exact products (E4M3 values and power-of-two scaled ones in fp32), so they
differ in fp32 summation order and exp's last ulp only; those can flip one E4M3 rounding of P
(a whole row moves, within the band plus one flip) or one bf16 rounding of out. ``forward``
fills its outputs with NaN before the kernel runs, and the band check asserts every element
finite, so an element the kernel does not write fails. Within the Triton backend, paged K/V
gives the contiguous call's bits, and the block order does not change a bit.

The kernel's E4M3 rounding of P (``e4m3_round_sat``) and its E4M3 / E8M0 decoding are checked
bit for bit against ``qfa.cast.fp8.on_e4m3_grid`` and torch's float8 dtypes, exhaustively.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from qfa import quant_flash_attn  # noqa: E402
from qfa.cast import mxfp8  # noqa: E402
from qfa.cast.fp8 import on_e4m3_grid  # noqa: E402
from test_attention_reference import BAND_ATOL, BAND_RTOL, check_against_reference  # noqa: E402
from test_attention_scaled_modes import E4M3_NAN, fp8_call, fp8_case, mx_call, mx_case, page_mx  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from qfa.kernels import scaled_attention as K  # noqa: E402


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv("QFA_BACKEND", raising=False)
    monkeypatch.delenv("QFA_PLATFORM", raising=False)


def _run(args, kwargs, backend):
    return quant_flash_attn(*args, **{**kwargs, "backend": backend})


def _check(got, ref, want_lse=True):
    """Triton (out, lse) against the torch path's, in the reference band."""
    (out, lse), (ref_out, ref_lse) = got, ref
    assert out.shape == ref_out.shape and out.dtype == torch.bfloat16
    ref64 = ref_out.double().numpy()
    v_max = max(float(np.abs(ref64).max()), 1e-30)
    return check_against_reference(out, lse, ref64, ref_lse.numpy(), v_max, want_lse)


def _bits_equal(a, b):
    (out_a, lse_a), (out_b, lse_b) = a, b
    assert torch.equal(out_a.view(torch.int16), out_b.view(torch.int16))
    assert torch.equal(lse_a, lse_b)


# --- Mode 1 ------------------------------------------------------------------------------------

MX_CASES = [
    # id, q_lens, kv_lens, (nq, nkv), d, causal, p_scale, softmax_scale, q_layout, lse
    ("d64-gqa2-empty", (37, 0, 5, 3), (300, 17, 0, 64), (4, 2), 64, False, 104.0, None, "TND", True),
    ("d72-gqa2-causal", (5, 33), (70, 600), (4, 2), 72, True, 104.0, None, "TND", True),
    ("d128-n2tgd-gqa3-decode", (1, 1, 3), (700, 64, 2), (6, 2), 128, True, 448.0, None, "N2TGD", True),
    ("d256-mha-ss-nolse", (20,), (513,), (2, 2), 256, False, 1.0, 0.05, "TND", False),
    ("d128-causal-sq-gt-skv", (140,), (7,), (4, 1), 128, True, 1.0, None, "TND", True),
]


@pytest.mark.parametrize("case_id,q_lens,kv_lens,heads,d,causal,p_scale,softmax_scale,q_layout,lse", MX_CASES,
                         ids=[c[0] for c in MX_CASES])
def test_mxfp8_matches_torch_path(case_id, q_lens, kv_lens, heads, d, causal, p_scale, softmax_scale, q_layout,
                                  lse):
    case = mx_case(q_lens, kv_lens, nq=heads[0], nkv=heads[1], d=d, seed=len(case_id))
    args, kwargs = mx_call(case, causal=causal, p_scale=p_scale, softmax_scale=softmax_scale, q_layout=q_layout,
                           lse=lse)
    got, ref = _run(args, kwargs, "triton"), _run(args, kwargs, "torch")
    _check(got, ref, lse)
    if causal and kv_lens[0] < q_lens[0]:  # Sq > Skv: the first Sq - Skv rows see no key
        hidden = q_lens[0] - kv_lens[0]
        assert (got[0][:hidden] == 0).all() and torch.isposinf(got[1][:, :hidden]).all()


@pytest.mark.parametrize("layout_kv,block_size,causal", [("PA_BBND", 64, True), ("PA_BNBD", 128, False),
                                                         ("PA_BNBD", 512, True)])
def test_mxfp8_paged_matches_torch_and_equals_contiguous(layout_kv, block_size, causal):
    """Paged K/V (shuffled blocks; spare blocks and the tail of each last block hold NaN
    elements and NaN scales) gives the contiguous TND call's bits, and the torch path's band."""
    case = mx_case((3, 1, 30), (600, 1, 190), d=72, seed=block_size)
    args, kwargs = mx_call(case, causal=causal, p_scale=104.0)
    flat = _run(args, kwargs, "triton")
    k, v, kd, vd, table = page_mx(case, layout_kv, block_size, torch.Generator().manual_seed(1))
    kwargs.pop("cu_seqlens_kv")
    paged_args = (args[0], k, v, args[3], kd, vd, 1)
    paged_kwargs = dict(kwargs, block_table=table, layout_kv=layout_kv,
                        seqused_kv=torch.tensor(case["kv_lens"], dtype=torch.int32))
    paged = _run(paged_args, paged_kwargs, "triton")
    _bits_equal(paged, flat)
    _check(paged, _run(paged_args, paged_kwargs, "torch"))


def test_mxfp8_paged_kv_strided_along_the_block_axis_equals_contiguous():
    """k / v as views with a block stride of twice their block (PA_BNBD allows it): read
    through the plan's strides, the contiguous call's bits."""
    case = mx_case((4,), (300,), d=64, seed=9)
    args, kwargs = mx_call(case, p_scale=104.0)
    flat = _run(args, kwargs, "triton")
    k, v, kd, vd, table = page_mx(case, "PA_BNBD", 64, torch.Generator().manual_seed(2))
    wide = lambda t: torch.stack([t.view(torch.uint8), torch.full_like(t.view(torch.uint8), E4M3_NAN)], 1)[:, 0]  # noqa: E731
    k2, v2 = wide(k).view(k.dtype), wide(v).view(v.dtype)
    assert not k2.is_contiguous() and k2.stride(0) == 2 * k.stride(0)
    kwargs.pop("cu_seqlens_kv")
    paged = _run((args[0], k2, v2, args[3], kd, vd, 1),
                 dict(kwargs, block_table=table, layout_kv="PA_BNBD",
                      seqused_kv=torch.tensor(case["kv_lens"], dtype=torch.int32)), "triton")
    _bits_equal(paged, flat)


def test_mxfp8_nan_in_v_reaches_only_the_rows_that_see_it():
    """NaN V elements at keys 298 (seen by the last two causal rows) and 299 (the last row only),
    and NaN elements and a NaN scale group past seqused_kv in the same 512-key block: exactly the
    elements the torch path makes NaN are NaN, and every other element keeps its clean bits."""
    case = mx_case((4,), (352,), nq=2, nkv=1, d=64, seed=11)
    kw = dict(causal=True, p_scale=104.0, seqused_kv=torch.tensor([300], dtype=torch.int32))
    clean = _run(*mx_call(case, **kw), "triton")
    v = case["v"].view(torch.uint8).clone()
    v[298, 0, 4] = v[299, 0, 3] = E4M3_NAN
    v[300:] = E4M3_NAN
    v_scales = [case["v_scales"][0].clone()]
    v_scales[0].view(torch.uint8)[10, 0, 9] = mxfp8.E8M0_NAN_CODE  # keys 320..351, channel 9
    poisoned = dict(case, v=v.view(torch.float8_e4m3fn), v_scales=v_scales)
    args, kwargs = mx_call(poisoned, **kw)
    (out, lse), (ref_out, _) = _run(args, kwargs, "triton"), _run(args, kwargs, "torch")
    nan = torch.isnan(out.float())
    assert torch.equal(nan, torch.isnan(ref_out.float()))
    want = torch.zeros_like(nan)
    want[3, :, 3] = want[2:, :, 4] = True
    assert torch.equal(nan, want)
    assert torch.equal(out.view(torch.int16)[~nan], clean[0].view(torch.int16)[~nan])
    assert torch.equal(lse[:, :2], clean[1][:, :2])
    o, r = out.float()[~nan].double(), ref_out.float()[~nan].double()
    assert ((o - r).abs() <= BAND_ATOL + BAND_RTOL * r.abs()).all()


# --- Mode 6 ------------------------------------------------------------------------------------

FP8_CASES = [
    # id, q_lens, kv_lens, (nq, nkv), causal, p_scale
    ("decode-gqa2", (1, 1), (300, 129), (4, 2), True, 448.0),
    ("prefill-causal-gqa2", (40, 3), (700, 3), (4, 2), True, 104.0),
    ("mha-p1-empty", (5, 0, 7), (128, 50, 0), (2, 2), False, 1.0),
]


@pytest.mark.parametrize("case_id,q_lens,kv_lens,heads,causal,p_scale", FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_fp8_matches_torch_path(case_id, q_lens, kv_lens, heads, causal, p_scale):
    case = fp8_case(q_lens, kv_lens, nq=heads[0], nkv=heads[1], seed=len(case_id))
    args, kwargs = fp8_call(case, causal=causal, p_scale=p_scale)
    _check(_run(args, kwargs, "triton"), _run(args, kwargs, "torch"))


def test_fp8_block_order_and_poisoned_hidden_keys_change_no_bit():
    """The same keys in other physical blocks give the same bits; keys past seqused and behind
    the causal diagonal poisoned with NaN elements and NaN scales leave the rows that cannot see
    them alone (the last row sees key 299: NaN, as in the torch path)."""
    shuffled = fp8_case((4,), (300,), seed=5, spare=1, shuffle=True)
    ordered = dict(shuffled)
    blocks = shuffled["table"][0, :3].long()
    ordered["k"] = shuffled["k"].view(torch.uint8)[blocks].view(torch.float8_e4m3fn)
    ordered["v"] = shuffled["v"].view(torch.uint8)[blocks].view(torch.float8_e4m3fn)
    ordered["k_scales"] = shuffled["k_scales"][blocks]
    ordered["table"] = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    clean = _run(*fp8_call(shuffled, causal=True), "triton")
    _bits_equal(clean, _run(*fp8_call(ordered, causal=True), "triton"))

    k, v, ks = (t.clone() for t in (ordered["k"].view(torch.uint8), ordered["v"].view(torch.uint8),
                                    ordered["k_scales"]))
    for j in range(299, 3 * 128):
        k[j // 128, :, j % 128], v[j // 128, :, j % 128] = E4M3_NAN, E4M3_NAN
        ks[j // 128, :, j % 128] = float("nan")
    poisoned = dict(ordered, k=k.view(torch.float8_e4m3fn), v=v.view(torch.float8_e4m3fn), k_scales=ks)
    args, kwargs = fp8_call(poisoned, causal=True)
    out, lse = _run(args, kwargs, "triton")
    assert torch.equal(out[:3].view(torch.int16), clean[0][:3].view(torch.int16))
    assert torch.equal(lse[:, :3], clean[1][:, :3])
    ref_out, _ = _run(args, kwargs, "torch")
    assert torch.isnan(out[3].float()).all() and torch.isnan(ref_out[3].float()).all()


# --- The CUDA launch: 64-key chunks, two passes per 512-key block ----------------------------------


@pytest.mark.parametrize("mode", [1, 6])
def test_cuda_launch_options_two_pass_chunks_match_torch_path(mode, monkeypatch):
    """``LAUNCH["cuda"]`` walks each 512-key block in chunks (row max first, then P and P8 @ V)
    on the one-item-per-program grid with 64-row sub-tiles: the same numbers, up to summation
    order."""
    monkeypatch.setenv("QFA_PLATFORM", "cuda")
    plans = []
    run_plan = K.forward
    monkeypatch.setattr(K, "forward", lambda plan, *a, **kw: plans.append(plan) or run_plan(plan, *a, **kw))
    if mode == 1:
        case = mx_case((20, 3), (600, 40), nq=2, nkv=1, d=72, seed=12)
        args, kwargs = mx_call(case, causal=True, p_scale=104.0)
    else:
        case = fp8_case((20, 1), (600, 129), nq=2, nkv=1, seed=12)
        args, kwargs = fp8_call(case, causal=True, p_scale=104.0)
    got = _run(args, kwargs, "triton")
    plan, = plans
    opts = K.launch_options(plan)
    assert plan.platform.name == "cuda" and opts.chunk < plan.block_n == 512 and opts.sub_m < plan.block_m
    assert plan.grid == (plan.batch * plan.heads_q, plan.n_tiles)
    _check(got, _run(args, kwargs, "torch"))
    monkeypatch.delenv("QFA_PLATFORM")
    # Not bit-equal to the one-pass interpreter launch in general (l and O are summed in another
    # order), but within the same band of it.
    _check(got, _run(args, kwargs, "triton"))


# --- In-kernel E4M3 / E8M0 arithmetic ------------------------------------------------------------


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(y_ptr + offs, K.e4m3_round_sat(tl.load(x_ptr + offs, mask=ok, other=0.0)), mask=ok)


@triton.jit
def _decode_kernel(c_ptr, e4m3_ptr, e8m0_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    codes = tl.load(c_ptr + offs)
    tl.store(e4m3_ptr + offs, K._e4m3_value(codes))
    tl.store(e8m0_ptr + offs, K._e8m0_value(codes))


def _kernel_round(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    block = 1 << 18
    _round_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), BLOCK=block)
    return y


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    bad = (got.view(torch.int32) != want.view(torch.int32)) & ~nan
    assert not bad.any(), (got[bad][:8].tolist(), want[bad][:8].tolist(), "from", bad.nonzero()[:8].flatten().tolist())


def test_e4m3_round_is_bit_exact_with_on_e4m3_grid():
    """Every fp32 top-16-bit pattern (both signs, every binade, NaN and Inf patterns) with random
    and with extreme low bits; every midpoint between neighbouring E4M3 values (ties to even) and
    its fp32 neighbours; the subnormal range densely; 448 and beyond."""
    gen = torch.Generator().manual_seed(0)
    top = torch.arange(1 << 16, dtype=torch.int64) << 16
    lows = [torch.randint(0, 1 << 16, (1 << 16,), generator=gen), torch.zeros(1 << 16, dtype=torch.int64),
            torch.full((1 << 16,), 0x8000), torch.full((1 << 16,), 0xFFFF)]
    patterns = torch.cat([top | low for low in lows])
    patterns = torch.where(patterns >= 1 << 31, patterns - (1 << 32), patterns).to(torch.int32)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()  # sorted, -448 .. 448 (one zero)
    mids = (grid[1:] + grid[:-1]) / 2  # exact in fp32: one bit below the E4M3 grid
    sub = torch.linspace(-2.0**-5, 2.0**-5, 20001)
    edge = torch.tensor([448.0, 448.00003, 463.99997, 464.0, 464.00003, 479.0, 480.0, 1e30, 2.0**-10, 2.0**-10 * 3,
                         2.0**-9 * 7.5, 2.0**-6 * 0.9999999, 2.0**-126, 2.0**-149, 0.0, -0.0])
    x = torch.cat([patterns.view(torch.float32), mids, torch.nextafter(mids, torch.tensor(0.0)),
                   torch.nextafter(mids, torch.tensor(float("inf"))), torch.nextafter(mids, torch.tensor(-float("inf"))),
                   sub, edge, -edge, torch.tensor([float("inf"), -float("inf"), float("nan")])])
    got = _kernel_round(x)
    _same_bits(got, on_e4m3_grid(x))
    # The ties really were ties, and they went to the even neighbour.
    assert (on_e4m3_grid(mids) != mids).all()
    assert torch.equal(_kernel_round(torch.tensor([448.0, 2.0**20, float("inf"), -float("inf")])),
                       torch.tensor([448.0, 448.0, 448.0, -448.0]))


def test_e4m3_and_e8m0_decoding_is_exact_for_every_code():
    codes = torch.arange(256, dtype=torch.int32)
    e4m3, e8m0 = torch.empty(256), torch.empty(256)
    _decode_kernel[(1,)](codes, e4m3, e8m0, BLOCK=256)
    _same_bits(e4m3, codes.to(torch.uint8).view(torch.float8_e4m3fn).float())
    assert torch.equal(torch.signbit(e4m3[:0x7F]), torch.zeros(0x7F, dtype=torch.bool))
    assert torch.signbit(e4m3[0x80:0xFF]).all()  # -0 (0x80) keeps its sign
    _same_bits(e8m0, codes.to(torch.uint8).view(mxfp8.E8M0).float())
    assert e8m0[0] == 2.0**-127 and e8m0[254] == 2.0**127
