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
from qfa.cast import format as fmt, luts
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

        want = hashlib.sha1(flags.encode() + torch.__version__.encode() + cpu_kernel.headers_digest())
        assert want.hexdigest()[:12] in name


def test_build_is_keyed_by_the_headers_the_source_includes(tmp_path, monkeypatch):
    """torch's loader hashes the listed sources only: a changed header must change the build."""
    from qfa.attention.backends import cpu_prepare

    for path in cpu_kernel.SOURCE.parent.iterdir():
        if path.suffix in (".cpp", ".h"):
            (tmp_path / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(cpu_kernel, "SOURCE", tmp_path / cpu_kernel.SOURCE.name)
    before = cpu_kernel.build_name(), cpu_prepare.build_name()
    header = sorted(tmp_path.glob("*.h"))[0]
    header.write_text(header.read_text() + "\n// changed\n")
    after = cpu_kernel.build_name(), cpu_prepare.build_name()
    assert before[0] != after[0] and before[1] != after[1]
    header.unlink()
    assert cpu_kernel.build_name() not in (before[0], after[0])



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
    """The kernel's HiF8 decoder (the affine rule per group of 8 magnitudes on AVX2 builds, the
    table's words looked up 32 codes at a time on AVX-512 builds, scalar lookups otherwise) against the 256-entry table: every code, NaN's bits included, in the 32-code SIMD
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
@pytest.mark.parametrize("bf16", ["1", "0"])
def test_nan_value_in_a_fused_decode_block_reaches_only_the_rows_that_see_it(bf16, monkeypatch):
    """Few-row blocks sum each row's visible keys alone: a NaN value at the last key poisons the
    causal rows that see it (the last position's), as in the torch path; with bf16 dot products
    (where the build has them) the group holding it runs the fp32 chains."""
    monkeypatch.setenv("QFA_COMPILE", "0")
    monkeypatch.setenv(cpu_kernel.BF16_ENV_VAR, bf16)
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
@pytest.mark.parametrize("bf16", ["1", "0"])
@pytest.mark.parametrize("code", [fmt.NAN_CODE, fmt.POS_INF_CODE, fmt.NEG_INF_CODE], ids=["nan", "inf", "-inf"])
def test_non_finite_key_in_a_fused_decode_block_reaches_only_the_rows_that_see_it(code, bf16, monkeypatch):
    """A NaN or Inf code in K of a few-row block: the rows that see its key get the torch path's
    NaN pattern, the others their bits of a clean call (the decoder's lookups give such codes no
    value of their own: a run holding one is decoded again from the table)."""
    monkeypatch.setenv("QFA_COMPILE", "0")
    monkeypatch.setenv(cpu_kernel.BF16_ENV_VAR, bf16)
    plan, args = make(8, 2, (3,), (600,), causal=True)
    clean, _ = cpu_kernel.forward(plan, *args)
    k = args[1].clone()
    k[0, 1, 599, 9] = code  # kv head 1, key 599: only query position 2 sees it
    args = (args[0], k, *args[2:])
    out, _ = cpu_kernel.forward(plan, *args)
    want, _ = torch_path.forward(plan, *args)
    assert torch.equal(torch.isnan(out), torch.isnan(want))
    sees = torch.zeros(out.shape, dtype=torch.bool)
    sees[0, 4:, 2] = True  # q heads 4..7 read kv head 1
    if code == fmt.NAN_CODE:
        assert torch.isnan(out[sees]).all()
    assert torch.equal(out[~sees].view(torch.int16), clean[~sees].view(torch.int16))


@needs_kernel
def test_few_row_scores_sum_their_lanes_by_one_add_tree_bit_for_bit():
    """The few-row kernels sum a dot product's 16 lanes by one fixed tree in fp32: lane i plus
    lane i + 8, then ((f0 + f1) + (f2 + f3)) + ((f4 + f5) + (f6 + f7)); the AVX512_BF16 build
    takes sixteen such sums side by side (tree_sums16), the AVX-512 one each alone. Checked
    against that tree in numpy's fp32 on values whose sums depend on the order (wide exponents,
    cancellations, Inf and NaN)."""
    if cpu_kernel._module.dot_sums16(torch.zeros(16, 16)).numel() == 0:
        pytest.skip(f"the {cpu_kernel.cpu_capability()} build's S has no 16-lane sums (8-lane AVX2 kernels)")
    gen = np.random.default_rng(5)
    for trial in range(200):
        x = (gen.standard_normal((16, 16)) * 2.0 ** gen.integers(-40, 40, (16, 16))).astype(np.float32)
        if trial % 4 == 0:
            x[gen.integers(16), gen.integers(16)] = [np.inf, -np.inf, np.nan][trial % 3]
        f = x[:, :8] + x[:, 8:]
        want = ((f[:, 0] + f[:, 1]) + (f[:, 2] + f[:, 3])) + ((f[:, 4] + f[:, 5]) + (f[:, 6] + f[:, 7]))
        got = cpu_kernel._module.dot_sums16(torch.from_numpy(x)).numpy()
        assert np.array_equal(got, want, equal_nan=True), trial
        assert np.array_equal(got[~np.isnan(got)].view(np.int32), want[~np.isnan(want)].view(np.int32)), trial


@needs_kernel
def test_kernel_rounding_of_p_is_the_table_bit_for_bit():
    """The kernel's HiF8 rounding of P (32 lanes of 16-bit words with table lookups and 16 lanes
    of 32-bit ones on AVX-512 builds, 8 lanes on AVX2, the scalar rule in the tail and elsewhere;
    and the bf16 dot products' rounding with its bf16 copy, on AVX512_BF16 builds) against the
    rounding table, exhaustively: every top-16 pattern of fp32 (NaNs, ±Inf, denormals, both
    signs, every threshold) with low bits 0, 0xFFFF and random, in the SIMD body and the tails
    (odd lengths, shifted starts)."""
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
        variants = [(True, False), (False, False)] + ([(True, True)] if mod.has_bf16_dot() else [])
        for simd, bf16 in variants:
            for start, stop in ((0, 1 << 16), (3, (1 << 16) - 2), (5, 12), (7, 40), (1, 32)):
                got = mod.round_p(x[start:stop].view(torch.float32), cpu_kernel._ROUND_CONSTS, simd, bf16)
                assert torch.equal(got.view(torch.int32), want[start:stop]), (simd, bf16, start, stop)


@needs_kernel
@pytest.mark.parametrize("index,value,words", [(3, 0x34800001, "low halves"), (0, 31, "within"),
                                               (3, 0x2F000000, "within")],
                         ids=["threshold-low-half", "band-past-the-tables", "min-denormal-past-the-tables"])
def test_rounding_constants_the_word_rule_cannot_hold_are_refused(index, value, words):
    """The 16-bit word rule and its 32-entry tables hold only for thresholds with zero low halves
    and binades within |e| <= 31: constants outside that are refused, not rounded wrongly."""
    consts = list(cpu_kernel._ROUND_CONSTS)
    consts[index] = value
    with pytest.raises(RuntimeError, match=words):
        cpu_kernel._module.round_p(torch.ones(4), consts, True, False)


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


# ---- the register-tiled GEMM paths and the budgets around them, at their edges ----------------
# Whether K and V were predecoded (PREDECODE_BYTES), whether pass 1's scores were kept
# (SCORE_STORE_BYTES), which other batches share the call and how codes are strided change no
# bit; shapes that end tiles and panels off their multiples hold the reference tolerances.

NAN_CODE, POS_INF_CODE, NEG_INF_CODE = 0x80, 0x6F, 0xEF


def _bits(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return out.view(torch.int16).clone(), lse.view(torch.int32).clone()


def _same_bits(a, b) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _predecode_need(plan, b: int) -> int:
    """Bytes the kernel sets aside for batch b's decoded K and V with panel GEMMs: whole blocks."""
    blocks = -(-plan.kv_lens[b] // plan.block_n)
    return 2 * plan.heads_kv * blocks * plan.block_n * plan.head_dim * 4


#: Prefill-shaped calls (batches of more than one query tile, whose K / V the kernel predecodes
#: when the budget allows), with partial last blocks, causal offsets of both signs and a batch
#: with no keys.
BUDGET_CASES = {
    "B3-causal-tnd": dict(nq=8, nkv=2, q_lens=(300, 40, 700), kv_lens=(250, 600, 777), layout="TND", causal=True,
                          p_scale=15),
    "B2-skv-lt-sq-bsnd": dict(nq=6, nkv=2, q_lens=(200, 130), kv_lens=(90, 17), layout="BSND", causal=True),
    "B2-skv-gt-sq-bnsd": dict(nq=5, nkv=1, q_lens=(70, 61), kv_lens=(530, 300), causal=True),
    "B3-noncausal-empty-tnd": dict(nq=4, nkv=1, q_lens=(90, 0, 77), kv_lens=(300, 10, 0), layout="TND"),
    # Tiles of 32 positions: the last one (16 positions, 128 rows) is split, and reads the
    # predecoded panels and slices through pass 1's kept scores.
    "split-last-tile-of-a-predecoded-batch": dict(nq=8, nkv=1, q_lens=(48, 48), kv_lens=(1500, 700), causal=True),
}


@needs_kernel
@pytest.mark.parametrize("name", list(BUDGET_CASES))
def test_predecode_budget_changes_no_bit(name, monkeypatch):
    """A batch whose K / V the budget leaves to per-block decoding (panels of the visible keys
    only) gives the bits of a predecoded one (panels of whole blocks): all, none, and only the
    first batch predecoded."""
    plan, args = make(**BUDGET_CASES[name])
    assert max(plan.q_lens) * plan.group > cpu_kernel.TILE_ROWS  # several tiles: predecoded by default
    want = _bits(*cpu_kernel.forward(plan, *args))
    for budget in (0, _predecode_need(plan, 0)):
        monkeypatch.setattr(cpu_kernel, "PREDECODE_BYTES", budget)
        assert _same_bits(_bits(*cpu_kernel.forward(plan, *args)), want), budget


@needs_kernel
@pytest.mark.parametrize("shape", [(32, 4, (16,), (2000,), False), (24, 2, (10, 3), (1500, 1300), True),
                                   (8, 1, (33,), (3000,), True), (8, 1, (48,), (1500,), False),
                                   (8, 2, (2,), (1100,), False)],
                         ids=["128-rows", "B2-60-and-36-rows-causal", "short-last-tile-causal",
                              "predecoded-128-row-last-tile", "8-rows"])
def test_score_store_budget_changes_no_bit(shape, monkeypatch):
    """Split items of more than 16 rows (panel GEMMs, pass 1 writing whole 16-column panels
    into the kept score store) and of at most 16: recomputing the scores in pass 2 gives the
    kept ones' bits (partial last blocks: without the causal mask, the block's own end bounds
    every row)."""
    nq, nkv, q_lens, kv_lens, causal = shape
    plan, args = make(nq, nkv, q_lens, kv_lens, causal=causal, p_scale=15, seed=2)
    want = _bits(*cpu_kernel.forward(plan, *args))
    monkeypatch.setattr(cpu_kernel, "SCORE_STORE_BYTES", 0)
    assert _same_bits(_bits(*cpu_kernel.forward(plan, *args)), want)


@needs_kernel
def test_a_batch_gives_the_same_bits_alone_as_with_others():
    """TND batches of different lengths (one predecoded, one split for decode, one fused):
    each sequence alone gives the bits it gets in the call with the others."""
    q_lens, kv_lens = (300, 3, 40), (700, 1100, 250)
    plan, args = make(8, 2, q_lens, kv_lens, layout="TND", causal=True, p_scale=15, seed=5)
    out, lse = cpu_kernel.forward(plan, *args)
    q, k, v, qd, kd, vd, ps = args
    q0 = k0 = 0
    for ql, kl in zip(q_lens, kv_lens):
        one = [x[a : a + n] for x, a, n in ((q, q0, ql), (k, k0, kl), (v, k0, kl))]
        cu_q, cu_kv = torch.tensor([0, ql], dtype=torch.int32), torch.tensor([0, kl], dtype=torch.int32)
        plan1 = plan_attention(*one, qd, kd, vd, 7, p_scale=ps, layout="TND", mask_mode=3, return_softmax_lse=True,
                               cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
        out1, lse1 = cpu_kernel.forward(plan1, *one, qd, kd, vd, ps)
        assert torch.equal(out1.view(torch.int16), out[q0 : q0 + ql].view(torch.int16))
        assert torch.equal(lse1, lse[:, q0 : q0 + ql])
        q0, k0 = q0 + ql, k0 + kl


def _edge_shapes():
    shapes = []
    for g in (1, 2, 3, 5, 6, 7, 8):
        # (Sq, Skv): rows Sq * g in every residue mod 6 across the groups; 1, 3, 16, 17 keys
        # (one panel, a partial one, a panel and one key); a partial last 256-key block.
        for sq, skv in ((7, 17), (23, 3), (41, 16), (70, 257), (5, 1)):
            shapes.append((g, 1, sq, skv, g % 2 == 0))
    shapes += [(4, 3, 37, 300, True), (2, 2, 130, 40, True), (8, 2, 9, 600, False)]
    return shapes


@needs_kernel
@pytest.mark.parametrize("shape", _edge_shapes(), ids=lambda s: "g{}-kv{}-{}x{}-{}".format(*s[:4], "causal" if s[4]
                                                                                             else "full"))
def test_edge_shapes_match_torch_path(shape, monkeypatch):
    monkeypatch.setenv("QFA_COMPILE", "0")
    g, nkv, sq, skv, causal = shape
    plan, args = make(g * nkv, nkv, (sq,), (skv,), layout="BSND" if g % 3 == 0 else "BNSD", causal=causal, seed=g)
    want_out, want_lse = torch_path.forward(plan, *args)
    out, lse = cpu_kernel.forward(plan, *args)
    check_against_reference(out, lse, want_out.to(torch.float64).numpy(), want_lse.numpy(), v_max(args), True)


def _special_case(q_len: int, kv_len: int, codes: dict, q_descale_factor: float = 1.0):
    """A causal call with the given V codes set (key: code, at dim 3 + key % 7 of kv head 0)."""
    plan, args = make(4, 1, (q_len,), (kv_len,), causal=True, seed=4)
    q, k, v, qd, kd, vd, ps = args
    v = v.clone()
    for key, code in codes.items():
        v[0, 0, key, 3 + key % 7] = code
    return plan, (q, k, v, qd * q_descale_factor, kd, vd, ps)


def _check_specials(plan, args, monkeypatch):
    """NaN and Inf exactly where the torch path has them (same signed Inf), the rest within
    tolerance; and the same bits with and without the predecode."""
    monkeypatch.setenv("QFA_COMPILE", "0")
    want_out, want_lse = torch_path.forward(plan, *args)
    out, lse = cpu_kernel.forward(plan, *args)
    got, want = out.float(), want_out.float()
    nan, inf = torch.isnan(want), torch.isinf(want)
    assert torch.equal(torch.isnan(got), nan) and torch.equal(torch.isinf(got), inf)
    assert torch.equal(got[inf], want[inf])
    assert torch.equal(torch.isnan(lse), torch.isnan(want_lse))
    keep = ~(nan | inf).any(dim=-1, keepdim=True).expand_as(nan)
    finite_v = args[2].masked_fill((args[2] == NAN_CODE) | ((args[2] & 0x7F) == POS_INF_CODE), 0)
    check_against_reference(torch.where(keep, out, 0), lse, torch.where(
        keep, want_out, 0).to(torch.float64).numpy(), want_lse.numpy(), v_max((*args[:2], finite_v, *args[3:])), True)
    monkeypatch.setattr(cpu_kernel, "PREDECODE_BYTES", 0)
    assert _same_bits(_bits(out, lse), _bits(*cpu_kernel.forward(plan, *args)))
    return nan, inf


@needs_kernel
def test_nan_value_past_a_tiles_edge_but_inside_its_block(monkeypatch):
    """Key 100 of block 0, Sq = Skv = 300 (tiles of 64 positions): the first tile's rows stop
    before it, so its predecoded block is flagged non-finite (the per-row sums) where the
    per-block decode of the tile's visible keys is finite (the panel GEMM): the same bits, the
    torch path's NaN pattern, and no NaN before position 100."""
    plan, args = _special_case(300, 300, {100: NAN_CODE})
    assert cpu_kernel.TILE_ROWS // plan.group < 100  # the first tile ends before key 100
    nan, _ = _check_specials(plan, args, monkeypatch)
    assert not nan[0, :, :100].any() and nan[0, :, 100:, 5].all()
    assert not nan[..., :5].any() and not nan[..., 6:].any()


@needs_kernel
@pytest.mark.parametrize("q_len", [3, 20, 300], ids=["fused-rows", "decoded-per-block", "predecoded"])
def test_inf_values_follow_the_torch_paths_ieee_sums(q_len, monkeypatch):
    """+Inf and -Inf values at keys most rows see: with a large q descale most visible P round to
    0 (0 * Inf is NaN) and the rows whose max is one of those keys keep +-Inf, or NaN where the
    signs meet; the kernel's per-row sums give the torch path's exact pattern."""
    plan, args = _special_case(q_len, 600, {0: POS_INF_CODE, 1: NEG_INF_CODE}, q_descale_factor=30.0)
    nan, inf = _check_specials(plan, args, monkeypatch)
    assert nan.any() and inf.any()  # both outcomes occur: the case tests what it claims


@needs_kernel
@pytest.mark.parametrize("shape", [(4, 1, 300, 600, True), (8, 2, 20, 300, False), (6, 1, 100, 257, True),
                                   (12, 2, 1, 700, False)],
                         ids=["predecoded", "decoded-per-block", "6-row-tail", "decode"])
def test_dim_strided_codes_give_the_contiguous_bits(shape):
    """Codes every other byte along the head dim (the scalar decode of strided rows feeding the
    panels and slices) give the contiguous codes' bits."""
    nq, nkv, sq, skv, causal = shape
    plan0, args = make(nq, nkv, (sq,), (skv,), causal=causal, seed=2)
    q, k, v, qd, kd, vd, ps = args

    def every_other(x):
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]

    q2, k2, v2 = (every_other(x) for x in (q, k, v))
    assert q2.stride(-1) == k2.stride(-1) == v2.stride(-1) == 2
    plan = plan_attention(q2, k2, v2, qd, kd, vd, 7, mask_mode=3 if causal else 0, return_softmax_lse=True)
    got = _bits(*cpu_kernel.forward(plan, q2, k2, v2, qd, kd, vd, ps))
    assert _same_bits(got, _bits(*cpu_kernel.forward(plan0, *args)))


# ---- the decoder's affine rule per group of 8 magnitudes, on tables built to break it ---------

def _table_with_descending_denormals() -> torch.Tensor:
    """The HiF8 decode table with the values of magnitudes 1..7 (the denormals) reversed: still
    bf16 patterns, zero at code 0, finite where HiF8 is, sign-symmetric, and affine in the low 3
    bits of the magnitude within its group of 8, but with an xor of 7 (counting down): the fit
    then has X[0] = 7, and code 0 is covered by the rule only if the rule's product is cleared too."""
    bits = luts.decode_lut(torch.float32).clone()  # int32 patterns
    mags = bits[1:8].clone()
    bits[1:8] = mags.flip(0)
    bits[0x81:0x88] = bits[1:8] | torch.tensor(-0x80000000, dtype=torch.int32)
    return bits.view(torch.float32)


@needs_kernel
def test_decoder_is_the_table_for_a_table_whose_first_group_counts_down():
    """Code 0 (and the NaN code's magnitude) is not part of the fit, and the affine rule clears
    only B for it: with X[0] != 0 the rule's M[0] * X[0] survives and +0 decodes to a tiny
    positive number. The init must either cover code 0 or fall back to the table."""
    table = _table_with_descending_denormals()
    t = table.view(torch.int32)
    assert t[0] == 0 and bool((t & 0xFFFF == 0).all())
    assert torch.equal(t[0x81:0x100], t[1:0x80] | torch.tensor(-0x80000000, dtype=torch.int32))
    mod = cpu_kernel._module
    # Finite codes only: a range holding a NaN / Inf code is decoded again by table lookups.
    codes = torch.tensor([c for c in range(256) if torch.isfinite(table[c])], dtype=torch.uint8).repeat(2)
    assert codes[0] == 0 and len(codes) >= 64
    for simd in (True, False):
        got, finite = mod.decode_codes(codes, table, simd)
        assert torch.equal(got.view(torch.int32), t[codes.long()]), (simd, got[:1].view(torch.int32))
        assert finite


@needs_kernel
@pytest.mark.parametrize("bf16", ["1", "0"])
@pytest.mark.parametrize("name", ["decode-1x4097", "fused-3x3000-causal-p15"])
def test_few_row_blocks_run_the_widest_kernels_the_build_has(name, bf16, monkeypatch):
    """Few-row blocks (decode) run bf16 dot products in the AVX512_BF16 build (unless
    QFA_BF16_DOT=0), the 16-lane fp32 kernels in the AVX-512 builds, the 8-lane ones in the AVX2
    build (each one's numbers are checked against the torch path by the cases above, which run
    the build's default, and by test_cpu_kernel_bf16.py's with QFA_BF16_DOT=0)."""
    capability = cpu_kernel.cpu_capability()
    if capability not in ("AVX512", "AVX512_BF16", "AVX2"):
        pytest.skip(f"the few-row kernels need a vector build; this CPU's is {capability} (no avx2 flag)")
    monkeypatch.setenv(cpu_kernel.BF16_ENV_VAR, bf16)
    plan, args = make(**CASES[name])
    cpu_kernel.forward(plan, *args)
    want = {"AVX2": "AVX2", "AVX512": "AVX512", "AVX512_BF16": "AVX512_BF16" if bf16 == "1" else "AVX512"}
    assert cpu_kernel.last_paths() == [want[capability]]


@needs_kernel
def test_decoder_matches_the_table_for_every_run_of_codes_around_the_32_code_body():
    """Every code at every position of the 32-code SIMD body, for lengths that end the body, the
    non-finite re-decode of the body and the scalar tail at each offset: a NaN / Inf code inside
    the body, only in the tail, or absent."""
    table = luts.decode_lut(torch.float32).view(torch.float32)
    bits = table.view(torch.int32)
    mod = cpu_kernel._module
    gen = torch.Generator().manual_seed(9)
    finite_codes = torch.tensor([c for c in range(256) if torch.isfinite(table[c])], dtype=torch.uint8)
    base = finite_codes[torch.randint(len(finite_codes), (100,), generator=gen)]
    for special in (0x80, 0x6F, 0xEF, 0x00):
        for at in (0, 5, 31, 32, 63, 64, 70):
            codes = base.clone()
            codes[at] = special
            for start, n in ((0, 64), (1, 64), (0, 65), (3, 71), (0, 96), (33, 40)):
                c = codes[start:start + n].contiguous()
                got, finite = mod.decode_codes(c, table, True)
                assert torch.equal(got.view(torch.int32), bits[c.long()]), (special, at, start, n)
                assert finite == bool(torch.isfinite(table[c.long()]).all()), (special, at, start, n)




@needs_kernel
@pytest.mark.parametrize("vbmi", ["1", "0"])
@pytest.mark.parametrize("e4m3", [False, True], ids=["hif8", "e4m3"])
def test_every_form_of_the_decoder_is_the_table_bit_for_bit(vbmi, e4m3, monkeypatch):
    """The decoder's form on this CPU (AVX512_VBMI byte lookups, AVX-512 word lookups, the AVX2
    rule / fp16 route, scalar; QFA_VBMI=0 leaves out the first) against the 256-entry table, to
    fp32 and to bf16 words: every code at every position of the 64-code body and its tail, NaN /
    Inf codes inside the body, only in the tail, or absent, and the non-finite flag."""
    monkeypatch.setenv("QFA_VBMI", vbmi)
    mod = cpu_kernel._module
    table = cpu_kernel._e4m3_table() if e4m3 else cpu_kernel._decode_table()
    kind = mod.decoder_kind(table, e4m3)
    flags = cpu_kernel._cpu_flags().split()
    if cpu_kernel.cpu_capability() in ("AVX512", "AVX512_BF16"):
        assert kind == ("vbmi" if vbmi == "1" and "avx512vbmi" in flags else "wide")
    else:
        assert kind in ("simd", "scalar")
    bits = table.view(torch.int32)
    words = (bits >> 16).to(torch.int16)
    finite = torch.isfinite(table)
    gen = torch.Generator().manual_seed(17)
    every = torch.cat([torch.randperm(256, generator=gen) for _ in range(2)]).to(torch.uint8)
    base = every[finite[every.long()]][:200]
    specials = [c for c in range(256) if not finite[c]] + [0x00, 0x80]
    runs = [every]
    for special in specials:
        for at in (0, 5, 31, 32, 63, 64, 100, 127, 128, 190):
            codes = base.clone()
            codes[at] = special
            runs += [codes[start:start + n] for start, n in ((0, 128), (1, 64), (0, 129), (3, 97), (64, 136))]
    for c in runs:
        c = c.contiguous()
        got, fin = mod.decode_codes(c, table, True, e4m3)
        assert torch.equal(got.view(torch.int32), bits[c.long()]), (kind, c[:8])
        assert fin == bool(finite[c.long()].all())
        got16, fin16 = mod.decode_bf16_codes(c, table, True, e4m3)
        assert torch.equal(got16, words[c.long()]), (kind, c[:8])
        assert fin16 == fin


@needs_kernel
def test_the_kernel_decodes_with_the_table_of_each_call():
    """The kernel keeps the decoder it fitted last (fitting one costs about as much as a short
    decode step): a call with another table (one value doubled), and then the first table
    again, must decode with each call's own table."""
    from qfa.attention import quant_flash_attn

    gen = torch.Generator().manual_seed(23)
    q, k, v = (torch.randint(0, 0x60, (1, n, s, 128), generator=gen, dtype=torch.uint8) for n, s in
               ((4, 16), (2, 200), (2, 200)))
    ones = torch.ones(1)
    table = cpu_kernel._decode_table()
    code = int(torch.bincount(k.flatten().long()).argmax())
    doubled = table.clone()
    doubled[code] *= 2
    results = []
    for t in (table, doubled, table):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu_kernel, "_decode_table", lambda t=t: t)
            results.append(quant_flash_attn(q, k, v, ones, ones, ones, 0)[0])
    assert not torch.equal(results[0], results[1]), "the doubled value did not reach the decoder"
    assert torch.equal(results[0], results[2])


@needs_kernel
def test_under_a_torch_func_transform_no_native_code_runs(monkeypatch):
    """Under ``torch.func.functionalize`` every tensor, a fresh output too, is a wrapper whose data
    pointer is 0 (native code would read and write address 0, which took the process down): the
    op and the preparation take their torch paths, whatever those make of the transform."""
    import qfa
    from qfa.attention.backends import cpu_prepare

    g = torch.Generator().manual_seed(11)
    q, k, v = (qfa.encode_to_hifloat8(torch.randn(1, n, 5, 128, generator=g)) for n in (4, 2, 2))
    scales = [torch.full((1,), 0.5)] * 3
    qfa.quant_flash_attn(q, k, v, *scales)  # remembered: the known path must stand aside too
    ran = []
    monkeypatch.setattr(cpu_kernel, "forward", lambda *a, **kw: ran.append("kernel"))
    seen = []

    def call(x):
        seen.append(cpu_prepare.usable(x))
        try:
            qfa.quant_flash_attn(x, k, v, *scales)
        except RuntimeError:  # (the torch path's reads of values are not functionalize's)
            pass
        return x

    torch.func.functionalize(call)(q)
    assert seen == [False] and not ran
    assert cpu_prepare.usable(q)  # outside the transform: native again


@needs_kernel
@pytest.mark.parametrize("wrapped", ["q", "k", "v"])
def test_the_binding_refuses_a_tensor_without_memory(wrapped):
    """The kernel's last line of defence: an operand whose data pointer is 0 is named, not read."""
    import qfa

    g = torch.Generator().manual_seed(12)
    q, k, v = (qfa.encode_to_hifloat8(torch.randn(1, n, 5, 128, generator=g)) for n in (4, 2, 2))
    scales = [torch.full((1,), 0.5)] * 3
    plan = plan_attention(q, k, v, *scales, 0)

    def call(x):
        operands = {"q": q, "k": k, "v": v} | {wrapped: x}
        return cpu_kernel.forward(plan, *operands.values(), *scales, None)[0]

    with pytest.raises(RuntimeError, match=f"^{wrapped}: a tensor with memory of its own"):
        torch.func.functionalize(call)({"q": q, "k": k, "v": v}[wrapped])
