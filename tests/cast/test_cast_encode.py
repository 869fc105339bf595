"""encode_to_hifloat8 on CPU against the independent spec reference, bit for bit.

fp16 and bf16 are checked exhaustively; fp32 at every level, every rounding midpoint and their
ulp neighbours, plus a large seeded random batch and hypothesis-drawn bit patterns. Every value
test runs on every path: the native encoder at each SIMD level the CPU has (scalar, AVX2,
AVX-512; the default on CPU, see qfa.attention.backends.cpu_prepare), and the torch path (``QFA_NATIVE=0``)
both TorchInductor-compiled (large tensors) and in eager torch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qfa
import spec_reference as spec
from qfa import _compile
from qfa.attention.backends import cpu_kernel, cpu_prepare
from qfa.cast import torch_path

pytestmark = pytest.mark.usefixtures("torch_backend")

MODES = spec.OVERFLOW_MODES
HALF_DTYPES = (torch.float16, torch.bfloat16)
DTYPES = (torch.float32, *HALF_DTYPES)
BITS = {torch.float16: (torch.int16, 16), torch.bfloat16: (torch.int16, 16), torch.float32: (torch.int32, 32)}


# --- helpers -------------------------------------------------------------------------------


def bit_patterns(x: torch.Tensor) -> np.ndarray:
    """Unsigned bit patterns of a float tensor, flattened."""
    view, width = BITS[x.dtype]
    return x.reshape(-1).view(view).numpy().astype(np.int64) & ((1 << width) - 1)


def from_bits(patterns, dtype: torch.dtype) -> torch.Tensor:
    width = BITS[dtype][1]
    unsigned = np.asarray(patterns, dtype=np.uint64).astype(np.uint32 if width == 32 else np.uint16)
    return torch.from_numpy(unsigned.view(np.int32 if width == 32 else np.int16)).view(dtype)


def all_patterns(dtype: torch.dtype) -> torch.Tensor:
    """All 65536 fp16 or bf16 values; index i holds pattern i."""
    return from_bits(np.arange(1 << 16), dtype)


def reference_codes(x: torch.Tensor, overflow: str) -> np.ndarray:
    """The spec reference's codes for ``x``, evaluated once per distinct bit pattern."""
    values = x.detach().reshape(-1).to(torch.float64).numpy()
    unique, inverse = np.unique(values.view(np.uint64), return_inverse=True)
    codes = np.array([spec.encode(v, overflow) for v in unique.view(np.float64).tolist()], dtype=np.uint8)
    return codes[inverse.reshape(-1)]


def assert_codes(got: torch.Tensor, want: np.ndarray, x: torch.Tensor, what: str) -> None:
    """Bit-exact comparison that names the first few offending inputs."""
    got = got.reshape(-1).numpy()
    bad = np.flatnonzero(got != want)
    if bad.size:
        patterns, values = bit_patterns(x), x.reshape(-1).tolist()
        digits = BITS[x.dtype][1] // 4
        lines = [
            f"  0x{patterns[i]:0{digits}X} ({values[i]!r}): got 0x{got[i]:02X}, want 0x{want[i]:02X}"
            for i in bad[:8]
        ]
        pytest.fail(f"{what}: {bad.size} of {got.size} codes differ from the spec reference\n" + "\n".join(lines))


def compiled_ran(fn) -> bool:
    return fn in _compile._compiled and fn not in _compile._failed


#: The native levels by name (an index into cpu_prepare.ISA_NAMES).
NATIVE_PATHS = {f"native-{name}": level for level, name in enumerate(cpu_prepare.ISA_NAMES)}


@pytest.fixture(params=[*NATIVE_PATHS, "compiled", "eager"])
def path(request, monkeypatch):
    """The encode path a value test runs on (overrides conftest's torch-only fixture)."""
    if request.param in NATIVE_PATHS:
        level = NATIVE_PATHS[request.param]
        if not cpu_prepare.available():
            pytest.skip("the native CPU preparation is not built (no compiler?)")
        if level > cpu_prepare.isa_level():
            pytest.skip(f"this CPU lacks {' / '.join(cpu_prepare.ISA_FLAGS[level])} for {request.param}")
        monkeypatch.setattr(cpu_prepare, "ISA", level)
    else:
        monkeypatch.setenv(cpu_kernel.ENV_VAR, "0")  # the torch path
        monkeypatch.setenv(_compile.ENV_VAR, "0" if request.param == "eager" else "1")
    return request.param


