"""The native preparation (qfa.attention.backends.cpu_prepare / prepare): the same bits as the definitions.

* The encoder at every SIMD level the CPU has, on every fp32 top-16-bit pattern with low-bit
  variants (the bf16/fp16 patterns are exhaustive in tests/cast/test_cast_encode.py), against the
  torch path's table; ``quantize`` (x / scale, then the encode) and its saturated count.
* The rotation's row kernel against its definition (the torch butterfly), every level, every
  dtype in and out; the butterfly against ``x @ hadamard(n)`` in float64.
* The drop-in's two passes (codes, scales, K means; any layout, padding, dtype, rule) against
  the materialised path in torch ops, and the output's un-rotation and cast.
* ``encode_tokens`` against its documented equivalent, its saturated count against the KV
  cache's, and its argument errors.
* The default drop-in call compiles nothing with TorchInductor in a fresh process.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch

import qfa
from qfa.dropin import calibration as cal
from qfa.attention.backends import cpu_kernel, cpu_prepare
from qfa.dropin import eager as dropin_eager, prepare, rotation, smoothing
from qfa.dropin.call import DropinCall
from qfa.cast import format as fmt
from qfa.cast import luts, torch_path
from qfa.serving import encoding

pytestmark = pytest.mark.skipif(not cpu_prepare.available(), reason="the native CPU preparation is not built")

D = 128
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def levels():
    """Every SIMD level of the source, skipped (with the flags it lacks) where the CPU lacks it."""
    out = []
    for level, name in enumerate(cpu_prepare.ISA_NAMES):
        marks = []
        if cpu_prepare.available() and level > cpu_prepare.isa_level():
            marks = [pytest.mark.skip(reason=f"this CPU lacks {' / '.join(cpu_prepare.ISA_FLAGS[level])}")]
        out.append(pytest.param(level, id=name, marks=marks))
    return out


@pytest.fixture
def torch_only(monkeypatch):
    """The torch paths (QFA_NATIVE=0): what the native passes must reproduce."""
    monkeypatch.setenv(cpu_kernel.ENV_VAR, "0")


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({4: torch.int32, 2: torch.int16}[x.element_size()])


def same_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns wherever either is not NaN, NaN at the same places (NaN payloads are
    not part of the contract)."""
    nan = torch.isnan(a.float())
    return torch.equal(nan, torch.isnan(b.float())) and torch.equal(bits(a)[~nan], bits(b)[~nan])


