"""qfa.attention.backends.cpu_kernel: the native CPU kernel against the torch path (its golden reference),
the exactness of its key split, thread-count independence, fully written outputs, fallback.

Against the torch path the two differ in fp32 summation order (MKL vs oneDNN GEMMs, the row
sums) and exp's last ulp, exactly as the torch path differs from the spec-level reference, so
the reference tests' derived tolerances apply (``test_attention_reference.check_against_reference``,
one source for them).

The key split (decode) is tighter: every S, exponent, P and HiF8(P) is the sequential walk's,
bit for bit, so the split result differs only by the fp32 reassociation of the alphas (see
cpu_kernel's docstring). The bound, from the arithmetic: with n key blocks, a term of l or O
passes through at most 2n + 1 roundings in the sequential walk and 3n + 2 in the split (its
chunk's chain, the product of the chunk's alphas, the merge), each a factor (1 + d), |d| <= u =
2^-24; so each differs from exact by at most gamma(3n + 2) = k u / (1 - k u) relative, and
the two by 2 gamma of the sum of |terms|. l's terms are positive: |dl| <= 2 gamma l. O's terms
are (P8 @ V) v_descale with |.| <= 2 P max|v| (HiF8 rounds P up by at most 2x, at the underflow
threshold), so |dO| <= 4 gamma max|v| l (1 + gamma). out = O / l (each rounded once):
|d out| <= 4 gamma max|v| (1 + gamma) + (2 gamma + 2u) |out|. lse = m + ln l with m identical:
|d lse| <= 2 gamma (1 + gamma) + 4u |ln l| (log's 1 ulp, both sides) + 2u |lse| (the add).
A chunk that started from the wrong running max would round its P differently: differences of
HiF8 steps (2^-4 relative) in O, orders of magnitude beyond this bound.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import attention_reference as ref
from qfa.attention.backends import cpu_kernel, torch_path
from qfa.cast import luts
from qfa.tiling.attention import plan_attention
from test_attention_reference import check_against_reference

D = 128
U = 2.0**-24

#: The kernel's own tests; the fallback tests below run wherever the kernel cannot be built too.
needs_kernel = pytest.mark.skipif(not cpu_kernel.available(), reason="native CPU kernel not built here")


def make(nq, nkv, q_lens, kv_lens, layout="BNSD", causal=False, p_scale=None, seqused_q=None, seqused_kv=None,
         seed=0, lse=True):
    """(plan, args) of one call; BNSD/BSND pad to the longest length."""
    b = len(q_lens)
    if layout == "TND":
        q_shape, kv_shape = (sum(q_lens), nq, D), (sum(kv_lens), nkv, D)
    elif layout == "BNSD":
        q_shape, kv_shape = (b, nq, max(q_lens), D), (b, nkv, max(kv_lens), D)
    else:
        q_shape, kv_shape = (b, max(q_lens), nq, D), (b, max(kv_lens), nkv, D)
    q, k, v, qd, kd, vd = ref.random_qkv(q_shape, kv_shape, seed)
    kw = {}
    if layout == "TND":
        kw["cu_seqlens_q"] = torch.tensor(np.cumsum((0,) + tuple(q_lens)), dtype=torch.int32)
        kw["cu_seqlens_kv"] = torch.tensor(np.cumsum((0,) + tuple(kv_lens)), dtype=torch.int32)
    if seqused_q is not None:
        kw["seqused_q"] = torch.tensor(seqused_q, dtype=torch.int32)
    if seqused_kv is not None:
        kw["seqused_kv"] = torch.tensor(seqused_kv, dtype=torch.int32)
    ps = None if p_scale is None else torch.tensor([float(p_scale)])
    plan = plan_attention(q, k, v, qd, kd, vd, 7, p_scale=ps, layout=layout, mask_mode=3 if causal else 0,
                          return_softmax_lse=lse, **kw)
    return plan, (q, k, v, qd, kd, vd, ps)


def v_max(args) -> float:
    return float(np.abs(ref.decode(args[2])).max() * float(args[5]))


CASES = {
    "gqa6-37x257-p128": dict(nq=12, nkv=2, q_lens=(37,), kv_lens=(257,), p_scale=128),
    "gqa4-255x513-causal-bsnd-p15": dict(nq=4, nkv=1, q_lens=(255,), kv_lens=(513,), layout="BSND", causal=True,
                                         p_scale=15),
    "mha8-B2-256x256-causal-nolse": dict(nq=8, nkv=8, q_lens=(256, 256), kv_lens=(256, 256), causal=True, lse=False),
    "gqa4-B2-257x37-causal": dict(nq=4, nkv=1, q_lens=(257, 257), kv_lens=(37, 37), causal=True),
    "tnd-gqa4-causal-empty": dict(nq=4, nkv=1, q_lens=(37, 0, 257, 5), kv_lens=(255, 1, 513, 0), layout="TND",
                                  causal=True, p_scale=15),
    "seqused-bnsd-causal": dict(nq=4, nkv=1, q_lens=(257,) * 3, kv_lens=(513,) * 3, causal=True,
                                seqused_q=(257, 0, 100), seqused_kv=(513, 300, 0)),
    "decode-1x4097": dict(nq=12, nkv=2, q_lens=(1,), kv_lens=(4097,)),
    "decode-B2-16x4096-causal-bsnd": dict(nq=8, nkv=2, q_lens=(16, 16), kv_lens=(4096, 4096), layout="BSND",
                                          causal=True, p_scale=256),
    # Few rows (new tokens x group <= the fused kernels' 16): fused decode + dot products.
    "fused-3x3000-causal-p15": dict(nq=8, nkv=2, q_lens=(3,), kv_lens=(3000,), causal=True, p_scale=15),
    "fused-mha-B3-1xskv-bsnd": dict(nq=4, nkv=4, q_lens=(1, 1, 1), kv_lens=(700, 1, 300), layout="BSND"),
}


@needs_kernel
@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch_path(name, monkeypatch):
    monkeypatch.setenv("QFA_COMPILE", "0")  # the torch path eager: same numerics, no compile time
    plan, args = make(**CASES[name])
    want_out, want_lse = torch_path.forward(plan, *args)
    out, lse = cpu_kernel.forward(plan, *args)
    assert out.dtype == torch.bfloat16 and out.shape == args[0].shape
    assert lse.shape == want_lse.shape
    check_against_reference(out, lse, want_out.to(torch.float64).numpy(), want_lse.numpy(), v_max(args), plan.return_lse)
    # Rows no batch reaches and rows that see no key: exactly 0 and +inf on both.
    no_key = (want_out == 0).all(dim=-1)
    assert torch.equal((out == 0).all(dim=-1) & no_key, no_key)


def _fp32_out(plan, args, **kw):
    out = torch.full(args[0].shape, float("nan"))
    lse = torch.full(tuple(plan.lse_shape), float("nan")) if plan.return_lse else torch.empty(0)
    cpu_kernel.run_into(plan, *args, out, lse, **kw)
    return out.to(torch.float64), lse.to(torch.float64)


@needs_kernel
@pytest.mark.parametrize("shape", [(12, 2, (1,), (4096,), False), (4, 1, (16, 3), (2049, 777), True),
                                   (8, 8, (1,), (513,), False), (8, 2, (3,), (2049,), True)],
                         ids=["1x4096", "B2-16x2049-causal", "mha-1x513", "fused-3x2049-causal"])
def test_key_split_is_the_sequential_walk_up_to_reassociation(shape):
    nq, nkv, q_lens, kv_lens, causal = shape
    plan, args = make(nq, nkv, q_lens, kv_lens, causal=causal, p_scale=15, seed=3)
    seq_out, seq_lse = _fp32_out(plan, args, split_rows=0)  # never split
    n = max(math.ceil(x / plan.block_n) for x in kv_lens)
    k = 3 * n + 2
    gamma = k * U / (1 - k * U)
    vm = v_max(args)
    for chunk in (cpu_kernel.CHUNK_BLOCKS, 1):  # the default split, and one block per chunk
        out, lse = _fp32_out(plan, args, chunk_blocks=chunk)
        bound = 4 * gamma * vm * (1 + gamma) + (2 * gamma + 2 * U) * seq_out.abs()
        assert ((out - seq_out).abs() <= bound).all(), float(((out - seq_out).abs() - bound).max())
        finite = torch.isfinite(seq_lse)
        assert torch.equal(finite, torch.isfinite(lse))
        log_l = math.log(kv_lens[0] * 15.0) + 1  # l <= Skv * p_scale, and l >= P of the row max ~ p_scale
        lse_bound = 2 * gamma * (1 + gamma) + 4 * U * log_l + 2 * U * seq_lse[finite].abs()
        assert ((lse[finite] - seq_lse[finite]).abs() <= lse_bound).all()


_THREADS_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import test_cpu_kernel as t
results = []
for threads in (1, 2):
    torch.set_num_threads(threads)
    for name in ("decode-1x4097", "gqa4-255x513-causal-bsnd-p15", "tnd-gqa4-causal-empty", "fused-3x3000-causal-p15",
                 "decode-B2-16x4096-causal-bsnd"):
        plan, args = t.make(**t.CASES[name])
        out, lse = t.cpu_kernel.forward(plan, *args)
        results.append((out.view(torch.int16).clone(), lse.view(torch.int32).clone()))
    # One block per chunk: a chunk's pass 2 reads the running max of many chunks before it.
    plan, args = t.make(**t.CASES["decode-1x4097"])
    out, lse = t._fp32_out(plan, args, chunk_blocks=1)
    results.append((out.view(torch.int64).clone(), lse.view(torch.int64).clone()))
    if threads == 2 and sys.argv[2]:  # the region ran on the team asked for, with both threads
        team, entered = t.cpu_kernel._module.last_region()
        assert team == sys.argv[2] and entered in ((2,) if team == "omp" else (-1,)), (team, entered)
half = len(results) // 2
assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(results[:half], results[half:]))
print("identical")
"""


