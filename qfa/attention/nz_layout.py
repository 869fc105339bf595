"""MXFP8's PA_NZ paged layout, taken by converting to PA_BNBD on the way in.

PA_NZ stores each block's keys as (Bn, KV_N, D/32, Bs, 32): 32-channel slabs, the layout of
Ascend's matrix units. Both backends here read PA_BNBD (Bn, KV_N, Bs, D), so a PA_NZ call is
rewritten as the same call on a PA_BNBD copy of k, v and their descales: the same keys in the
same logical order, hence bit for bit the PA_BNBD result. The copy costs one pass over the cache
per call (a decode step that reads it anyway reads it twice); it exists so that code written for
upstream's PA_NZ runs unchanged, not as the layout to serve from.
"""

from __future__ import annotations

import torch

from qfa.cast import mxfp8
from qfa.tiling.attention_checks import check_paged_strides
from qfa.tiling.spec import QuantMode

NZ_SLAB = 32
#: Head sizes PA_NZ can hold: whole 32-channel slabs, and whole pairs of them for the paired
#: k_descale / 16-channel v_descale groups.
NZ_HEAD_DIMS = (64, 128, 256)


def _check(k: torch.Tensor, v: torch.Tensor) -> None:
    for t, name in ((k, "k"), (v, "v")):
        if t.dim() != 5 or t.shape[-1] != NZ_SLAB:
            raise ValueError(f"{name} must be 5-D (blocks, Nkv, D/32, block_size, 32) for layout_kv PA_NZ, "
                             f"got shape {tuple(t.shape)}")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    for t, name in ((k, "k"), (v, "v")):  # the PA_BNBD copy would hide an aliased cache from the plan's check
        check_paged_strides(t, name)
    d = k.shape[2] * NZ_SLAB
    if d not in NZ_HEAD_DIMS:
        raise ValueError(f"head dim D of k must be one of {NZ_HEAD_DIMS} for layout_kv PA_NZ, got {d}")


def _slabs_to_rows(t: torch.Tensor) -> torch.Tensor:
    """(Bn, N, D/32, S, 32) -> (Bn, N, S, D), through the bytes (float8 permutes are copies anyway)."""
    bn, n, slabs, s, _ = t.shape
    bits = t.view(torch.uint8).permute(0, 1, 3, 2, 4).reshape(bn, n, s, slabs * NZ_SLAB)
    return bits.view(t.dtype)


def to_bnbd(quant_mode, k, v, k_descale, v_descale) -> tuple[torch.Tensor, ...]:
    """(k, v, k_descale, v_descale) of a PA_NZ MXFP8 call, in PA_BNBD."""
    if quant_mode != QuantMode.MXFP8:
        raise ValueError(f"layout_kv PA_NZ is MXFP8's (quant_mode 1), got quant_mode {int(quant_mode)}")
    _check(k, v)
    d = k.shape[2] * NZ_SLAB
    bn, n, _, bs, _ = k.shape
    pairs = -(-d // mxfp8.VALUES_PER_PAIR)
    expected = {"k_descale": (bn, n, bs // mxfp8.NZ_GROUP, pairs, mxfp8.NZ_GROUP, mxfp8.PAIR),
                "v_descale": (bn, n, d // mxfp8.NZ_GROUP, bs // mxfp8.VALUES_PER_PAIR, mxfp8.NZ_GROUP, mxfp8.PAIR)}
    if bs % mxfp8.VALUES_PER_PAIR:
        raise ValueError(f"block size of paged k/v must be a multiple of {mxfp8.VALUES_PER_PAIR} for layout_kv "
                         f"PA_NZ, got {bs}")
    for (name, shape), t in zip(expected.items(), (k_descale, v_descale)):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} in quant_mode 1 (MXFP8, layout PA_NZ), "
                             f"got {tuple(t.shape)}")
    k_scales = mxfp8.unpack_k_descale(k_descale, d, "PA_NZ")  # (Bn, N, D/32, Bs, 1)
    v_scales = mxfp8.unpack_v_descale(v_descale, "PA_NZ")  # (Bn, N, D/32, Bs/32, 32)
    k_scales = k_scales.view(torch.uint8).squeeze(-1).transpose(2, 3).contiguous().view(mxfp8.E8M0)
    return (_slabs_to_rows(k), _slabs_to_rows(v), mxfp8.pack_k_descale(k_scales, "PA_BNBD"),
            mxfp8.pack_v_descale(_slabs_to_rows(v_scales), "PA_BNBD"))
