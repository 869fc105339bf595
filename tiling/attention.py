"""Host tiling for QuantFlashAttn, HiF8 per-tensor (quant_mode 0; 7 is its older number).

Every check of the op's spec runs here, once, before any backend: a bad argument raises a
``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong value or shape) naming the argument,
what was expected and what was given.

Planning has two halves, as upstream's ``quant_flash_attn_metadata`` / ``quant_flash_attn`` and
FlashInfer's plan / run split have:

* :func:`plan_metadata` -> :class:`AttentionMetadata`: what depends on the call's *values* (the
  per-batch lengths read from ``cu_seqlens`` / ``seqused``, a host read) and on its static
  arguments (heads, layouts, mask). Made once, reused for every layer of a forward pass.
* :func:`bind` -> :class:`AttentionPlan`: the metadata applied to concrete tensors: shapes,
  strides, output and LSE geometry, tiles and grid. Pure host arithmetic on shapes (no device
  synchronisation), cached in the metadata per tensor geometry, so a repeated call reuses the
  same plan object (and its device-side length table).

:func:`plan_attention` does both for a one-off call. The :class:`AttentionPlan` is all that the
torch path and the Triton kernel consume; neither re-derives shapes, lengths or block sizes.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from functools import cached_property

import torch

from qfa.cast import format as fmt
from qfa.tiling.checks import (
    apply_seqused, check_bool, check_codes, check_device, check_scalar_fp32, check_sequence_lengths, cumulative_lengths,
    int32_vector, require_tensor,
)
from qfa.tiling.spec import HEAD_DIM, LEGACY_QUANT_MODES, MaskMode, QuantMode, default_softmax_scale

LAYOUTS = ("BNSD", "BSND", "TND")
#: Paged K/V layouts (with block_table): PA_BBND (blocks, block_size, Nkv, D), PA_BNBD
#: (blocks, Nkv, block_size, D). Their (block, position-in-block, head, dim) axes:
PAGED_LAYOUTS = ("PA_BBND", "PA_BNBD")
_PAGED_AXES = {"PA_BBND": {"blk": 0, "s": 1, "n": 2, "d": 3}, "PA_BNBD": {"blk": 0, "n": 1, "s": 2, "d": 3}}
#: Paged block sizes: multiples of PAGE_MULTIPLE up to MAX_PAGE (vLLM uses 16 by default).
PAGE_MULTIPLE = 16
MAX_PAGE = 1024
#: ``layout_q_descale`` of the HiF8 mode: a per-tensor scale has no layout; upstream names it so.
Q_DESCALE_LAYOUTS = ("BSND",)
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
MASK_MODES = {MaskMode.NONE: "none", MaskMode.CAUSAL: "causal (bottom-right aligned)"}
CAUSAL_MASK_SHAPE = (2048, 2048)
MAX_HEADS = 256
MAX_GROUP = 64
MAX_BATCH = 65535
#: Query tiles one sequence may have along the grid's second axis (CUDA's limit there).
MAX_QUERY_TILES = 65535
FP32_MAX = torch.finfo(torch.float32).max
#: Valid p_scale: HiF8's normal binades, [2^-15, 2^15].
P_SCALE_RANGE = (fmt.MIN_NORMAL, fmt.MAX)
#: |Q . K| of two HiF8 vectors is at most D * 32768^2 = 2^37; dScale beyond this overflows.
MAX_DSCALE = FP32_MAX / (HEAD_DIM * fmt.MAX**2)
#: HiF8(P) <= P_OVERSHOOT * P: rounding up by half a step of the 1-mantissa-bit binades.
P8_OVERSHOOT = 1.25

# Positions of (batch, seq, head, dim) in each layout's shape; TND has no batch axis.
_AXES = {"BNSD": {"b": 0, "n": 1, "s": 2, "d": 3}, "BSND": {"b": 0, "s": 1, "n": 2, "d": 3}, "TND": {"s": 0, "n": 1, "d": 2}}
#: Arguments that upstream has and this mode does not support yet: (name, value meaning "unused").
_UNSUPPORTED = {
    "block_table": "paged KV needs layout_kv 'PA_BBND' or 'PA_BNBD' (and seqused_kv); got a contiguous layout_kv",
    "sinks": "attention sinks are not supported (upstream rejects them too)",
}


# ============================================================================ small checks

def check_quant_mode(quant_mode) -> QuantMode:
    """The HiF8 per-tensor mode, from 0, ``QuantMode.HIF8_PER_TENSOR`` or the legacy 7."""
    if isinstance(quant_mode, bool) or not isinstance(quant_mode, int):
        raise TypeError(f"quant_mode must be an int or qfa's QuantMode, got {type(quant_mode).__name__} {quant_mode!r}")
    if quant_mode in LEGACY_QUANT_MODES:
        return LEGACY_QUANT_MODES[quant_mode]
    if quant_mode != QuantMode.HIF8_PER_TENSOR:
        known = {m.value: m.name for m in QuantMode}
        later = f" ({known[quant_mode]}: upstream's mode, not implemented in qfa yet)" if quant_mode in known else ""
        raise ValueError(f"quant_mode must be 0 (HiF8 per-tensor; 7 is its older number), got {quant_mode!r}{later}")
    return QuantMode.HIF8_PER_TENSOR


def check_mask_mode(mask_mode) -> MaskMode:
    if isinstance(mask_mode, bool) or not isinstance(mask_mode, int):
        raise TypeError(f"mask_mode must be an int (0 none, 3 causal), got {type(mask_mode).__name__} {mask_mode!r}")
    if mask_mode not in MASK_MODES:
        raise ValueError(f"mask_mode must be 0 (none) or 3 (causal) in the HiF8 mode, got {mask_mode!r}")
    return MaskMode(mask_mode)


def resolve_layouts(layout, layout_q, layout_kv, layout_out, layout_q_descale="BSND") -> tuple[str, str]:
    """(layout of q and out, layout of k and v) for the HiF8 mode.

    ``layout`` is shorthand for all three per-operand layouts; an operand layout left None is
    qfa's default ``"BNSD"``. q and out share one layout; k and v have it too, or a paged one
    (``PA_BBND`` / ``PA_BNBD``, with ``block_table``).
    """
    per_operand = {"layout_q": layout_q, "layout_kv": layout_kv, "layout_out": layout_out}
    for name, value in {"layout": layout, **per_operand}.items():
        allowed = LAYOUTS + PAGED_LAYOUTS if name == "layout_kv" else LAYOUTS
        if value is not None and value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if layout is not None:
        clash = {n: v for n, v in per_operand.items() if v is not None and v != layout
                 and not (n == "layout_kv" and v in PAGED_LAYOUTS)}
        if clash:
            raise ValueError(f"layout={layout!r} sets layout_q, layout_kv and layout_out; it contradicts {clash}")
        chosen, kv = layout, layout_kv if layout_kv in PAGED_LAYOUTS else layout
    else:
        resolved = {n: "BNSD" if v is None else v for n, v in per_operand.items()}
        kv = resolved["layout_kv"]
        if kv in PAGED_LAYOUTS:
            resolved.pop("layout_kv")
        if len(set(resolved.values())) != 1:
            raise ValueError(f"layout_q, layout_kv and layout_out must be equal in the HiF8 mode, except for a paged "
                             f"layout_kv (unset ones are 'BNSD'), got {resolved | {'layout_kv': kv}}")
        chosen = resolved["layout_q"]
        kv = chosen if kv not in PAGED_LAYOUTS else kv
    if layout_q_descale not in Q_DESCALE_LAYOUTS:
        raise ValueError(f"layout_q_descale must be 'BSND' in the HiF8 mode (a per-tensor descale), "
                         f"got {layout_q_descale!r}")
    return chosen, kv


def check_softmax_scale(softmax_scale) -> float:
    if softmax_scale is None:
        return default_softmax_scale(HEAD_DIM)
    if isinstance(softmax_scale, (torch.Tensor, bool)) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a Python float or None, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale}")
    return float(softmax_scale)


def _check_max_seqlen(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (-1: not given), got {type(value).__name__} {value!r}")
    if value != -1 and value < 0:
        raise ValueError(f"{name} must be -1 (not given) or >= 0, got {value}")
    return value


def check_unsupported(win_left, win_right, **tensors) -> None:
    for name, value in tensors.items():
        if value is not None:
            raise ValueError(f"{name}: {_UNSUPPORTED[name]}")
    for name, value in (("win_left", win_left), ("win_right", win_right)):
        if value != -1:
            raise ValueError(f"{name} must be -1: sliding windows are not supported in the HiF8 mode, got {value!r}")


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


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def check_heads(nq: int, nkv: int) -> None:
    for n, name in ((nq, "q"), (nkv, "k/v")):
        if not 1 <= n <= MAX_HEADS:
            raise ValueError(f"head count of {name} must be in [1, {MAX_HEADS}], got {n}")
    if nq < nkv or nq % nkv:
        raise ValueError(f"q heads must be a multiple of k/v heads (GQA), got Nq={nq}, Nkv={nkv}")
    if nq // nkv > MAX_GROUP:
        raise ValueError(f"GQA group Nq/Nkv must be <= {MAX_GROUP}, got {nq // nkv}")


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str) -> tuple[dict, dict]:
    """The op's static shape rules: rank per layout, D = 128, k and v alike, head counts, GQA,
    one batch size. Shared with the drop-in, which checks float q/k/v before quantising them.
    Returns q's and k's sizes by axis name (``b``, ``n``, ``s``, ``d``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    qs, ks, vs = _shape_of(q, "q", layout), _shape_of(k, "k", layout), _shape_of(v, "v", layout)
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    for shape, name in ((qs, "q"), (ks, "k"), (vs, "v")):
        if shape["d"] != HEAD_DIM:
            raise ValueError(f"head dim D of {name} must be {HEAD_DIM}, got {shape['d']}")
    check_heads(qs["n"], ks["n"])
    if layout != "TND":
        for shape, name in ((ks, "k"), (vs, "v")):
            if shape["b"] != qs["b"]:
                raise ValueError(f"batch size of {name} must equal q's ({qs['b']}), got {shape['b']}")
    return qs, ks


def _check_attn_mask(attn_mask, mask_mode: MaskMode) -> None:
    if attn_mask is None:
        return
    if mask_mode == MaskMode.NONE:
        raise ValueError("attn_mask must be None with mask_mode 0 (no mask)")
    require_tensor(attn_mask, "attn_mask")
    expected = f"int8 {list(CAUSAL_MASK_SHAPE)} (the compressed causal mask)"
    if attn_mask.dtype != torch.int8:  # a dtype error is a TypeError, as everywhere else here
        raise TypeError(f"attn_mask for mask_mode 3 must be {expected}, got {attn_mask.dtype} {list(attn_mask.shape)}")
    if tuple(attn_mask.shape) != CAUSAL_MASK_SHAPE:
        raise ValueError(f"attn_mask for mask_mode 3 must be {expected}, got {attn_mask.dtype} {list(attn_mask.shape)}")


def check_devices(device: torch.device, named: dict) -> None:
    for name, t in named.items():
        check_device(t, name, device)


# ============================================================================ metadata

@dataclass(frozen=True)
class AttentionMetadata:
    """The tensor-independent half of a plan: what :func:`qfa.quant_flash_attn_metadata` returns.

    ``q_lens`` / ``kv_lens`` are the per-batch used lengths when the metadata call knew them
    (TND's ``cu_seqlens``, or ``seqused``); None means "the tensors' full sequence length",
    filled in when the metadata is bound to tensors. ``q_starts`` / ``kv_starts`` are TND's
    segment starts (None otherwise), ``total_q`` / ``total_kv`` its token counts.
    """

    quant_mode: QuantMode
    layout: str  # of q and out
    layout_kv: str  # of k and v: ``layout``, or a paged layout
    heads_q: int
    heads_kv: int
    head_dim: int
    mask_mode: MaskMode
    batch: int | None
    q_lens: tuple[int, ...] | None
    kv_lens: tuple[int, ...] | None
    q_starts: tuple[int, ...] | None
    kv_starts: tuple[int, ...] | None
    total_q: int | None
    total_kv: int | None
    max_seqlen_q: int
    max_seqlen_kv: int
    device: torch.device | None
    #: The (dtype, shape) of each length tensor it was planned with; a run must pass alike ones.
    length_args: tuple = ()
    _plans: dict = field(default_factory=dict, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    @property
    def causal(self) -> bool:
        return self.mask_mode == MaskMode.CAUSAL

    @property
    def paged(self) -> bool:
        return self.layout_kv in PAGED_LAYOUTS


def _length_signature(**tensors) -> tuple:
    return tuple((name, None if t is None else (t.dtype, tuple(t.shape))) for name, t in sorted(tensors.items()))


def plan_metadata(
    num_heads_q: int, num_heads_kv: int, head_dim: int = HEAD_DIM, quant_mode=QuantMode.HIF8_PER_TENSOR, *,
    cu_seqlens_q=None, cu_seqlens_kv=None, seqused_q=None, seqused_kv=None, batch_size=None,
    max_seqlen_q: int = -1, max_seqlen_kv: int = -1, head_dim_v=None, mask_mode=MaskMode.NONE,
    win_left: int = -1, win_right: int = -1, layout: str = "BNSD", layout_q_descale: str = "BSND",
    is_grad_enabled: bool = False, total_q: int | None = None, total_kv: int | None = None,
    layout_kv: str | None = None,
) -> AttentionMetadata:
    """Validate the tensor-independent arguments and read the per-batch lengths (a host read of
    ``cu_seqlens`` / ``seqused``: the one device synchronisation of a plan, paid here once).

    ``total_q`` / ``total_kv``, the tensors' sequence lengths when known (TND: token counts,
    checked against ``cu_seqlens[-1]``; otherwise the padded S, which bounds ``seqused``), are
    checked here when given and by :func:`bind` otherwise.
    """
    quant_mode = check_quant_mode(quant_mode)
    mask_mode = check_mask_mode(mask_mode)
    for value, name in ((num_heads_q, "num_heads_q"), (num_heads_kv, "num_heads_kv"), (head_dim, "head_dim")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    check_heads(num_heads_q, num_heads_kv)
    if head_dim != HEAD_DIM:
        raise ValueError(f"head_dim must be {HEAD_DIM} in the HiF8 mode, got {head_dim}")
    if head_dim_v is not None and head_dim_v != head_dim:
        raise ValueError(f"head_dim_v must be None or equal head_dim ({head_dim}) in the HiF8 mode, got {head_dim_v!r}")
    if check_bool(is_grad_enabled, "is_grad_enabled"):
        raise ValueError("is_grad_enabled must be False: qfa's quant_flash_attn is forward-only")
    check_unsupported(win_left, win_right)
    max_seqlen_q = _check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    max_seqlen_kv = _check_max_seqlen(max_seqlen_kv, "max_seqlen_kv")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    layout, layout_kv = resolve_layouts(layout, None, layout_kv, None, layout_q_descale)
    paged = layout_kv in PAGED_LAYOUTS
    named = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_kv": cu_seqlens_kv, "seqused_q": seqused_q,
             "seqused_kv": seqused_kv}
    if layout == "TND" and batch_size is not None:
        raise ValueError("batch_size is not accepted with layout 'TND' (cu_seqlens_q gives the batch)")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)):
        raise TypeError(f"batch_size must be an int or None, got {type(batch_size).__name__} {batch_size!r}")
    batch = check_sequence_lengths(layout, batch=batch_size, max_batch=MAX_BATCH, kv_paged=paged, **named)
    devices = {t.device for t in named.values() if isinstance(t, torch.Tensor)}

    # The host reads, after every static check.
    for name, t in named.items():
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device, but planning reads its values: pass it on a real "
                             f"device (the CPU or q's)")
    q_lens = kv_lens = q_starts = kv_starts = None
    if layout == "TND":
        cu_q_list = int32_vector(cu_seqlens_q, "cu_seqlens_q", batch + 1)
        q_lens = cumulative_lengths(cu_q_list, "cu_seqlens_q", total_q)
        q_starts, total_q = tuple(cu_q_list[:-1]), cu_q_list[-1]
        if not paged:
            cu_kv_list = int32_vector(cu_seqlens_kv, "cu_seqlens_kv", batch + 1)
            kv_lens = cumulative_lengths(cu_kv_list, "cu_seqlens_kv", total_kv)
            kv_starts, total_kv = tuple(cu_kv_list[:-1]), cu_kv_list[-1]
    used_q = int32_vector(seqused_q, "seqused_q", batch) if seqused_q is not None else None
    used_kv = int32_vector(seqused_kv, "seqused_kv", batch) if seqused_kv is not None else None
    if layout != "TND":  # lengths are the tensors' (known here only through total_*) unless seqused
        q_lens = [total_q] * batch if total_q is not None and batch else None
        kv_lens = [total_kv] * batch if total_kv is not None and batch and not paged else None
    q_lens = apply_seqused(q_lens, used_q, "seqused_q")
    kv_lens = apply_seqused(kv_lens, used_kv, "seqused_kv")
    if layout != "TND":
        q_lens = q_lens if used_q is not None else None
        kv_lens = kv_lens if used_kv is not None else None
    if paged:  # keys live in blocks: no token axis, every sequence's keys start at 0
        kv_starts, total_kv = (0,) * batch if layout == "TND" else None, None
    for lens, bound, name in ((q_lens, max_seqlen_q, "max_seqlen_q"), (kv_lens, max_seqlen_kv, "max_seqlen_kv")):
        if lens is not None and bound != -1 and max(lens, default=0) > bound:
            raise ValueError(f"{name} must be an upper bound of the used lengths (>= {max(lens)}), got {bound}")
    return AttentionMetadata(
        quant_mode=quant_mode, layout=layout, layout_kv=layout_kv, heads_q=num_heads_q, heads_kv=num_heads_kv, head_dim=head_dim,
        mask_mode=mask_mode, batch=batch, q_lens=None if q_lens is None else tuple(q_lens),
        kv_lens=None if kv_lens is None else tuple(kv_lens), q_starts=q_starts, kv_starts=kv_starts,
        total_q=total_q if layout == "TND" else None, total_kv=total_kv if layout == "TND" and not paged else None,
        max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
        device=next(iter(devices)) if devices else None,
        length_args=_length_signature(**named),
    )


