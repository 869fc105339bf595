"""quant_mode 1 (MXFP8) and 6 (FP8 per-token-head) on the native CPU kernel, against the torch path.

The kernel computes :mod:`qfa.attention.backends.scaled_torch_path`'s numbers up to fp32
summation order: the same E4M3 values (its decoder, checked here on all 256 codes), the same
scaled operands (mode 1's E8M0 scales are powers of two, so folding them into Q, K and V at decode
is exact; mode 6's fp32 scales are applied to S and to P8 V where the torch path applies them, in
the same order of operations), the same 512-key softmax blocks and the same E4M3 rounding of P
(checked here on every rounding midpoint and a dense sweep). Products of E4M3 values (4
significant bits each) are exact in fp32, so S and P8 V differ only in the order their exact
terms are summed; exp may differ in its last ulp (Sleef's vectorised exp against torch's).

The tolerances follow from that, as ``check_against_reference`` (test_attention_reference.py)
derives its own: an fp32 result a few ulps apart can round to the neighbouring bf16 (the band's
2^-7 relative, 1e-4 absolute near 0); and a P within a few fp32 ulps of an E4M3 rounding tie may
round the other way on one side, moving P8 by one E4M3 step. A step is at most 2^-3 of P (3
mantissa bits; subnormal steps 2^-9 are smaller still than the band), P <= p_scale and l >=
p_scale (the row's maximum contributes p_scale), so one flip moves out by at most 2^-3 max|v|:
within the reference's allowance of 2^-2 max|v| beyond the band. The tie window (a few 2^-23
relative against steps of 2^-3) makes flips rare (~1e-6 of the P values), so the reference's 99.9 %
in-band share holds too. lse = m + ln l: m is computed by the same steps from the same S up to
summation order, so the reference's lse tolerance applies unchanged.

Where every fp32 step is exact in any order (scores +-128 from +-1 elements, P in {0, 1}, V sums
of at most 24 bits; see "exact scores" below), the kernel must give the torch path's bits, on
every path it has (fp32 tiles, bf16 dot products, fused decode kernels, split keys).

The layouts are the modes' own: mode 1 q TND (q_descale TND or N2TGD), k/v TND or paged PA_BBND /
PA_BNBD (PA_NZ becomes PA_BNBD before any backend runs); mode 6 q NTD, k/v PA_BNBD. BNSD / BSND
are mode 0's only.

On the AVX512_BF16 build the many-row blocks run as bf16 dot products (``QFA_BF16_DOT=1``, the
default) or the fp32 tiles (``QFA_BF16_DOT=0``): E4M3 values, E4M3-rounded P and mode 1's scaled
values (scales >= 2^-54, ``cpu_kernel.MIN_BF16_E8M0``) are exact in bf16, with exact products, so
both are within the same bound. NaN and Inf (NaN codes, NaN scales) reach exactly the rows the
torch path's do. 1 and 2 threads give the same bits; inputs are not modified.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mode16_reference as ref
from qfa import quant_flash_attn
from qfa.attention.backends import cpu_kernel, scaled_torch_path
from qfa.cast import fp8, mxfp8
from qfa.tiling.scaled_checks import MAX_FINITE_E8M0
from test_attention_reference import check_against_reference
from test_attention_scaled_modes import E4M3_NAN, fp8_case, fp8_call, mx_case, mx_call, page_mx


def _missing() -> str | None:
    if not cpu_kernel.available():
        return "native CPU kernel not built here (no compiler, or the build failed: see cpu_kernel.available)"
    return None


needs_kernel = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")
pytestmark = needs_kernel


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv("QFA_BACKEND", raising=False)
    monkeypatch.delenv("QFA_NATIVE", raising=False)
    monkeypatch.delenv("QFA_BF16_DOT", raising=False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _run(args, kwargs, monkeypatch, *, native: bool, bf16: str = "1"):
    monkeypatch.setenv("QFA_NATIVE", "1" if native else "0")
    monkeypatch.setenv("QFA_BF16_DOT", bf16)
    kw = dict(kwargs)
    kw.pop("backend", None)
    try:
        return quant_flash_attn(*args, **kw)
    finally:
        monkeypatch.delenv("QFA_NATIVE")
        monkeypatch.delenv("QFA_BF16_DOT")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _v_max(mode: int, case) -> float:
    """The largest |v| value the call can read (an upper bound for the flip allowance)."""
    if mode == 1:
        return max(float(np.nanmax(np.abs(_mx_values(case)))), 1e-30)
    v = ref.decode_e4m3(case["v"]) * case["v_scales"].double().numpy()[None, :, None, None]
    return max(float(np.nanmax(np.abs(v))), 1e-30)


def _mx_values(case) -> np.ndarray:
    """|V| values of a TND MXFP8 case (every sequence's scaled elements)."""
    starts = np.cumsum((0,) + case["kv_lens"])
    out = [np.zeros(1)]
    for b, (a, e) in enumerate(zip(starts[:-1], starts[1:])):
        if e > a:
            out.append(mxfp8.dequantize(case["v"][a:e], case["v_scales"][b], 0).double().numpy().ravel())
    return np.concatenate(out)


def _check(mode, case, args, kwargs, monkeypatch, *, bf16_modes=("1", "0")):
    """The kernel's out / lse against the torch path's, within the derived tolerance, for each
    QFA_BF16_DOT setting; returns the kernel's results and the kernels its blocks ran."""
    want_out, want_lse = _run(args, kwargs, monkeypatch, native=False)
    lse_wanted = kwargs.get("return_softmax_lse", False)
    results = {}
    for bf16 in bf16_modes:
        out, lse = _run(args, kwargs, monkeypatch, native=True, bf16=bf16)
        paths = cpu_kernel.last_paths()
        assert paths, "the native kernel did not run"
        check_against_reference(out, lse, want_out.to(torch.float64).numpy(), want_lse.numpy(), _v_max(mode, case),
                                lse_wanted)
        results[bf16] = (out, lse, paths)
    return results


# ---------------------------------------------------------------------------- E4M3 decode and rounding


def _e4m3_table() -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


@pytest.mark.parametrize("simd", [True, False])
def test_e4m3_decoder_is_exact_on_all_256_codes(simd):
    table = _e4m3_table()
    codes = torch.arange(256, dtype=torch.uint8)
    # qfa.cast.fp8 decodes (dequantises) as the fp32 cast of the elements; the spec reference decodes
    # from the bits itself.
    want = codes.view(torch.float8_e4m3fn).to(torch.float32)
    spec = ref.decode_e4m3(codes.view(torch.float8_e4m3fn))
    assert np.array_equal(want.double().numpy(), spec, equal_nan=True)
    if simd:
        assert cpu_kernel._module.simd_e4m3_decoder(table) == (cpu_kernel._module.vec_width() >= 8 and
                                                               cpu_kernel.cpu_capability() != "DEFAULT")
    for offset in range(0, 33, 11):  # SIMD bodies of 32 codes and scalar tails, at several alignments
        got, finite = cpu_kernel._module.decode_e4m3_codes(torch.cat([codes[256 - offset:], codes]), table, simd)
        got = got[offset:]
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan)
        assert torch.equal(_bits(got[~nan]), _bits(want[~nan]))
        assert not finite
        fin, ok = cpu_kernel._module.decode_e4m3_codes(codes[~nan][:96].contiguous(), table, simd)
        assert ok and torch.equal(_bits(fin), _bits(want[~nan][:96]))
    # The whole kernel's decode (HiF8 codes) is untouched by the E4M3 form of the decoder.
    hif8, _ = cpu_kernel._module.decode_codes(codes, cpu_kernel._decode_table(), simd)
    assert torch.equal(torch.isnan(hif8), torch.isnan(cpu_kernel._decode_table()))


