"""The native kernel's bf16 dot products (the AVX512_BF16 build), and paged K/V read in place.

Where the CPU has avx512_bf16, the many-row blocks (prefill, Sq >= 16 decode) run Q K^T and P V
as vdpbf16ps: HiF8 values and HiF8-rounded P are exact in bf16 and their products exact in fp32,
so the results are the fp32 kernels' up to fp32 summation order. Each dot product is a chain over
pairs of the summed index, each step adding the pair's two exact products to the accumulator
with at most two roundings (see csrc/cpu_attention.cpp, "bf16 dot products"); with n terms, at
most n roundings, in whatever order an implementation adds the two products of a pair.

The bounds below come from that arithmetic and nothing measured, so they hold on any CPU:

* Inputs whose scores are exact in every summation order (Q and K codes of magnitude in
  [2^-2, 2^3) or 0: every value a multiple of 2^-5, products multiples of 2^-10 below 2^6, so
  every partial sum of 128 of them is a multiple of 2^-10 below 2^13: at most 23 bits). Then
  S, the running max, every exponent, P, HiF8(P), alpha and l are the same bits on both paths
  (the same code computes them from the same S), and lse is equal bit for bit. O differs only in
  P V's summation order: as a sum of terms t_j = P8_j V_j v_descale (times later alphas, which
  both paths share), each term passes through at most k = BN + 3 n + 1 roundings (its block's
  dot chain of BN, the v_descale product, and per later block the alpha product and two adds),
  so each path's O is within gamma(k) sum |t_j| of the exact sum, gamma(k) = k u / (1 - k u),
  u = 2^-24; sum |t_j| <= max|v| sum P8 <= 2 max|v| l (HiF8 rounds P up by at most 2x, at the
  underflow threshold) and l >= l_exact (1 - gamma(k)). So |dO| / l <= 4 gamma(k) max|v| /
  (1 - gamma(k)), and out = O / l, each rounded once: |d out| <= (1 + u) |dO| / l + u (|a| + |b|).
* Against the torch path (its GEMMs in any order, its own exp): scores that are either a row's
  maximum or 2 |u|^2 below it (q rows = u, keys +-u), with dScale = 1 and no p_scale: every
  exponent is exactly 0 or below -110, so P is 1 or 0 in any correct exp (exp(0) = 1, exp(-110)
  underflows to 0), every alpha 1 or 0, l an exact count. The bound above then holds between the
  two fp32 outputs; the bf16 outputs (rounded half away from zero) differ from them by at most
  half a bf16 step each, 2^-8 |x|: |a16 - b16| <= bound + 2^-8 (1 + 2^-8) (|a16| + |b16|).
* The general cases, against the torch path with the reference tests' derived tolerances
  (``check_against_reference``: HiF8 rounding flips of P allowed for, as for the fp32 kernels).

Thread counts 1 and 2 give the same bits, on torch's OpenMP team and on the own pool; a batch's
bits do not depend on the split of its keys beyond the reassociation bound of test_cpu_kernel.
On a CPU without avx512_bf16 the bf16 tests skip, naming the flag; the build itself is compiled
everywhere (test_cpu_kernel_builds.py). Paged K/V (vLLM's CPU cache view) is read in place, bit
for bit the contiguous call, and a mixed batch runs as one parallel region.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import attention_reference as ref
import qfa
from qfa.attention.backends import cpu_kernel, paged, torch_path
from qfa.tiling.attention import plan_attention
from test_attention_reference import check_against_reference
from test_cpu_kernel import D, U, make, needs_kernel, v_max

BN = 256  # keys per softmax block (the plan's block_n, asserted below)


def _missing() -> str | None:
    """Why the bf16 path cannot run here, or None."""
    if not cpu_kernel.available():
        return "native CPU kernel not built here"
    if cpu_kernel.BF16_FLAG not in cpu_kernel._cpu_flags().split():
        return (f"this CPU has no {cpu_kernel.BF16_FLAG} flag (AVX512_BF16, vdpbf16ps); the bf16 source is compiled "
                "in test_cpu_kernel_builds.py")
    if not cpu_kernel._module.has_bf16_dot():
        return (f"this CPU has {cpu_kernel.BF16_FLAG} but torch's capability is "
                f"{torch.backends.cpu.get_cpu_capability()}, not AVX512, which the AVX512_BF16 build extends")
    return None


needs_bf16 = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")


def _fp32_run(plan, args, *, bf16_dot, block_table=None, **kw):
    """fp32 O / l and lse of one call through run_into, and the kernels its blocks ran."""
    out = torch.full(args[0].shape, float("nan"))
    lse = torch.full(tuple(plan.lse_shape), float("nan")) if plan.return_lse else torch.empty(0)
    cpu_kernel.run_into(plan, *args, out, lse, bf16_dot=bf16_dot, block_table=block_table, **kw)
    return out.to(torch.float64), lse, cpu_kernel.last_paths()


def _gamma(k: int) -> float:
    return k * U / (1 - k * U)


def _order_bound(a: torch.Tensor, b: torch.Tensor, vm: float, blocks: int) -> torch.Tensor:
    """|a - b| allowed between two fp32 outputs that differ only in P V's summation order."""
    g = _gamma(BN + 3 * blocks + 1)
    return (1 + U) * 4 * g * vm / (1 - g) + U * (a.abs() + b.abs())


