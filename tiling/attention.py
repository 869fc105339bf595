"""Host tiling for QuantFlashAttn, HiF8 per-tensor (quant_mode 7).

Every check of the op's spec runs here, once, before any backend: a bad argument raises a
``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong value or shape) naming the argument,
what was expected and what was given. The :class:`AttentionPlan` returned is all that the torch
path and the Triton kernel consume; neither re-derives shapes, lengths or block sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qfa.cast.api import as_codes
from qfa.tiling.spec import HEAD_DIM, LEGACY_QUANT_MODES, MaskMode, QuantMode, default_softmax_scale
from qfa.tiling.checks import check_scalar_fp32, int32_vector, require_tensor

LAYOUTS = ("BNSD", "BSND", "TND")
#: Keys per softmax block: it changes the numbers (P is quantised relative to the running max).
BLOCK_N = 256
#: Query rows per kernel program (upstream's tile); it does not change the numbers.
BLOCK_M = 128
#: The torch path's query tile, in score rows per kv head (G x positions): one 256-key block of
#: fp32 scores is then 2 MiB, cache-sized, and the GEMMs are big enough for oneDNN to run near
#: peak. Causal prefill at S=2048 on the reference CPU, time / fp32 SDPA: G=1 1.06 at 2048
#: rows vs 1.10 at 1024 and 1.30 at 512; G=2 0.87 vs 1.01 at 1024; G=4 0.84 vs 0.90 at 1024.
#: Like BLOCK_M, it does not change the numbers.
TORCH_TILE_SCORE_ROWS = 2048
TORCH_TILE_MIN_POSITIONS = 512
MASK_MODES = {0: "none", 3: "causal (bottom-right aligned)"}
CAUSAL_MASK_SHAPE = (2048, 2048)
MAX_HEADS = 256
MAX_GROUP = 64
MAX_BATCH = 65535

# Positions of (batch, seq, head, dim) in each layout's shape; TND has no batch axis.
_AXES = {"BNSD": {"b": 0, "n": 1, "s": 2, "d": 3}, "BSND": {"b": 0, "s": 1, "n": 2, "d": 3}, "TND": {"s": 0, "n": 1, "d": 2}}


@dataclass(frozen=True)
class AttentionPlan:
    """What both backends run: layout-normalised geometry, per-batch lengths and blocks.

    Sequences are addressed as (batch, head, position, dim) with element ``strides_*`` into the
    original tensors; ``q_starts[b]`` / ``kv_starts[b]`` are the first position of batch ``b``
    (non-zero only for TND, where the batch axis is folded into the token axis).
    """

    layout: str
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    seq_q: int  # padded length of the normalised (B, N, S, D) view
    seq_kv: int
    q_starts: tuple[int, ...]
    kv_starts: tuple[int, ...]
    q_lens: tuple[int, ...]  # actual lengths (seqused applied)
    kv_lens: tuple[int, ...]
    strides_q: tuple[int, int, int, int]  # (batch, head, position, dim)
    strides_kv: tuple[int, int, int, int]  # of k
    strides_v: tuple[int, int, int, int]  # of v: same shape as k, but it may be a different view
    causal: bool
    softmax_scale: float
    return_lse: bool
    block_m: int
    block_n: int
    grid: tuple[int, int]  # (batch * q heads, query tiles), or a persistent grid
    persistent: bool
    tiling_key: str
    #: Query positions per tile of the torch path (CPU): see :func:`torch_tile_rows`.
    torch_rows: int

    @property
    def group(self) -> int:
        """q heads per kv head (GQA): kv head of q head h is h // group."""
        return self.heads_q // self.heads_kv

    @property
    def uniform(self) -> bool:
        """All batches use the full padded lengths (no per-batch masking needed)."""
        return set(self.q_lens) == {self.seq_q} and set(self.kv_lens) == {self.seq_kv}

    @property
    def causal_offsets(self) -> tuple[int, ...]:
        """Bottom-right alignment: query i of batch b sees key j iff j <= i + offset[b]."""
        return tuple(kv - q for q, kv in zip(self.q_lens, self.kv_lens))