def _rounding_inputs() -> torch.Tensor:
    values = _e4m3_table()
    values = values[torch.isfinite(values)].unique()
    pos = values[values >= 0].double()
    mids = ((pos[1:] + pos[:-1]) / 2).float()  # every midpoint is an fp32 (4 + 1 significant bits)
    assert torch.equal(mids.double(), (pos[1:] + pos[:-1]) / 2)
    extra = torch.tensor([464.0, 480.0, 449.0, 1e6, 3e38, float("inf"), 2.0**-10, 2.0**-11, 3 * 2.0**-11,
                          2.0**-149, 2.0**-126, 0.0])
    base = torch.cat([values.abs(), mids, extra])
    near = torch.cat([base, torch.nextafter(base, torch.tensor(0.0)), torch.nextafter(base, torch.tensor(float("inf")))])
    g = torch.Generator().manual_seed(0)
    # Dense sweeps: random fp32 bit patterns over binades 2^-20 .. 2^10, and uniform in (0, 448]
    # (where P lives).
    rnd_bits = torch.randint(0x35800000, 0x44800000, (200_000,), generator=g, dtype=torch.int32).view(torch.float32)
    uniform = torch.rand(200_000, generator=g) * 448
    x = torch.cat([near, rnd_bits, uniform])
    return torch.cat([x, -x, torch.tensor([float("nan"), -0.0])])


