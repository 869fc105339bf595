"""Host-side lookup tables, built once per (device, table) and shared between threads.

Like the Ascend cast op, the host builds every table and the device only looks up:

* the half-space encode LUT: 32768 magnitude codes indexed by the low 15 bits of an fp16 or
  bf16 pattern; the device restores the sign as ``mag | sign << 7`` unless ``mag`` is 0;
* the full encode LUT (65536 entries, sign included), derived from the half-space LUT by that
  same rule, for the CPU path where one gather beats a gather plus sign arithmetic;
* the 256-entry decode LUTs, one per output dtype, stored as raw bit patterns.

fp32 needs no table of its own: HiF8 rounding reads only the sign, the exponent and the first
four mantissa bits (three kept, one to round on), all of which sit in the upper 16 bits of an
fp32 pattern, i.e. in the bf16 pattern truncated from it. Only NaNs whose payload lies in the
low 16 bits need a separate ``isnan`` check.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np
import torch

from qfa import _plain_memory
from qfa.cast import format as fmt

#: Dtypes that encode takes and decode produces, with the integer view of their bit patterns.
BITS_VIEW: dict[torch.dtype, torch.dtype] = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
}
#: Dtypes with a 32768-entry half-space table (fp32 is looked up in the bf16 one).
TABLE_DTYPES = (torch.float16, torch.bfloat16)

_lock = threading.RLock()  # re-entrant: the full LUT is built from the half-space one
_cache: dict[tuple, torch.Tensor] = {}


def _cached(key: tuple, device: torch.device, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    full_key = (*key, str(device))
    table = _cache.get(full_key)
    if table is None:
        with _lock:
            table = _cache.get(full_key)
            if table is None:
                with _plain_memory.host_constant():
                    table = build().to(device)
                _cache[full_key] = table
    return table


def encode_magnitudes(values: np.ndarray, overflow: str) -> np.ndarray:
    """Magnitude codes (0..0x7F, or 0x80 for NaN) of non-negative float64 values."""
    thresholds = np.asarray(fmt.ROUNDING_THRESHOLDS)
    codes = np.asarray(fmt.POSITIVE_CODES, dtype=np.uint8)
    finite = np.where(np.isfinite(values), values, 0.0)
    mag = codes[np.searchsorted(thresholds, finite, side="right")]
    overflowed = values >= fmt.OVERFLOW_THRESHOLD  # Inf included
    if overflow == "saturate":
        mag = np.where(overflowed, fmt.MAX_CODE, mag)
        mag = np.where(np.isinf(values), fmt.POS_INF_CODE, mag)
    else:
        mag = np.where(overflowed, fmt.POS_INF_CODE, mag)
    return np.where(np.isnan(values), fmt.NAN_CODE, mag).astype(np.uint8)


def _build_half_space(dtype: torch.dtype, overflow: str) -> torch.Tensor:
    patterns = torch.arange(0x8000, dtype=torch.int32).to(torch.int16).view(dtype)
    values = patterns.to(torch.float64).numpy()
    return torch.from_numpy(encode_magnitudes(values, overflow))


def half_space_lut(dtype: torch.dtype, overflow: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """uint8[32768]: magnitude code of the positive fp16/bf16 pattern ``i``."""
    return _cached(("half", dtype, overflow), torch.device(device), lambda: _build_half_space(dtype, overflow))


def restore_sign(mag: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """``mag | sign << 7`` unless the magnitude code is 0 (HiF8 has no -0; NaN stays 0x80)."""
    signed = mag | (negative.to(torch.uint8) << 7)
    return torch.where(mag == fmt.ZERO_CODE, mag, signed)


def _build_full(dtype: torch.dtype, overflow: str) -> torch.Tensor:
    half = half_space_lut(dtype, overflow)
    return torch.cat([half, restore_sign(half, torch.ones_like(half, dtype=torch.bool))])


def full_lut(dtype: torch.dtype, overflow: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """uint8[65536]: code of the fp16/bf16 pattern ``i`` (read as unsigned), sign included."""
    return _cached(("full", dtype, overflow), torch.device(device), lambda: _build_full(dtype, overflow))


def _build_decode(dtype: torch.dtype) -> torch.Tensor:
    values = torch.tensor(fmt.DECODE_VALUES, dtype=torch.float64).to(dtype)
    return values.view(BITS_VIEW[dtype])


def decode_lut(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """int16[256] or int32[256]: bit pattern of each code's value in ``dtype``."""
    return _cached(("decode", dtype), torch.device(device), lambda: _build_decode(dtype))


def table_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype whose encode table serves ``dtype`` (fp32 uses bf16's, see module doc)."""
    return torch.bfloat16 if dtype == torch.float32 else dtype



def _build_round() -> torch.Tensor:
    codes = full_lut(torch.bfloat16, "saturate")
    return decode_lut(torch.float32)[codes.to(torch.int64)].view(torch.float32)


def round_lut(device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32[65536]: the saturating HiF8 rounding of any fp32 whose upper 16 bits are ``i``.

    HiF8 rounding reads only those bits (see the module docstring), so one gather rounds a
    tensor to HiF8 values; the torch attention path rounds P with it.
    """
    return _cached(("round",), torch.device(device), _build_round)