@needs_kernel
@pytest.mark.parametrize("team", ["omp", "own", ""], ids=["openmp-team", "own-pool", "automatic"])
def test_one_and_two_threads_give_identical_bits(team):
    """On torch's OpenMP team, on the kernel's own pool, and with the choice left to the kernel."""
    here = str(__import__("pathlib").Path(__file__).parent)
    env = {**os.environ, "QFA_POOL": team}
    done = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, here, team], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0 and "identical" in done.stdout, done.stderr[-2000:]


_STEER_SCRIPT = r"""
import os, sys, torch
sys.path.insert(0, sys.argv[1])
import test_cpu_kernel as t
torch.set_num_threads(2)
plan, args = t.make(**t.CASES["decode-1x4097"])
t.cpu_kernel.forward(plan, *args)
assert t.cpu_kernel._module.last_region()[0] == "own"
base = os.sched_getaffinity(0)
me = str(__import__("threading").get_native_id())
steered = [os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task") if tid != me]
print(any(len(base - s) == 1 and s < base for s in steered))
"""


@needs_kernel
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to steer")
def test_own_pool_threads_keep_off_the_callers_cpu():
    """The own pool's threads may run on every CPU of the process but the caller's: when no CPU is
    idle, the scheduler would otherwise put the thread the caller wakes on the caller's core."""
    here = str(__import__("pathlib").Path(__file__).parent)
    done = subprocess.run([sys.executable, "-c", _STEER_SCRIPT, here], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "QFA_POOL": "own"})
    assert done.returncode == 0 and done.stdout.strip() == "True", (done.stdout, done.stderr[-2000:])