# ============================================================================ plan

@dataclass(frozen=True)
class AttentionPlan:
    """What both backends run: layout-normalised geometry, per-batch lengths, outputs and grid.

    Sequences are addressed as (batch, head, position, dim) with element ``strides_*`` into the
    original tensors (``normalised_strides``); ``q_starts[b]`` / ``kv_starts[b]`` are the first
    position of batch ``b`` (non-zero only for TND, where the batch axis is folded into the
    token axis). ``rows[b]`` are the rows of out / lse batch ``b`` owns (the padded Sq, or its
    TND segment): rows past ``q_lens[b]`` are written as 0 / +inf.
    """

    meta: AttentionMetadata
    layout: str
    device: torch.device
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
    rows: tuple[int, ...]
    strides_q: tuple[int, int, int, int]  # (batch, head, position, dim)
    strides_kv: tuple[int, int, int, int]  # of k
    strides_v: tuple[int, int, int, int]  # of v: same shape as k, but it may be a different view
    out_shape: tuple[int, ...]  # bf16, contiguous, in the layout
    out_strides: tuple[int, int, int, int]  # normalised, of the contiguous out
    lse_shape: tuple[int, ...]
    lse_strides: tuple[int, int, int]  # (batch, head, position) of the contiguous lse
    causal: bool
    softmax_scale: float
    return_lse: bool
    block_m: int
    block_n: int
    n_tiles: int  # query tiles of block_m rows per (batch, q head): ceil(max(rows) / block_m)
    #: Query positions per tile of the torch path (CPU): see :func:`torch_tile_rows`.
    torch_rows: int
    #: Paged K/V (layout_kv PA_*): strides_kv/v are then (block, head, position in block, dim)
    #: and key j of batch b sits at block block_table[b, j // block_size], position j % block_size.
    layout_kv: str = ""
    block_size: int = 0
    num_blocks: int = 0
    table_width: int = 0
    table_stride: int = 0

    @property
    def paged(self) -> bool:
        return self.block_size > 0

    @property
    def group(self) -> int:
        """q heads per kv head (GQA): kv head of q head h is h // group."""
        return self.heads_q // self.heads_kv

    @property
    def causal_offsets(self) -> tuple[int, ...]:
        """Bottom-right alignment: query i of batch b sees key j iff j <= i + offset[b]."""
        return tuple(kv - q for q, kv in zip(self.q_lens, self.kv_lens))

    @cached_property
    def platform(self):
        """The launch platform (``qfa.tiling.platform``), looked up once per plan: the grid and
        the kernel's launch options come from the same entry. Derived on first use, so the torch
        path never asks for one."""
        from qfa.tiling.platform import platform_for

        return platform_for(self.device)

    @cached_property
    def grid(self) -> tuple[int, int]:
        """The Triton launch grid over the plan's items (batch * q heads x ``n_tiles``): one
        program per item, or a persistent grid (see :func:`_grid`)."""
        return _grid(self.batch * self.heads_q, self.n_tiles, self.platform)

    @cached_property
    def seq_table(self) -> torch.Tensor:
        """int32 (5, B) on the device: q starts, kv starts, q lens, kv lens, rows (the kernel's).
        Made once per plan, so a reused plan uploads nothing."""
        table = [self.q_starts, self.kv_starts, self.q_lens, self.kv_lens, self.rows]
        return torch.tensor(table, dtype=torch.int32).to(self.device)

    def scalars(self, q_descale: torch.Tensor, k_descale: torch.Tensor, v_descale: torch.Tensor,
                p_scale: torch.Tensor | None) -> torch.Tensor:
        """fp32 (3,) on the device: dScale = softmax_scale * q_descale * k_descale, ln p_scale,
        v_descale. Device ops only (no host read); both backends take these same bits."""
        dscale = (q_descale * k_descale) * self.softmax_scale
        ln_p = torch.log(p_scale) if p_scale is not None else torch.zeros(1, dtype=torch.float32, device=dscale.device)
        return torch.cat([dscale, ln_p, v_descale])

    def new_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Uninitialised (out bf16, lse fp32 or an empty tensor) of the plan's shapes."""
        out = torch.empty(self.out_shape, dtype=torch.bfloat16, device=self.device)
        lse = torch.empty(self.lse_shape if self.return_lse else (0,), dtype=torch.float32, device=self.device)
        return out, lse


