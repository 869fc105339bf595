"""FP8 E4M3 (``torch.float8_e4m3fn``): the element rounding, and quant_mode 6's scales.

The rounding, shared with :mod:`qfa.cast.mxfp8`: an fp32 value becomes the nearest E4M3 value,
ties to even, saturating at +-448 (+-Inf included); NaN stays NaN (code 0x7F) and the sign of
zero is kept (-0.0 -> 0x80). It is computed here from the fp32 exponent bits and ``torch.round``
(half to even), so it does not depend on torch's own fp8 cast or on the CPU's vector unit; the
final cast only sees values already on the E4M3 grid, which every implementation converts
exactly. On CPU, inputs of ``COMPILE_MIN_ELEMENTS`` or more run the elementwise core through
TorchInductor (:mod:`qfa._compile`, as the HiF8 cast does; ``QFA_COMPILE=0`` turns it off): it
is exact arithmetic only (shifts, powers of two, round, one IEEE division), so compiled and eager
give the same bits.

quant_mode 6 (``docs/spec/quant-flash-attn.md``) keeps one fp32 scale per token and
head for q (NTD, scale (Q_N, Q_T)) and for the paged k (PA_BNBD (Bn, KV_N, 128, D), scale
(Bn, KV_N, 128)), and one per head for v (scale (KV_N,)). The rule, for each group of values
sharing a scale:

* ``scale = amax / 448`` in fp32 (so the largest magnitude lands on 448, E4M3's largest value);
* a zero scale (amax = 0, or an amax below 448 * 2^-150 whose quotient underflows) is replaced
  by 1.0: the elements are then +-0 and dequantise to +-0;
* a group holding NaN or +-Inf gets the scale NaN and NaN elements, so it dequantises to NaN
  rather than to a finite value that hides the fault (the rule MXFP8 follows, see
  :mod:`qfa.cast.mxfp8`);
* ``elements = E4M3(fp32(x / scale))``: the fp32 quotient, then the rounding above (a quotient
  a rounding step past 448 saturates).

Dequantising is the fp32 product ``elements * scale`` (rounded to fp32: a scale carries 24
significant bits), then cast to the requested dtype.
"""

from __future__ import annotations

from typing import Callable, Final

import torch

from qfa import _compile
from qfa.cast.torch_path import COMPILE_MIN_ELEMENTS
from qfa.tiling.checks import require_tensor
from qfa.tiling.spec import FLOAT_DTYPES

E4M3: Final = torch.float8_e4m3fn
#: Largest finite E4M3 (fn) magnitude, 1.75 * 2^8.
E4M3_MAX: Final = 448.0
#: Mantissa bits of E4M3, and the exponent of its smallest normal binade (2^-6).
E4M3_MANTISSA_BITS: Final = 3
E4M3_MIN_NORMAL_EXPONENT: Final = -6
#: The code torch (and OCP) use for NaN in float8_e4m3fn (0xFF is the negative NaN).
E4M3_NAN_CODE: Final = 0x7F
#: Dtypes ``dequantize`` can return: the float inputs, and float64 (which holds any product).
OUTPUT_DTYPES: Final = FLOAT_DTYPES + (torch.float64,)

_FP32_EXPONENT_SHIFT = 23
_FP32_BIAS = 127


def check_float_input(x, name: str) -> torch.Tensor:
    """``x`` if it is an fp32/fp16/bf16 tensor; TypeError naming ``name`` otherwise."""
    require_tensor(x, name)
    if x.dtype not in FLOAT_DTYPES:
        hint = " (round it to float32 yourself: a silent fp64->fp32 cast could double-round)" if x.dtype == torch.float64 else ""
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}{hint}")
    return x


def check_output_dtype(dtype, name: str = "dtype") -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or dtype not in OUTPUT_DTYPES:
        raise TypeError(f"{name} must be one of {', '.join(map(str, OUTPUT_DTYPES))}, got {dtype!r}")
    return dtype


def check_dtype(value, name: str, dtype: torch.dtype) -> torch.Tensor:
    """``value`` if it is a tensor of ``dtype``; TypeError naming ``name`` otherwise."""
    require_tensor(value, name)
    if value.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {value.dtype}")
    return value


def check_e4m3(elements, name: str) -> torch.Tensor:
    return check_dtype(elements, name, E4M3)


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent as fp32 for int32 exponents in [-126, 127], built from the bits (exact)."""
    return ((exponent + _FP32_BIAS) << _FP32_EXPONENT_SHIFT).view(torch.float32)


def binade(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 |x|) of fp32 ``x`` read from its exponent field (int32); fp32 subnormals and
    zero read as -127, NaN and Inf as 128."""
    return ((x.view(torch.int32) >> _FP32_EXPONENT_SHIFT) & 0xFF) - _FP32_BIAS


def on_e4m3_grid(y: torch.Tensor) -> torch.Tensor:
    """fp32 ``y`` rounded to E4M3 values, still as fp32 (the elementwise core: no fp8 dtype, so
    TorchInductor can fuse it into one loop)."""
    # Clamping first is the same as saturating afterwards (rounding is monotone and 448 is on
    # the grid), and it bounds the binade, so the scalings below stay exact.
    y = y.clamp(-E4M3_MAX, E4M3_MAX)
    e = binade(y).clamp(E4M3_MIN_NORMAL_EXPONENT, 8)  # subnormals share 2^-6's quantum 2^-9
    shift = E4M3_MANTISSA_BITS - e
    # y * 2^shift has the kept bits as its integer part; torch.round rounds half to even and
    # keeps the sign of zero; the carry of a round-up lands on the next power of two, on the grid.
    return torch.round(y * pow2(shift)) * pow2(-shift)


