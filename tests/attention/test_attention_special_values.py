"""Special values and odd process state, in every backend: masked keys have no influence (NaN
and Inf included), a row of only -inf scores is NaN (not "saw no key"), and torch's default
dtype or a descale that requires grad change no bit, now or in later calls."""

from __future__ import annotations

import os

import pytest
import torch

import qfa
from qfa.attention.backends import cpu_kernel, torch_path
from qfa.cast import format as fmt
from qfa.tiling import attention as tiling

D = 128


def _triton_forward(*args):
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("the Triton kernel runs on CPU only under TRITON_INTERPRET=1")
    from qfa.kernels import attention

    return attention.forward(*args)


def _native_forward(*args):
    if not cpu_kernel.available():
        pytest.skip("the native CPU kernel did not build here (the torch path serves instead)")
    return cpu_kernel.forward(*args)


BACKENDS = {"torch_path": torch_path.forward, "native": _native_forward, "triton": _triton_forward}


def run(backend, q, k, v, *, scales=None, p_scale=None, **kwargs):
    qd, kd, vd = scales or [torch.ones(1)] * 3
    plan = tiling.plan_attention(q, k, v, qd, kd, vd, 0, p_scale=p_scale, return_softmax_lse=True, **kwargs)
    return BACKENDS[backend](plan, q, k, v, qd, kd, vd, p_scale)


def codes(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return qfa.encode_to_hifloat8(torch.randn(shape, generator=g))


def same_bits(a, b) -> bool:
    return torch.equal(a[0].view(torch.int16), b[0].view(torch.int16)) and torch.equal(
        a[1].view(torch.int32), b[1].view(torch.int32))


SPECIALS = [fmt.NAN_CODE, fmt.POS_INF_CODE, fmt.NEG_INF_CODE]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("special", SPECIALS, ids=["nan", "+inf", "-inf"])
def test_causally_masked_keys_have_no_influence(backend, special):
    """Poison K and V at keys the causal mask hides from the first rows: those rows keep the
    bits they had with ordinary codes there; the rows that see the keys are poisoned."""
    q, k, v = codes(1, 4, 300, D, seed=1), codes(1, 2, 300, D, seed=2), codes(1, 2, 300, D, seed=3)
    clean = run(backend, q, k, v, mask_mode=3)
    kp, vp = k.clone(), v.clone()
    kp[0, 0, 150, 3] = special  # diagonal block 0 (keys 0..255) and block 1
    vp[0, 1, 200, 5] = special
    vp[0, 0, 280, 0] = special
    got = run(backend, q, kp, vp, mask_mode=3)
    assert same_bits((got[0][:, :, :150], got[1][:, :, :150]), (clean[0][:, :, :150], clean[1][:, :, :150]))
    if special == fmt.NAN_CODE:
        assert torch.isnan(got[0][0, 2:4, 200:, 5].float()).all()  # q heads 2, 3 read kv head 1
        assert torch.isnan(got[0][0, 0:2, 150:].float()).all()  # a NaN score poisons the whole row


@pytest.mark.parametrize("backend", BACKENDS)
def test_keys_past_seqused_and_tnd_segments_have_no_influence(backend):
    q, k, v = codes(7, 2, D, seed=4), codes(40, 1, D, seed=5), codes(40, 1, D, seed=6)
    lens = dict(layout="TND", cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32),
                cu_seqlens_kv=torch.tensor([0, 20, 40], dtype=torch.int32),
                seqused_kv=torch.tensor([11, 20], dtype=torch.int32))
    clean = run(backend, q, k, v, **lens)
    kp, vp = k.clone(), v.clone()
    kp[11:20], vp[11:20] = fmt.NAN_CODE, fmt.POS_INF_CODE  # past seqused_kv of sequence 0
    assert same_bits(run(backend, q, kp, vp, **lens), clean)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_whose_only_visible_score_is_minus_inf_is_nan(backend):
    """+Inf in q against a negative k gives -inf scores; with causal masking row 0 sees only
    key 0, so its softmax is exp(-inf - (-inf)): NaN, and its LSE log(0) = -inf; never the
    0 / +inf of a row that sees no key."""
    q, k, v = codes(1, 2, 5, D, seed=7), codes(1, 1, 5, D, seed=8), codes(1, 1, 5, D, seed=9)
    q[0, 0, 0] = 0
    q[0, 0, 0, 0] = fmt.POS_INF_CODE
    k[0, 0, 0, 0] = qfa.encode_to_hifloat8(torch.tensor([-1.0]))[0]
    out, lse = run(backend, q, k, v, mask_mode=3)
    assert torch.isnan(out[0, 0, 0].float()).all() and lse[0, 0, 0] == float("-inf")
    assert torch.isfinite(out[0, 1].float()).all()  # the other head is untouched


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_that_see_no_key_give_zero_and_plus_inf(backend):
    q, k, v = codes(1, 2, 9, D, seed=10), codes(1, 1, 4, D, seed=11), codes(1, 1, 4, D, seed=12)
    out, lse = run(backend, q, k, v, mask_mode=3)  # Sq > Skv: rows 0..4 see no key
    assert (out[0, :, :5].float() == 0).all() and (lse[0, :, :5] == float("inf")).all()
    assert torch.isfinite(lse[0, :, 5:]).all()


def test_default_dtype_float64_changes_no_bit():
    q, k, v = codes(2, 4, 37, D, seed=13), codes(2, 2, 300, D, seed=14), codes(2, 2, 300, D, seed=15)
    one = torch.ones(1)
    want = qfa.quant_flash_attn(q, k, v, one, one, one, mask_mode=3, return_softmax_lse=True)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = qfa.quant_flash_attn(q, k, v, one, one, one, mask_mode=3, return_softmax_lse=True)
    finally:
        torch.set_default_dtype(old)
    assert same_bits(got, want) and got[1].dtype == torch.float32


def test_descales_that_require_grad_change_no_bit_now_or_later():
    """A call with descales that require grad must give the bits of the plain call, and must not
    change what later good calls compute (no step switched to eager for the process)."""
    q, k, v = codes(1, 4, 300, D, seed=16), codes(1, 2, 300, D, seed=17), codes(1, 2, 300, D, seed=18)
    scales = [torch.full((1,), 0.5), torch.full((1,), 0.25), torch.full((1,), 2.0)]
    want = qfa.quant_flash_attn(q, k, v, *scales, mask_mode=3, return_softmax_lse=True)
    grads = [s.clone().requires_grad_(True) for s in scales]
    p = torch.ones(1, requires_grad=True)
    got = qfa.quant_flash_attn(q, k, v, *grads, p_scale=p, mask_mode=3, return_softmax_lse=True)
    assert not got[0].requires_grad and same_bits(got, want)
    assert all(g.grad is None for g in grads)
    assert same_bits(qfa.quant_flash_attn(q, k, v, *scales, mask_mode=3, return_softmax_lse=True), want)
