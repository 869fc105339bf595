"""Hadamard rotation of the head dimension: an exact transform that suits a tapered format.

For an orthogonal H, (Q H)(K H)^T = Q K^T and P (V H) H^T = P V, so rotating Q, K and V before
quantising and rotating the output back changes nothing in exact arithmetic. What it changes
is the distribution each per-tensor scale sees: a normalised Hadamard matrix spreads the few
outlier channels of Q and K over all 128, so values bunch around the RMS, inside the 7 binades
where HiF8 keeps 3 mantissa bits (the QuaRot / SpinQuant idea, here applied to attention).
"""

from __future__ import annotations

import functools
import math

import torch

from qfa.attention.cpu_gemm import matmul_nt


@functools.lru_cache(maxsize=8)
def _hadamard_cpu(n: int) -> torch.Tensor:
    if n < 1 or n & (n - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head_dim, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:  # Sylvester's construction
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(torch.float32)


@functools.lru_cache(maxsize=16)
def _hadamard_on(n: int, device: torch.device) -> torch.Tensor:
    return _hadamard_cpu(n).to(device)


def hadamard(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The symmetric, orthogonal n x n Sylvester-Hadamard matrix scaled by 1/sqrt(n), fp32.

    One tensor per (n, device), made once: a decode step rotates a few rows per layer, so a copy
    to the device per call would cost more than the rotation. Do not modify the result."""
    return _hadamard_on(n, torch.device(device))


#: CPU rotations of at most this many elements run on one thread (ATen's grain size: below it
#: ATen runs its own elementwise ops serially). A decode step rotates a few rows per layer, four
#: times; a parallel region for so little work costs more than the product, and on a loaded
#: machine each one waits for a descheduled thread: ~3 ms a call instead of ~40 us (measured,
#: 2 shared cores). The bits are the same on one thread (tests/test_hif8_cache.py checks it).
SERIAL_ELEMENTS = 32768


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` over the last dimension, in fp32 (H is its own inverse, and symmetric)."""
    h = hadamard(x.shape[-1], x.device)
    threads = torch.get_num_threads()
    if x.device.type != "cpu" or x.numel() > SERIAL_ELEMENTS or threads == 1:
        return matmul_nt(x.float(), h)
    torch.set_num_threads(1)  # this thread's OpenMP count: other threads keep theirs
    try:
        return matmul_nt(x.float(), h)
    finally:
        torch.set_num_threads(threads)