# ---------------------------------------------------------------------------- inputs

#: Codes whose values have magnitude in [2^-2, 2^3), or are 0: exact scores in any order.
_TABLE = ref.DECODE
SMALL_CODES = torch.tensor([c for c in range(256) if np.isfinite(_TABLE[c])
                            and (_TABLE[c] == 0 or 0.25 <= abs(_TABLE[c]) < 8)], dtype=torch.uint8)


def test_small_codes_give_exact_scores_in_any_order():
    """The premise of the exact-score inputs, checked on the values themselves."""
    vals = _TABLE[SMALL_CODES.long()]
    assert len(vals) > 40 and np.abs(vals).max() < 8
    assert (vals * 32 == np.round(vals * 32)).all()  # multiples of 2^-5
    assert 128 * 8 * 8 * 2**10 < 2**24  # 128 products below 2^6, multiples of 2^-10: 23 bits


def _plan(q, k, v, *, layout, causal, p_scale=None, softmax_scale=None, q_lens=None, kv_lens=None, **kw):
    ones = torch.ones(1)
    extra = {}
    if layout == "TND":
        extra["cu_seqlens_q"] = torch.tensor(np.cumsum((0,) + tuple(q_lens)), dtype=torch.int32)
        extra["cu_seqlens_kv"] = torch.tensor(np.cumsum((0,) + tuple(kv_lens)), dtype=torch.int32)
    ps = None if p_scale is None else torch.tensor([float(p_scale)])
    plan = plan_attention(q, k, v, ones, ones, ones, 7, p_scale=ps, layout=layout, mask_mode=3 if causal else 0,
                          softmax_scale=softmax_scale, return_softmax_lse=True, **extra, **kw)
    assert plan.block_n == BN
    return plan, (q, k, v, ones, ones, ones, ps)


def exact_score_case(nq, nkv, q_lens, kv_lens, *, causal, p_scale, seed):
    """TND codes: Q and K from SMALL_CODES, V any code; descales 1, softmax scale 1/32 (scores of
    a few units: P spread over HiF8's range)."""
    gen = torch.Generator().manual_seed(seed)
    pick = lambda *shape: SMALL_CODES[torch.randint(len(SMALL_CODES), shape, generator=gen)]  # noqa: E731
    q = pick(sum(q_lens), nq, D)
    k = pick(sum(kv_lens), nkv, D)
    v = ref.random_qkv((1, 1, 1, D), (sum(kv_lens), nkv, D), seed)[2]
    return _plan(q, k, v, layout="TND", causal=causal, p_scale=p_scale, softmax_scale=1 / 32, q_lens=q_lens,
                 kv_lens=kv_lens)