def torch_tile_rows(group: int) -> int:
    """Query positions per torch-path tile for GQA group size ``group``."""
    return max(TORCH_TILE_MIN_POSITIONS, TORCH_TILE_SCORE_ROWS // group)


def _grid(programs_bh: int, tiles_m: int, platform) -> tuple[int, int]:
    """(batch * heads, query tiles), or on NPU / the interpreter a persistent grid of one
    program per core (every program loops over items pid, pid + programs, ...).

    Batch * heads goes on the first axis: CUDA allows 2^31 - 1 programs there but only 65535
    on the others, and a sequence needs 65535 query tiles (8M rows) before it hits that.
    """
    if platform.persistent:
        return (max(1, min(platform.cube_cores, tiles_m * programs_bh)), 1)
    if tiles_m > MAX_QUERY_TILES:
        raise ValueError(f"query length must be <= {MAX_QUERY_TILES * BLOCK_M} rows, got {tiles_m} tiles of {BLOCK_M}")
    if programs_bh > platform.max_grid:
        raise ValueError(f"batch * q heads must be <= {platform.max_grid} on {platform.name}, got {programs_bh}")
    return (programs_bh, max(tiles_m, 1))


def _geometry_key(q, k, v, softmax_scale: float, return_lse: bool, block_table=None) -> tuple:
    table = None
    if isinstance(block_table, torch.Tensor):
        table = (tuple(block_table.shape), block_table.stride(), block_table.dtype, block_table.device)
    elif block_table is not None:
        table = type(block_table)
    return (tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), tuple(v.shape), v.stride(), q.dtype, q.device,
            softmax_scale, return_lse, table)