@pytest.mark.parametrize("variant", ["simd", "scalar", "bf16"])
def test_e4m3_rounding_of_p_is_the_torch_paths(variant):
    if variant == "bf16" and not cpu_kernel._module.has_bf16_dot():
        pytest.skip("the bf16 rounding needs the AVX512_BF16 build (no avx512_bf16 here)")
    x = _rounding_inputs()
    want = fp8.on_e4m3_grid(x)
    got = cpu_kernel._module.round_p_e4m3(x, variant != "scalar", variant == "bf16")
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(_bits(got[~nan]), _bits(want[~nan]))  # signs of zero included
    assert torch.equal(got[~nan].to(torch.float8_e4m3fn).to(torch.float32), got[~nan])  # on the grid


# ---------------------------------------------------------------------------- against the torch path

MX_CASES = [
    # id, q_lens, kv_lens, (nq, nkv), d, causal, p_scale, softmax_scale, q layout
    ("prefill", (600,), (600,), (4, 2), 128, False, 1.0, None, "TND"),
    ("prefill-causal", (600, 77), (600, 1100), (4, 2), 128, True, 448.0, None, "TND"),
    ("prefill-gqa8-causal", (300,), (700,), (8, 1), 128, True, 104.0, 1.0, "N2TGD"),
    ("mha-partial", (513, 3), (513, 9), (2, 2), 128, False, 448.0, None, "TND"),
    ("decode-sq1", (1, 1, 1), (700, 1030, 5000), (8, 2), 128, False, 1.0, None, "TND"),
    ("decode-sq16-causal", (16, 16), (900, 2100), (4, 2), 128, True, 104.0, None, "TND"),
    ("empty-sequences", (0, 5, 3, 7), (100, 0, 40, 7), (4, 2), 128, True, 448.0, None, "TND"),
    ("d64", (100, 1), (600, 300), (4, 2), 64, True, 1.0, None, "TND"),
    ("d256", (40, 1), (520, 600), (2, 1), 256, False, 448.0, None, "N2TGD"),
]


@pytest.mark.parametrize("case_id,q_lens,kv_lens,heads,d,causal,p_scale,softmax_scale,q_layout", MX_CASES,
                         ids=[c[0] for c in MX_CASES])
def test_mxfp8_matches_the_torch_path(case_id, q_lens, kv_lens, heads, d, causal, p_scale, softmax_scale, q_layout,
                                      monkeypatch):
    case = mx_case(q_lens, kv_lens, nq=heads[0], nkv=heads[1], d=d, seed=len(case_id))
    args, kwargs = mx_call(case, causal=causal, p_scale=p_scale, softmax_scale=softmax_scale, q_layout=q_layout)
    _check(1, case, args, kwargs, monkeypatch)


@pytest.mark.parametrize("layout_kv", ["PA_BBND", "PA_BNBD"])
@pytest.mark.parametrize("block_size,q_lens,kv_lens,causal", [
    (64, (1, 1, 16), (700, 65, 1000), False),
    (512, (200, 1), (1100, 3000), True),
    (1024, (16,), (2500,), True),
])
def test_mxfp8_paged_reads_in_place(layout_kv, block_size, q_lens, kv_lens, causal, monkeypatch):
    """Paged K/V and scales read through the table (spare blocks hold NaN elements and NaN
    scales no row may see): within the bound of the torch path, and bit for bit the kernel's TND
    call on the same keys."""
    case = mx_case(q_lens, kv_lens, d=128, seed=block_size)
    tnd_args, tnd_kwargs = mx_call(case, causal=causal, p_scale=448.0)
    k, v, kd, vd, table = page_mx(case, layout_kv, block_size, torch.Generator().manual_seed(1))
    args = (case["q"], k, v, tnd_args[3], kd, vd, 1)
    kwargs = dict(tnd_kwargs, cu_seqlens_kv=None, block_table=table, layout_kv=layout_kv,
                  seqused_kv=torch.tensor(kv_lens, dtype=torch.int32))
    got = _check(1, case, args, kwargs, monkeypatch)
    for bf16, (out, lse, _) in got.items():
        flat_out, flat_lse = _run(tnd_args, tnd_kwargs, monkeypatch, native=True, bf16=bf16)
        assert torch.equal(_bits(out), _bits(flat_out)) and torch.equal(lse, flat_lse)


FP8_CASES = [
    # id, q_lens, kv_lens, (nq, nkv), causal, p_scale
    ("prefill", (600,), (600,), (4, 2), False, 448.0),
    ("prefill-causal-gqa8", (300, 64), (700, 1100), (8, 1), True, 104.0),
    ("decode-sq1", (1, 1, 1), (300, 1030, 5000), (8, 2), False, 1.0),
    ("decode-sq16-causal", (16, 16), (900, 2100), (4, 2), True, 448.0),
    ("empty-and-partial", (0, 5, 130), (100, 0, 129), (4, 4), True, 104.0),
]