def two_level_case(nq, nkv, q_lens, kv_lens, *, causal, seed, layout="TND"):
    """Scores that are a row's max or 2 |u|^2 below it: every q row u, every key +u or -u (hot
    with probability 1/3), dScale 1 and no p_scale; V any code (descale 1)."""
    gen = torch.Generator().manual_seed(seed)
    nonzero = SMALL_CODES[torch.from_numpy(_TABLE[SMALL_CODES.long()] != 0)]
    u = nonzero[torch.randint(len(nonzero), (D,), generator=gen)]
    neg_u = u ^ 0x80  # the sign bit: -u (0x80 itself, NaN, would be -0: u holds no zero)
    assert (_TABLE[neg_u.long()] == -_TABLE[u.long()]).all()
    q = u.expand(sum(q_lens), nq, D).contiguous()
    hot = torch.rand(sum(kv_lens), nkv, generator=gen) < 1 / 3
    k = torch.where(hot.unsqueeze(-1), u, neg_u).contiguous()
    v = ref.random_qkv((1, 1, 1, D), (sum(kv_lens), nkv, D), seed)[2]
    uu = float((_TABLE[u.long()] ** 2).sum())
    assert 2 * uu > 110  # cold keys: exp below exp(-110)
    return _plan(q, k, v, layout=layout, causal=causal, softmax_scale=1.0, q_lens=q_lens, kv_lens=kv_lens)


# Many-row shapes: prefill (K/V decoded once), Sq = 16 decode (split keys), odd lengths, row
# tails of every size below the 12-row tile, a mixed TND batch with decode rows beside them; and
# few-row ones (the fused kernels' bf16 form): Sq = 1 with an odd key count (a last V pair of one
# key), causal rows that see different key counts.
EXACT_CASES = {
    "decode1-gqa6-4097-p15": dict(nq=12, nkv=2, q_lens=(1,), kv_lens=(4097,), causal=False, p_scale=15),
    "fused-gqa4-3x3001-causal": dict(nq=8, nkv=2, q_lens=(3,), kv_lens=(3001,), causal=True, p_scale=None),
    "prefill-gqa6-600-causal": dict(nq=12, nkv=2, q_lens=(600,), kv_lens=(600,), causal=True, p_scale=None),
    "decode16-gqa6-3000-p15": dict(nq=12, nkv=2, q_lens=(16,), kv_lens=(3000,), causal=False, p_scale=15),
    "gqa5-23x333-odd": dict(nq=5, nkv=1, q_lens=(23,), kv_lens=(333,), causal=False, p_scale=256),
    "tnd-mixed-causal": dict(nq=8, nkv=2, q_lens=(1, 40, 3, 300, 17), kv_lens=(513, 40, 257, 700, 1029),
                             causal=True, p_scale=15),
}


@needs_bf16
@pytest.mark.parametrize("name", list(EXACT_CASES))
def test_bf16_path_is_the_fp32_tiles_up_to_summation_order(name):
    """Exact scores: lse the same bits, out within the P V summation-order bound (module docstring)."""
    case = EXACT_CASES[name]
    plan, args = exact_score_case(**case, seed=len(name))
    a, lse_a, paths_a = _fp32_run(plan, args, bf16_dot=True)
    b, lse_b, paths_b = _fp32_run(plan, args, bf16_dot=False)
    assert "AVX512_BF16" in paths_a and "AVX512_BF16" not in paths_b
    assert torch.equal(lse_a.view(torch.int32), lse_b.view(torch.int32))
    blocks = max(math.ceil(n / BN) for n in case["kv_lens"])
    bound = _order_bound(a, b, v_max(args), blocks)
    assert torch.isfinite(a).all() and ((a - b).abs() <= bound).all(), float(((a - b).abs() - bound).max())


