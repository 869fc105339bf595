"""Argument checks shared by every entry point (the op, its plan, the drop-in, the adapters).

One function per rule, so the same mistake gets the same message wherever it is made: a wrong
type or dtype raises ``TypeError``, a wrong value or shape ``ValueError``, and the message names
the argument, what was expected and what was given.
"""

from __future__ import annotations

import math

import sys

import torch

from qfa.tiling.spec import FLOAT_DTYPES


def require_tensor(value, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def hifloat8_dtypes() -> tuple[torch.dtype, ...]:
    """Dtypes that hold HiF8 codes: uint8, plus ``torch_npu.hifloat8`` once torch_npu is loaded."""
    npu = sys.modules.get("torch_npu")  # never import torch_npu ourselves
    hif8 = getattr(npu, "hifloat8", None) if npu is not None else None
    return (torch.uint8,) if not isinstance(hif8, torch.dtype) else (torch.uint8, hif8)


def check_codes(value, name: str) -> torch.Tensor:
    """A tensor of HiF8 codes (uint8, or torch_npu.hifloat8), or a TypeError naming ``name``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of HiF8 codes, got {type(value).__name__}")
    if value.dtype != torch.uint8 and value.dtype not in hifloat8_dtypes():
        raise TypeError(f"{name} must hold HiF8 codes as torch.uint8 (or torch_npu.hifloat8), got {value.dtype}")
    return value


def check_bool(value, name: str) -> bool:
    """``value`` if it is a real bool (not merely truthy: ``"no"`` is not False)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_scalar_fp32(value, name: str) -> torch.Tensor:
    require_tensor(value, name)
    if value.dtype != torch.float32:
        raise TypeError(f"{name} must be torch.float32, got {value.dtype}")
    if value.shape != (1,):
        raise ValueError(f"{name} must have shape (1,), got {tuple(value.shape)}")
    return value


def check_int32_vector(value, name: str, length: int) -> torch.Tensor:
    """An int32 tensor of shape (length,); its values are not read (no device sync)."""
    require_tensor(value, name)
    if value.dtype != torch.int32:
        raise TypeError(f"{name} must be torch.int32, got {value.dtype}")
    if tuple(value.shape) != (length,):
        raise ValueError(f"{name} must have shape ({length},), got {tuple(value.shape)}")
    return value


def int32_vector(value, name: str, length: int) -> list[int]:
    """The values of an int32 (length,) tensor, as Python ints (a host read)."""
    return [int(v) for v in check_int32_vector(value, name, length).tolist()]


def check_device(value, name: str, device: torch.device) -> None:
    """``value`` (when a tensor) on ``device``, q's device: every tensor of a call lives there."""
    if isinstance(value, torch.Tensor) and value.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {value.device}")


def check_float_tensor(value, name: str) -> torch.Tensor:
    """A tensor of one of the floating dtypes the cast and the drop-in take (spec.FLOAT_DTYPES)."""
    require_tensor(value, name)
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {value.dtype}")
    return value


def check_positive_float(value, name: str) -> float:
    """A Python number, finite and > 0, as a float (a tensor or a bool is refused: reading a
    tensor here would cost a device sync, and ``True`` is not a scale)."""
    if isinstance(value, (bool, torch.Tensor)) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a Python float or None, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return float(value)


def check_sequence_lengths(layout: str, *, batch: int | None = None, device: torch.device | None = None,
                           cu_seqlens_q=None, cu_seqlens_kv=None, seqused_q=None, seqused_kv=None,
                           max_batch: int | None = None, kv_paged: bool = False) -> int | None:
    """The static rules of the per-sequence lengths; returns the batch size B.

    TND needs ``cu_seqlens_q`` and ``cu_seqlens_kv`` (int32, 1-D, B + 1 entries; B is then
    their length less one) and the other layouts refuse them: B is then ``batch`` (q's leading
    size), or, when the caller has no q (a plan made before the tensors), ``seqused``'s length
    (None when nothing gives it). ``seqused_q`` / ``seqused_kv`` are optional int32 (B,) in every
    layout. The tensors are on ``device`` (q's), or, without one, on one device. With
    ``max_batch``, B must be in [1, max_batch]. Reads no tensor value (no device sync): the values
    (leading 0, monotone, within the tensor) are :func:`cumulative_lengths` and
    :func:`apply_seqused`'s job. ``layout`` must already be one of the layouts.

    ``kv_paged`` (k/v in a paged layout): the keys' lengths come from ``seqused_kv``, which is
    then required, and ``cu_seqlens_kv`` is refused.
    """
    named = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_kv": cu_seqlens_kv, "seqused_q": seqused_q,
             "seqused_kv": seqused_kv}
    if device is not None:
        for name, t in named.items():
            check_device(t, name, device)
    else:
        devices = {t.device for t in named.values() if isinstance(t, torch.Tensor)}
        if len(devices) > 1:
            raise ValueError(f"cu_seqlens and seqused tensors must share one device, got {sorted(map(str, devices))}")
    if kv_paged:
        if cu_seqlens_kv is not None:
            raise ValueError("cu_seqlens_kv is not for paged k/v: seqused_kv gives each sequence's key count")
        if seqused_kv is None:
            raise ValueError("paged k/v (block_table) needs seqused_kv (int32, B): each sequence's key count")
    if layout == "TND":
        if cu_seqlens_q is None or (cu_seqlens_kv is None and not kv_paged):
            needs = "cu_seqlens_q" if kv_paged else "cu_seqlens_q and cu_seqlens_kv"
            raise ValueError(f"layout 'TND' needs {needs} (int32, B+1, leading 0)")
        cu_q = require_tensor(cu_seqlens_q, "cu_seqlens_q")
        if cu_q.dim() != 1 or cu_q.numel() < 2:
            raise ValueError(f"cu_seqlens_q must be 1-D with B+1 >= 2 entries, got shape {tuple(cu_q.shape)}")
        batch = cu_q.numel() - 1
        check_int32_vector(cu_q, "cu_seqlens_q", batch + 1)
        if not kv_paged:
            check_int32_vector(cu_seqlens_kv, "cu_seqlens_kv", batch + 1)
    else:
        for name in ("cu_seqlens_q", "cu_seqlens_kv"):
            if named[name] is not None:
                raise ValueError(f"{name} is only for layout 'TND'; got it with layout {layout!r}")
        for name in ("seqused_q", "seqused_kv"):
            if named[name] is not None and batch is None:
                t = require_tensor(named[name], name)
                batch = t.shape[0] if t.dim() == 1 else None
    if max_batch is not None and batch is not None:
        check_batch_size(batch, max_batch)
    for name in ("seqused_q", "seqused_kv"):
        if named[name] is not None:
            check_int32_vector(named[name], name, batch)
    return batch