_FORK_SCRIPT = r"""
import os, sys, torch
sys.path.insert(0, sys.argv[1])
import test_cpu_kernel as t
torch.set_num_threads(2)
plan, args = t.make(**t.CASES["decode-1x4097"])
want = t.cpu_kernel.forward(plan, *args)[0].view(torch.int16)
assert t.cpu_kernel._module.last_region() == ("omp", 2)
pid = os.fork()
if pid == 0:
    got = t.cpu_kernel.forward(plan, *args)[0].view(torch.int16)
    os._exit(0 if torch.equal(got, want) and t.cpu_kernel._module.last_region()[0] == "own" else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""


@needs_kernel
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_runs_on_the_own_pool():
    """libgomp's team does not survive fork (a child's first OpenMP region hangs); a child of a
    process that ran the kernel on it gets the same bits from the own pool."""
    here = str(__import__("pathlib").Path(__file__).parent)
    done = subprocess.run([sys.executable, "-c", _FORK_SCRIPT, here], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "QFA_POOL": "omp"})
    assert done.returncode == 0 and done.stdout.strip() == "child 0", (done.stdout, done.stderr[-2000:])


@needs_kernel
@pytest.mark.parametrize("name", ["gqa4-B2-257x37-causal", "decode-1x4097", "tnd-gqa4-causal-empty"])
def test_nan_poisoned_outputs_are_fully_written(name):
    plan, args = make(**CASES[name])
    out = torch.full(args[0].shape, float("nan"), dtype=torch.bfloat16)
    lse = torch.full(tuple(plan.lse_shape), float("nan"))
    cpu_kernel.run_into(plan, *args, out, lse)
    q_lens = plan.q_lens
    if plan.layout == "TND":  # every token belongs to a batch here
        assert sum(q_lens) == args[0].shape[0]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    want_out, want_lse = cpu_kernel.forward(plan, *args)
    assert torch.equal(out.view(torch.int16), want_out.view(torch.int16))
    assert torch.equal(lse, want_lse)


@needs_kernel
def test_nan_codes_in_q_give_nan_rows():
    plan, args = make(4, 1, (5,), (300,))
    q = args[0].clone()
    q[0, 2, 3, 7] = 0x80  # NaN code: q head 2, position 3
    args = (q, *args[1:])
    out, lse = cpu_kernel.forward(plan, *args)
    want_out, want_lse = torch_path.forward(plan, *args)
    assert torch.isnan(out[0, 2, 3]).all() and torch.isnan(lse[0, 2, 3])
    assert torch.equal(torch.isnan(out), torch.isnan(want_out)) and torch.equal(torch.isnan(lse), torch.isnan(want_lse))


@needs_kernel
def test_inputs_are_not_modified():
    plan, args = make(12, 2, (16,), (600,), causal=True)
    before = [a.clone() for a in args if a is not None]
    cpu_kernel.forward(plan, *args)
    assert all(torch.equal(a, b) for a, b in zip([a for a in args if a is not None], before))


@needs_kernel
def test_strided_inputs():
    """K and V as views (a transposed BSND-like buffer read as BNSD), q non-contiguous."""
    plan0, args = make(4, 2, (40,), (300,), seed=4)
    q, k, v, qd, kd, vd, ps = args
    k2 = k.transpose(1, 2).contiguous().transpose(1, 2)
    q2 = q.transpose(1, 2).contiguous().transpose(1, 2)
    plan = plan_attention(q2, k2, v, qd, kd, vd, 7, return_softmax_lse=True)
    out, lse = cpu_kernel.forward(plan, q2, k2, v, qd, kd, vd, ps)
    want_out, want_lse = cpu_kernel.forward(plan0, q, k, v, qd, kd, vd, ps)
    assert torch.equal(out.view(torch.int16), want_out.view(torch.int16)) and torch.equal(lse, want_lse)


def test_fallback_when_disabled(monkeypatch):
    from qfa.attention import quant_flash_attn

    plan, args = make(**CASES["gqa4-B2-257x37-causal"])
    q, k, v, qd, kd, vd, ps = args
    monkeypatch.setenv("QFA_COMPILE", "0")
    monkeypatch.setenv(cpu_kernel.ENV_VAR, "0")
    assert not cpu_kernel.available()
    out, lse = quant_flash_attn(q, k, v, qd, kd, vd, mask_mode=3, return_softmax_lse=True, backend="torch")
    want_out, want_lse = torch_path.forward(plan, *args)
    assert torch.equal(out.view(torch.int16), want_out.view(torch.int16)) and torch.equal(lse, want_lse)


def test_build_failure_falls_back_and_warns_once(monkeypatch):
    from qfa.attention import quant_flash_attn

    def broken():
        raise RuntimeError("no compiler (simulated)")

    monkeypatch.setattr(cpu_kernel, "_module", None)
    monkeypatch.setattr(cpu_kernel, "_failed", False)
    monkeypatch.setattr(cpu_kernel, "_build", broken)
    monkeypatch.setenv("QFA_COMPILE", "0")
    plan, args = make(**CASES["gqa4-B2-257x37-causal"])
    q, k, v, qd, kd, vd, ps = args
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            out, lse = quant_flash_attn(q, k, v, qd, kd, vd, mask_mode=3, return_softmax_lse=True, backend="torch")
    native = [w for w in caught if "native CPU attention kernel" in str(w.message)]
    assert len(native) == 1 and "pure-torch" in str(native[0].message)
    want_out, want_lse = torch_path.forward(plan, *args)
    assert torch.equal(out.view(torch.int16), want_out.view(torch.int16)) and torch.equal(lse, want_lse)
    assert not cpu_kernel.available()


@needs_kernel
def test_build_is_keyed_by_cpu():
    name = cpu_kernel.build_name()
    assert cpu_kernel.cpu_capability().lower() in name
    flags = cpu_kernel._cpu_flags()
    if flags:  # a different flags line gives a different build
        import hashlib

        assert hashlib.sha1(flags.encode() + torch.__version__.encode()).hexdigest()[:12] in name



@needs_kernel
def test_nan_value_past_the_causal_edge_poisons_as_in_the_torch_path(monkeypatch):
    """P = 0 times a NaN value is NaN: a key no row of a tile sees, inside a block the tile
    visits, still poisons the rows that visit that block, in the torch path and here."""
    monkeypatch.setenv("QFA_COMPILE", "0")
    plan, args = make(4, 1, (300,), (300,), causal=True)
    v = args[2].clone()
    v[0, 0, 290, 5] = 0x80  # key 290: rows before position 290 cannot see it
    args = (args[0], args[1], v, *args[3:])
    out, lse = cpu_kernel.forward(plan, *args)
    want_out, want_lse = torch_path.forward(plan, *args)
    assert torch.isnan(want_out).any() and not torch.isnan(want_out).all()
    assert torch.equal(torch.isnan(out), torch.isnan(want_out))


@needs_kernel
def test_thread_count_is_left_as_it_was():
    """The workers pin their nested OpenMP teams to one thread and restore it: the calling
    thread runs a share of the region, and its setting is torch's thread count."""
    before = torch.get_num_threads()
    for case in ("decode-1x4097", "gqa4-B2-257x37-causal"):
        plan, args = make(**CASES[case])
        cpu_kernel.forward(plan, *args)
        assert torch.get_num_threads() == before