TWO_LEVEL_CASES = {
    "fused-gqa4-3x2999-causal": dict(nq=8, nkv=2, q_lens=(3,), kv_lens=(2999,), causal=True),
    "prefill-gqa6-700-causal": dict(nq=12, nkv=2, q_lens=(700,), kv_lens=(700,), causal=True),
    "decode16-B2-4096-causal": dict(nq=8, nkv=2, q_lens=(16, 16), kv_lens=(4096, 1500), causal=True),
    "tnd-mixed-causal": dict(nq=12, nkv=2, q_lens=(1, 1, 256, 37), kv_lens=(1000, 3, 800, 37), causal=True),
}


@needs_bf16
@pytest.mark.parametrize("name", list(TWO_LEVEL_CASES))
def test_bf16_path_against_the_torch_path_within_the_summation_order_bound(name, monkeypatch):
    """P in {0, 1} exactly in both implementations: out within the bound of the module docstring."""
    monkeypatch.setenv("QFA_COMPILE", "0")
    case = TWO_LEVEL_CASES[name]
    plan, args = two_level_case(**case, seed=len(name))
    got, got_lse = cpu_kernel.forward(plan, *args)
    assert "AVX512_BF16" in cpu_kernel.last_paths()
    want, want_lse = torch_path.forward(plan, *args)
    a, b = got.to(torch.float64), want.to(torch.float64)
    blocks = max(math.ceil(n / BN) for n in case["kv_lens"])
    a32 = a.abs() * (1 + 2.0**-8)  # the fp32 values' magnitudes, from the bf16 ones
    b32 = b.abs() * (1 + 2.0**-8)
    bound = _order_bound(a32, b32, v_max(args), blocks) + 2.0**-8 * (a32 + b32)
    assert torch.isfinite(a).all() and ((a - b).abs() <= bound).all(), float(((a - b).abs() - bound).max())
    # lse = m + ln l with m and l exact on both sides: log's last ulp (ln l <= ln Skv) and the
    # add's rounding, on each side.
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(got_lse))
    lse_bound = 4 * U * (want_lse[finite].abs().double() + math.log(max(case["kv_lens"])) + 1)
    assert ((got_lse[finite] - want_lse[finite]).abs().double() <= lse_bound).all()


GENERAL_CASES = {
    "decode1-B3-bsnd-p15": dict(nq=12, nkv=2, q_lens=(1, 1, 1), kv_lens=(4097, 63, 1), layout="BSND", p_scale=15),
    "fused-gqa4-5x777-causal": dict(nq=8, nkv=2, q_lens=(5,), kv_lens=(777,), causal=True),
    "prefill-gqa6-700-causal": dict(nq=12, nkv=2, q_lens=(700,), kv_lens=(700,), causal=True),
    "gqa4-257x513-bsnd-p15": dict(nq=4, nkv=1, q_lens=(257,), kv_lens=(513,), layout="BSND", p_scale=15),
    "decode16-B2-causal-p256": dict(nq=8, nkv=2, q_lens=(16, 16), kv_lens=(4096, 1537), layout="BSND", causal=True,
                                    p_scale=256),
    "tnd-mixed-causal-p15": dict(nq=12, nkv=2, q_lens=(1, 37, 1, 300), kv_lens=(700, 37, 1, 555), layout="TND",
                                 causal=True, p_scale=15),
    "gqa5-23x333": dict(nq=5, nkv=1, q_lens=(23,), kv_lens=(333,)),
}


@needs_bf16
@pytest.mark.parametrize("name", list(GENERAL_CASES))
def test_bf16_path_matches_the_torch_path(name, monkeypatch):
    monkeypatch.setenv("QFA_COMPILE", "0")
    plan, args = make(**GENERAL_CASES[name])
    want_out, want_lse = torch_path.forward(plan, *args)
    out, lse = cpu_kernel.forward(plan, *args)
    assert "AVX512_BF16" in cpu_kernel.last_paths()
    check_against_reference(out, lse, want_out.to(torch.float64).numpy(), want_lse.numpy(), v_max(args),
                            plan.return_lse)