#: Elements past which the native encode runs in parallel chunks (the source's kGrain).
NATIVE_PARALLEL = 1 << 18


def encode_on(x: torch.Tensor, overflow: str, path: str) -> torch.Tensor:
    """Encode on the requested path. Only tensors of COMPILE_MIN_ELEMENTS or more get compiled,
    and the native encode is parallel past NATIVE_PARALLEL elements, so a small input is tiled
    up to that size, plus a ragged tail (every copy must come out the same)."""
    n = x.numel()
    if path == "eager":
        return qfa.encode_to_hifloat8(x, overflow=overflow)
    minimum = torch_path.COMPILE_MIN_ELEMENTS if path == "compiled" else NATIVE_PARALLEL + 1
    reps = -(-minimum // n)
    flat = x.reshape(-1)
    tail = min(n, 37)
    codes = qfa.encode_to_hifloat8(torch.cat([flat.repeat(reps), flat[:tail]]), overflow=overflow)
    if path == "compiled":
        assert compiled_ran(torch_path.encode_bits), "the compiled path did not run"
    tiled = codes[:reps * n].view(reps, n)
    assert torch.equal(tiled, tiled[:1].expand(reps, n)), "copies of the same input encoded differently"
    assert torch.equal(codes[reps * n:], tiled[0, :tail]), "the ragged tail encoded differently"
    return tiled[0].view(x.shape)


def hif8_levels() -> list[float]:
    """Zero and the 126 positive finite magnitudes, ascending, from the reference decode."""
    return sorted({spec.decode(c) for c in range(0x80) if c != spec.POS_INF})


def levels_and_midpoints() -> list[float]:
    levels = hif8_levels()
    midpoints = [(lo + hi) / 2 for lo, hi in zip(levels, levels[1:])]
    # The overflow threshold is the midpoint from MAX to the 1.5 * MAX slot that Inf occupies.
    midpoints.append((levels[-1] + 1.5 * levels[-1]) / 2)
    return levels + midpoints


def with_ulp_neighbours(points, ulps: int = 3) -> np.ndarray:
    """fp32 points, each with its neighbours up to ``ulps`` ulps away, in both signs."""
    base = np.asarray(points, dtype=np.float32)
    out = [base]
    for direction in (np.float32(np.inf), np.float32(-np.inf)):
        step = base
        for _ in range(ulps):
            step = np.nextafter(step, direction)
            out.append(step)
    both = np.concatenate(out)
    return np.concatenate([both, -both])


# --- the reference agrees with the spec's own statements -----------------------------------

F32 = np.float32
CHECK_VECTORS = [  # fp32 input, saturate code, inf code (docs/spec/hif8-format.md, "Check vectors")
    (2.0**-23, 0x01, 0x01),
    (float(np.nextafter(F32(2.0**-23), F32(0))), 0x00, 0x00),
    (1.0625, 0x09, 0x09),
    (15.5, 0x40, 0x40),
    (float(np.nextafter(F32(40960), F32(0))), 0x6E, 0x6E),
    (40960.0, 0x6E, 0x6F),
    (-40960.0, 0xEE, 0xEF),
    (65504.0, 0x6E, 0x6F),
    (-0.0, 0x00, 0x00),
    (float(F32(1e-30)), 0x00, 0x00),
]
HALF_CHECK_VECTORS = [  # (dtype, pattern, saturate code, inf code), spec rule 7
    (torch.float16, 0x78FF, 0x6E, 0x6E),
    (torch.float16, 0x7900, 0x6E, 0x6F),
    (torch.bfloat16, 0x471F, 0x6E, 0x6E),
    (torch.bfloat16, 0x4720, 0x6E, 0x6F),
]
ROUNDED_VALUES = [  # spec rule 4: ties at Dot-region edges and in the denormal binades go up
    (15.5, 16.0),
    (18.0, 20.0),
    (28672.0, 32768.0),
    (1.5 * 2.0**-17, 2.0**-16),
    (1.5 * 2.0**-16, 2.0**-15),
]


@pytest.mark.parametrize("value, saturate, inf", CHECK_VECTORS)
def test_reference_check_vectors(value, saturate, inf):
    assert (spec.encode(value, "saturate"), spec.encode(value, "inf")) == (saturate, inf)


@pytest.mark.parametrize("value, rounded", ROUNDED_VALUES)
def test_reference_rounds_spec_examples(value, rounded):
    assert spec.decode(spec.encode(value)) == rounded


def test_reference_rounds_to_nearest_ties_away():
    """Binade-wise rounding on the first dropped bit is the same as rounding to the nearest
    HiF8 level with ties going up, which the spec states for edges and denormals."""
    levels = np.array(hif8_levels() + [1.5 * 2.0**15])  # plus the slot Inf occupies
    samples = [all_patterns(dtype).to(torch.float64).numpy() for dtype in HALF_DTYPES]
    samples.append(with_ulp_neighbours(levels_and_midpoints()).astype(np.float64))
    a = np.abs(np.concatenate(samples))
    a = np.unique(a[np.isfinite(a) & (a < spec.OVERFLOW_THRESHOLD)])
    hi_index = np.searchsorted(levels, a, side="right")
    lo, hi = levels[hi_index - 1], levels[hi_index]
    nearest = np.where(a - lo >= hi - a, hi, lo)
    got = np.array([spec.decode(spec.encode(v)) for v in a.tolist()])
    bad = np.flatnonzero(got != nearest)
    assert bad.size == 0, [(a[i], got[i], nearest[i]) for i in bad[:5]]


# --- the op on the spec's check vectors ----------------------------------------------------


@pytest.mark.parametrize("overflow", MODES)
def test_check_vectors(overflow):
    x = torch.tensor([v for v, _, _ in CHECK_VECTORS], dtype=torch.float32)
    want = [sat if overflow == "saturate" else inf for _, sat, inf in CHECK_VECTORS]
    assert qfa.encode_to_hifloat8(x, overflow=overflow).tolist() == want


@pytest.mark.parametrize("dtype, pattern, saturate, inf", HALF_CHECK_VECTORS)
def test_half_check_vectors(dtype, pattern, saturate, inf):
    x = from_bits([pattern], dtype)
    got = [qfa.encode_to_hifloat8(x, overflow=mode).item() for mode in MODES]
    assert got == [saturate, inf]


def test_saturate_is_the_default():
    x = torch.tensor([40960.0, -1e30, math.inf])
    assert torch.equal(qfa.encode_to_hifloat8(x), qfa.encode_to_hifloat8(x, overflow="saturate"))


# --- exhaustive fp16 / bf16 ----------------------------------------------------------------


@pytest.fixture(scope="module")
def half_reference():
    """Reference codes of all 65536 patterns, per (dtype, overflow), computed once."""
    cache: dict[tuple, np.ndarray] = {}

    def get(dtype: torch.dtype, overflow: str) -> np.ndarray:
        if (dtype, overflow) not in cache:
            cache[dtype, overflow] = reference_codes(all_patterns(dtype), overflow)
        return cache[dtype, overflow]

    return get


@pytest.mark.parametrize("overflow", MODES)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_all_half_patterns(dtype, overflow, path, half_reference):
    x = all_patterns(dtype)
    assert_codes(encode_on(x, overflow, path), half_reference(dtype, overflow), x, f"{dtype} {overflow} {path}")


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_sign_symmetry_and_no_negative_zero(dtype, half_reference):
    codes = qfa.encode_to_hifloat8(all_patterns(dtype)).numpy().astype(np.int64)
    positive, negative = codes[: 1 << 15], codes[1 << 15 :]  # pattern p and p | 0x8000
    unsigned = (positive == 0) | (positive == spec.NAN)
    assert np.array_equal(negative[~unsigned], positive[~unsigned] | 0x80)
    assert np.array_equal(negative[unsigned], positive[unsigned])
    # 0x80 would be -0 if HiF8 had one; it must mean NaN and nothing else.
    assert np.array_equal(codes == spec.NAN, all_patterns(dtype).isnan().numpy())


# --- fp32 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overflow", MODES)
def test_fp32_levels_midpoints_and_neighbours(overflow, path):
    points = levels_and_midpoints()
    # The spec names these; the set must contain them for this test to mean what it says.
    assert {0.0, 2.0**-22, 2.0**-23, 15.5, 18.0, 28672.0, 32768.0, 40960.0} <= set(points)
    x = torch.from_numpy(with_ulp_neighbours(points))
    assert_codes(encode_on(x, overflow, path), reference_codes(x, overflow), x, f"fp32 levels {overflow} {path}")


def random_fp32_patterns(n: int, seed: int = 2409_16626) -> np.ndarray:
    """Uniform bit patterns, plus patterns whose exponents lie in and around HiF8's binades
    (where rounding happens), plus coarse mantissas there that often land on exact ties."""
    rng = np.random.default_rng(seed)
    uniform = rng.integers(0, 1 << 32, size=n * 2 // 5, dtype=np.uint64)
    m = n - uniform.size
    sign = rng.integers(0, 2, size=m, dtype=np.uint64) << 31
    exponent = rng.integers(127 - 26, 127 + 18, size=m, dtype=np.uint64) << 23
    mantissa = rng.integers(0, 1 << 23, size=m, dtype=np.uint64)
    mantissa[m // 4 * 3 :] &= np.uint64(0x7C0000)  # 5 leading mantissa bits only
    return np.concatenate([uniform, sign | exponent | mantissa])


@pytest.fixture(scope="module")
def fp32_batch():
    x = from_bits(random_fp32_patterns(1_000_000), torch.float32)
    return x, {mode: reference_codes(x, mode) for mode in MODES}


@pytest.mark.parametrize("overflow", MODES)
def test_fp32_random_batch(overflow, path, fp32_batch):
    x, reference = fp32_batch
    assert_codes(encode_on(x, overflow, path), reference[overflow], x, f"fp32 random {overflow} {path}")


def test_fp32_sign_symmetry_and_no_negative_zero(fp32_batch):
    x, _ = fp32_batch
    codes = qfa.encode_to_hifloat8(x).numpy().astype(np.int64)
    flipped = qfa.encode_to_hifloat8(-x).numpy().astype(np.int64)
    unsigned = (codes == 0) | (codes == spec.NAN)
    assert np.array_equal(flipped[~unsigned], codes[~unsigned] ^ 0x80)
    assert np.array_equal(flipped[unsigned], codes[unsigned])
    assert np.array_equal(codes == spec.NAN, x.isnan().numpy())


@settings(max_examples=300, deadline=None)
@given(
    patterns=st.lists(st.integers(0, (1 << 32) - 1), min_size=1, max_size=64),
    overflow=st.sampled_from(MODES),
)
def test_fp32_hypothesis_bit_patterns(patterns, overflow):
    x = from_bits(patterns, torch.float32)
    assert_codes(qfa.encode_to_hifloat8(x, overflow=overflow), reference_codes(x, overflow), x, "hypothesis")


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.floats(width=32), min_size=1, max_size=64), overflow=st.sampled_from(MODES))
def test_fp32_hypothesis_floats(values, overflow):
    x = torch.tensor(values, dtype=torch.float32)
    assert_codes(qfa.encode_to_hifloat8(x, overflow=overflow), reference_codes(x, overflow), x, "hypothesis")


FP32_SUBNORMALS = [*range(1, 1 << 23, 4099), (1 << 23) - 1]
# Payloads in the low 16 bits leave the upper half looking like Inf, so they need their own check.
FP32_NANS = [0x7F800001, 0xFF800001, 0x7F80FFFF, 0x7F810000, 0x7FC00000, 0x7FFFFFFF, 0xFFC00001, 0xFFFFFFFF]


@pytest.mark.parametrize("overflow", MODES)
def test_fp32_subnormals_nans_and_infs(overflow, path):
    patterns = FP32_SUBNORMALS + [p | 1 << 31 for p in FP32_SUBNORMALS] + FP32_NANS + [0x7F800000, 0xFF800000]
    x = from_bits(patterns, torch.float32)
    codes = encode_on(x, overflow, path)
    assert_codes(codes, reference_codes(x, overflow), x, f"fp32 specials {overflow} {path}")
    assert (codes[x.isnan()] == spec.NAN).all()


# --- TorchInductor-compiled path versus eager ----------------------------------------------


def test_compiled_path_matches_eager_and_reference(monkeypatch, half_reference):
    """A tensor several tiles long, with a ragged tail, through the compiled graph. Other
    sizes, layouts and autograd must reuse that graph: each new one costs seconds, and
    enough of them hit dynamo's recompile limit."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv(cpu_kernel.ENV_VAR, "0")  # the torch path
    monkeypatch.setenv(_compile.ENV_VAR, "1")
    x = all_patterns(torch.bfloat16).repeat(3)
    x = torch.cat([x, x[12345 : 12345 + 17]])
    n = 3 << 16
    assert x[::2].numel() >= torch_path.COMPILE_MIN_ELEMENTS

    compiled = qfa.encode_to_hifloat8(x)
    assert compiled_ran(torch_path.encode_bits), "the compiled path did not run"
    graphs = counters["stats"]["unique_graphs"]
    variants = {
        "shorter": (x[:-5], compiled[:-5]),
        "2-D view": (x[:n].view(3, -1), compiled[:n].view(3, -1)),
        "strided": (x[::2], compiled[::2]),
        "offset": (x[1:], compiled[1:]),
        "requires_grad": (x.clone().requires_grad_(), compiled),
    }
    for name, (variant, want) in variants.items():
        assert torch.equal(qfa.encode_to_hifloat8(variant), want), name
        assert counters["stats"]["unique_graphs"] == graphs, f"a {name} input compiled another graph"

    monkeypatch.setenv(_compile.ENV_VAR, "0")
    assert torch.equal(qfa.encode_to_hifloat8(x), compiled)
    want = half_reference(torch.bfloat16, "saturate")[bit_patterns(x)]
    assert_codes(compiled, want, x, "compiled bf16")


# --- tensor handling -----------------------------------------------------------------------


def random_values(shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Values spread over HiF8's whole range, with a few specials mixed in."""
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(torch.rand(shape, generator=g) * 44 - 26)
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    x = (sign * magnitude).reshape(-1)
    specials = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 0.0, 40960.0, -2.0**-23])
    k = min(x.numel(), specials.numel())
    x[:k] = specials[:k]
    return x.reshape(shape).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_larger_than_one_tile(dtype):
    x = random_values((3 * 65536 + 17,), dtype, seed=1)
    assert_codes(qfa.encode_to_hifloat8(x), reference_codes(x, "saturate"), x, f"{dtype} large")