@needs_kernel
def test_lse_is_fp32_under_a_float64_default_dtype():
    plan, args = make(**CASES["gqa4-B2-257x37-causal"])
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out, lse = cpu_kernel.forward(plan, *args)
    finally:
        torch.set_default_dtype(old)
    assert lse.dtype == torch.float32 and out.dtype == torch.bfloat16


@needs_kernel
def test_decoder_is_the_table_bit_for_bit():
    """The kernel's HiF8 decoder (the affine rule per group of 8 magnitudes on AVX2 / AVX-512
    builds, scalar lookups otherwise) against the 256-entry table: every code, NaN's bits included, in the 32-code SIMD
    body and the scalar tail, from several alignments; and its non-finite flag."""
    table = luts.decode_lut(torch.float32).view(torch.float32)
    bits = table.view(torch.int32)
    mod = cpu_kernel._module
    assert mod.simd_decoder(table) == (cpu_kernel.cpu_capability() in ("AVX2", "AVX512", "AVX512_BF16"))
    gen = torch.Generator().manual_seed(5)
    every = torch.cat([torch.randperm(256, generator=gen) for _ in range(4)]).to(torch.uint8)
    finite_codes = every[torch.isfinite(table[every.long()])]
    for codes in (every, finite_codes):
        for start, n in ((0, len(codes)), (1, 255), (7, 33), (3, 31), (0, 1)):
            c = codes[start:start + n].contiguous()
            for simd in (True, False):
                got, finite = mod.decode_codes(c, table, simd)
                assert torch.equal(got.view(torch.int32), bits[c.long()]), (start, n, simd)
                assert finite == bool(torch.isfinite(table[c.long()]).all())