def check_batch_size(batch: int, max_batch: int) -> None:
    if not 0 < batch <= max_batch:
        raise ValueError(f"batch size B must be in [1, {max_batch}], got {batch}")


def cumulative_lengths(cu: list[int], name: str, total: int | None) -> list[int]:
    """Per-sequence lengths from the values of a cu_seqlens: a leading 0, non-decreasing, and
    ending at the tensor's token count ``total`` (unchecked when None: no tensor yet)."""
    if cu[0] != 0:
        raise ValueError(f"{name} must start with 0, got {cu[0]}")
    lens = [b - a for a, b in zip(cu, cu[1:])]
    if any(n < 0 for n in lens):
        raise ValueError(f"{name} must be non-decreasing, got {cu}")
    if total is not None and cu[-1] != total:
        raise ValueError(f"{name}[-1] must equal the token count {total} of the tensor, got {cu[-1]}")
    return lens


def apply_seqused(lens: list[int] | None, used: list[int] | None, name: str) -> list[int] | None:
    """The used lengths ``used`` (a seqused's values), each within its sequence's length in
    ``lens`` (or only >= 0 when the lengths are not known yet); ``lens`` when there is no seqused."""
    if used is None:
        return lens
    if lens is not None:
        for b, (u, n) in enumerate(zip(used, lens)):
            if not 0 <= u <= n:
                raise ValueError(f"{name}[{b}] must be in [0, {n}] (the sequence's length), got {u}")
    elif any(u < 0 for u in used):
        raise ValueError(f"{name} must hold lengths >= 0, got {used}")
    return used
