"""Triton HiF8 cast kernels and their host launchers, driven by ``qfa.tiling.cast``'s plan.

``encode(flat, overflow)`` / ``decode(flat_codes, dtype)`` take a 1-D contiguous tensor and
return a new 1-D tensor of the same numel (``qfa.cast.api`` reshapes). The host builds the
tables once per device (``qfa.cast.luts``); the plan for the device's platform
(``qfa.tiling.platform_for``) gives the grid, each program's element range, the tile and the
Triton block. Each program walks its range tile by tile (the persistent loop on NPU; on CUDA a
program usually owns one tile), each tile in ``SUB`` masked steps of ``BLOCK`` elements.

One kernel per direction serves every dtype: fp16/bf16 are passed as their int16 bit patterns,
fp32 as values, decode writes through an int16/int32 view of the output. Platform choices
(grid, persistence, tile and block sizes, ``num_warps``) live in the plan, not here.

Not run on an NPU: the kernels use plain pointer arithmetic with masks (no block pointers,
which triton-ascend prefers for contiguous copies). If triton-ascend needs them, add an
NPU variant next to these kernels, keyed by ``plan.platform``, rather than branching inside.
Tests compile these kernels to PTX for sm_90 with the real compiler, and run them under the
interpreter; they have not run on a GPU here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qfa.cast import luts
from qfa.kernels.hif8 import hif8_decode_bits, hif8_encode
from qfa.tiling.cast import CastPlan, cast_plan
from qfa.tiling.platform import Platform, resolve_platform


@triton.jit
def _program_range(numel, per_program, INT64: tl.constexpr):
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    start = pid * per_program
    return start, tl.minimum(start + per_program, numel)


@triton.jit
def _cast_kernel(
    src_ptr, dst_ptr, lut_ptr, numel, per_program,
    TILE: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, INT64: tl.constexpr, DECODE: tl.constexpr,
):
    """One program walks its range tile by tile: load, look up in the host-built LUT, store."""
    start, end = _program_range(numel, per_program, INT64)
    for tile_start in range(start, end, TILE):
        limit = tl.minimum(tile_start + TILE, end)
        for sub in tl.static_range(SUB):
            offs = tile_start + sub * BLOCK + tl.arange(0, BLOCK)
            mask = offs < limit
            x = tl.load(src_ptr + offs, mask=mask, other=0)
            if DECODE:
                y = hif8_decode_bits(x, lut_ptr)
            else:
                y = hif8_encode(x, lut_ptr).to(tl.uint8)
            tl.store(dst_ptr + offs, y, mask=mask)


def _check_flat(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a 1-D contiguous tensor, got shape {tuple(t.shape)}")


def _output(out: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if out is None:
        return torch.empty(like.numel(), dtype=dtype, device=like.device)
    _check_flat(out, "out")
    if out.dtype != dtype or out.numel() != like.numel() or out.device != like.device:
        raise ValueError(
            f"out must be a {dtype} tensor of {like.numel()} elements on {like.device}, "
            f"got {out.dtype}, {out.numel()} elements on {out.device}"
        )
    return out


def _launch(plan: CastPlan, src: torch.Tensor, dst: torch.Tensor, lut: torch.Tensor, *, decode: bool) -> None:
    """Launch the cast kernel exactly as ``plan`` says: grid, per-program range, tile, block."""
    options = {} if plan.num_warps is None else {"num_warps": plan.num_warps}
    _cast_kernel[(plan.grid,)](
        src, dst, lut, plan.numel, plan.per_program,
        TILE=plan.tile, BLOCK=plan.block, SUB=plan.sub_blocks, INT64=plan.use_int64, DECODE=decode,
        **options,
    )


def encode_plan(flat: torch.Tensor, overflow: str, platform: Platform | str | None = None) -> CastPlan:
    """The plan ``encode`` launches with for ``flat`` on its device's (or the given) platform."""
    return cast_plan("encode", flat.numel(), flat.dtype, resolve_platform(platform, flat.device), overflow)


def decode_plan(flat_codes: torch.Tensor, dtype: torch.dtype, platform: Platform | str | None = None) -> CastPlan:
    """The plan ``decode`` launches with for ``flat_codes`` on its device's (or the given) platform."""
    return cast_plan("decode", flat_codes.numel(), dtype, resolve_platform(platform, flat_codes.device))


def encode(
    flat: torch.Tensor,
    overflow: str,
    *,
    out: torch.Tensor | None = None,
    platform: Platform | str | None = None,
) -> torch.Tensor:
    """HiF8 codes (uint8, 1-D) of the 1-D contiguous fp32/fp16/bf16 tensor ``flat``."""
    _check_flat(flat, "flat")
    if flat.dtype not in luts.BITS_VIEW:
        raise TypeError(f"flat must be float32, float16 or bfloat16, got {flat.dtype}")
    out = _output(out, flat, torch.uint8)
    if flat.numel() == 0:
        return out
    plan = encode_plan(flat, overflow, platform)
    lut = luts.half_space_lut(luts.table_dtype(flat.dtype), overflow, flat.device)
    src = flat if flat.dtype == torch.float32 else flat.view(torch.int16)
    _launch(plan, src, out, lut, decode=False)
    return out


def decode(
    flat_codes: torch.Tensor,
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    platform: Platform | str | None = None,
) -> torch.Tensor:
    """Values (1-D ``dtype``) of the 1-D contiguous uint8 HiF8 codes ``flat_codes``."""
    _check_flat(flat_codes, "flat_codes")
    if flat_codes.dtype != torch.uint8:
        raise TypeError(f"flat_codes must be torch.uint8, got {flat_codes.dtype}")
    if dtype not in luts.BITS_VIEW:
        raise TypeError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")
    out = _output(out, flat_codes, dtype)
    if flat_codes.numel() == 0:
        return out
    plan = decode_plan(flat_codes, dtype, platform)
    lut = luts.decode_lut(dtype, flat_codes.device)
    _launch(plan, flat_codes, out.view(luts.BITS_VIEW[dtype]), lut, decode=True)
    return out