NON_CONTIGUOUS = {
    "transposed": lambda x: x.t(),
    "strided": lambda x: x[::2, 1::3],
    "offset": lambda x: x[3:, 5:],
    "expanded": lambda x: x[:, :1].expand(-1, 7),
    "permuted": lambda x: x.view(6, 10, 8).permute(2, 0, 1),
}


@pytest.mark.parametrize("view", NON_CONTIGUOUS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous(dtype, view):
    x = NON_CONTIGUOUS[view](random_values((60, 8), dtype, seed=2))
    assert not x.is_contiguous()
    codes = qfa.encode_to_hifloat8(x)
    assert codes.shape == x.shape
    assert torch.equal(codes, qfa.encode_to_hifloat8(x.contiguous()))
    assert_codes(codes, reference_codes(x, "saturate"), x.contiguous(), f"{dtype} {view}")


@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 3, 4, 5)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shape_dtype_and_device_kept(dtype, shape):
    x = random_values(shape, dtype, seed=3)
    codes = qfa.encode_to_hifloat8(x)
    assert (codes.shape, codes.dtype, codes.device) == (x.shape, torch.uint8, x.device)
    assert_codes(codes, reference_codes(x, "saturate"), x, f"{dtype} {shape}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_dim(dtype):
    codes = qfa.encode_to_hifloat8(torch.tensor(1.0625, dtype=dtype))
    assert codes.shape == () and codes.item() == 0x09  # a check vector, exact in every dtype


@pytest.mark.parametrize("shape", [(0,), (2, 0, 3)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty(dtype, shape):
    codes = qfa.encode_to_hifloat8(torch.empty(shape, dtype=dtype))
    assert (codes.shape, codes.dtype) == (torch.Size(shape), torch.uint8)


@pytest.mark.parametrize("size", [100, 3 * 65536 + 17], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_input_left_unmodified(dtype, size):
    x = random_values((size,), dtype, seed=4)
    before = x.clone()
    qfa.encode_to_hifloat8(x)
    qfa.encode_to_hifloat8(x[::3].view(-1, 1).t())
    assert np.array_equal(bit_patterns(x), bit_patterns(before))  # bitwise, so NaNs compare


def test_compile_limits_scope_qfa_calls_only():
    """qfa's recompile limit holds inside :func:`_compile.limits` (nested scopes included) and
    the user's dynamo config is back afterwards, also after an exception."""
    user = torch._dynamo.config.recompile_limit
    assert user != _compile.RECOMPILE_LIMIT  # otherwise the test proves nothing
    with _compile.limits():
        assert torch._dynamo.config.recompile_limit == _compile.RECOMPILE_LIMIT
        with _compile.limits():
            assert torch._dynamo.config.recompile_limit == _compile.RECOMPILE_LIMIT
        assert torch._dynamo.config.recompile_limit == _compile.RECOMPILE_LIMIT
    assert torch._dynamo.config.recompile_limit == user
    with pytest.raises(RuntimeError):
        with _compile.limits():
            raise RuntimeError("boom")
    assert torch._dynamo.config.recompile_limit == user
    with _compile.limits():  # and a later scope still applies it
        assert torch._dynamo.config.recompile_limit == _compile.RECOMPILE_LIMIT
