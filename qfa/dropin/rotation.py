"""Hadamard rotation of the head dimension: an exact transform that suits a tapered format.

For an orthogonal H, (Q H)(K H)^T = Q K^T and P (V H) H^T = P V, so rotating Q, K and V before
quantising and rotating the output back changes nothing in exact arithmetic. What it changes
is the distribution each per-tensor scale sees: a normalised Hadamard matrix spreads the few
outlier channels of Q and K over all 128, so values bunch around the RMS, inside the 7 binades
where HiF8 keeps 3 mantissa bits (the QuaRot / SpinQuant idea, here applied to attention).

The definition of :func:`rotate` (one for every caller: the drop-in, the KV caches, the vLLM
plugin), in fp32: the Walsh-Hadamard butterfly, levels h = 1, 2, 4, ..., n/2, each replacing
``x[i], x[i+h]`` by ``x[i] + x[i+h], x[i] - x[i+h]`` for the i whose bit h is clear, then one
multiply by :func:`normalisation` (fl(1/sqrt(n))). That is ``x @ hadamard(n)`` in exact
arithmetic (Sylvester's H is ``(-1)^popcount(i & j)``); each level is one exact-order IEEE
operation per element, so the native row kernel (:mod:`qfa.attention.backends.cpu_prepare`, for n = 128
on CPU) and the torch ops below (any device, n, or autograd) give the same bits. It is also
more accurate than the 128-term product it replaced (log2(n) roundings per element, not n) and
costs n log2(n) additions instead of n^2 multiply-adds.
"""

from __future__ import annotations

import functools
import math
import struct

import torch

from qfa import _plain_memory
from qfa.attention.backends import cpu_prepare


def _check_size(n: int) -> None:
    if n < 1 or n & (n - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head_dim, got {n}")


def _fp32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


#: fl(1/sqrt(n)) per power of two, made at import: a constant for a traced graph to read.
_NORMALISATIONS = {1 << k: _fp32(1 / math.sqrt(1 << k)) for k in range(31)}


def normalisation(n: int) -> float:
    """fl(1/sqrt(n)): the fp32 factor every entry of the stored H carries (as a Python float)."""
    _check_size(n)
    return _NORMALISATIONS[n]


@functools.lru_cache(maxsize=8)
def _hadamard_cpu(n: int) -> torch.Tensor:
    _check_size(n)
    with _plain_memory.host_constant():
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:  # Sylvester's construction
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return (h * normalisation(n)).to(torch.float32)


@functools.lru_cache(maxsize=16)
def _hadamard_on(n: int, device: torch.device) -> torch.Tensor:
    with _plain_memory.host_constant():
        return _hadamard_cpu(n).to(device)


def hadamard(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The symmetric, orthogonal n x n Sylvester-Hadamard matrix scaled by fl(1/sqrt(n)), fp32:
    what :func:`rotate` multiplies by, in exact arithmetic. One tensor per (n, device), made once.
    Do not modify the result."""
    return _hadamard_on(n, torch.device(device))


def butterfly(x: torch.Tensor) -> torch.Tensor:
    """:func:`rotate` in torch ops (fp32 ``x``): the definition, on any device, with autograd."""
    n = x.shape[-1]
    _check_size(n)
    shape = x.shape
    h = 1
    while h < n:
        pairs = x.reshape(-1, n // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        x = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return x.reshape(shape) * normalisation(n)


#: The row length the native kernel rotates (HiF8 mode 0's head dimension).
NATIVE_SIZE = 128


def native(x: torch.Tensor) -> bool:
    """Whether :func:`rotate` of ``x`` runs in the native row kernel (the same bits either way)."""
    return (x.shape[-1] == NATIVE_SIZE and x.dtype in cpu_prepare.DTYPE_CODES
            and not (x.requires_grad and torch.is_grad_enabled()) and cpu_prepare.usable(x))


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` over the last dimension, in fp32 (H is its own inverse, and symmetric), by the
    butterfly of the module doc. On CPU (n = 128) one pass on the calling thread: no parallel
    region (a decode step rotates a few rows per layer, and on a loaded machine each region
    waited ~3 ms for a descheduled thread), no fp32 copy of a bf16/fp16 input."""
    if native(x):
        return cpu_prepare.rotate_rows(x.detach().contiguous(), torch.float32, normalisation(NATIVE_SIZE))
    return butterfly(x.float())
