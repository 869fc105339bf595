"""Paged K/V for the CPU backends: a sequence's keys gathered from its blocks in logical order.

The numerics walk each sequence's keys in 256-key blocks of the *logical* key sequence, so
where a key is stored changes nothing: gathering the codes (1 byte per element, never decoded
here) and running the contiguous computation gives the contiguous call's bits.
"""

from __future__ import annotations

import dataclasses

import torch

from qfa.tiling.attention import AttentionPlan


def keys_of(t: torch.Tensor, strides, plan: AttentionPlan, block_table: torch.Tensor, b: int,
            length: int) -> torch.Tensor:
    """(heads, length, D) codes of batch ``b``'s first ``length`` keys from paged ``t``, whose
    plan strides are ``strides`` = (block, head, position in block, dim)."""
    blocks = block_table[b, : -(-length // plan.block_size)].long()
    pages = t.as_strided((plan.num_blocks, plan.heads_kv, plan.block_size, t.shape[-1]), strides,
                         t.storage_offset()).index_select(0, blocks)  # (blocks, heads, block_size, D)
    return pages.transpose(0, 1).reshape(plan.heads_kv, -1, t.shape[-1])[:, :length]


def contiguous(plan: AttentionPlan, k: torch.Tensor, v: torch.Tensor,
               block_table: torch.Tensor) -> tuple[AttentionPlan, torch.Tensor, torch.Tensor]:
    """(plan, k, v) of the same call with the keys laid out contiguously, (B, Nkv, max Skv, D):
    for a backend that reads only contiguous K/V."""
    shape = (plan.batch, plan.heads_kv, max(plan.seq_kv, 1), plan.head_dim)
    out = []
    for t, strides in ((k, plan.strides_kv), (v, plan.strides_v)):
        flat = torch.zeros(shape, dtype=torch.uint8, device=t.device)
        for b, n in enumerate(plan.kv_lens):
            if n:
                flat[b, :, :n] = keys_of(t, strides, plan, block_table, b, n)
        out.append(flat)
    strides = tuple(out[0].stride())
    flat_plan = dataclasses.replace(plan, strides_kv=strides, strides_v=strides, kv_starts=(0,) * plan.batch,
                                    layout_kv=plan.layout, block_size=0, num_blocks=0, table_width=0,
                                    table_strides=(0, 0))
    return flat_plan, out[0], out[1]