@needs_bf16
@pytest.mark.parametrize("q_len", [20, 300], ids=["decoded-per-block", "predecoded"])
def test_nan_value_in_a_bf16_block_poisons_as_in_the_torch_path(q_len, monkeypatch):
    """A block holding a NaN value runs the per-row fp32 kernel (P = 0 times NaN is NaN in a
    GEMM): the NaN pattern is the torch path's."""
    monkeypatch.setenv("QFA_COMPILE", "0")
    plan, args = make(4, 1, (q_len,), (600,), causal=True, seed=4)
    v = args[2].clone()
    v[0, 0, 595, 3] = 0x80
    args = (args[0], args[1], v, *args[3:])
    out, _ = cpu_kernel.forward(plan, *args)
    assert {"AVX512_BF16", "AVX512"} <= set(cpu_kernel.last_paths())  # (the fp32 few-row kernel: 16 lanes)
    want_out, _ = torch_path.forward(plan, *args)
    nan = torch.isnan(want_out)
    assert nan.any() and torch.equal(torch.isnan(out), nan)


@needs_bf16
@pytest.mark.parametrize("shape", [(4, 1, (16, 3), (2049, 777), True), (12, 2, (16,), (4097,), False)],
                         ids=["B2-16x2049-causal", "16x4097"])
def test_bf16_key_split_is_the_sequential_walk_up_to_reassociation(shape):
    """As test_cpu_kernel's key-split test, on the bf16 path: the split moves only the alphas'
    reassociation (its bound, restated here), never P."""
    nq, nkv, q_lens, kv_lens, causal = shape
    plan, args = make(nq, nkv, q_lens, kv_lens, causal=causal, p_scale=15, seed=3)
    seq, seq_lse, _ = _fp32_run(plan, args, bf16_dot=True, split_rows=0)
    n = max(math.ceil(x / BN) for x in kv_lens)
    gamma = _gamma(3 * n + 2)
    vm = v_max(args)
    for chunk in (cpu_kernel.CHUNK_BLOCKS, 1):
        out, lse, paths = _fp32_run(plan, args, bf16_dot=True, chunk_blocks=chunk)
        assert "AVX512_BF16" in paths
        bound = 4 * gamma * vm * (1 + gamma) + (2 * gamma + 2 * U) * seq.abs()
        assert ((out - seq).abs() <= bound).all()
        finite = torch.isfinite(seq_lse)
        log_l = math.log(max(kv_lens) * 15.0) + 1
        lse_bound = 2 * gamma * (1 + gamma) + 4 * U * log_l + 2 * U * seq_lse[finite].abs()
        assert ((lse[finite] - seq_lse[finite]).abs() <= lse_bound).all()


# ---------------------------------------------------------------------------- paged K/V, vLLM's view


