"""Host tiling of the HiF8 cast, as the Ascend LUT cast op does it, driven by the platform table.

The rules (all sizes in elements unless they say bytes):

1. **Tile.** ``(UB - LUT bytes) // (in bytes + out bytes)`` elements (``// 3`` for fp16/bf16
   encode and for uint8 -> fp16/bf16 decode, ``// 5`` for fp32), capped at 65536, then aligned
   down to 32768 when >= 32768, else to 32. LUT bytes: the 32768-entry uint8 half-space table
   for encode (fp32 uses bf16's), the 256-entry decode table in the output's width for decode;
   0 where the platform keeps tables off-chip (``Platform.lut_on_chip``).
2. **Core split** (persistent platforms): ``min(cores, numel // min_per_core)`` programs, at
   least one, with ``min_per_core`` = 4096 (encode) / 2048 (decode); each program takes
   ``ceil(numel / programs)`` aligned up to 32 elements (so every program starts 32-byte aligned
   in the uint8 tensor) and the last one the rest. Non-persistent platforms (CUDA) run one
   program per tile, several tiles per program only if the grid would exceed ``max_grid``.
3. **DataCopy.** Every copy-in and copy-out of a tile takes one of three branches, with
   ``blockLen <= 65535`` bytes: (a) ``single``: one block when the length is <= 65535 bytes;
   (b) ``blocks``: n x 32768-byte blocks when the length is a multiple of 32768; (c) ``halves``:
   two halves of at most 65535 bytes each. Any other length has no branch: ValueError.
4. **Triton block.** Triton's ``tl.arange`` needs a power of two, the tile need not be one
   (below 32768 it is only 32-aligned), so the kernel walks each tile in ``sub_blocks`` steps of
   ``block`` = the largest power of two <= tile, masked at the tile's end. Never wider than the
   tile, so the on-chip budget holds. On every Ascend figure in the table tile == block.

The result is an immutable :class:`CastPlan`; the Triton launch takes ``grid``, ``per_program``,
``tile``, ``block`` and ``sub_blocks`` from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from qfa.cast import format as fmt
from qfa.tiling.platform import Platform, resolve_platform
from qfa.tiling.spec import FLOAT_DTYPES  # the dtypes the cast takes (encode) or produces (decode)

OPS = ("encode", "decode")
_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.uint8: "u8"}

#: Entries of the half-space encode table (uint8, indexed by the low 15 bits of an fp16/bf16
#: pattern) and of the decode table; ``qfa.cast.luts`` builds them (a test checks the sizes).
HALF_SPACE_LUT_ENTRIES = 1 << 15
DECODE_LUT_ENTRIES = 256

MAX_TILE = 65536
BIG_ALIGN = 32768
ALIGN = 32
MIN_PER_CORE = {"encode": 4096, "decode": 2048}

#: DataCopy: the largest blockLen in bytes (uint16), and the block size of branch (b).
MAX_BLOCK_LEN = 65535
COPY_BLOCK = 32768
BRANCHES = ("single", "blocks", "halves")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class DataCopy:
    """How one contiguous copy of ``nbytes`` bytes is issued: ``branch`` and each block's bytes."""

    nbytes: int
    branch: str
    blocks: tuple[int, ...]