def randn(*shape, seed: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


# ----------------------------------------------------------------------------- the encoder

def fp32_patterns(low: int) -> torch.Tensor:
    """Every upper half of an fp32 pattern with the lower half ``low``."""
    top = torch.arange(1 << 16, dtype=torch.int64)
    u = (top << 16) | low
    return torch.where(u >= 1 << 31, u - (1 << 32), u).to(torch.int32).view(torch.float32)


def table_codes(x: torch.Tensor, overflow: str) -> torch.Tensor:
    """The torch path's encode (the 65536-entry table, NaN by the full pattern), eager."""
    table = luts.full_lut(luts.table_dtype(x.dtype), overflow)
    return torch_path.encode_bits(x.reshape(-1).view(luts.BITS_VIEW[x.dtype]), table).view(x.shape)


LOW_BITS = (0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x5A3C)


@pytest.mark.parametrize("level", levels())
@pytest.mark.parametrize("overflow", fmt.OVERFLOW_MODES)
def test_every_fp32_top16_pattern_with_low_bits(level, overflow):
    for low in LOW_BITS:
        x = fp32_patterns(low)
        got = cpu_prepare.encode_flat(x, inf_mode=overflow == "inf", isa=level)
        assert torch.equal(got, table_codes(x, overflow)), f"low half 0x{low:04X}"


@pytest.mark.parametrize("level", levels())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_is_the_fp32_division_then_the_encode(level, dtype):
    # values over HiF8's range and beyond (saturation), specials, a ragged length past the
    # parallel grain; a scale that is not a power of two, so the division rounds
    n = (1 << 18) + 4099
    x = randn(n, seed=1) * torch.exp2(randn(n, seed=2) * 12)
    x[:6] = torch.tensor([math.nan, math.inf, -math.inf, 1e30, -5e4, 0.0])
    x = x.to(dtype)
    scale = 0.3
    codes, saturated = cpu_prepare.quantize_flat(x, scale, isa=level)
    q = x.float() / torch.tensor([scale], dtype=torch.float32)
    assert torch.equal(codes, table_codes(q, "saturate"))
    assert saturated == int(((q.abs() >= fmt.OVERFLOW_THRESHOLD) & torch.isfinite(q)).sum())
    assert saturated > 0


@pytest.mark.parametrize("level", levels())
def test_saturation_count_at_its_edges(level):
    """The count of quotients at or above the overflow threshold and finite, at the patterns
    where each SIMD level's test could go wrong: the threshold and its neighbours, the largest
    finite value, Inf, and NaNs whose payload lies in either half; both signs, every lane."""
    edge = torch.tensor([fmt.OVERFLOW_THRESHOLD], dtype=torch.float32).view(torch.int32).item()
    bits = [edge - 1, edge, edge + 1, 0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7F80FFFF, 0x3F800000]
    bits += [b | -0x80000000 for b in bits]
    x = torch.tensor(bits * 8, dtype=torch.int64).to(torch.int32).view(torch.float32)  # 144 values: full vectors
    codes, saturated = cpu_prepare.quantize_flat(x, 1.0, isa=level)
    assert saturated == int(((x.abs() >= fmt.OVERFLOW_THRESHOLD) & torch.isfinite(x)).sum()) == 8 * 2 * 3
    assert torch.equal(codes, table_codes(x, "saturate"))


#: Codes past which the native cast writes with non-temporal stores (the source's kStreamMin).
STREAM_MIN = 1 << 23


@pytest.mark.parametrize("level", levels())
def test_outputs_past_the_caches_stream_with_the_same_bits(level):
    x = fp32_patterns(0x8001).view(torch.int32).repeat(STREAM_MIN // (1 << 16) + 1)[:STREAM_MIN + 4133]
    x = x.view(torch.float32)
    assert torch.equal(cpu_prepare.encode_flat(x, isa=level), table_codes(x, "saturate"))
    codes, saturated = cpu_prepare.quantize_flat(x, 2.0, isa=level)
    q = x / 2.0
    assert torch.equal(codes, table_codes(q, "saturate"))
    assert saturated == int(((q.abs() >= fmt.OVERFLOW_THRESHOLD) & torch.isfinite(q)).sum())


def _virtio(root, devices):
    """A fake /sys/bus/virtio/devices: one folder per (device id, features string)."""
    for i, (device, features) in enumerate(devices):
        entry = root / f"virtio{i}"
        entry.mkdir()
        (entry / "device").write_text(f"0x{device:04x}\n")
        (entry / "features").write_text(features + "\n")
    return root


@pytest.mark.parametrize("devices, reports", [
    ([], False),
    ([(5, "0110010100000000")], True),             # a balloon with VIRTIO_BALLOON_F_REPORTING (bit 5)
    ([(5, "0110000100000000")], False),            # a balloon without it
    ([(2, "0010011001100100"), (1, "1100010110111011")], False),   # a disk and a NIC: bit 5 is theirs
    ([(2, "0000010000000000"), (5, "0000010000000000")], True),
    ([(5, "01100")], False),                       # a features string too short to hold the bit
], ids=["none", "balloon-reports", "balloon-quiet", "other-devices", "mixed", "short"])
def test_free_page_reporting_reads_the_balloons_feature_bit(tmp_path, devices, reports):
    assert cpu_prepare.free_page_reporting(_virtio(tmp_path, devices)) is reports


def test_free_page_reporting_without_sysfs_or_with_odd_entries(tmp_path):
    assert cpu_prepare.free_page_reporting(tmp_path / "absent") is False
    (tmp_path / "virtio0").mkdir()                          # no device file
    odd = tmp_path / "virtio1"
    odd.mkdir()
    (odd / "device").write_text("balloon\n")                # not a hex id
    assert cpu_prepare.free_page_reporting(tmp_path) is False


def test_the_huge_page_hint_follows_the_machine_and_keeps_the_bits():
    assert cpu_prepare.huge_pages() is (not cpu_prepare.free_page_reporting())
    x = torch.randn(STREAM_MIN + 77, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = table_codes(x.float(), "saturate")
    lib = cpu_prepare.module()
    before = lib.qfa_huge_pages()
    try:
        for on in (1, 0):
            lib.qfa_set_huge_pages(on)
            assert cpu_prepare.huge_pages() is bool(on)
            assert torch.equal(cpu_prepare.encode_flat(x), want)
    finally:
        lib.qfa_set_huge_pages(before)


def test_a_forked_child_encodes_after_the_parents_parallel_cast():
    """libgomp's team does not survive fork: the child runs the cast on its calling thread
    (it hung in the parent's team before). Compared by hash: a torch op in the child could
    itself open a parallel region."""
    code = (
        "import hashlib, os, torch, qfa\n"
        "x = torch.randn(1 << 22).bfloat16()\n"
        "digest = lambda: hashlib.sha1(qfa.encode_to_hifloat8(x).numpy().tobytes()).hexdigest()\n"
        "want = digest()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if digest() == want else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(os.waitstatus_to_exitcode(status))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "0"


def test_a_forked_child_runs_the_prepare_passes_on_the_pool():
    """The prepare passes of a forked child run on the library's own pool (libgomp's team does
    not survive fork), pinned to it after the parent's OpenMP regions, with the parent's bits:
    a statistics pass and an encode over 4096 rows, past the passes' parallel threshold."""
    code = (
        "import hashlib, os, torch\n"
        "from qfa.dropin import prepare\n"
        "x = torch.randn(4096, 4, 128).bfloat16()\n"
        "def digest():\n"
        "    codes, scale, sat = prepare.encode_tokens(x)\n"
        "    return hashlib.sha1(codes.numpy().tobytes()).hexdigest() + repr(float(scale)) + repr(int(sat))\n"
        "from qfa.attention.backends import cpu_prepare\n"
        "torch.set_num_threads(2)\n"
        "want = digest()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    same = digest() == want and digest() == want\n"
        "    os._exit(0 if same and cpu_prepare.last_team() == 'pool' else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(os.waitstatus_to_exitcode(status))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "0"


def test_calibration_quantize_takes_the_native_pass_with_the_same_bits(monkeypatch):
    x = randn(3, 70, D, seed=3, dtype=torch.bfloat16)[:, ::2]  # strided
    native = cal.quantize(x, 0.125)
    monkeypatch.setenv(cpu_kernel.ENV_VAR, "0")
    assert torch.equal(native, cal.quantize(x, 0.125))


# ----------------------------------------------------------------------------- the rotation

def test_the_butterfly_is_the_hadamard_product():
    """In float64 the butterfly is x @ hadamard(n) up to float64 rounding (log2 n levels of
    sums of magnitude <= sum |x|, and the scaling)."""
    x = randn(64, D, seed=4).double()
    got = rotation.butterfly(x)
    want = x @ rotation.hadamard(D).double()
    bound = (math.log2(D) + 2) * 2.0 ** -53 * x.abs().sum(-1, keepdim=True) * rotation.normalisation(D)
    assert ((got - want).abs() <= bound).all()


@pytest.mark.parametrize("level", levels())
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotate_rows_is_the_butterfly_then_the_saturating_cast(level, dtype, out_dtype):
    x = randn(300, D, seed=5, scale=3e4).to(dtype)
    x[0, :4] = torch.tensor([math.inf, -math.inf, math.nan, 1e30]).to(dtype)
    x[1] = torch.finfo(dtype).max / 4  # sums past a narrow dtype's range: saturate, not Inf
    x[2] = (randn(1, D, seed=9) * torch.finfo(torch.float32).tiny).to(dtype)  # fp32 denormal sums
    got = cpu_prepare.rotate_rows(x, out_dtype, rotation.normalisation(D), isa=level)
    want = dropin_eager.saturating_cast(rotation.butterfly(x.float()), out_dtype)
    assert same_or_both_nan(got, want)
    if out_dtype == torch.float32:
        assert same_or_both_nan(rotation.rotate(x), want)  # the public function: the same kernel


def test_rotate_under_tracing_takes_the_torch_ops_with_the_same_bits():
    x = randn(5, 3, D, seed=6, dtype=torch.bfloat16)
    traced = torch.compile(rotation.rotate, backend="eager", fullgraph=True)(x)
    assert torch.equal(bits(traced), bits(rotation.rotate(x)))


def test_rotate_keeps_autograd_through_the_torch_ops():
    x = randn(4, D, seed=7).requires_grad_()
    rotation.rotate(x).sum().backward()
    assert torch.allclose(x.grad, rotation.hadamard(D).sum(1).expand(4, D), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- the drop-in's passes

def _call(layout: str, dtype, *, smooth_k=True, rotate=True, calibration="rms", scales=None, padded=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, nq, nkv, s = 2, 4, 2, 45
    q, k, v = (torch.randn(b, n, s, D, generator=g) for n in (nq, nkv, nkv))
    k = k + 3 * torch.randn(D, generator=g)  # a key offset: smoothing matters
    kw = {}
    if padded:
        kw["seqused_q"] = torch.tensor([45, 30], dtype=torch.int32)
        kw["seqused_kv"] = torch.tensor([40, 17], dtype=torch.int32)
    if layout == "BSND":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # strided views, not copies
    elif layout == "TND":
        lens = [19, 26]
        q, k, v = (torch.cat([t[0, :, :lens[0]], t[1, :, :lens[1]]], dim=1).transpose(0, 1) for t in (q, k, v))
        cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
        kw = {"cu_seqlens_q": cu, "cu_seqlens_kv": cu}
        if padded:
            kw["seqused_q"] = torch.tensor([19, 11], dtype=torch.int32)
            kw["seqused_kv"] = torch.tensor([7, 26], dtype=torch.int32)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    q_s, k_s, v_s = scales or (None, None, None)
    return DropinCall(q=q, k=k, v=v, layout=layout, smooth_k=smooth_k, rotate=rotate, calibration=calibration,
                      q_scale=q_s, k_scale=k_s, v_scale=v_s, **kw)


def materialised(c: DropinCall):
    """codes, scales, mu by the materialised path: smoothing.prepare, the rule on the valid
    values, calibration.quantize (the drop-in's code before the native passes)."""
    tensors, mu = smoothing.prepare(c.q, c.k, c.v, layout=c.layout, cu_seqlens_kv=c.cu_seqlens_kv,
                                    seqused_kv=c.seqused_kv, smooth_k=c.smooth_k, rotate=c.rotate)
    scales = dropin_eager._scales(c, tensors)
    return [cal.quantize(t, s) for t, s in zip(tensors, scales)], scales, mu


CASES = [
    ("BNSD", torch.bfloat16, {}),
    ("BNSD", torch.float32, {"padded": True}),
    ("BNSD", torch.float16, {"smooth_k": False}),
    ("BSND", torch.bfloat16, {"padded": True}),
    ("BSND", torch.float32, {"rotate": False}),
    ("TND", torch.bfloat16, {}),
    ("TND", torch.float32, {"padded": True}),
    ("TND", torch.float16, {"padded": True, "calibration": "amax"}),
    ("BNSD", torch.bfloat16, {"calibration": "amax", "rotate": False, "smooth_k": False}),
    ("BNSD", torch.bfloat16, {"scales": (torch.tensor([0.25]), None, torch.tensor([0.75]))}),
    ("TND", torch.float32, {"scales": (torch.tensor([0.5]), torch.tensor([0.3]), torch.tensor([2.0]))}),
]


def _case_id(case):
    layout, dtype, kw = case
    return "-".join([layout, str(dtype).split(".")[-1], *(f"{k}={'set' if k == 'scales' else v}" for k, v in kw.items())])


@pytest.mark.parametrize("layout,dtype,kw", CASES, ids=[_case_id(c) for c in CASES])
def test_the_native_passes_have_the_materialised_bits(layout, dtype, kw, monkeypatch):
    c = _call(layout, dtype, **kw)
    got = prepare.quantized_inputs(c, dropin_eager.static_scale)
    assert got is not None, "the native passes did not run"
    monkeypatch.setenv(cpu_kernel.ENV_VAR, "0")
    want = materialised(c)
    for name, g, w in zip("qkv", got[0], want[0]):
        assert torch.equal(g, w), f"{name} codes"
    for name, g, w in zip("qkv", got[1], want[1]):
        assert torch.equal(g, w), f"{name} scale"
    assert (got[2] is None) == (want[2] is None) and (got[2] is None or torch.equal(got[2], want[2]))


@pytest.mark.parametrize("level", levels())
def test_every_level_gives_the_drop_ins_bits(level, monkeypatch):
    c = _call("BSND", torch.bfloat16, padded=True, seed=3)
    best = prepare.quantized_inputs(c, dropin_eager.static_scale)
    monkeypatch.setattr(cpu_prepare, "ISA", level)
    got = prepare.quantized_inputs(c, dropin_eager.static_scale)
    for a, b in zip(best[0] + best[1] + [best[2]], got[0] + got[1] + [got[2]]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("threads", [1, 2])
def test_no_bit_depends_on_the_thread_count_or_the_team(threads, monkeypatch):
    """Fixed chunks, partial sums added in chunk order: the calling thread alone, the OpenMP
    team and the library's own pool give the same statistics (the float64 sum itself, not just
    the scale), codes and output, on any thread count."""
    c = _call("BSND", torch.bfloat16, padded=True, seed=8)
    big = randn(4, 700, D, seed=9, dtype=torch.bfloat16).transpose(0, 1)  # (T, N, D), strided; past the
    strides, heads = prepare.row_strides(big, "TND")                       # passes' parallel threshold
    segs = [0, 0, 700, 700]
    before = torch.get_num_threads()
    results = []
    try:
        torch.set_num_threads(threads)
        for team in ("caller", "openmp", "pool"):
            cpu_prepare.set_team(team)
            mu = torch.empty(1, heads, D)
            stats = cpu_prepare.stats(big, strides, segs, heads, True, rotation.normalisation(D), mean=mu,
                                      compute_mean=True)
            assert cpu_prepare.last_team() == (team if threads > 1 else "caller")  # the pinned team ran it
            codes = prepare.encode_rows(big, "TND", segs, rotate=True, scale=None, reduction=cal.RMS_REDUCTION)[0]
            results.append((stats, mu, codes, prepare.quantized_inputs(c, dropin_eager.static_scale),
                            prepare.restore_output(big.contiguous(), torch.float16)))
    finally:
        cpu_prepare.set_team("automatic")
        torch.set_num_threads(before)
    s0, m0, c0, d0, r0 = results[0]
    for s1, m1, c1, d1, r1 in results[1:]:
        assert s0 == s1 and torch.equal(m0, m1) and torch.equal(c0, c1) and torch.equal(bits(r0), bits(r1))
        for a, b in zip(d0[0] + d0[1] + [d0[2]], d1[0] + d1[1] + [d1[2]]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("team", ["caller", "openmp", "pool"])
def test_batched_passes_give_each_tensor_its_own_results(team):
    """q, k and v share one region per pass (stats_many, encode_many): each tensor's float64
    sum, amax, NaN flag, K means, codes and saturated count are those of its passes alone,
    whichever team runs the region and whatever the other tensors hold (a NaN in one flags only
    that one)."""
    c = rotation.normalisation(D)
    q = randn(3, 600, D, seed=21, dtype=torch.bfloat16).transpose(0, 1)  # (T, N, D), strided
    k = randn(700, 2, D, seed=22, scale=3.0)
    v = randn(700, 2, D, seed=23, dtype=torch.float16)
    v[5, 1, 7] = float("nan")
    tensors = [(q, [0, 0, 600, 600]), (k, [0, 0, 650, 700]), (v, [0, 0, 700, 700])]
    plans = [(x, *prepare.row_strides(x, "TND"), segs) for x, segs in tensors]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cpu_prepare.set_team(team)
        means = [torch.empty(1, 2, D), torch.empty(1, 2, D)]
        alone = [cpu_prepare.stats(q, plans[0][1], plans[0][3], 3, True, c),
                 cpu_prepare.stats(k, plans[1][1], plans[1][3], 2, True, c, mean=means[0], compute_mean=True),
                 cpu_prepare.stats(v, plans[2][1], plans[2][3], 2, False, c)]
        together = cpu_prepare.stats_many([
            cpu_prepare.RowPass(k, plans[1][1], plans[1][3], 2, True, means[1], True),
            cpu_prepare.RowPass(q, plans[0][1], plans[0][3], 3, True),
            cpu_prepare.RowPass(v, plans[2][1], plans[2][3], 2, False)], c)
        same = lambda a, b: all(x == y or (x != x and y != y) for x, y in zip(a, b))  # noqa: E731  (NaN sums)
        assert all(same(a, b) for a, b in zip(together, [alone[1], alone[0], alone[2]]))
        assert torch.equal(means[0], means[1])
        assert [s[2] for s in alone] == [False, False, True]
        outs = [[torch.empty(x.shape, dtype=torch.uint8) for x, _ in tensors] for _ in range(2)]
        scales, mus, rotates = (0.25, 0.5, 1e-5), (None, means[0], None), (True, True, False)
        passes = [[cpu_prepare.RowPass(x, st, segs, n, r, mu, False, out, prepare.row_strides(out, "TND")[0], s)
                   for (x, st, n, segs), out, s, mu, r in zip(plans, outs[i], scales, mus, rotates)] for i in range(2)]
        sat_alone = [cpu_prepare.encode_many([p], c)[0] for p in passes[0]]
        sat_together = cpu_prepare.encode_many(passes[1], c)
    finally:
        cpu_prepare.set_team("automatic")
        torch.set_num_threads(before)
    assert sat_alone == sat_together and sat_alone[2] > 0  # v / 1e-5 saturates
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_one_array_for_both_passes_gives_the_per_pass_results():
    """cpu_prepare.Passes (the drop-in's: the array built and checked once) against stats_many
    then encode_many: pass 1 over a prefix (K computing its means first), pass 2 over all, the
    means pass 1 wrote read back by pass 2; and its argument errors."""
    c = rotation.normalisation(D)
    k = randn(300, 2, D, seed=31, scale=2.0, dtype=torch.bfloat16)
    q = randn(300, 4, D, seed=32)
    v = randn(300, 2, D, seed=33, dtype=torch.float16)
    tensors = [(k, [0, 0, 280, 300], True), (q, [0, 0, 300, 300], False), (v, [0, 0, 300, 300], False)]
    plans = [(x, *prepare.row_strides(x, "TND"), segs, smooth) for x, segs, smooth in tensors]

    def rows(means, outs, scales=(1.0, 1.0, 1.0), compute=True):
        return [cpu_prepare.RowPass(x, st, segs, n, True, mu, compute and smooth, out,
                                    prepare.row_strides(out, "TND")[0], s)
                for (x, st, n, segs, smooth), mu, out, s in zip(plans, means, outs, scales)]

    fresh = lambda: ([torch.empty(1, 2, D), None, None], [torch.empty(x.shape, dtype=torch.uint8) for x, _, _ in tensors])  # noqa: E731
    (mu_a, out_a), (mu_b, out_b) = fresh(), fresh()
    want_stats = cpu_prepare.stats_many(rows(mu_a, out_a)[:2], c)  # k (computing its means), q; v's scale given
    scales = (0.5, 0.25, 1e-5)
    want_sat = cpu_prepare.encode_many(rows(mu_a, out_a, scales, compute=False), c)
    native = cpu_prepare.Passes(rows(mu_b, out_b))
    got_stats = native.stats(2, c)
    got_sat = native.encode(scales, c)
    assert got_stats == want_stats and got_sat == want_sat and got_sat[2] > 0
    assert torch.equal(mu_a[0], mu_b[0])
    assert all(torch.equal(a, b) for a, b in zip(out_a, out_b))
    with pytest.raises(ValueError, match=r"count must be in \[0, 3\] \(every pass computing its means included\), got 4"):
        native.stats(4, c)
    again = cpu_prepare.Passes(rows(*fresh()))
    with pytest.raises(ValueError, match=r"count must be in \[1, 3\] .*, got 0"):  # k computes its means
        again.stats(0, c)
    with pytest.raises(ValueError, match="pass 2 would read K means that pass 1 has not computed"):
        again.encode(scales, c)
    with pytest.raises(ValueError, match=r"scales must hold one value per tensor \(3\), got 2"):
        native.encode((1.0, 1.0), c)
    with pytest.raises(ValueError, match="out must be uint8"):
        cpu_prepare.Passes([rows(*fresh())[0]._replace(out=None)])


def test_pass_one_statistics_are_the_rules_statistics():
    """amax exactly that of the materialised tensor; the float64 sum of squares within float64
    rounding of the exact sum (math.fsum) over the same values."""
    c = _call("BNSD", torch.bfloat16, padded=True, seed=4)
    segs = prepare.segments(c.k, "BNSD", None, c.seqused_kv)
    strides, heads = prepare.row_strides(c.k, "BNSD")
    mu = torch.empty(2, heads, D)
    sumsq, amax, nonfinite = cpu_prepare.stats(c.k, strides, segs, heads, True, rotation.normalisation(D),
                                               mean=mu, compute_mean=True)
    assert torch.equal(mu, smoothing.key_means(c.k, "BNSD", None, c.seqused_kv))
    (_, ks, _), _ = smoothing.prepare(c.q, c.k, c.v, seqused_kv=c.seqused_kv)
    part = smoothing.valid_values(ks, "BNSD", c.seqused_kv).double()
    assert not nonfinite and amax == part.abs().max().item()
    exact = math.fsum((part * part).tolist())
    assert abs(sumsq - exact) <= part.numel() * 2.0 ** -53 * exact


def test_key_means_native_and_torch_agree(monkeypatch):
    c = _call("TND", torch.bfloat16, padded=True, seed=5)
    native = smoothing.key_means(c.k, "TND", c.cu_seqlens_kv, c.seqused_kv)
    monkeypatch.setenv(cpu_kernel.ENV_VAR, "0")
    assert torch.equal(native, smoothing.key_means(c.k, "TND", c.cu_seqlens_kv, c.seqused_kv))


def test_untrusted_lengths_never_reach_the_native_passes():
    """With a caller's plan the lengths are not checked again: lengths outside the tensor must
    send the call to the materialised path, not read out of bounds."""
    k = torch.zeros(10, 2, D)
    assert prepare.segments(k, "TND", torch.tensor([0, 12], dtype=torch.int32), None) is None
    assert prepare.segments(k, "TND", torch.tensor([0, 6, 3], dtype=torch.int32), None) is None
    assert prepare.segments(k.view(1, 2, 10, D), "BNSD", None, torch.tensor([19], dtype=torch.int32)) == [0, 0, 10, 10]


def test_a_row_plan_past_the_tensor_is_refused():
    x = torch.zeros(10, 2, D)
    strides, heads = prepare.row_strides(x, "TND")
    with pytest.raises(ValueError, match="reaches past x's storage"):
        cpu_prepare.stats(x, strides, [0, 0, 11, 11], heads, True, 1.0)
    with pytest.raises(ValueError, match="reaches past x's storage"):
        cpu_prepare.stats(x, strides, [0, 0, 10, 10], heads + 1, True, 1.0)
    out = torch.empty(5, 2, D, dtype=torch.uint8)
    with pytest.raises(ValueError, match="reaches past out's storage"):
        cpu_prepare.encode_rows(x, strides, out, prepare.row_strides(out, "TND")[0], [0, 0, 10, 10], heads, True,
                                1.0, None, 1.0)
    with pytest.raises(ValueError, match="mean_out must be a contiguous fp32"):
        cpu_prepare.key_means(x, strides, [0, 0, 10, 10], heads, torch.empty(1, 1, D))
    assert cpu_prepare.stats(x, strides, [0, 0, 10, 10], heads, True, 1.0) == (0.0, 0.0, False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_restore_output_is_the_rotation_then_the_saturating_cast(dtype):
    out = randn(1, 4, 33, D, seed=6, scale=2e4).bfloat16()
    out[0, 0, 0, :3] = torch.tensor([math.nan, math.inf, 6e4])
    got = prepare.restore_output(out, dtype)
    want = dropin_eager.saturating_cast(rotation.butterfly(out.float()), dtype)
    assert got.shape == out.shape and got.dtype == dtype and same_or_both_nan(got, want)


def test_non_finite_inputs_still_name_the_tensor():
    c = _call("BNSD", torch.bfloat16, seed=7)
    k = c.k.clone()
    k[1, 0, 3, 5] = math.inf
    with pytest.raises(ValueError, match="^k contains NaN or Inf"):
        qfa.hif8_attention(c.q, k, c.v)


@pytest.mark.parametrize("bad", ["q", "k", "v"])
def test_the_first_bad_input_in_q_k_v_order_is_the_one_named(bad, monkeypatch):
    """A NaN in one input whose scale is computed, beside a NaN static scale of a later one (or
    an earlier one): the native passes raise the error the materialised path raises, the first
    bad one in q, k, v order, though they check the scales after one batched pass 1."""
    c = _call("BNSD", torch.float32, seed=11)
    tensors = {"q": c.q.clone(), "k": c.k.clone(), "v": c.v.clone()}
    tensors[bad][0, 1, 2, 3] = math.nan
    scale_of = {"q": "k", "k": "v", "v": "q"}[bad]  # a bad static scale elsewhere
    scales = tuple(torch.tensor([math.nan]) if n == scale_of else None for n in "qkv")
    errors = []
    for native in ("1", "0"):
        monkeypatch.setenv(cpu_kernel.ENV_VAR, native)
        with pytest.raises(ValueError) as info:
            qfa.hif8_attention(tensors["q"], tensors["k"], tensors["v"], scales=scales)
        errors.append(str(info.value))
    assert errors[0] == errors[1]
    first = min(bad, scale_of, key="qkv".index)
    want = f"^{bad} contains NaN or Inf" if first == bad else rf"^scales\[{'qkv'.index(first)}\] \({first}_scale\)"
    assert re.match(want, errors[0]), errors[0]


# ----------------------------------------------------------------------------- encode_tokens

def reference_tokens(x, mean, rotate, scale, calibration):
    y = x.float() if mean is None else x.float() - mean
    y = rotation.rotate(y) if rotate else y
    s = cal.compute_scale(y, calibration) if scale is None else cal.check_scale(scale)
    return cal.quantize(y, s), s, y


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("with_mean", [True, False])
@pytest.mark.parametrize("calibration", ["rms", "amax", "mse"])
def test_encode_tokens_is_its_documented_equivalent(dtype, rotate, with_mean, calibration):
    x = (randn(37, 3, D, seed=8) + 2).to(dtype)
    mean = randn(3, D, seed=9) if with_mean else None
    codes, scale, saturated = prepare.encode_tokens(x, mean=mean, rotate=rotate, calibration=calibration)
    want_codes, want_scale, _ = reference_tokens(x, mean, rotate, None, calibration)
    assert torch.equal(codes, want_codes) and torch.equal(scale, want_scale)
    assert saturated.dtype == torch.int64 and saturated.dim() == 0 and int(saturated) == 0


def test_encode_tokens_with_a_static_scale_counts_what_the_cache_counts():
    x = randn(50, 2, D, seed=10, scale=3.0, dtype=torch.bfloat16).transpose(0, 1).contiguous().transpose(0, 1)
    assert not x.is_contiguous()
    mean = randn(2, D, seed=11)
    scale = torch.tensor([2.0 ** -14])  # too small: many values saturate
    codes, used, saturated = prepare.encode_tokens(x, mean=mean, scale=scale)
    want_codes, _, y = reference_tokens(x, mean, True, scale, None)
    cache_codes, cache_saturated = encoding.encode(y, scale)
    assert torch.equal(codes, want_codes) and torch.equal(codes, cache_codes)
    assert torch.equal(used, scale) and int(saturated) == int(cache_saturated) > 0


def test_encode_tokens_nan_inf():
    x = randn(4, 1, D, seed=12)
    x[1, 0, 7] = math.nan
    with pytest.raises(ValueError, match="^x contains NaN or Inf"):
        prepare.encode_tokens(x)
    codes, _, _ = prepare.encode_tokens(x, scale=1.0, rotate=False)
    assert codes[1, 0, 7] == fmt.NAN_CODE


def test_encode_tokens_leaves_inputs_alone():
    x, mean = randn(9, 2, D, seed=13, dtype=torch.float16), randn(2, D, seed=14)
    before = (x.clone(), mean.clone())
    prepare.encode_tokens(x, mean=mean)
    assert torch.equal(x, before[0]) and torch.equal(mean, before[1])


@pytest.mark.parametrize("kwargs,exc,pattern", [
    ({"x": torch.zeros(2, 1, D, dtype=torch.float64)}, TypeError, "x must be float32, bfloat16 or float16, got"),
    ({"x": torch.zeros(2, D)}, ValueError, r"x must be \(tokens, heads, 128\), got shape \(2, 128\)"),
    ({"x": [1.0]}, TypeError, "x must be a torch.Tensor, got list"),
    ({"mean": torch.zeros(3, D)}, ValueError, r"mean must be fp32 of shape \(heads, 128\) = \(2, 128\)"),
    ({"mean": torch.zeros(2, D, dtype=torch.bfloat16)}, ValueError, "mean must be fp32"),
    ({"mean": 0.5}, TypeError, "mean must be None or an fp32 tensor, got float"),
    ({"scale": 0.0}, ValueError, "scale must be positive and finite, got 0.0"),
    ({"scale": torch.ones(2)}, ValueError, r"scale must hold one value"),
    ({"calibration": "nope"}, ValueError, "calibration must be one of"),
    ({"calibration": 3}, TypeError, "calibration must be a rule name"),
    ({"rotate": 1}, TypeError, "rotate must be a bool, got int"),
])
def test_encode_tokens_names_bad_arguments(kwargs, exc, pattern):
    args = {"x": torch.zeros(4, 2, D), **kwargs}
    x = args.pop("x")
    with pytest.raises(exc, match=pattern):
        prepare.encode_tokens(x, **args)


# ----------------------------------------------------------------------------- no compile on the first call

def test_the_default_call_compiles_nothing_in_a_fresh_process():
    code = (
        "import json, torch, qfa\n"
        "from qfa import _compile\n"
        "q, k, v = (torch.randn(1, h, 300, 128, dtype=torch.bfloat16) for h in (4, 2, 2))\n"
        "qfa.hif8_attention(q, k, v, is_causal=True)\n"
        "qfa.encode_to_hifloat8(torch.randn(1 << 17))\n"
        "print(json.dumps(sorted(f.__name__ for f in _compile._compiled)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
