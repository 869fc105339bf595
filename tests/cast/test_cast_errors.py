"""Bad arguments to the cast raise the documented errors, naming the offending argument."""

from __future__ import annotations

import pytest
import torch

import qfa

X = torch.ones(4)
CODES = torch.zeros(4, dtype=torch.uint8)


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64], ids=str
)
def test_encode_rejects_dtype(dtype):
    with pytest.raises(TypeError, match=rf"\bx must be .*{dtype}"):
        qfa.encode_to_hifloat8(torch.zeros(4, dtype=dtype))


def test_encode_float64_is_not_silently_double_rounded():
    # 1.0625 - 2^-30 lies below the tie at 1.0625 (so HiF8 1.0), but fp32 rounds it onto the
    # tie, which HiF8 rounds up to 1.125: the op must refuse rather than pick one.
    with pytest.raises(TypeError, match="float64.*double-round"):
        qfa.encode_to_hifloat8(torch.tensor([1 + 2**-4 - 2**-30], dtype=torch.float64))


@pytest.mark.parametrize("x", [[1.0, 2.0], 1.0, None], ids=["list", "float", "None"])
def test_encode_rejects_non_tensor(x):
    with pytest.raises(TypeError, match=r"\bx must be a torch\.Tensor"):
        qfa.encode_to_hifloat8(x)


@pytest.mark.parametrize("overflow", ["bogus", "INF", "saturating", None])
def test_encode_rejects_overflow_mode(overflow):
    with pytest.raises(ValueError, match=r"\boverflow must be one of"):
        qfa.encode_to_hifloat8(X, overflow=overflow)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.float32, torch.float16, torch.bool], ids=str)
def test_decode_rejects_input_dtype(dtype):
    with pytest.raises(TypeError, match=rf"\by must hold HiF8 codes .*{dtype}"):
        qfa.decode_from_hifloat8(torch.zeros(4, dtype=dtype))


def test_decode_rejects_non_tensor():
    with pytest.raises(TypeError, match=r"\by must be a torch\.Tensor"):
        qfa.decode_from_hifloat8([0, 1, 2])


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.uint8, torch.float8_e4m3fn, "float32"], ids=str)
def test_decode_rejects_target_dtype(dtype):
    with pytest.raises(TypeError, match=r"\bdtype must be"):
        qfa.decode_from_hifloat8(CODES, dtype)


def test_encode_rejects_backend():
    with pytest.raises(ValueError, match=r"\bbackend must be one of"):
        qfa.encode_to_hifloat8(X, backend="bogus")


def test_decode_rejects_backend():
    with pytest.raises(ValueError, match=r"\bbackend must be one of"):
        qfa.decode_from_hifloat8(CODES, backend="bogus")


@pytest.mark.parametrize("empty", [torch.empty(0), torch.empty(3, 0, dtype=torch.bfloat16)], ids=["1d", "2d"])
def test_backend_is_checked_for_empty_inputs_too(empty):
    with pytest.raises(ValueError, match=r"\bbackend must be one of"):
        qfa.encode_to_hifloat8(empty, backend="bogus")
    with pytest.raises(ValueError, match=r"\bbackend must be one of"):
        qfa.decode_from_hifloat8(torch.empty(0, dtype=torch.uint8), backend="bogus")