def _lengths_from_cu(cu: list[int], name: str, total: int) -> list[int]:
    if cu[0] != 0:
        raise ValueError(f"{name} must start with 0, got {cu[0]}")
    lens = [b - a for a, b in zip(cu, cu[1:])]
    if any(n < 0 for n in lens):
        raise ValueError(f"{name} must be non-decreasing, got {cu}")
    if cu[-1] != total:
        raise ValueError(f"{name}[-1] must equal the token count {total} of the tensor, got {cu[-1]}")
    return lens


def _apply_seqused(lens: list[int], seqused, name: str, batch: int) -> list[int]:
    if seqused is None:
        return lens
    used = int32_vector(seqused, name, batch)
    for b, (u, n) in enumerate(zip(used, lens)):
        if not 0 <= u <= n:
            raise ValueError(f"{name}[{b}] must be in [0, {n}] (the sequence's length), got {u}")
    return used


def _shape_of(t: torch.Tensor, name: str, layout: str) -> dict[str, int]:
    axes = _AXES[layout]
    if t.dim() != len(axes):
        raise ValueError(f"{name} must be {len(axes)}-D for layout {layout} ({layout}), got shape {tuple(t.shape)}")
    return {k: t.shape[i] for k, i in axes.items()}


def lse_shape(q_shape, layout: str) -> tuple[int, ...]:
    """Shape of the fp32 LSE for a q of ``q_shape`` in ``layout``: (B, Nq, Sq), or (Nq, Tq) for TND.
    The one place this is known: the plan, the backends and the fake kernels all ask here."""
    axes = _AXES[layout]
    if layout == "TND":
        return (q_shape[axes["n"]], q_shape[axes["s"]])
    return (q_shape[axes["b"]], q_shape[axes["n"]], q_shape[axes["s"]])