def datacopy_plan(nbytes: int) -> DataCopy:
    """The DataCopy branch for a copy of ``nbytes`` bytes; ValueError if none of the three fits."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    if nbytes <= 0:
        raise ValueError(f"a DataCopy needs a positive byte length, got {nbytes}")
    if nbytes <= MAX_BLOCK_LEN:
        return DataCopy(nbytes, "single", (nbytes,))
    if nbytes % COPY_BLOCK == 0:
        return DataCopy(nbytes, "blocks", (COPY_BLOCK,) * (nbytes // COPY_BLOCK))
    first = _ceil_div(nbytes, 2)
    if first <= MAX_BLOCK_LEN:
        return DataCopy(nbytes, "halves", (first, nbytes - first))
    raise ValueError(
        f"a DataCopy of {nbytes} bytes has no branch: it is over {MAX_BLOCK_LEN} bytes, not a "
        f"multiple of {COPY_BLOCK}, and its halves would exceed {MAX_BLOCK_LEN} bytes (blockLen limit)"
    )


@dataclass(frozen=True)
class TileCopy:
    """The copy-in (input bytes) and copy-out (output bytes) of one tile of ``elements``."""

    elements: int
    copy_in: DataCopy
    copy_out: DataCopy


@dataclass(frozen=True)
class CastPlan:
    """Everything the cast launch needs; immutable. Sizes are elements unless named bytes."""

    op: str  #: "encode" or "decode"
    src_dtype: torch.dtype
    dst_dtype: torch.dtype
    overflow: str | None  #: encode's overflow mode; None for decode
    platform: str  #: name of the platform entry
    persistent: bool
    numel: int
    in_bytes: int  #: bytes per input element
    out_bytes: int  #: bytes per output element
    lut_bytes: int  #: table bytes counted against the on-chip budget
    tile: int  #: elements per tile (the copy unit)
    block: int  #: Triton BLOCK: largest power of two <= tile
    sub_blocks: int  #: ceil(tile / block) steps of ``block`` per tile
    grid: int  #: number of programs
    per_program: int  #: elements of every program but the last
    last_program: int  #: elements of the last program
    tiles_per_program: int  #: tiles of every program but the last
    tail: int  #: elements in the last tile of a full program (== tile if it divides evenly)
    last_tiles: int  #: tiles of the last program
    last_tail: int  #: elements in the last program's last tile
    copies: tuple[TileCopy, ...]  #: DataCopy plan of every tile length that occurs, longest first
    use_int64: bool  #: offsets reach 2^31: index in int64
    num_warps: int | None  #: Triton launch option, None for Triton's default
    tiling_key: str

    def program_range(self, pid: int) -> tuple[int, int]:
        """The ``[start, end)`` element range of program ``pid``."""
        if not 0 <= pid < self.grid:
            raise ValueError(f"program id {pid} outside the grid [0, {self.grid})")
        start = pid * self.per_program
        return start, min(start + self.per_program, self.numel)

    def tile_ranges(self, pid: int) -> Iterator[tuple[int, int]]:
        """The ``[start, end)`` range of each tile of program ``pid``, in order."""
        start, end = self.program_range(pid)
        for tile_start in range(start, end, self.tile):
            yield tile_start, min(tile_start + self.tile, end)

    def copy_for(self, elements: int) -> TileCopy:
        """The DataCopy plan of a tile of ``elements``."""
        for copy in self.copies:
            if copy.elements == elements:
                return copy
        raise ValueError(f"no tile of {elements} elements in this plan")


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"the cast handles torch.float16, torch.bfloat16 and torch.float32, got {dtype!r}")


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")


def element_bytes(op: str, dtype: torch.dtype) -> tuple[int, int]:
    """(input, output) bytes per element of ``op`` on float ``dtype``."""
    _check_op(op)
    _check_dtype(dtype)
    size = torch.empty((), dtype=dtype).element_size()
    return (size, 1) if op == "encode" else (1, size)


def lut_bytes(op: str, dtype: torch.dtype) -> int:
    """Bytes of the table ``op`` reads: the uint8 half-space table, or 256 output-width entries."""
    _, out_size = element_bytes(op, dtype)
    return HALF_SPACE_LUT_ENTRIES if op == "encode" else DECODE_LUT_ENTRIES * out_size


def tile_elements(op: str, dtype: torch.dtype, platform: Platform | str) -> int:
    """Rule 1: the tile, in elements, of ``op`` on ``dtype`` for ``platform``."""
    platform = resolve_platform(platform)
    in_size, out_size = element_bytes(op, dtype)
    table = lut_bytes(op, dtype) if platform.lut_on_chip else 0
    raw = min((platform.ub_bytes - table) // (in_size + out_size), MAX_TILE)
    tile = raw // BIG_ALIGN * BIG_ALIGN if raw >= BIG_ALIGN else raw // ALIGN * ALIGN
    if tile < ALIGN:
        raise ValueError(
            f"platform {platform.name!r}: {platform.ub_bytes} on-chip bytes leave no room for a "
            f"{ALIGN}-element {op} tile of {dtype} next to a {table}-byte table"
        )
    return tile


def triton_block(tile: int) -> tuple[int, int]:
    """Rule 4: (block, sub_blocks) for a tile: block = largest power of two <= tile."""
    block = 1 << (tile.bit_length() - 1)
    return block, _ceil_div(tile, block)


def _split(numel: int, op: str, tile: int, platform: Platform) -> tuple[int, int]:
    """Rule 2: (programs, elements per program but the last)."""
    if platform.persistent:
        programs = max(1, min(platform.cores, platform.max_grid, numel // MIN_PER_CORE[op]))
        per_program = _ceil_div(_ceil_div(numel, programs), ALIGN) * ALIGN
    else:
        tiles_per_program = _ceil_div(_ceil_div(numel, tile), platform.max_grid)
        per_program = tiles_per_program * tile
    grid = _ceil_div(numel, per_program)
    if grid > platform.max_grid:  # unreachable by construction; kept as a guard
        raise ValueError(f"grid {grid} exceeds {platform.name!r}'s limit {platform.max_grid}")
    return grid, per_program


def cast_plan(
    op: str,
    numel: int,
    dtype: torch.dtype,
    platform: Platform | str,
    overflow: str | None = None,
) -> CastPlan:
    """The plan of ``op`` over ``numel`` elements of float ``dtype`` (encode's input, decode's output)."""
    _check_op(op)
    _check_dtype(dtype)
    platform = resolve_platform(platform)
    if isinstance(numel, bool) or not isinstance(numel, int):
        raise TypeError(f"numel must be an int, got {type(numel).__name__}")
    if numel <= 0:
        raise ValueError(f"numel must be positive (empty tensors need no launch), got {numel}")
    if op == "encode" and overflow not in fmt.OVERFLOW_MODES:
        raise ValueError(f"encode needs overflow in {fmt.OVERFLOW_MODES}, got {overflow!r}")
    if op == "decode" and overflow is not None:
        raise ValueError(f"decode takes no overflow mode, got {overflow!r}")

    in_size, out_size = element_bytes(op, dtype)
    tile = tile_elements(op, dtype, platform)
    block, sub_blocks = triton_block(tile)
    grid, per_program = _split(numel, op, tile, platform)
    if grid == 1:  # one program: it owns everything, so "full program" == "last program"
        per_program = numel
    last_program = numel - (grid - 1) * per_program
    tiles_per_program = _ceil_div(per_program, tile)
    tail = per_program - (tiles_per_program - 1) * tile
    last_tiles = _ceil_div(last_program, tile)
    last_tail = last_program - (last_tiles - 1) * tile

    lengths = {last_tail}
    if last_tiles > 1:
        lengths.add(tile)
    if grid > 1:
        lengths.add(tail)
        if tiles_per_program > 1:
            lengths.add(tile)
    copies = tuple(
        TileCopy(n, datacopy_plan(n * in_size), datacopy_plan(n * out_size))
        for n in sorted(lengths, reverse=True)
    )
    use_int64 = grid * per_program + sub_blocks * block >= 2**31
    src_dtype, dst_dtype = (dtype, torch.uint8) if op == "encode" else (torch.uint8, dtype)
    key = ".".join(
        [
            "hif8_cast",
            op,
            f"{_SHORT[src_dtype]}_to_{_SHORT[dst_dtype]}",
            overflow or "exact",
            platform.name,
            f"tile{tile}",
            f"block{block}x{sub_blocks}",
            "persistent" if platform.persistent else "per_tile",
            "i64" if use_int64 else "i32",
        ]
    )
    return CastPlan(
        op=op,
        src_dtype=src_dtype,
        dst_dtype=dst_dtype,
        overflow=overflow,
        platform=platform.name,
        persistent=platform.persistent,
        numel=numel,
        in_bytes=in_size,
        out_bytes=out_size,
        lut_bytes=lut_bytes(op, dtype) if platform.lut_on_chip else 0,
        tile=tile,
        block=block,
        sub_blocks=sub_blocks,
        grid=grid,
        per_program=per_program,
        last_program=last_program,
        tiles_per_program=tiles_per_program,
        tail=tail,
        last_tiles=last_tiles,
        last_tail=last_tail,
        copies=copies,
        use_int64=use_int64,
        num_warps=platform.num_warps,
        tiling_key=key,
    )