def check_run_tensors(q, k, v, q_descale, k_descale, v_descale, p_scale) -> None:
    """Static checks of one call's tensors (types, dtypes, shapes of the scales): no value read."""
    q, k, v = (require_tensor(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        check_codes(t, name)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one HiF8 dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for t, name in ((q_descale, "q_descale"), (k_descale, "k_descale"), (v_descale, "v_descale")):
        check_scalar_fp32(t, name)
    if p_scale is not None:
        check_scalar_fp32(p_scale, "p_scale")


def host_reads_are_free(device: torch.device) -> bool:
    """Whether reading a tensor's values costs no device synchronisation (CPU memory)."""
    return device.type == "cpu"


def check_scale_values(plan: "AttentionPlan", q_descale, k_descale, v_descale, p_scale) -> None:
    """The scales' values against the ranges the numerics handle (one host read of 4 floats).

    Outside these ranges the op would return a silent wrong answer, so they are errors:

    * every descale finite and > 0 (a negative one would turn the running max into a min);
    * dScale = softmax_scale * q_descale * k_descale <= FLT_MAX / (128 * 32768^2), so no scaled
      score S * dScale overflows before the running max is subtracted;
    * p_scale in [2^-15, 2^15], HiF8's normal binades (outside, P saturates or flushes to 0);
    * v_descale * p_scale <= FLT_MAX / (1.25 * 32768 * max Skv), so the unnormalised output
      P8 @ V * v_descale cannot overflow fp32 (HiF8(P) <= 1.25 p_scale, |V| <= 32768).

    Done on CPU always, and on devices when a call plans without ready metadata.
    """
    if plan.device.type == "meta":
        return
    named = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if p_scale is not None:
        named["p_scale"] = p_scale
    values = dict(zip(named, torch.cat(list(named.values())).tolist()))
    for name in ("q_descale", "k_descale", "v_descale"):
        if not (math.isfinite(values[name]) and values[name] > 0):
            raise ValueError(f"{name} must be a finite value > 0, got {values[name]:g}")
    p = values.get("p_scale", 1.0)
    if not (math.isfinite(p) and P_SCALE_RANGE[0] <= p <= P_SCALE_RANGE[1]):
        raise ValueError(f"p_scale must be in [2^-15, 2^15] = [{P_SCALE_RANGE[0]:g}, {P_SCALE_RANGE[1]:g}] (HiF8's "
                         f"normal binades: P lies in (0, p_scale]), got {p:g}")
    dscale = plan.softmax_scale * values["q_descale"] * values["k_descale"]
    if dscale > MAX_DSCALE:
        raise ValueError(f"softmax_scale * q_descale * k_descale must be <= {MAX_DSCALE:.3g} (beyond it the scaled "
                         f"HiF8 scores overflow fp32), got {dscale:.3g} = {plan.softmax_scale:g} * "
                         f"{values['q_descale']:g} * {values['k_descale']:g}")
    if dscale == 0:
        raise ValueError(f"softmax_scale * q_descale * k_descale underflows to 0 ({plan.softmax_scale:g} * "
                         f"{values['q_descale']:g} * {values['k_descale']:g})")
    max_v = FP32_MAX / (P8_OVERSHOOT * fmt.MAX * max(max(plan.kv_lens, default=1), 1) * p)
    if values["v_descale"] > max_v:
        raise ValueError(f"v_descale must be <= {max_v:.3g} for this call (FLT_MAX / (1.25 * 32768 * max Skv "
                         f"{max(plan.kv_lens, default=0)} * p_scale {p:g}): beyond it P @ V * v_descale can "
                         f"overflow fp32), got {values['v_descale']:g}")


def bind(meta: AttentionMetadata, q, k, v, *, softmax_scale=None, return_softmax_lse: bool = False,
         attn_mask=None, block_table=None) -> AttentionPlan:
    """``meta`` applied to tensors q, k, v (already checked by :func:`check_run_tensors`): shape
    rules, lengths against the tensors, output geometry, tiles and grid. Host arithmetic only;
    the plan is cached in ``meta`` per geometry."""
    softmax_scale = check_softmax_scale(softmax_scale)
    return_lse = check_bool(return_softmax_lse, "return_softmax_lse")
    _check_attn_mask(attn_mask, meta.mask_mode)
    key = _geometry_key(q, k, v, softmax_scale, return_lse, block_table)
    plan = meta._plans.get(key)
    if plan is not None:
        return plan
    plan = _bind(meta, q, k, v, softmax_scale, return_lse, block_table)
    with meta._lock:
        return meta._plans.setdefault(key, plan)


def _paged_shape(t: torch.Tensor, name: str, layout_kv: str) -> dict[str, int]:
    axes = _PAGED_AXES[layout_kv]
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D for layout_kv {layout_kv} ({'(blocks, block_size, Nkv, D)' if layout_kv == 'PA_BBND' else '(blocks, Nkv, block_size, D)'}), "
                         f"got shape {tuple(t.shape)}")
    return {k: t.shape[i] for k, i in axes.items()}


def paged_strides(t: torch.Tensor, layout_kv: str) -> tuple[int, int, int, int]:
    """Element strides of paged ``t`` as (block, head, position in block, dim)."""
    axes = _PAGED_AXES[layout_kv]
    return (t.stride(axes["blk"]), t.stride(axes["n"]), t.stride(axes["s"]), t.stride(axes["d"]))


def _check_paged(meta: AttentionMetadata, q, k, v, block_table, qs: dict, batch: int) -> tuple[dict, int]:
    """Shapes of paged k/v and of the block table; returns k's sizes and the table width."""
    ks = _paged_shape(k, "k", meta.layout_kv)
    _paged_shape(v, "v", meta.layout_kv)
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    for shape, name in ((qs, "q"), (ks, "k")):
        if shape["d"] != HEAD_DIM:
            raise ValueError(f"head dim D of {name} must be {HEAD_DIM}, got {shape['d']}")
    check_heads(qs["n"], ks["n"])
    page = ks["s"]
    if not (0 < page <= MAX_PAGE and page % PAGE_MULTIPLE == 0):
        raise ValueError(f"block size of paged k/v must be a multiple of {PAGE_MULTIPLE} up to {MAX_PAGE}, got {page}")
    if block_table is None:
        raise ValueError(f"layout_kv {meta.layout_kv!r} needs block_table (int32, (B, max blocks per sequence))")
    require_tensor(block_table, "block_table")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be torch.int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must have shape (B={batch}, max blocks per sequence), got "
                         f"{tuple(block_table.shape)}")
    width = block_table.shape[1]
    for b, n in enumerate(meta.kv_lens):
        if n > width * page:
            raise ValueError(f"seqused_kv[{b}] = {n} needs {-(-n // page)} blocks of {page}, but block_table rows "
                             f"hold {width}")
    return ks, width