def normalised_strides(t: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """Element strides of ``t`` as (batch, head, position, dim); TND has batch stride 0."""
    axes = _AXES[layout]
    batch_stride = t.stride(axes["b"]) if "b" in axes else 0
    return (batch_stride, t.stride(axes["n"]), t.stride(axes["s"]), t.stride(axes["d"]))


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str) -> tuple[dict, dict]:
    """The op's static shape rules: rank per layout, D = 128, k and v alike, head counts, GQA,
    one batch size. Shared with the drop-in, which checks float q/k/v before quantising them.
    Returns q's and k's sizes by axis name (``b``, ``n``, ``s``, ``d``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} (shared by q, k, v and out), got {layout!r}")
    qs, ks, vs = _shape_of(q, "q", layout), _shape_of(k, "k", layout), _shape_of(v, "v", layout)
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    for shape, name in ((qs, "q"), (ks, "k"), (vs, "v")):
        if shape["d"] != HEAD_DIM:
            raise ValueError(f"head dim D of {name} must be {HEAD_DIM}, got {shape['d']}")
    nq, nkv = qs["n"], ks["n"]
    for n, name in ((nq, "q"), (nkv, "k/v")):
        if not 1 <= n <= MAX_HEADS:
            raise ValueError(f"head count of {name} must be in [1, {MAX_HEADS}], got {n}")
    if nq < nkv or nq % nkv:
        raise ValueError(f"q heads must be a multiple of k/v heads (GQA), got Nq={nq}, Nkv={nkv}")
    if nq // nkv > MAX_GROUP:
        raise ValueError(f"GQA group Nq/Nkv must be <= {MAX_GROUP}, got {nq // nkv}")
    if layout != "TND":
        for shape, name in ((ks, "k"), (vs, "v")):
            if shape["b"] != qs["b"]:
                raise ValueError(f"batch size of {name} must equal q's ({qs['b']}), got {shape['b']}")
    return qs, ks


def plan_attention(
    q, k, v, q_descale, k_descale, v_descale, quant_mode, *, p_scale, layout, cu_seqlens_q, cu_seqlens_kv,
    seqused_q, seqused_kv, attn_mask, mask_mode, softmax_scale, return_softmax_lse, block_table=None, sinks=None,
) -> AttentionPlan:
    """Validate one quant_flash_attn call against the spec and derive its plan."""
    q, k, v = (require_tensor(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        as_codes(t, name)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one HiF8 dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if isinstance(quant_mode, bool) or quant_mode not in (QuantMode.HIF8_PER_TENSOR, *LEGACY_QUANT_MODES):
        raise ValueError(f"quant_mode must be 7 (HiF8 per-tensor; 0 is its alias), got {quant_mode!r}")
    for t, name in ((q_descale, "q_descale"), (k_descale, "k_descale"), (v_descale, "v_descale")):
        check_scalar_fp32(t, name)
    if p_scale is not None:
        check_scalar_fp32(p_scale, "p_scale")
        p_value = float(p_scale.item()) if p_scale.device.type != "meta" else 1.0
        if not (math.isfinite(p_value) and p_value > 0):
            raise ValueError(f"p_scale must be a finite value > 0 (it enters as -ln(p_scale)), got {p_value}")
    if block_table is not None:
        raise ValueError("block_table (paged attention) is not supported in quant_mode 7; pass contiguous k/v")
    if sinks is not None:
        raise ValueError("sinks (learnable softmax sinks) are not supported in quant_mode 7")
    device = q.device
    for t, name in ((k, "k"), (v, "v"), (q_descale, "q_descale"), (k_descale, "k_descale"), (v_descale, "v_descale"),
                    (p_scale, "p_scale"), (cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_kv, "cu_seqlens_kv"),
                    (seqused_q, "seqused_q"), (seqused_kv, "seqused_kv"), (attn_mask, "attn_mask")):
        if isinstance(t, torch.Tensor) and t.device != device:
            raise ValueError(f"{name} must be on q's device {device}, got {t.device}")

    qs, ks = check_shapes(q, k, v, layout)
    nq, nkv = qs["n"], ks["n"]

    if layout == "TND":
        if cu_seqlens_q is None or cu_seqlens_kv is None:
            raise ValueError("layout 'TND' needs cu_seqlens_q and cu_seqlens_kv (int32, B+1, leading 0)")
        cu_q = require_tensor(cu_seqlens_q, "cu_seqlens_q")
        if cu_q.dim() != 1 or cu_q.numel() < 2:
            raise ValueError(f"cu_seqlens_q must be 1-D with B+1 >= 2 entries, got shape {tuple(cu_q.shape)}")
        batch = cu_q.numel() - 1
        cu_q_list = int32_vector(cu_q, "cu_seqlens_q", batch + 1)
        cu_kv_list = int32_vector(cu_seqlens_kv, "cu_seqlens_kv", batch + 1)
        q_lens = _lengths_from_cu(cu_q_list, "cu_seqlens_q", qs["s"])
        kv_lens = _lengths_from_cu(cu_kv_list, "cu_seqlens_kv", ks["s"])
        q_starts, kv_starts = tuple(cu_q_list[:-1]), tuple(cu_kv_list[:-1])
    else:
        for t, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_kv, "cu_seqlens_kv")):
            if t is not None:
                raise ValueError(f"{name} is only for layout 'TND'; got it with layout {layout!r}")
        batch = qs["b"]
        q_lens, kv_lens = [qs["s"]] * batch, [ks["s"]] * batch
        q_starts, kv_starts = (0,) * batch, (0,) * batch
    if not 0 < batch <= MAX_BATCH:
        raise ValueError(f"batch size B must be in [1, {MAX_BATCH}], got {batch}")
    q_lens = _apply_seqused(q_lens, seqused_q, "seqused_q", batch)
    kv_lens = _apply_seqused(kv_lens, seqused_kv, "seqused_kv", batch)

    if mask_mode not in MASK_MODES:
        raise ValueError(f"mask_mode must be 0 (none) or 3 (causal) in quant_mode 7, got {mask_mode!r}")
    if attn_mask is not None:
        if mask_mode == 0:
            raise ValueError("attn_mask must be None with mask_mode 0 (no mask)")
        require_tensor(attn_mask, "attn_mask")
        expected = f"int8 {list(CAUSAL_MASK_SHAPE)} (the compressed causal mask)"
        if attn_mask.dtype != torch.int8:  # a dtype error is a TypeError, as everywhere else here
            raise TypeError(f"attn_mask for mask_mode 3 must be {expected}, got {attn_mask.dtype} {list(attn_mask.shape)}")
        if tuple(attn_mask.shape) != CAUSAL_MASK_SHAPE:
            raise ValueError(f"attn_mask for mask_mode 3 must be {expected}, got {attn_mask.dtype} {list(attn_mask.shape)}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(HEAD_DIM)
    if isinstance(softmax_scale, torch.Tensor) or not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise TypeError(f"softmax_scale must be a Python float or None, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale}")

    seq_q = qs["s"] if layout != "TND" else max(q_lens, default=0)
    seq_kv = ks["s"] if layout != "TND" else max(kv_lens, default=0)
    causal = mask_mode == 3
    grid, persistent = _grid(batch * nq, math.ceil(max(seq_q, 1) / BLOCK_M), device)
    key = "_".join([
        "hif8pt", layout.lower(), f"d{HEAD_DIM}", "causal" if causal else "nomask",
        f"gqa{nq // nkv}", f"bm{BLOCK_M}", f"bn{BLOCK_N}", "lse" if return_softmax_lse else "nolse",
        "persistent" if persistent else "grid",
    ])
    return AttentionPlan(
        layout=layout, batch=batch, heads_q=nq, heads_kv=nkv, head_dim=HEAD_DIM, seq_q=seq_q, seq_kv=seq_kv,
        q_starts=q_starts, kv_starts=kv_starts, q_lens=tuple(q_lens), kv_lens=tuple(kv_lens),
        strides_q=normalised_strides(q, layout), strides_kv=normalised_strides(k, layout),
        strides_v=normalised_strides(v, layout), causal=causal,
        softmax_scale=float(softmax_scale), return_lse=bool(return_softmax_lse), block_m=BLOCK_M, block_n=BLOCK_N,
        grid=grid, persistent=persistent, tiling_key=key, torch_rows=torch_tile_rows(nq // nkv),
    )


def torch_tile_rows(group: int) -> int:
    """Query positions per torch-path tile for GQA group size ``group``."""
    return max(TORCH_TILE_MIN_POSITIONS, TORCH_TILE_SCORE_ROWS // group)


def _grid(programs_bh: int, tiles_m: int, device: torch.device) -> tuple[tuple[int, int], bool]:
    """(batch * heads, query tiles), or on NPU a persistent grid of one program per core.

    Batch * heads goes on the first axis: CUDA allows 2^31 - 1 programs there but only 65535
    on the others, and a sequence needs 65535 query tiles (8M rows) before it hits that.
    """
    from qfa.tiling.platform import platform_for

    platform = platform_for(device)
    if platform.persistent:
        return (min(platform.cube_cores, tiles_m * programs_bh), 1), True
    if tiles_m > 65535:
        raise ValueError(f"query length must be <= {65535 * BLOCK_M} rows, got {tiles_m} tiles of {BLOCK_M}")
    if programs_bh > platform.max_grid:
        raise ValueError(f"batch * q heads must be <= {platform.max_grid} on {platform.name}, got {programs_bh}")
    return (programs_bh, tiles_m), False