@pytest.mark.parametrize("case_id,q_lens,kv_lens,heads,causal,p_scale", FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_fp8_matches_the_torch_path(case_id, q_lens, kv_lens, heads, causal, p_scale, monkeypatch):
    case = fp8_case(q_lens, kv_lens, nq=heads[0], nkv=heads[1], seed=len(case_id))
    args, kwargs = fp8_call(case, causal=causal, p_scale=p_scale)
    _check(6, case, args, kwargs, monkeypatch)


def test_without_lse(monkeypatch):
    case = fp8_case((20,), (700,), seed=2)
    args, kwargs = fp8_call(case, causal=True, lse=False)
    (out, lse, _), = _check(6, case, args, kwargs, monkeypatch, bf16_modes=("1",)).values()
    assert lse.numel() == 0


def test_many_row_blocks_take_bf16_dot_products_where_built(monkeypatch):
    case = mx_case((300,), (700,), seed=4)
    args, kwargs = mx_call(case, causal=True)
    got = _check(1, case, args, kwargs, monkeypatch)
    assert "AVX512_BF16" not in got["0"][2]
    if cpu_kernel._module.has_bf16_dot():
        assert "AVX512_BF16" in got["1"][2]
    # A scale below 2^-54 would make products subnormal, which vdpbf16ps flushes: the fp32 tiles run.
    small = dict(case, k_scales=case["k_scales"].clone())
    small["k_scales"].view(torch.uint8)[0, 0, 0] = cpu_kernel.MIN_BF16_E8M0 - 1
    args, kwargs = mx_call(small, causal=True)
    got = _check(1, small, args, kwargs, monkeypatch, bf16_modes=("1",))
    assert "AVX512_BF16" not in got["1"][2]


def test_few_row_blocks_take_bf16_dot_products_where_built(monkeypatch):
    """Decode-shaped MXFP8 calls (few rows): bf16 dot products on the scaled words where built;
    NaN K and V scales and a NaN V code poison the torch path's rows either way (a V group holding
    one runs the fp32 chains); a scale below MIN_BF16_E8M0 sends what reads it to the fp32
    kernels, checked by the kernel (no host reduction for calls without many-row blocks): a K or V
    scale its group of keys, a Q scale its item."""
    case = mx_case((1, 3), (1500, 700), seed=11)
    args, kwargs = mx_call(case, causal=True)
    got = _check(1, case, args, kwargs, monkeypatch)
    assert "AVX512_BF16" not in got["0"][2]
    if cpu_kernel._module.has_bf16_dot():
        assert got["1"][2] == ["AVX512_BF16"]
    bad = dict(case, k_scales=case["k_scales"].clone(), v_scales=[s.clone() for s in case["v_scales"]])
    bad["k_scales"].view(torch.uint8)[20, 1, 2] = mxfp8.E8M0_NAN_CODE  # sequence 0, key 20, kv head 1
    bad["v_scales"][1].view(torch.uint8)[3, 0, 7] = mxfp8.E8M0_NAN_CODE  # sequence 1, keys 96-127, head 0
    v = case["v"].view(torch.uint8).clone()
    v[1500 + 650, 0, 5] = E4M3_NAN  # sequence 1, key 650
    bad["v"] = v.view(torch.float8_e4m3fn)
    _nan_as_the_torch_path(*mx_call(bad, causal=True), monkeypatch)
    low = cpu_kernel.MIN_BF16_E8M0 - 1
    for name, where in (("v_scales", (0, 0, 0)), ("k_scales", (100, 1, 3)), ("q_scales", (2, 3, 1))):
        small = dict(case)
        if name == "v_scales":
            small[name] = [s.clone() for s in case[name]]
            small[name][0].view(torch.uint8)[where] = low
        else:
            small[name] = case[name].clone()
            small[name].view(torch.uint8)[where] = low
        args, kwargs = mx_call(small, causal=True)
        got = _check(1, small, args, kwargs, monkeypatch, bf16_modes=("1",))
        if cpu_kernel._module.has_bf16_dot():
            assert set(got["1"][2]) == {"AVX512_BF16", "AVX512"}, name


# ---------------------------------------------------------------------------- NaN and Inf


def _nan_as_the_torch_path(args, kwargs, monkeypatch) -> None:
    """The call's NaN pattern (which it must have) is the torch path's, and the rest close to
    it, with the bf16 dot products and without."""
    want = _run(args, kwargs, monkeypatch, native=False)
    assert torch.isnan(want[0].float()).any()
    for bf16 in ("1", "0"):
        got = _run(args, kwargs, monkeypatch, native=True, bf16=bf16)
        _same_nan_then_close(got[0], want[0], got[1], want[1])


def _same_nan_then_close(out, want, lse, want_lse):
    nan = torch.isnan(want.float())
    assert torch.equal(torch.isnan(out.float()), nan)
    close = (out.float() - want.float()).abs() <= 1e-4 + 2.0**-7 * want.float().abs()
    assert close[~nan].float().mean() >= 0.999
    assert torch.equal(torch.isnan(lse), torch.isnan(want_lse))
    assert torch.equal(torch.isposinf(lse), torch.isposinf(want_lse))


def test_nan_codes_and_scales_reach_the_torch_paths_rows(monkeypatch):
    # mode 1: a NaN k scale (one key of sequence 1, kv head 0), and NaN V elements behind the
    # causal diagonal of sequence 0 (only its last rows see them)
    case = mx_case((40, 2), (600, 64), d=128, seed=6)
    case["k_scales"] = case["k_scales"].clone()
    case["k_scales"].view(torch.uint8)[606, 0, 1] = mxfp8.E8M0_NAN_CODE
    v = case["v"].view(torch.uint8).clone()
    v[595, 1, 7] = E4M3_NAN
    case["v"] = v.view(torch.float8_e4m3fn)
    _nan_as_the_torch_path(*mx_call(case, causal=True), monkeypatch)
    # mode 6: a NaN v_descale (head 1), a NaN k scale and a NaN V element
    case = fp8_case((30, 1), (400, 300), seed=7)
    case["v_scales"] = case["v_scales"].clone()
    case["v_scales"][1] = float("nan")
    case["k_scales"] = case["k_scales"].clone()
    case["k_scales"][int(case["table"][1, 1]), 0, 5] = float("nan")
    v = case["v"].view(torch.uint8).clone()
    v[int(case["table"][0, 3]), 0, 100, 9] = E4M3_NAN  # key 484 of sequence 0: beyond 400, unseen
    v[int(case["table"][0, 2]), 0, 120, 3] = E4M3_NAN  # key 376: seen by the last causal rows
    case["v"] = v.view(torch.float8_e4m3fn)
    args, kwargs = fp8_call(case, causal=True)
    want = _run(args, kwargs, monkeypatch, native=False)
    for bf16 in ("1", "0"):
        got = _run(args, kwargs, monkeypatch, native=True, bf16=bf16)
        _same_nan_then_close(got[0], want[0], got[1], want[1])


# ---------------------------------------------------------------------------- threads, inputs, dispatch


@pytest.mark.parametrize("mode", [1, 6])
def test_one_and_two_threads_give_the_same_bits(mode, monkeypatch):
    if mode == 1:
        case = mx_case((1, 16, 300), (3000, 900, 700), d=128, seed=8)
        args, kwargs = mx_call(case, causal=True)
    else:
        case = fp8_case((1, 16, 300), (3000, 900, 700), seed=8)
        args, kwargs = fp8_call(case, causal=True)
    runs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        runs.append(_run(args, kwargs, monkeypatch, native=True))
    assert torch.equal(_bits(runs[0][0]), _bits(runs[1][0]))
    assert torch.equal(_bits(runs[0][1]), _bits(runs[1][1]))


def test_inputs_are_not_modified(monkeypatch):
    for mode in (1, 6):
        if mode == 1:
            case = mx_case((20, 1), (600, 300), seed=9)
            args, kwargs = mx_call(case, causal=True)
        else:
            case = fp8_case((20, 1), (600, 300), seed=9)
            args, kwargs = fp8_call(case, causal=True)
        before = [t.view(torch.uint8).clone() if t.element_size() == 1 else t.clone() for t in args[:6]]
        _run(args, kwargs, monkeypatch, native=True)
        for t, b in zip(args[:6], before):
            assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t, b)


