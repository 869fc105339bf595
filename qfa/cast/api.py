"""``encode_to_hifloat8`` / ``decode_from_hifloat8``: argument checks and backend dispatch.

On CPU the encode runs the native encoder (:mod:`qfa.attention.backends.cpu_prepare`: register tables on
AVX-512, a code table elsewhere, parallel above 2^18 elements) when it is built; the
torch path (one table gather, compiled by TorchInductor for large tensors) runs elsewhere, under
``torch.compile`` tracing and with ``QFA_NATIVE=0``. Both give the same bits (tested on every
input pattern).
"""

from __future__ import annotations

import torch

from qfa import backends
from qfa.cast import format as fmt
from qfa.cast import luts, torch_path
from qfa.tiling.checks import check_codes
from qfa.tiling.spec import FLOAT_DTYPES


def as_codes(y: torch.Tensor, name: str) -> torch.Tensor:
    """``y`` as a uint8 tensor of HiF8 codes, or a TypeError naming ``name``."""
    check_codes(y, name)
    return y if y.dtype == torch.uint8 else y.view(torch.uint8)


_cpu_prepare = None


def _native_cpu(x: torch.Tensor) -> bool:
    """Whether the native encoder takes ``x`` (imported on first use: qfa.attention imports this
    module)."""
    global _cpu_prepare
    if x.device.type != "cpu":
        return False
    if _cpu_prepare is None:
        from qfa.attention.backends import cpu_prepare

        _cpu_prepare = cpu_prepare
    return _cpu_prepare.usable(x)


def _check_overflow(overflow: str) -> None:
    if overflow not in fmt.OVERFLOW_MODES:
        raise ValueError(f"overflow must be one of {fmt.OVERFLOW_MODES}, got {overflow!r}")


def encode_to_hifloat8(x: torch.Tensor, *, overflow: str = "saturate", backend: str | None = None) -> torch.Tensor:
    """Round fp32/fp16/bf16 ``x`` to HiF8 codes (uint8, same shape and device), bit-exact.

    Rounding is to nearest with ties away from zero in the input's own binade. With
    ``overflow="saturate"`` (default) finite values with ``|x| >= 40960`` become +-MAX (0x6E /
    0xEE) and +-Inf stays +-Inf; ``overflow="inf"`` maps them all to +-Inf (CANN host code). NaN
    becomes 0x80 and -0.0 becomes 0x00. float64 is rejected: rounding it to fp32 first could
    double-round, so cast it yourself and say which rounding you want.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        hint = " (round it to float32 yourself: a silent fp64->fp32 cast could double-round)" if x.dtype == torch.float64 else ""
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}{hint}")
    _check_overflow(overflow)
    chosen = backends.resolve(x.device, backend)
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    x = x.resolve_neg()  # (a negative view's bits are not its values: both paths read bits)
    if chosen != "triton" and _native_cpu(x):
        # (a contiguous x in its own shape: the codes are allocated in it, no reshape or view,
        # a tenth of a small call's time)
        return _cpu_prepare.encode_flat(x.contiguous(), inf_mode=overflow == "inf")
    flat = x.reshape(-1)
    if chosen == "triton":
        from qfa.kernels import cast as cast_kernels

        codes = cast_kernels.encode(flat.contiguous(), overflow)
    else:
        table = luts.full_lut(luts.table_dtype(x.dtype), overflow, x.device)
        bits = flat.view(luts.BITS_VIEW[x.dtype])
        codes = torch_path.run(torch_path.encode_bits, bits, table)
    return codes.view(x.shape)


def decode_from_hifloat8(y: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *, backend: str | None = None) -> torch.Tensor:
    """Exact values of HiF8 codes ``y`` as ``dtype`` (fp16, bf16 or fp32), same shape and device.

    Every HiF8 value is representable in all three dtypes; 0x80 decodes to NaN, 0x6F/0xEF to
    +-Inf.
    """
    codes = as_codes(y, "y")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")
    chosen = backends.resolve(codes.device, backend)
    if codes.numel() == 0:
        return torch.empty(codes.shape, dtype=dtype, device=codes.device)
    flat = codes.reshape(-1)
    if chosen == "triton":
        from qfa.kernels import cast as cast_kernels

        return cast_kernels.decode(flat.contiguous(), dtype).view(codes.shape)
    table = luts.decode_lut(dtype, codes.device)
    bits = torch_path.run(torch_path.decode_codes, flat, table)
    return bits.view(dtype).view(codes.shape)