@needs_kernel
def test_nan_value_in_a_fused_decode_block_reaches_only_the_rows_that_see_it(monkeypatch):
    """Few-row blocks sum each row's visible keys alone: a NaN value at the last key poisons the
    causal rows that see it (the last position's), as in the torch path."""
    monkeypatch.setenv("QFA_COMPILE", "0")
    plan, args = make(8, 2, (3,), (600,), causal=True)
    v = args[2].clone()
    v[0, 1, 599, 9] = 0x80  # kv head 1, key 599: only query position 2 sees it
    args = (args[0], args[1], v, *args[3:])
    out, lse = cpu_kernel.forward(plan, *args)
    want_out, want_lse = torch_path.forward(plan, *args)
    assert torch.isnan(out[0, 4:, 2, 9]).all()  # q heads 4..7 read kv head 1
    assert not torch.isnan(out[0, :, :2]).any() and not torch.isnan(out[0, :4]).any()
    assert torch.equal(torch.isnan(out), torch.isnan(want_out))


@needs_kernel
def test_kernel_rounding_of_p_is_the_table_bit_for_bit():
    """The kernel's HiF8 rounding of P (8 lanes of integer ops on AVX2 / AVX-512 builds, the
    scalar rule in the tail and elsewhere) against the rounding table, exhaustively: every top-16
    pattern of fp32 (NaNs, ±Inf, denormals, both signs, every threshold) with low bits 0, 0xFFFF
    and random, in the SIMD body and the scalar tail (odd lengths, shifted starts)."""
    from qfa.cast import rounding

    mod = cpu_kernel._module
    top = torch.arange(1 << 16, dtype=torch.int32) << 16
    gen = torch.Generator().manual_seed(11)
    lows = (torch.zeros(1 << 16, dtype=torch.int32), torch.full((1 << 16,), 0xFFFF, dtype=torch.int32),
            torch.randint(0, 1 << 16, (1 << 16,), generator=gen, dtype=torch.int32))
    table = luts.round_lut().view(torch.int32)
    for low in lows:
        x = (top | low)[torch.randperm(1 << 16, generator=gen)]
        want = table[(x >> 16) & 0xFFFF]
        assert torch.equal(rounding.round_hif8_bits(x), want)  # the two rule-holders agree
        for simd in (True, False):
            for start, stop in ((0, 1 << 16), (3, (1 << 16) - 2), (5, 12)):
                got = mod.round_p(x[start:stop].view(torch.float32), cpu_kernel._ROUND_CONSTS, simd)
                assert torch.equal(got.view(torch.int32), want[start:stop]), (simd, start, stop)