def test_v_scales_rewritten_in_place_between_calls_are_read_again(monkeypatch):
    """Each thread keeps the last V scale row it expanded (the few-row kernels decode 8 keys at a
    time, a scale row covers 32): a second call on the same tensors, after every V scale was
    doubled in place, must read the new scales. Doubling V doubles the output exactly (a power of
    two; P is unchanged), so the second output is the first times two, bit for bit, on one thread
    and on two."""
    single_row = mx_case((1,), (20,), nq=4, nkv=1, seed=12, spread=0.5)  # every call reads the same row
    batches = mx_case((1, 1, 16), (700, 1030, 300), nq=8, nkv=2, seed=12, spread=0.5)
    for case, threads in ((single_row, 1), (batches, 1), (batches, 2)):
        args, kwargs = mx_call(case, p_scale=448.0)
        codes = args[5].view(torch.uint8)
        assert int(codes.max()) < MAX_FINITE_E8M0  # still within the plan's cap after the doubling
        torch.set_num_threads(threads)
        first, _ = _run(args, kwargs, monkeypatch, native=True)
        codes.add_(1)
        try:
            second, _ = _run(args, kwargs, monkeypatch, native=True)
        finally:
            codes.sub_(1)
        assert torch.equal(_bits(second), _bits(first * 2))
        assert not torch.equal(_bits(second), _bits(first))


