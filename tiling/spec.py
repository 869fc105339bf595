"""The op family's spec constants, defined once: quant and mask modes, the head size, float dtypes.

Everything else (the plan, the drop-in, the adapters, the upstream-compatible module) imports
them from here.
"""

from __future__ import annotations

import enum
import math

import torch


class QuantMode(enum.IntEnum):
    """``quant_mode`` of quant_flash_attn, upstream's current numbering."""

    HIF8_PER_TENSOR = 0
    MXFP8 = 1
    FP8_PER_TOKEN_HEAD = 6


#: Upstream's older headers numbered HiF8 per-tensor 7; accepted as an alias of 0.
LEGACY_QUANT_MODES = {7: QuantMode.HIF8_PER_TENSOR}


class MaskMode(enum.IntEnum):
    """``mask_mode`` of quant_flash_attn: only these two are supported."""

    NONE = 0
    CAUSAL = 3  # aligned bottom-right with the per-batch lengths


#: The head size of q, k and v in the HiF8 mode (and the FP8 mode).
HEAD_DIM = 128
#: Head sizes each mode takes (``docs/spec/quant-flash-attn.md``).
HEAD_DIMS = {QuantMode.HIF8_PER_TENSOR: (HEAD_DIM,), QuantMode.MXFP8: (64, 72, 128, 256),
             QuantMode.FP8_PER_TOKEN_HEAD: (HEAD_DIM,)}
#: Keys per online-softmax block: it changes the numbers (P is quantised relative to the running
#: max), so it is part of each mode's spec. HiF8: 256, upstream's. MXFP8 / FP8: upstream's value
#: is not public; its HiF8 tiling notes say HiF8 uses 256-key blocks "instead of 512", which
#: points to 512 for the other modes, so qfa uses 512 there.
KEY_BLOCK = {QuantMode.HIF8_PER_TENSOR: 256, QuantMode.MXFP8: 512, QuantMode.FP8_PER_TOKEN_HEAD: 512}
#: Channels per q/k scale and keys per v scale in the MXFP8 mode (OCP MX blocks of 32).
MX_GROUP = 32
#: Floating dtypes the cast and the drop-in take.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def default_softmax_scale(head_dim: int = HEAD_DIM) -> float:
    """qfa's ``softmax_scale=None``: 1/sqrt(D), the SDPA/FlashAttention convention (upstream's
    own default is 1.0; ``qfa.compat.cann_ops_transformer`` keeps that)."""
    return 1.0 / math.sqrt(head_dim)