def run(fn: Callable, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``fn(*tensors)``, compiled for large CPU inputs as the HiF8 cast's torch path is (the
    same function either way, and exact arithmetic only, so both give the same bits)."""
    if tensors[0].numel() >= COMPILE_MIN_ELEMENTS:
        # Contiguous, detached inputs keep dynamo to one graph per rank and dtype.
        return _compile.call(fn, *(t.contiguous().detach() for t in tensors), device=tensors[0].device)
    return fn(*tensors)


def round_to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """fp32 (fp16, bf16) ``y`` rounded to E4M3: nearest, ties to even, saturating at +-448; NaN
    stays NaN. Returns ``torch.float8_e4m3fn`` of ``y``'s shape."""
    flat = y.to(torch.float32).reshape(-1)
    return run(on_e4m3_grid, flat).view(y.shape).to(E4M3)  # values on the grid: an exact cast


def with_nan(elements: torch.Tensor, nonfinite: torch.Tensor) -> torch.Tensor:
    """E4M3 ``elements`` with NaN (0x7F) wherever ``nonfinite`` (broadcast) is set: the elements of
    a group whose scale is NaN, so they announce it on their own too."""
    bits = torch.where(nonfinite, torch.tensor(E4M3_NAN_CODE, dtype=torch.uint8, device=elements.device),
                       elements.view(torch.uint8))
    return bits.view(E4M3)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The core for a 2-D fp32 ``x``, one scale per row: (values on the grid, scale (R, 1),
    nonfinite (R, 1))."""
    nonfinite = (~torch.isfinite(x)).any(dim=1, keepdim=True)
    scale = x.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    scale = torch.where(nonfinite, torch.full_like(scale, float("nan")), scale)
    return on_e4m3_grid(x / scale), scale, nonfinite


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements, scale (R,)) of a 2-D float tensor with non-empty rows."""
    values, scale, nonfinite = run(_rows, x.to(torch.float32))
    return with_nan(values.to(E4M3), nonfinite), scale.squeeze(1)


def quantize_per_token_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row of the last axis: q (Q_N, Q_T, D) -> scale (Q_N, Q_T); paged k
    (Bn, KV_N, 128, D) -> scale (Bn, KV_N, 128). Returns (float8_e4m3fn elements of x's shape,
    fp32 scale of x.shape[:-1]) with ``x ~= elements * scale[..., None]``."""
    check_float_input(x, "x")
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last axis (the head dimension), got shape {tuple(x.shape)}")
    elements, scale = _quantize_rows(x.reshape(-1, x.shape[-1]))
    return elements.view(x.shape), scale.view(x.shape[:-1])


def quantize_per_head(x: torch.Tensor, head_axis: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per index of ``head_axis`` (v in PA_BNBD (Bn, KV_N, 128, D): axis 1, scale
    (KV_N,)). Returns (float8_e4m3fn elements of x's shape, fp32 scale (x.shape[head_axis],))."""
    check_float_input(x, "x")
    axis = normalise_axis(head_axis, x.ndim, "head_axis")
    dims = tuple(d for d in range(x.ndim) if d != axis)
    if not dims or any(x.shape[d] == 0 for d in dims):
        raise ValueError(f"x must have non-empty axes besides head_axis {head_axis}, got shape {tuple(x.shape)}")
    moved = x.movedim(axis, 0)
    elements, scale = _quantize_rows(moved.reshape(moved.shape[0], -1))
    return elements.view(moved.shape).movedim(0, axis).contiguous(), scale


def normalise_axis(axis, ndim: int, name: str = "axis") -> int:
    """``axis`` in [0, ndim) from an int in [-ndim, ndim); TypeError / ValueError otherwise."""
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"{name} must be an int, got {type(axis).__name__} {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name} must be in [{-ndim}, {ndim}) for a {ndim}-D tensor, got {axis}")
    return axis % ndim


def _check_scale(scale, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    check_dtype(scale, name, torch.float32)
    if tuple(scale.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(scale.shape)}")
    return scale


def _dequantize(elements: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return (elements.to(work) * scale.to(work)).to(dtype)


def dequantize_per_token_head(elements: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``elements * scale[..., None]`` as ``dtype`` (fp32 product; exact in float64)."""
    check_e4m3(elements, "elements")
    if elements.ndim < 1:
        raise ValueError(f"elements must have at least one axis, got shape {tuple(elements.shape)}")
    _check_scale(scale, "scale", tuple(elements.shape[:-1]))
    check_output_dtype(dtype)
    return _dequantize(elements, scale.unsqueeze(-1), dtype)


def dequantize_per_head(elements: torch.Tensor, scale: torch.Tensor, head_axis: int = 1,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``elements * scale`` with ``scale`` (N,) broadcast along ``head_axis``, as ``dtype``."""
    check_e4m3(elements, "elements")
    axis = normalise_axis(head_axis, elements.ndim, "head_axis")
    _check_scale(scale, "scale", (elements.shape[axis],))
    check_output_dtype(dtype)
    shape = [1] * elements.ndim
    shape[axis] = elements.shape[axis]
    return _dequantize(elements, scale.view(shape), dtype)