def test_dispatch(monkeypatch):
    """Modes 1 and 6 on CPU run the native kernel; QFA_NATIVE=0, or a head dim the build's
    vectors do not divide, runs the torch path."""
    case = fp8_case((3,), (200,), seed=10)
    args, kwargs = fp8_call(case)
    calls = []
    real_kernel, real_torch = cpu_kernel.forward_scaled, scaled_torch_path.forward
    monkeypatch.setattr(cpu_kernel, "forward_scaled", lambda *a, **k: calls.append("native") or real_kernel(*a, **k))
    monkeypatch.setattr(scaled_torch_path, "forward", lambda *a, **k: calls.append("torch") or real_torch(*a, **k))
    _run(args, kwargs, monkeypatch, native=True)
    _run(args, kwargs, monkeypatch, native=False)
    assert calls == ["native", "torch"]
    calls.clear()
    case = mx_case((3,), (100,), d=72, seed=10)
    _run(*mx_call(case), monkeypatch, native=True)
    assert calls == ["native" if 72 % cpu_kernel._module.vec_width() == 0 else "torch"]


# ---------------------------------------------------------------------------- exact scores: the same bits
# Inputs on which every fp32 step is exact in any summation order, so the kernel (fp32 tiles, bf16
# dot products, fused decode kernels, split keys) must give the torch path's bits. Q rows are u
# (every element 1, times a power of two per 32-channel group) and keys +-u (the inverse powers),
# so every score is +-128 exactly (128 exact products of +-1), softmax_scale 1: a key is its row's
# maximum or 256 below it, P is exp(0) = 1 or exp(-256) = 0 in any correct exp, every alpha 1 (or 0
# before a row's first key), l an exact count. V's values are multiples of 2^-7 below 32 in
# magnitude (E4M3 magnitudes in [2^-2, 8), multiples of 2^-5, times scales 2^-2 .. 2^2), so every
# partial sum of up to 2^12 of them is a multiple of 2^-7 below 2^17: 24 bits, exact. O, l and so
# out = O / l (one rounding) are then the same bits on both paths; lse = m + ln l with m = 128 on
# both: ln may differ by its last ulp (Sleef's against torch's), so |d lse| <= 2 ulp(lse).

ONE, MINUS_ONE = 0x38, 0xB8  # E4M3 +-1.0


def _small_v_codes(gen, *shape) -> torch.Tensor:
    exp_field = torch.randint(5, 10, shape, generator=gen)  # 2^-2 .. 2^2 binades
    mant = torch.randint(0, 8, shape, generator=gen)
    sign = torch.randint(0, 2, shape, generator=gen) * 0x80
    return (sign + exp_field * 8 + mant).to(torch.uint8)


