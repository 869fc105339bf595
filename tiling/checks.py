"""Argument checks shared by every entry point (the op, its plan, the drop-in, the adapters).

One function per rule, so the same mistake gets the same message wherever it is made: a wrong
type or dtype raises ``TypeError``, a wrong value or shape ``ValueError``, and the message names
the argument, what was expected and what was given.
"""

from __future__ import annotations

import torch


def require_tensor(value, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
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
    if tuple(value.shape) != (1,):
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
