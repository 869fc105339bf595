"""Host tiling of the HiF8 cast: the tile / core-split / DataCopy rules on every platform of the
table (the table itself and its lookup are tested in test_platform.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qfa.cast import luts
from qfa.tiling import PLATFORMS, Platform, cast_plan, datacopy_plan, tile_elements
from qfa.tiling import cast as tc

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
OPS = ("encode", "decode")
SIZE = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}


def resolved(platform: Platform) -> Platform:
    """Table entries with a core count (CUDA's is read at run time: give it an H100's)."""
    return platform if platform.vector_cores is not None else dataclasses.replace(platform, vector_cores=132, cube_cores=132)


ALL_PLATFORMS = [resolved(p) for p in PLATFORMS.values()]


def overflow_for(op: str) -> str | None:
    return "saturate" if op == "encode" else None


# --------------------------------------------------------------------------- tile rule


def test_lut_sizes_match_the_host_tables():
    for dtype in (torch.float16, torch.bfloat16):
        lut = luts.half_space_lut(dtype, "saturate")
        assert lut.numel() * lut.element_size() == tc.HALF_SPACE_LUT_ENTRIES == tc.lut_bytes("encode", dtype)
    assert tc.lut_bytes("encode", torch.float32) == tc.HALF_SPACE_LUT_ENTRIES  # fp32 reads bf16's table
    for dtype in FLOATS:
        lut = luts.decode_lut(dtype)
        assert lut.numel() == tc.DECODE_LUT_ENTRIES
        assert lut.numel() * lut.element_size() == tc.lut_bytes("decode", dtype) == 256 * SIZE[dtype]


def _expected_tile(ub: int, lut: int, per_element: int) -> int:
    raw = min((ub - lut) // per_element, 65536)
    return raw - raw % 32768 if raw >= 32768 else raw - raw % 32


@pytest.mark.parametrize("platform", ALL_PLATFORMS, ids=lambda p: p.name)
def test_tile_rule_every_platform(platform):
    for op in OPS:
        for dtype in FLOATS:
            in_b, out_b = (SIZE[dtype], 1) if op == "encode" else (1, SIZE[dtype])
            lut = tc.lut_bytes(op, dtype) if platform.lut_on_chip else 0
            tile = tile_elements(op, dtype, platform)
            assert tile == _expected_tile(platform.ub_bytes, lut, in_b + out_b)
            assert 32 <= tile <= 65536
            assert tile % (32768 if tile >= 32768 else 32) == 0
            assert tile * (in_b + out_b) + lut <= platform.ub_bytes  # fits the on-chip budget
            block, sub = tc.triton_block(tile)
            assert block & (block - 1) == 0 and block <= tile and (sub - 1) * block < tile <= sub * block


def test_tile_values():
    for name in ("atlas-a2", "atlas-a3", "ascend-950"):
        for op in OPS:
            for dtype in FLOATS:
                assert tile_elements(op, dtype, name) == 32768
    # the /3 case: fp16/bf16 encode and uint8 -> 16-bit decode
    assert (196608 - 32768) // 3 == 54613  # A2 encode fp16: 54613 -> aligned down to 32768
    assert tile_elements("encode", torch.float16, "cpu-interpreter") == 65536
    assert tile_elements("decode", torch.bfloat16, "cpu-interpreter") == 65536
    assert tile_elements("encode", torch.float32, "cpu-interpreter") == 32768
    assert tile_elements("encode", torch.bfloat16, "cuda") == 4096
    assert tile_elements("decode", torch.float32, "cuda") == 2432  # 12288 // 5 = 2457 -> 32-aligned


def _synthetic(ub: int, **kw) -> Platform:
    args = dict(name="test", ub_bytes=ub, vector_cores=4, cube_cores=4, max_grid=65535, persistent=True)
    args.update(kw)
    return Platform(**args)


def test_tile_alignment_and_cap():
    lut = 32768
    assert tile_elements("encode", torch.float16, _synthetic(lut + 3 * 1000)) == 992  # align 32
    assert tile_elements("encode", torch.float16, _synthetic(lut + 3 * 32767)) == 32736
    assert tile_elements("encode", torch.float16, _synthetic(lut + 3 * 32768)) == 32768
    assert tile_elements("encode", torch.float16, _synthetic(lut + 3 * 40000)) == 32768  # align 32768
    assert tile_elements("encode", torch.float16, _synthetic(lut + 3 * 65535)) == 32768
    assert tile_elements("encode", torch.float16, _synthetic(lut + 3 * 65536)) == 65536
    assert tile_elements("encode", torch.float16, _synthetic(lut + 3 * 10**6)) == 65536  # cap
    assert tile_elements("decode", torch.float16, _synthetic(512 + 3 * 100)) == 96
    assert tile_elements("encode", torch.float16, _synthetic(3 * 1000, lut_on_chip=False)) == 992
    with pytest.raises(ValueError, match="no room"):
        tile_elements("encode", torch.float16, _synthetic(lut + 3 * 31))
    with pytest.raises(ValueError, match="no room"):
        tile_elements("encode", torch.float16, _synthetic(1000))


# --------------------------------------------------------------------------- DataCopy


def test_datacopy_branches():
    assert datacopy_plan(1) == tc.DataCopy(1, "single", (1,))
    assert datacopy_plan(65535) == tc.DataCopy(65535, "single", (65535,))
    assert datacopy_plan(65536) == tc.DataCopy(65536, "blocks", (32768, 32768))
    assert datacopy_plan(98304).blocks == (32768,) * 3
    assert datacopy_plan(262144).blocks == (32768,) * 8
    assert datacopy_plan(65537) == tc.DataCopy(65537, "halves", (32769, 32768))
    assert datacopy_plan(131070) == tc.DataCopy(131070, "halves", (65535, 65535))
    with pytest.raises(ValueError, match="131071 bytes has no branch"):
        datacopy_plan(131071)
    with pytest.raises(ValueError, match="has no branch"):
        datacopy_plan(160000)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="positive"):
            datacopy_plan(bad)
    for bad in (1.5, True, "1"):
        with pytest.raises(TypeError):
            datacopy_plan(bad)


def test_datacopy_covers_every_tile_and_tail_the_tiling_can_produce():
    """The proof: every platform x op x dtype x every tile/tail length 1..tile, in and out.

    The tiling only ever copies a tile of ``1..tile`` elements (``test_program_ranges`` checks
    that every plan's tiles and tails lie in that range), so covering these lengths covers every
    copy any plan can issue.
    """
    checked: dict[int, str] = {}

    def check(nbytes: int) -> None:
        if nbytes in checked:
            return
        copy = datacopy_plan(nbytes)
        assert copy.nbytes == nbytes and sum(copy.blocks) == nbytes
        assert all(0 < b <= tc.MAX_BLOCK_LEN for b in copy.blocks)
        if copy.branch == "single":
            assert nbytes <= 65535 and len(copy.blocks) == 1
        elif copy.branch == "blocks":
            assert nbytes > 65535 and nbytes % 32768 == 0 and set(copy.blocks) == {32768}
        else:
            assert copy.branch == "halves" and len(copy.blocks) == 2 and abs(copy.blocks[0] - copy.blocks[1]) <= 1
        checked[nbytes] = copy.branch

    combos = 0
    for platform in ALL_PLATFORMS:
        for op in OPS:
            for dtype in FLOATS:
                tile = tile_elements(op, dtype, platform)
                in_b, out_b = tc.element_bytes(op, dtype)
                for n in range(1, tile + 1):
                    check(n * in_b)
                    check(n * out_b)
                combos += 1
    assert combos == len(PLATFORMS) * 6
    assert set(checked.values()) == {"single", "blocks", "halves"}  # all three branches are needed


def test_missing_branch_is_a_clear_error():
    # A UB large enough for a 65536-element fp32 tile: a 40000-element tail is 160000 bytes,
    # which no branch can copy with blockLen <= 65535.
    big = _synthetic(32768 + 5 * 65536, vector_cores=1)
    assert tile_elements("encode", torch.float32, big) == 65536
    with pytest.raises(ValueError, match="160000 bytes has no branch"):
        cast_plan("encode", 65536 + 40000, torch.float32, big, "saturate")


# --------------------------------------------------------------------------- core split, ranges

SIZES = [1, 2, 31, 32, 33, 2047, 2048, 2049, 4095, 4096, 4097, 8191, 8192, 65535, 65536, 65537,
         3 * 65536 + 17, 48 * 4096 - 1, 48 * 4096, 48 * 65536 + 5, 10**6, 7 * 10**6 + 3]


def _check_plan(plan: tc.CastPlan, platform: Platform) -> set[int]:
    n = plan.numel
    assert 1 <= plan.grid <= platform.max_grid
    covered = 0
    lengths = set()
    for pid in range(plan.grid):
        start, end = plan.program_range(pid)
        assert start == covered and end > start  # contiguous, non-empty, in order
        tiles = list(plan.tile_ranges(pid))
        assert tiles[0][0] == start and tiles[-1][1] == end
        assert all(a[1] == b[0] for a, b in zip(tiles, tiles[1:]))
        assert all(1 <= e - s <= plan.tile for s, e in tiles)
        assert all(e - s == plan.tile for s, e in tiles[:-1])
        last = pid == plan.grid - 1
        assert len(tiles) == (plan.last_tiles if last else plan.tiles_per_program)
        assert tiles[-1][1] - tiles[-1][0] == (plan.last_tail if last else plan.tail)
        assert end - start == (plan.last_program if last else plan.per_program)
        for s, e in tiles:
            lengths.add(e - s)
            copy = plan.copy_for(e - s)  # every tile the kernel copies has a DataCopy plan
            assert copy.copy_in.nbytes == (e - s) * plan.in_bytes
            assert copy.copy_out.nbytes == (e - s) * plan.out_bytes
        covered = end
    assert covered == n  # [0, n) exactly once
    assert {c.elements for c in plan.copies} == lengths
    min_per_core = tc.MIN_PER_CORE[plan.op]
    if platform.persistent:
        assert plan.grid == max(1, min(platform.cores, n // min_per_core))
        if plan.grid > 1:
            assert plan.per_program >= min_per_core and plan.per_program % 32 == 0
    elif plan.grid > 1:
        assert plan.per_program % plan.tile == 0
    return lengths


@pytest.mark.parametrize("platform", ALL_PLATFORMS, ids=lambda p: p.name)
def test_program_ranges(platform):
    for op in OPS:
        for dtype in FLOATS:
            for n in SIZES:
                plan = cast_plan(op, n, dtype, platform, overflow_for(op))
                _check_plan(plan, platform)
                assert plan.src_dtype == (dtype if op == "encode" else torch.uint8)
                assert plan.dst_dtype == (torch.uint8 if op == "encode" else dtype)


def test_core_split_minimum_per_core():
    a2 = PLATFORMS["atlas-a2"]
    assert cast_plan("encode", 4095, torch.float16, a2, "saturate").grid == 1
    assert cast_plan("encode", 8191, torch.float16, a2, "saturate").grid == 1
    assert cast_plan("encode", 8192, torch.float16, a2, "saturate").grid == 2
    assert cast_plan("encode", 48 * 4096 - 1, torch.float16, a2, "saturate").grid == 47
    assert cast_plan("encode", 10**8, torch.float16, a2, "saturate").grid == 48
    assert cast_plan("decode", 4095, torch.float16, a2).grid == 1
    assert cast_plan("decode", 4096, torch.float16, a2).grid == 2
    plan = cast_plan("decode", 10**6, torch.bfloat16, a2)
    assert (plan.grid, plan.per_program, plan.last_program) == (48, 20864, 10**6 - 47 * 20864)


def test_non_persistent_split_and_grid_limit():
    cuda = ALL_PLATFORMS[[p.name for p in ALL_PLATFORMS].index("cuda")]
    plan = cast_plan("encode", 10 * 4096 + 5, torch.float16, cuda, "inf")
    assert (plan.grid, plan.per_program, plan.tiles_per_program, plan.last_program) == (11, 4096, 1, 5)
    tiny_grid = _synthetic(32768 + 3 * 96, persistent=False, max_grid=3)
    plan = cast_plan("encode", 10 * 96, torch.float16, tiny_grid, "saturate")
    assert (plan.tile, plan.grid, plan.per_program, plan.tiles_per_program, plan.last_tiles) == (96, 3, 384, 4, 2)
    _check_plan(plan, tiny_grid)


def test_plan_object():
    plan = cast_plan("encode", 3 * 65536 + 17, torch.float16, "cpu-interpreter", "saturate")
    assert isinstance(plan, tc.CastPlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.grid = 1  # type: ignore[misc]
    assert plan.tiling_key == "hif8_cast.encode.fp16_to_u8.saturate.cpu-interpreter.tile65536.block65536x1.persistent.i32"
    assert cast_plan("decode", 100, torch.float32, "cuda").tiling_key == (
        "hif8_cast.decode.u8_to_fp32.exact.cuda.tile2432.block2048x2.per_tile.i32"
    )
    keys = {
        cast_plan(op, 1000, dt, p, ov).tiling_key
        for op in OPS
        for dt in FLOATS
        for p in ("atlas-a2", "cuda")
        for ov in ((("saturate", "inf")) if op == "encode" else (None,))
    }
    assert len(keys) == 2 * (3 * 2) + 2 * 3  # (platform x dtype x overflow) encode + decode: all distinct
    assert not plan.use_int64
    big = cast_plan("decode", 2**31 + 5, torch.float16, "atlas-a2")
    assert big.use_int64 and big.tiling_key.endswith(".i64")
    assert big.program_range(47)[1] == 2**31 + 5
    with pytest.raises(ValueError, match="outside the grid"):
        plan.program_range(plan.grid)
    with pytest.raises(ValueError, match="no tile of 5 elements"):
        plan.copy_for(5)


def test_bad_inputs():
    with pytest.raises(ValueError, match="op must be one of"):
        cast_plan("round", 10, torch.float16, "atlas-a2", "saturate")
    for dtype in (torch.float64, torch.uint8, torch.int32):
        with pytest.raises(ValueError, match="float16, torch.bfloat16 and torch.float32"):
            cast_plan("encode", 10, dtype, "atlas-a2", "saturate")
    for n in (0, -1):
        with pytest.raises(ValueError, match="numel must be positive"):
            cast_plan("encode", n, torch.float16, "atlas-a2", "saturate")
    for n in (1.5, True, "10"):
        with pytest.raises(TypeError, match="numel must be an int"):
            cast_plan("encode", n, torch.float16, "atlas-a2", "saturate")
    for overflow in (None, "wrap"):
        with pytest.raises(ValueError, match="encode needs overflow"):
            cast_plan("encode", 10, torch.float16, "atlas-a2", overflow)
    with pytest.raises(ValueError, match="decode takes no overflow"):
        cast_plan("decode", 10, torch.float16, "atlas-a2", "saturate")
    with pytest.raises(ValueError, match="unknown platform"):
        cast_plan("decode", 10, torch.float16, "tpu")
    with pytest.raises(TypeError, match="platform must be"):
        cast_plan("decode", 10, torch.float16, 3)
    unresolved = _synthetic(196608, vector_cores=None)
    with pytest.raises(ValueError, match="no core count"):
        cast_plan("decode", 10, torch.float16, unresolved)