def _exact_mx(q_lens, kv_lens, nq, nkv, seed):
    gen = torch.Generator().manual_seed(seed)
    tq, tk, d = sum(q_lens), sum(kv_lens), 128
    e8 = mxfp8.E8M0
    a = torch.randint(-3, 4, (1, 1, d // 32), generator=gen)  # per channel group, shared by q and k
    q = torch.full((tq, nq, d), ONE, dtype=torch.uint8)
    sign = torch.randint(0, 2, (tk, nkv, 1), generator=gen).bool()
    k = torch.where(sign, torch.tensor(ONE, dtype=torch.uint8), torch.tensor(MINUS_ONE, dtype=torch.uint8)).expand(tk, nkv, d)
    qs = (127 + a).expand(tq, nq, d // 32).to(torch.uint8)
    ks = (127 - a).expand(tk, nkv, d // 32).to(torch.uint8)
    v = _small_v_codes(gen, tk, nkv, d)
    vs = [torch.randint(125, 130, (-(-n // 32), nkv, d), generator=gen, dtype=torch.uint8).view(e8) for n in kv_lens]
    return dict(q=q.view(torch.float8_e4m3fn), k=k.contiguous().view(torch.float8_e4m3fn), v=v.view(torch.float8_e4m3fn),
                q_scales=qs.contiguous().view(e8), k_scales=ks.contiguous().view(e8), v_scales=vs,
                q_lens=tuple(q_lens), kv_lens=tuple(kv_lens), nq=nq, nkv=nkv, d=d)


def _exact_fp8(q_lens, kv_lens, nq, nkv, seed):
    case = fp8_case(q_lens, kv_lens, nq=nq, nkv=nkv, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    nb = case["k"].shape[0]
    q = torch.full(case["q"].shape, ONE, dtype=torch.uint8)
    sign = torch.randint(0, 2, (nb, nkv, 128, 1), generator=gen).bool()
    k = torch.where(sign, torch.tensor(ONE, dtype=torch.uint8), torch.tensor(MINUS_ONE, dtype=torch.uint8))
    k = k.expand(nb, nkv, 128, 128).contiguous()
    return dict(case, q=q.view(torch.float8_e4m3fn), k=k.view(torch.float8_e4m3fn),
                v=_small_v_codes(gen, nb, nkv, 128, 128).view(torch.float8_e4m3fn),
                q_scales=torch.full(case["q_scales"].shape, 2.0), k_scales=torch.full(case["k_scales"].shape, 0.5),
                v_scales=2.0 ** torch.arange(nkv, dtype=torch.float32))


def _check_same_bits(args, kwargs, monkeypatch):
    want_out, want_lse = _run(args, kwargs, monkeypatch, native=False)
    seen = 0
    for bf16 in ("1", "0"):
        out, lse = _run(args, kwargs, monkeypatch, native=True, bf16=bf16)
        assert torch.equal(_bits(out), _bits(want_out)), bf16
        assert torch.equal(torch.isposinf(lse), torch.isposinf(want_lse))
        finite = torch.isfinite(want_lse)
        ulp = torch.nextafter(want_lse[finite].abs(), torch.tensor(float("inf"))) - want_lse[finite].abs()
        assert ((lse[finite] - want_lse[finite]).abs() <= 2 * ulp).all()
        seen += finite.sum().item()
    assert seen > 0


EXACT_SHAPES = [
    # q_lens, kv_lens, (nq, nkv), causal
    ((600,), (600,), (4, 2), True),
    ((300, 16), (700, 2100), (8, 1), False),
    ((1, 1, 16), (5000, 1030, 900), (8, 2), True),
    ((0, 5, 3), (100, 0, 40), (4, 4), True),
]


@pytest.mark.parametrize("mode", [1, 6])
@pytest.mark.parametrize("q_lens,kv_lens,heads,causal", EXACT_SHAPES)
def test_exact_scores_give_the_torch_paths_bits(mode, q_lens, kv_lens, heads, causal, monkeypatch):
    if mode == 1:
        case = _exact_mx(q_lens, kv_lens, *heads, seed=sum(kv_lens))
        args, kwargs = mx_call(case, causal=causal, p_scale=1.0, softmax_scale=1.0)
    else:
        case = _exact_fp8(q_lens, kv_lens, *heads, seed=sum(kv_lens))
        args, kwargs = fp8_call(case, causal=causal, p_scale=1.0, softmax_scale=1.0)
    _check_same_bits(args, kwargs, monkeypatch)


def _vbmi_or_skip() -> None:
    if cpu_kernel._module.decoder_kind(cpu_kernel._decode_table(), False) != "vbmi":
        pytest.skip("the decoder's VBMI form needs an AVX-512 build on a CPU with the avx512vbmi flag")


@pytest.mark.parametrize("mode", [1, 6, 0])
def test_the_vbmi_decoder_gives_the_word_lookups_bits(mode, monkeypatch):
    """The two AVX-512 forms of the decoder build the same operands, so a call gives the same
    bits with either (QFA_VBMI=0 keeps the vpermt2w word lookups): few-row blocks and many-row
    ones, NaN codes and scales (mode 1: the scaled rows of both forms), paged and contiguous."""
    _vbmi_or_skip()
    if mode == 1:
        case = mx_case((1, 3, 40), (1500, 700, 300), seed=12)
        case["k_scales"] = case["k_scales"].clone()
        case["k_scales"].view(torch.uint8)[30, 1, 2] = mxfp8.E8M0_NAN_CODE
        args, kwargs = mx_call(case, causal=True)
    elif mode == 6:
        case = fp8_case((1, 5, 30), (900, 400, 300), seed=13)
        v = case["v"].view(torch.uint8).clone()
        v[int(case["table"][0, 2]), 0, 7, 3] = E4M3_NAN
        case["v"] = v.view(torch.float8_e4m3fn)
        args, kwargs = fp8_call(case, causal=True)
    else:
        import test_cpu_kernel as t

        plan, hif8_args = t.make(12, 2, (1, 3, 40), (4097, 700, 300), layout="TND", causal=True, seed=14)
        v = hif8_args[2].clone()
        v[5, 1, 9] = 0x80
        hif8_args = (hif8_args[0], hif8_args[1], v, *hif8_args[3:])
    got = {}
    for vbmi in ("1", "0"):
        monkeypatch.setenv("QFA_VBMI", vbmi)
        if mode == 0:
            got[vbmi] = cpu_kernel.forward(plan, *hif8_args)
        else:
            got[vbmi] = _run(args, kwargs, monkeypatch, native=True)
    for a, b in zip(got["1"], got["0"]):
        assert torch.equal(_bits(a), _bits(b))


def _every_other(x: torch.Tensor) -> torch.Tensor:
    """x's codes every other byte along the head dim (a view with stride 2 there)."""
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=torch.uint8)
    wide[..., ::2] = x.view(torch.uint8)
    return wide[..., ::2].view(x.dtype)


def test_mxfp8_dim_strided_codes_give_the_contiguous_bits(monkeypatch):
    """Q, K and V codes every other byte along the head dim give a few-row MXFP8 call the
    contiguous codes' bits (the scaled K rows of the bf16 kernels read runs along D: strided rows
    take the fp32 kernels' decode)."""
    case = mx_case((1, 3), (700, 300), seed=15)
    args, kwargs = mx_call(case, causal=True)
    want = _run(args, kwargs, monkeypatch, native=True)
    strided = tuple(_every_other(t) for t in args[:3])
    assert all(t.stride(-1) == 2 for t in strided)
    got = _run((*strided, *args[3:]), kwargs, monkeypatch, native=True)
    for a, b in zip(got, want):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("which", ["k", "v"])
def test_mxfp8_scales_beyond_the_exponent_bound_leave_the_bf16_words(which, monkeypatch):
    """A direct caller of forward_scaled (the op's value checks refuse E8M0 codes above 246)
    with a scale past the bound over a value of 448: fp32 overflows to Inf there, where the bf16
    few-row kernels' exponent move would give NaN (K, 2^120) or wrap into a finite value (V,
    2^123), so such a group runs the fp32 kernels. K: the key's score is -Inf (q is -1 in that
    channel and 0 beside it), so the rows stay finite; V: the output channel is not finite."""
    from qfa.tiling import attention as tiling

    if not cpu_kernel._module.has_bf16_dot():
        pytest.skip(f"the bf16 few-row kernels need the AVX512_BF16 build (this CPU's is "
                    f"{cpu_kernel.cpu_capability()}; flag {cpu_kernel.BF16_FLAG})")
    case = mx_case((1, 3), (700, 300), seed=16)
    args, kwargs = mx_call(case, causal=True)
    kw = {k: v for k, v in kwargs.items() if k != "backend"}
    q, k, v, qd, kd, vd, _ = args
    q, k, v, kd, vd = (t.view(torch.uint8).clone() for t in (q, k, v, kd, vd))
    if which == "v":  # sequence 0, kv head 1, channel 3, keys 0-31: 1.0 but key 10, 448
        v[0:32, 1, 3] = ONE
        v[10, 1, 3] = 0x7E
        vd[0, 1, 3, 0] = 250
    else:  # sequence 0, key 5, kv head 0, channels 32-63: 1.0 but channel 40, 448; q -1 there
        k[5, 0, 32:64] = ONE
        k[5, 0, 40] = 0x7E
        kd[5, 0, 0, 1] = 247
        q[0, 0:2, 32:64] = 0
        q[0, 0:2, 40] = MINUS_ONE
    e4m3 = torch.float8_e4m3fn
    q, k, v = (t.view(e4m3) for t in (q, k, v))
    kd, vd = kd.view(args[4].dtype), vd.view(args[5].dtype)
    plan = tiling.plan_attention(q, k, v, qd, args[4], args[5], 1, layout="TND", **kw)
    got = {bf16: cpu_kernel.forward_scaled(plan, q, k, v, qd, kd, vd, kw["p_scale"], bf16_dot=bf16)
           for bf16 in (True, False)}
    out = got[False][0].float()
    if which == "v":
        assert not torch.isfinite(out[0, 2:4, 3]).any()
    else:
        assert torch.isfinite(out[0, 0:2]).all()
    for a, b in zip(got[True], got[False]):
        assert torch.equal(torch.isnan(a.float()), torch.isnan(b.float()))
        assert torch.equal(torch.isinf(a.float()), torch.isinf(b.float()))