def check_block_table_values(plan: "AttentionPlan", block_table: torch.Tensor) -> None:
    """Every block a sequence uses is in [0, num_blocks): a host read, so done on CPU only (on a
    device a table changes every decode step, and reading it would synchronise each call).
    Upstream leaves bad values undefined. The table's shape against the lengths
    (``seqused_kv`` <= blocks per row * block size) is checked everywhere, with no read."""
    if plan.device.type == "meta":
        return
    rows = block_table.tolist()
    for b, n in enumerate(plan.kv_lens):
        used = rows[b][: -(-n // plan.block_size)]
        bad = [(j, x) for j, x in enumerate(used) if not 0 <= x < plan.num_blocks]
        if bad:
            j, x = bad[0]
            raise ValueError(f"block_table[{b}, {j}] must be a block index in [0, {plan.num_blocks}), got {x}")


def _bind(meta: AttentionMetadata, q, k, v, softmax_scale: float, return_lse: bool, block_table=None) -> AttentionPlan:
    layout = meta.layout
    device = q.device
    if meta.device is not None and meta.device != device:
        raise ValueError(f"cu_seqlens / seqused must be on q's device {device}, got {meta.device}")
    check_devices(device, {"k": k, "v": v, "block_table": block_table})
    paged = meta.paged
    if paged:
        qs = _shape_of(q, "q", layout)
        batch = meta.batch if layout == "TND" else qs["b"]
        ks, width = _check_paged(meta, q, k, v, block_table, qs, batch)
    else:
        if block_table is not None:
            check_unsupported(-1, -1, block_table=block_table)
        qs, ks = check_shapes(q, k, v, layout)
        width = 0
    if (qs["n"], ks["n"]) != (meta.heads_q, meta.heads_kv):
        raise ValueError(f"q/k heads must match the metadata's ({meta.heads_q}, {meta.heads_kv}), "
                         f"got ({qs['n']}, {ks['n']})")
    if layout == "TND":
        if qs["s"] != meta.total_q:
            raise ValueError(f"cu_seqlens_q[-1] must equal the token count {qs['s']} of the tensor, got {meta.total_q}")
        if not paged and ks["s"] != meta.total_kv:
            raise ValueError(f"cu_seqlens_kv[-1] must equal the token count {ks['s']} of the tensor, got {meta.total_kv}")
        batch = meta.batch
        q_lens, kv_lens = meta.q_lens, meta.kv_lens
        q_starts, kv_starts = meta.q_starts, meta.kv_starts
        seq_q = max(q_lens, default=0)
        ends = list(q_starts[1:]) + [qs["s"]]
        rows = tuple(end - start for start, end in zip(q_starts, ends))
    else:
        batch = qs["b"]
        if not 0 < batch <= MAX_BATCH:
            raise ValueError(f"batch size B must be in [1, {MAX_BATCH}], got {batch}")
        if meta.batch is not None and meta.batch != batch:
            raise ValueError(f"batch size of q must equal the metadata's ({meta.batch}), got {batch}")
        seq_q = qs["s"]
        q_lens = tuple(apply_seqused([seq_q] * batch, meta.q_lens and list(meta.q_lens), "seqused_q"))
        if paged:
            kv_lens = meta.kv_lens
        else:
            kv_lens = tuple(apply_seqused([ks["s"]] * batch, meta.kv_lens and list(meta.kv_lens), "seqused_kv"))
        q_starts = kv_starts = (0,) * batch
        rows = (seq_q,) * batch
    if not 0 < batch <= MAX_BATCH:
        raise ValueError(f"batch size B must be in [1, {MAX_BATCH}], got {batch}")
    for lens, bound, name in ((q_lens, meta.max_seqlen_q, "max_seqlen_q"), (kv_lens, meta.max_seqlen_kv, "max_seqlen_kv")):
        if bound != -1 and max(lens, default=0) > bound:
            raise ValueError(f"{name} must be an upper bound of the used lengths (>= {max(lens)}), got {bound}")
    seq_kv = max(kv_lens, default=0) if paged or layout == "TND" else ks["s"]
    out_shape = tuple(q.shape)
    out_strides = _contiguous_strides(out_shape)
    axes = _AXES[layout]
    out_norm = (out_strides[axes["b"]] if "b" in axes else 0, out_strides[axes["n"]], out_strides[axes["s"]],
                out_strides[axes["d"]])
    lse_sh = lse_shape(out_shape, layout)
    lse_st = (0, *_contiguous_strides(lse_sh)) if layout == "TND" else _contiguous_strides(lse_sh)
    n_tiles = math.ceil(max(rows, default=0) / BLOCK_M)
    kv_strides = (lambda t: paged_strides(t, meta.layout_kv)) if paged else (lambda t: normalised_strides(t, layout))
    return AttentionPlan(
        meta=meta, layout=layout, device=device, batch=batch, heads_q=meta.heads_q, heads_kv=meta.heads_kv,
        head_dim=HEAD_DIM, seq_q=seq_q, seq_kv=seq_kv, q_starts=tuple(q_starts), kv_starts=tuple(kv_starts),
        q_lens=q_lens, kv_lens=kv_lens, rows=rows, strides_q=normalised_strides(q, layout),
        strides_kv=kv_strides(k), strides_v=kv_strides(v), out_shape=out_shape,
        out_strides=out_norm, lse_shape=lse_sh, lse_strides=lse_st, causal=meta.causal,
        softmax_scale=softmax_scale, return_lse=return_lse, block_m=BLOCK_M, block_n=BLOCK_N, n_tiles=n_tiles,
        torch_rows=torch_tile_rows(meta.heads_q // meta.heads_kv),
        layout_kv=meta.layout_kv, block_size=ks["s"] if paged else 0, num_blocks=ks["blk"] if paged else 0,
        table_width=width, table_stride=block_table.stride(0) if paged else 0,
    )


def check_against_metadata(meta: AttentionMetadata, *, layout: str, mask_mode, cu_seqlens_q, cu_seqlens_kv,
                           seqused_q, seqused_kv, layout_kv: str | None = None) -> None:
    """A run with ``metadata=`` must pass what the metadata was planned with: the same layout and
    mask, and length tensors alike in dtype and shape (their values are the metadata's: reading
    them again would cost a device synchronisation)."""
    if layout != meta.layout:
        raise ValueError(f"layout must be the metadata's {meta.layout!r}, got {layout!r}")
    if layout_kv is not None and layout_kv != meta.layout_kv:
        raise ValueError(f"layout_kv must be the metadata's {meta.layout_kv!r}, got {layout_kv!r}")
    if check_mask_mode(mask_mode) != meta.mask_mode:
        raise ValueError(f"mask_mode must be the metadata's {int(meta.mask_mode)}, got {mask_mode!r}")
    given = _length_signature(cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, seqused_q=seqused_q,
                              seqused_kv=seqused_kv)
    for (name, planned), (_, got) in zip(meta.length_args, given):
        if planned != got:
            raise ValueError(f"{name} must be like the one the metadata was planned with "
                             f"({'None' if planned is None else planned}), got {'None' if got is None else got}")


def plan_attention(
    q, k, v, q_descale, k_descale, v_descale, quant_mode, *, p_scale=None, layout="BNSD", cu_seqlens_q=None,
    cu_seqlens_kv=None, seqused_q=None, seqused_kv=None, attn_mask=None, mask_mode=0, softmax_scale=None,
    return_softmax_lse=False, block_table=None, sinks=None, win_left=-1, win_right=-1, max_seqlen_q=-1,
    max_seqlen_kv=-1, layout_kv=None,
) -> AttentionPlan:
    """Validate one quant_flash_attn call against the spec and derive its plan (metadata + bind).
    ``layout_kv`` None is ``layout``; a paged one (``PA_BBND`` / ``PA_BNBD``) needs block_table."""
    layout_kv = layout if layout_kv is None else layout_kv
    paged = layout_kv in PAGED_LAYOUTS
    check_run_tensors(q, k, v, q_descale, k_descale, v_descale, p_scale)
    check_quant_mode(quant_mode)
    check_unsupported(win_left, win_right, sinks=sinks, **({} if paged else {"block_table": block_table}))
    check_devices(q.device, {"k": k, "v": v, "q_descale": q_descale, "k_descale": k_descale,
                             "v_descale": v_descale, "p_scale": p_scale, "cu_seqlens_q": cu_seqlens_q,
                             "cu_seqlens_kv": cu_seqlens_kv, "seqused_q": seqused_q, "seqused_kv": seqused_kv,
                             "attn_mask": attn_mask, "block_table": block_table})
    if paged:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        qs, ks = _shape_of(q, "q", layout), _paged_shape(k, "k", layout_kv)
    else:
        qs, ks = check_shapes(q, k, v, layout)
    tnd = layout == "TND"
    meta = plan_metadata(
        qs["n"], ks["n"], qs["d"], quant_mode, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
        seqused_q=seqused_q, seqused_kv=seqused_kv, batch_size=None if tnd else qs["b"],
        max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, mask_mode=mask_mode, layout=layout,
        total_q=qs["s"], total_kv=None if paged else ks["s"], layout_kv=layout_kv,
    )
    plan = bind(meta, q, k, v, softmax_scale=softmax_scale, return_softmax_lse=return_softmax_lse,
                attn_mask=attn_mask, block_table=block_table)
    check_scale_values(plan, q_descale, k_descale, v_descale, p_scale)
    if paged and host_reads_are_free(plan.device):  # a table changes every decode step: never a sync
        check_block_table_values(plan, block_table)
    return plan