@needs_kernel
@pytest.mark.parametrize("q_len", [20, 300], ids=["decoded-per-block", "predecoded"])
def test_nan_value_in_a_many_row_block_poisons_as_in_the_torch_path(q_len, monkeypatch):
    """Blocks of more than 16 rows run the register-tiled GEMMs; a block holding a NaN value
    takes the per-row path instead, whether its V was decoded for the call (prefill, several
    tiles) or per block (one tile): the NaN pattern is the torch path's, the rest agrees."""
    monkeypatch.setenv("QFA_COMPILE", "0")
    plan, args = make(4, 1, (q_len,), (600,), causal=True, seed=4)
    v = args[2].clone()
    v[0, 0, 595, 3] = 0x80
    args = (args[0], args[1], v, *args[3:])
    out, lse = cpu_kernel.forward(plan, *args)
    want_out, want_lse = torch_path.forward(plan, *args)
    nan = torch.isnan(want_out)
    assert nan.any() and torch.equal(torch.isnan(out), nan)
    keep = ~nan.any(dim=-1, keepdim=True).expand_as(nan)
    check_against_reference(torch.where(keep, out, 0), lse, torch.where(keep, want_out, 0).to(torch.float64).numpy(),
                            want_lse.numpy(), v_max((args[0], args[1], args[2].masked_fill(args[2] == 0x80, 0),
                                                     *args[3:])), plan.return_lse)


@needs_kernel
@pytest.mark.parametrize("name", ["seqused-bnsd-causal", "tnd-gqa4-causal-empty"])
def test_forward_fills_the_rows_no_batch_owns(name, monkeypatch):
    """forward allocates out / lse unfilled and the kernel sets them to 0 / +inf first: with the
    allocation poisoned (NaN), the result is the bits of a call into 0 / +inf-filled outputs."""
    plan, args = make(**CASES[name])
    want_out = torch.zeros(args[0].shape, dtype=torch.bfloat16)
    want_lse = torch.full(tuple(plan.lse_shape), math.inf)
    cpu_kernel.run_into(plan, *args, want_out, want_lse)
    real_empty, real_empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(math.nan))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: real_empty_like(*a, **kw).fill_(math.nan))
    out, lse = cpu_kernel.forward(plan, *args)
    assert torch.equal(out.view(torch.int16), want_out.view(torch.int16))
    assert torch.equal(lse.view(torch.int32), want_lse.view(torch.int32))
    assert (out == 0).all(dim=-1).any() and torch.isinf(lse).any()  # the case has rows no batch owns