def vllm_case(q_lens, kv_lens, *, nq=12, nkv=2, block_size=128, seed=0):
    """TND q codes and a vLLM-style CPU cache of codes, [blocks, Nkv, block_size, 2 * 128], with
    K and V as its two halves (PA_BNBD, token stride 256) and sequences in shuffled blocks; the
    cache's other blocks hold random codes. Returns (paged call kwargs, contiguous TND k, v)."""
    gen = torch.Generator().manual_seed(seed)
    q = ref.random_qkv((sum(q_lens), nq, D), (1, 1, 1, D), seed)[0]
    ks = [ref.random_qkv((1, 1, 1, D), (n, nkv, D), seed + 1 + b)[1] for b, n in enumerate(kv_lens)]
    vs = [ref.random_qkv((1, 1, 1, D), (n, nkv, D), seed + 1 + b)[2] for b, n in enumerate(kv_lens)]
    need = [-(-n // block_size) for n in kv_lens]
    cache = torch.randint(0, 256, (sum(need) + 3, nkv, block_size, 2 * D), dtype=torch.uint8, generator=gen)
    free = torch.randperm(cache.shape[0], generator=gen).tolist()
    table = torch.full((len(kv_lens), max(need) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(kv_lens):
        for j in range(need[b]):
            blk = free.pop()
            table[b, j] = blk
            part = slice(j * block_size, min(n, (j + 1) * block_size))
            width = part.stop - part.start
            cache[blk, :, :width, :D] = ks[b][part].transpose(0, 1)
            cache[blk, :, :width, D:] = vs[b][part].transpose(0, 1)
    cu_q = torch.tensor(np.cumsum((0,) + tuple(q_lens)), dtype=torch.int32)
    cu_kv = torch.tensor(np.cumsum((0,) + tuple(kv_lens)), dtype=torch.int32)
    kwargs = dict(layout_q="TND", layout_out="TND", layout_kv="PA_BNBD", cu_seqlens_q=cu_q, block_table=table,
                  seqused_kv=torch.tensor(kv_lens, dtype=torch.int32), mask_mode=3, return_softmax_lse=True)
    flat = dict(layout="TND", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, mask_mode=3, return_softmax_lse=True)
    return q, cache[..., :D], cache[..., D:], kwargs, torch.cat(ks), torch.cat(vs), flat


MIXED = ((1, 1, 1, 1, 256), (4096, 4096, 4096, 4096, 4096))  # the bench's row, shorter contexts
MIXED_SMALL = ((1, 16, 1, 100, 3), (700, 300, 1, 257, 5))


@needs_kernel
@pytest.mark.parametrize("lens", [MIXED_SMALL, MIXED], ids=["small", "bench-shaped"])
def test_paged_kv_is_read_in_place_bit_for_bit(lens, monkeypatch):
    """vLLM's cache view through the op: the kernel reads the blocks in place (no gather: the
    op's gather is made to fail), the same bits as the contiguous call, in one parallel region."""
    q, k, v, kwargs, flat_k, flat_v, flat = vllm_case(*lens)
    assert k.stride()[2:] == (2 * D, 1) and not k.is_contiguous()
    one = torch.ones(1)
    want = qfa.quant_flash_attn(q, flat_k, flat_v, one, one, one, **flat)

    def no_gather(*a, **kw):
        raise AssertionError("the native kernel gathered paged K/V instead of reading it in place")

    monkeypatch.setattr(paged, "contiguous", no_gather)
    got = qfa.quant_flash_attn(q, k, v, one, one, one, **kwargs)
    assert cpu_kernel._module.last_regions() == 1
    assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
    assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))


@needs_kernel
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32-tiles", "bf16-dot"])
def test_paged_kv_block_sizes(bf16):
    """Block sizes that split the 256-key softmax blocks (16, 48) and that hold several (1024),
    on either path, run_into with the table directly: the contiguous call's bits."""
    if bf16 and _missing():
        pytest.skip(_missing())
    for block_size in (16, 48, 1024):
        q, k, v, kwargs, flat_k, flat_v, flat = vllm_case(*MIXED_SMALL, nq=8, nkv=2, block_size=block_size,
                                                          seed=block_size)
        one = torch.ones(1)
        pplan = plan_attention(q, k, v, one, one, one, 0, layout="TND", layout_kv="PA_BNBD",
                               cu_seqlens_q=kwargs["cu_seqlens_q"], seqused_kv=kwargs["seqused_kv"],
                               block_table=kwargs["block_table"], mask_mode=3, return_softmax_lse=True)
        fplan = plan_attention(q, flat_k, flat_v, one, one, one, 0, layout="TND", cu_seqlens_q=flat["cu_seqlens_q"],
                               cu_seqlens_kv=flat["cu_seqlens_kv"], mask_mode=3, return_softmax_lse=True)
        args = (one, one, one, None)
        a, la, _ = _fp32_run(pplan, (q, k, v, *args), bf16_dot=bf16, block_table=kwargs["block_table"])
        b, lb, _ = _fp32_run(fplan, (q, flat_k, flat_v, *args), bf16_dot=bf16)
        assert torch.equal(a.float().view(torch.int32), b.float().view(torch.int32)), block_size
        assert torch.equal(la.view(torch.int32), lb.view(torch.int32)), block_size


@needs_kernel
@pytest.mark.parametrize("name", ["gqa4-255x513-causal-bsnd-p15", "decode-B2-16x4096-causal-bsnd", "decode-1x4097",
                                  "tnd-gqa4-causal-empty"])
def test_every_call_is_one_parallel_region(name):
    """Prefill's K/V decode, split decode chunks (pass 1, pass 2 and their merge) and a mixed TND
    batch: all in the call's one region."""
    from test_cpu_kernel import CASES

    plan, args = make(**CASES[name])
    cpu_kernel.forward(plan, *args)
    assert cpu_kernel._module.last_regions() == 1


@needs_kernel
def test_block_table_is_for_paged_plans_only():
    plan, args = make(4, 1, (3,), (40,))
    out = torch.empty(args[0].shape)
    lse = torch.empty(tuple(plan.lse_shape))
    with pytest.raises(ValueError, match="^block_table is for paged K/V"):
        cpu_kernel.run_into(plan, *args, out, lse, block_table=torch.zeros(1, 1, dtype=torch.int32))


# ---------------------------------------------------------------------------- threads

_THREADS_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import test_cpu_kernel as t
import test_cpu_kernel_bf16 as tb
import qfa
results = []
for threads in (1, 2):
    torch.set_num_threads(threads)
    for name in ("prefill-gqa6-700-causal", "decode16-B2-causal-p256", "tnd-mixed-causal-p15"):
        plan, args = t.make(**tb.GENERAL_CASES[name])
        out, lse = t.cpu_kernel.forward(plan, *args)
        assert "AVX512_BF16" in t.cpu_kernel.last_paths()
        results.append((out.view(torch.int16).clone(), lse.view(torch.int32).clone()))
    q, k, v, kwargs, *_ = tb.vllm_case(*tb.MIXED_SMALL)
    one = torch.ones(1)
    out, lse = qfa.quant_flash_attn(q, k, v, one, one, one, **kwargs)
    results.append((out.view(torch.int16).clone(), lse.view(torch.int32).clone()))
half = len(results) // 2
assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(results[:half], results[half:]))
print("identical")
"""


@needs_bf16
@pytest.mark.parametrize("team", ["omp", "own"], ids=["openmp-team", "own-pool"])
def test_bf16_one_and_two_threads_give_identical_bits(team):
    here = str(Path(__file__).parent)
    done = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, here], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "QFA_POOL": team})
    assert done.returncode == 0 and "identical" in done.stdout, done.stderr[-2000:]


# ---------------------------------------------------------------------------- peak and paths


@needs_kernel
def test_peak_loops_and_their_arguments():
    """The bench's peak: every kind this build lists runs and gives a positive rate; a kind or
    an argument it does not take is a ValueError naming it."""
    kinds = cpu_kernel.peak_kinds()
    assert ("bf16_dot" in kinds) == cpu_kernel._module.has_bf16_dot()
    for kind in kinds:
        assert cpu_kernel.peak_gflops(kind, 1, 0.01) > 0
    with pytest.raises(ValueError, match="^kind must be one of"):
        cpu_kernel.peak_gflops("fp64_x87")
    with pytest.raises(ValueError, match="^threads must be a positive int, got 0"):
        cpu_kernel.peak_gflops(kinds[0], 0)
    with pytest.raises(ValueError, match="^seconds must be a number in"):
        cpu_kernel.peak_gflops(kinds[0], 1, 0)


@needs_kernel
def test_qfa_bf16_dot_zero_runs_the_fp32_tiles(monkeypatch):
    plan, args = make(4, 1, (100,), (300,))
    monkeypatch.setenv(cpu_kernel.BF16_ENV_VAR, "0")
    assert not cpu_kernel.bf16_dot()
    cpu_kernel.forward(plan, *args)
    assert cpu_kernel.last_paths() == ["AVX2"] or cpu_kernel.cpu_capability() == "DEFAULT"
