"""decode_from_hifloat8 on CPU: all 256 codes against the spec reference, and round trips."""

from __future__ import annotations

import math

import pytest
import torch

import qfa
import spec_reference as spec
from qfa import _compile
from qfa.cast import torch_path

pytestmark = pytest.mark.usefixtures("torch_backend")

MODES = spec.OVERFLOW_MODES
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ALL_CODES = torch.arange(256, dtype=torch.uint8)


def compiled_ran(fn) -> bool:
    return fn in _compile._compiled and fn not in _compile._failed


def decode_on(codes: torch.Tensor, dtype: torch.dtype, path: str) -> torch.Tensor:
    """Decode on the requested path; small inputs are tiled up to the compile threshold."""
    n, minimum = codes.numel(), torch_path.COMPILE_MIN_ELEMENTS
    if path == "eager":
        return qfa.decode_from_hifloat8(codes, dtype)
    reps = -(-minimum // n)
    tiled = qfa.decode_from_hifloat8(codes.reshape(-1).repeat(reps), dtype).view(reps, n)
    assert compiled_ran(torch_path.decode_codes), "the compiled path did not run"
    assert same_values(tiled, tiled[:1].expand(reps, n)), "copies of the same code decoded differently"
    return tiled[0].view(codes.shape)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values with equal signs (so -0.0 != 0.0), NaN matching NaN."""
    both_nan = a.isnan() & b.isnan()
    same = (a == b) & (torch.signbit(a) == torch.signbit(b))
    return bool((both_nan | same).all())


def reference_values(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    values = torch.tensor([spec.decode(c) for c in codes.reshape(-1).tolist()], dtype=torch.float64)
    exact = values.to(dtype)
    finite = values.isfinite()
    # The spec promises every HiF8 value is exact in fp16, bf16 and fp32.
    assert torch.equal(exact[finite].to(torch.float64), values[finite])
    return exact.view(codes.shape)


# --- the reference decode agrees with the spec's own statements ----------------------------


def test_reference_decode_matches_spec_facts():
    values = [spec.decode(c) for c in range(256)]
    assert values[0x6E] == 2.0**15 and values[0x7E] == 2.0**-15 and values[0x01] == 2.0**-22
    assert values[0x00] == 0.0 and not math.copysign(1.0, values[0x00]) < 0
    assert math.isnan(values[0x80]) and sum(map(math.isnan, values)) == 1
    assert (values[0x6F], values[0xEF]) == (math.inf, -math.inf)
    finite = [v for v in values if math.isfinite(v)]
    assert len({v for v in finite if v > 0}) == 126 and len(set(finite)) == 253
    assert len({abs(v) for v in values if not math.isnan(v)}) == 128  # 0, Inf, 126 magnitudes
    # At most 4 significant bits: why HiF8 x HiF8 products are exact in fp32.
    assert all(math.frexp(v)[0] * 16 == int(math.frexp(v)[0] * 16) for v in finite)


# --- the op --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_codes(dtype, path):
    got = decode_on(ALL_CODES, dtype, path)
    assert got.dtype == dtype
    want = reference_values(ALL_CODES, dtype)
    bad = [c for c in range(256) if not same_values(got[c : c + 1], want[c : c + 1])]
    assert not bad, [f"0x{c:02X}: got {got[c].item()!r}, want {want[c].item()!r}" for c in bad[:8]]


def test_bfloat16_is_the_default_dtype():
    assert qfa.decode_from_hifloat8(ALL_CODES).dtype == torch.bfloat16


@pytest.mark.parametrize("overflow", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip(dtype, overflow, path):
    # Every code survives decode then encode, NaN (0x80) and Inf (0x6F/0xEF) included.
    decoded = decode_on(ALL_CODES, dtype, path)
    codes = qfa.encode_to_hifloat8(decoded, overflow=overflow)
    assert torch.equal(codes, ALL_CODES), [
        f"0x{c:02X} -> {decoded[c].item()!r} -> 0x{codes[c].item():02X}" for c in range(256) if codes[c] != c
    ][:8]


def random_codes(shape, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_larger_than_one_tile(dtype):
    codes = random_codes((3 * 65536 + 17,), seed=1)
    assert same_values(qfa.decode_from_hifloat8(codes, dtype), reference_values(codes, dtype))


def test_compiled_path_matches_eager_and_keeps_one_graph(monkeypatch):
    """Other sizes and input layouts must reuse the compiled graph (see the encode twin)."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv(_compile.ENV_VAR, "1")
    codes = random_codes((3 * 65536 + 17,), seed=5)
    n = 3 << 16
    compiled = qfa.decode_from_hifloat8(codes, torch.float16)
    assert compiled_ran(torch_path.decode_codes), "the compiled path did not run"
    graphs = counters["stats"]["unique_graphs"]
    variants = {
        "shorter": (codes[:-5], compiled[:-5]),
        "2-D view": (codes[:n].view(3, -1), compiled[:n].view(3, -1)),
        "strided": (codes[::2], compiled[::2]),
        "offset": (codes[1:], compiled[1:]),
    }
    for name, (variant, want) in variants.items():
        assert same_values(qfa.decode_from_hifloat8(variant, torch.float16), want), name
        assert counters["stats"]["unique_graphs"] == graphs, f"a {name} input compiled another graph"

    monkeypatch.setenv(_compile.ENV_VAR, "0")
    assert same_values(qfa.decode_from_hifloat8(codes, torch.float16), compiled)
    assert same_values(compiled, reference_values(codes, torch.float16))


NON_CONTIGUOUS = {
    "transposed": lambda y: y.t(),
    "strided": lambda y: y[::2, 1::3],
    "offset": lambda y: y[3:, 5:],
    "expanded": lambda y: y[:, :1].expand(-1, 7),
}


@pytest.mark.parametrize("view", NON_CONTIGUOUS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous(dtype, view):
    codes = NON_CONTIGUOUS[view](random_codes((60, 8), seed=2))
    assert not codes.is_contiguous()
    values = qfa.decode_from_hifloat8(codes, dtype)
    assert values.shape == codes.shape
    assert same_values(values, reference_values(codes.contiguous(), dtype))


@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 3, 4, 5)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shape_dtype_and_device_kept(dtype, shape):
    codes = random_codes(shape, seed=3)
    values = qfa.decode_from_hifloat8(codes, dtype)
    assert (values.shape, values.dtype, values.device) == (codes.shape, dtype, codes.device)
    assert same_values(values, reference_values(codes, dtype))


@pytest.mark.parametrize("shape", [(0,), (2, 0, 3)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty(dtype, shape):
    values = qfa.decode_from_hifloat8(torch.empty(shape, dtype=torch.uint8), dtype)
    assert (values.shape, values.dtype) == (torch.Size(shape), dtype)


@pytest.mark.parametrize("size", [100, 3 * 65536 + 17], ids=["eager", "compiled"])
def test_input_left_unmodified(size):
    codes = random_codes((size,), seed=4)
    before = codes.clone()
    qfa.decode_from_hifloat8(codes, torch.float32)
    qfa.decode_from_hifloat8(codes[::3].view(-1, 1).t(), torch.float16)
    assert torch.equal(codes, before)
