"""Host tiling for QuantFlashAttn, HiF8 per-tensor (quant_mode 0; 7 is its older number).

Every check of the op's spec runs while planning, once, before any backend (the rules are in
:mod:`qfa.tiling.attention_checks`): a bad argument raises a ``TypeError`` (wrong type or dtype)
or ``ValueError`` (wrong value or shape) naming the argument, what was expected and what was given.

Planning has two halves, as upstream's ``quant_flash_attn_metadata`` / ``quant_flash_attn`` and
FlashInfer's plan / run split have:

* :func:`plan_metadata` -> :class:`AttentionMetadata`: what depends on the call's *values* (the
  per-batch lengths read from ``cu_seqlens`` / ``seqused``, a host read) and on its static
  arguments (heads, layouts, mask). Made once, reused for every layer of a forward pass.
* :func:`bind` -> :class:`AttentionPlan`: the metadata applied to concrete tensors: shapes,
  strides, output and LSE geometry, tiles and grid. Pure host arithmetic on shapes (no device
  synchronisation), cached in the metadata per tensor geometry, so a repeated call reuses the
  same plan object (and its device-side length table).

:func:`plan_attention` does both for a one-off call; a call without length tensors (a decode
step) reuses the plan of an earlier call of the same geometry (``_plan_cache``), its checks
still run in full. The :class:`AttentionPlan` is all that the torch path and the Triton kernel
consume; neither re-derives shapes, lengths or block sizes.
"""

from __future__ import annotations

import enum
import math
import threading
from dataclasses import dataclass, field
from functools import cached_property

import torch

from qfa.tiling.attention_checks import (  # noqa: F401  (re-exported: the plan's users ask here)
    LAYOUTS, MAX_BATCH, PACKED_LAYOUTS, PAGED_LAYOUTS, _AXES, _check_attn_mask, _check_max_seqlen, _check_paged,
    _contiguous_strides, _paged_shape, _shape_of, check_block_table_values, check_devices, check_heads,
    check_mask_mode, check_quant_mode, check_run_tensors, check_scale_floats, check_scale_values, check_shapes,
    check_softmax_scale, Layouts, check_unsupported, host_reads_are_free, lse_shape, normalised_strides, paged_strides,
    resolve_layouts,
)
from qfa.tiling.checks import (
    apply_seqused, check_batch_size, check_bool, check_sequence_lengths, cumulative_lengths, int32_vector,
)
from qfa.tiling.scaled_checks import check_descale_shapes, check_scaled_run_tensors, check_scaled_values
from qfa.tiling.spec import HEAD_DIM, HEAD_DIMS, KEY_BLOCK, MaskMode, QuantMode

#: Keys per softmax block of the HiF8 mode (each mode's: ``spec.KEY_BLOCK``).
BLOCK_N = KEY_BLOCK[QuantMode.HIF8_PER_TENSOR]
#: Query rows per kernel program (upstream's tile); it does not change the numbers.
BLOCK_M = 128
#: The torch path's query tile, in score rows per kv head (G x positions): one 256-key block of
#: fp32 scores is then 2 MiB, cache-sized, and the GEMMs are big enough for oneDNN to run near
#: peak. Causal prefill at S=2048 on the reference CPU, time / fp32 SDPA: G=1 1.06 at 2048
#: rows vs 1.10 at 1024 and 1.30 at 512; G=2 0.87 vs 1.01 at 1024; G=4 0.84 vs 0.90 at 1024.
#: Like BLOCK_M, it does not change the numbers.
TORCH_TILE_SCORE_ROWS = 2048
TORCH_TILE_MIN_POSITIONS = 512
#: Every layout q may have (check_shapes checks the one given against these).
_ALL_LAYOUTS = tuple(_AXES)
#: Query tiles one sequence may have along the grid's second axis (CUDA's limit there).
MAX_QUERY_TILES = 65535


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
    layout: str  # of q (and of out in the HiF8 mode)
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
    layout_out: str = ""  # "" means ``layout``
    layout_q_descale: str = "BSND"
    _plans: dict = field(default_factory=dict, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    @property
    def causal(self) -> bool:
        return self.mask_mode == MaskMode.CAUSAL

    @property
    def paged(self) -> bool:
        return self.layout_kv in PAGED_LAYOUTS

    @property
    def out_layout(self) -> str:
        return self.layout_out or self.layout


def _check_length_bounds(q_lens, kv_lens, max_seqlen_q: int, max_seqlen_kv: int) -> None:
    """``max_seqlen_*`` (-1: not given) bound the used lengths (None: not known yet)."""
    for lens, bound, name in ((q_lens, max_seqlen_q, "max_seqlen_q"), (kv_lens, max_seqlen_kv, "max_seqlen_kv")):
        if lens is not None and bound != -1 and max(lens, default=0) > bound:
            raise ValueError(f"{name} must be an upper bound of the used lengths (>= {max(lens)}), got {bound}")


def _length_signature(**tensors) -> tuple:
    return tuple((name, None if t is None else (t.dtype, tuple(t.shape))) for name, t in sorted(tensors.items()))


def plan_metadata(
    num_heads_q: int, num_heads_kv: int, head_dim: int = HEAD_DIM, quant_mode=QuantMode.HIF8_PER_TENSOR, *,
    cu_seqlens_q=None, cu_seqlens_kv=None, seqused_q=None, seqused_kv=None, batch_size=None,
    max_seqlen_q: int = -1, max_seqlen_kv: int = -1, head_dim_v=None, mask_mode=MaskMode.NONE,
    win_left: int = -1, win_right: int = -1, layout: str | None = None, layout_q_descale: str | None = None,
    is_grad_enabled: bool = False, total_q: int | None = None, total_kv: int | None = None,
    layout_kv: str | None = None, layout_out: str | None = None,
) -> AttentionMetadata:
    """Validate the tensor-independent arguments and read the per-batch lengths (a host read of
    ``cu_seqlens`` / ``seqused``: the one device synchronisation of a plan, paid here once).

    ``total_q`` / ``total_kv``, the tensors' sequence lengths when known (TND: token counts,
    checked against ``cu_seqlens[-1]``; otherwise the padded S, which bounds ``seqused``), are
    checked here when given and by :func:`bind` otherwise. ``layout`` is q's layout (and out's
    unless ``layout_out`` says otherwise: modes 1 and 6, see ``resolve_layouts``).
    """
    quant_mode = check_quant_mode(quant_mode)
    mask_mode = check_mask_mode(mask_mode)
    for value, name in ((num_heads_q, "num_heads_q"), (num_heads_kv, "num_heads_kv"), (head_dim, "head_dim")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    check_heads(num_heads_q, num_heads_kv, ("num_heads_q", "num_heads_kv"))
    mode_name = "the HiF8 mode" if quant_mode == QuantMode.HIF8_PER_TENSOR else f"quant_mode {int(quant_mode)}"
    dims = HEAD_DIMS[quant_mode]
    if head_dim not in dims:
        expected = dims[0] if len(dims) == 1 else f"one of {dims}"
        raise ValueError(f"head_dim must be {expected} in {mode_name}, got {head_dim}")
    if head_dim_v is not None and head_dim_v != head_dim:
        raise ValueError(f"head_dim_v must be None or equal head_dim ({head_dim}) in {mode_name}, got {head_dim_v!r}")
    if check_bool(is_grad_enabled, "is_grad_enabled"):
        raise ValueError("is_grad_enabled must be False: qfa's quant_flash_attn is forward-only")
    check_unsupported(win_left, win_right)
    max_seqlen_q = _check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    max_seqlen_kv = _check_max_seqlen(max_seqlen_kv, "max_seqlen_kv")
    if quant_mode == QuantMode.HIF8_PER_TENSOR:
        layout = "BNSD" if layout is None else layout
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        layouts = resolve_layouts(layout, None, layout_kv, None, layout_q_descale, quant_mode)
    else:  # ``layout`` is q's; out's and kv's are their own (unset: the mode's defaults)
        layouts = resolve_layouts(None, layout, layout_kv, layout_out, layout_q_descale, quant_mode)
        if layouts.kv == "PA_NZ":  # runs convert its k/v to PA_BNBD (qfa.attention.nz_layout)
            layouts = layouts._replace(kv="PA_BNBD")
    layout, layout_kv = layouts.q, layouts.kv
    paged = layout_kv in PAGED_LAYOUTS
    # Token-packed q (TND, mode 6's NTD) takes its segments from cu_seqlens_q.
    lengths_layout = "TND" if layout in PACKED_LAYOUTS else layout
    named = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_kv": cu_seqlens_kv, "seqused_q": seqused_q,
             "seqused_kv": seqused_kv}
    if lengths_layout == "TND" and batch_size is not None:
        raise ValueError(f"batch_size is not accepted with layout {layout!r} (cu_seqlens_q gives the batch)")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)):
        raise TypeError(f"batch_size must be an int or None, got {type(batch_size).__name__} {batch_size!r}")
    batch = check_sequence_lengths(lengths_layout, batch=batch_size, max_batch=MAX_BATCH, kv_paged=paged, **named)
    devices = {t.device for t in named.values() if isinstance(t, torch.Tensor)}

    # The host reads, after every static check.
    for name, t in named.items():
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device, but planning reads its values: pass it on a real "
                             f"device (the CPU or q's)")
    q_lens = kv_lens = q_starts = kv_starts = None
    if lengths_layout == "TND":
        cu_q_list = int32_vector(cu_seqlens_q, "cu_seqlens_q", batch + 1)
        q_lens = cumulative_lengths(cu_q_list, "cu_seqlens_q", total_q)
        q_starts, total_q = tuple(cu_q_list[:-1]), cu_q_list[-1]
        if not paged:
            cu_kv_list = int32_vector(cu_seqlens_kv, "cu_seqlens_kv", batch + 1)
            kv_lens = cumulative_lengths(cu_kv_list, "cu_seqlens_kv", total_kv)
            kv_starts, total_kv = tuple(cu_kv_list[:-1]), cu_kv_list[-1]
    used_q = int32_vector(seqused_q, "seqused_q", batch) if seqused_q is not None else None
    used_kv = int32_vector(seqused_kv, "seqused_kv", batch) if seqused_kv is not None else None
    if lengths_layout != "TND":  # lengths are the tensors' (known here only through total_*) unless seqused
        q_lens = [total_q] * batch if total_q is not None and batch else None
        kv_lens = [total_kv] * batch if total_kv is not None and batch and not paged else None
    q_lens = apply_seqused(q_lens, used_q, "seqused_q")
    kv_lens = apply_seqused(kv_lens, used_kv, "seqused_kv")
    if lengths_layout != "TND":
        q_lens = q_lens if used_q is not None else None
        kv_lens = kv_lens if used_kv is not None else None
    if paged:  # keys live in blocks: no token axis, every sequence's keys start at 0
        kv_starts, total_kv = (0,) * batch if lengths_layout == "TND" else None, None
    _check_length_bounds(q_lens, kv_lens, max_seqlen_q, max_seqlen_kv)
    return AttentionMetadata(
        quant_mode=quant_mode, layout=layout, layout_kv=layout_kv, heads_q=num_heads_q, heads_kv=num_heads_kv, head_dim=head_dim,
        mask_mode=mask_mode, batch=batch, q_lens=None if q_lens is None else tuple(q_lens),
        kv_lens=None if kv_lens is None else tuple(kv_lens), q_starts=q_starts, kv_starts=kv_starts,
        total_q=total_q if lengths_layout == "TND" else None,
        total_kv=total_kv if lengths_layout == "TND" and not paged else None,
        max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
        device=next(iter(devices)) if devices else None,
        length_args=_length_signature(**named), layout_out=layouts.out if layouts.out != layout else "",
        layout_q_descale=layouts.q_descale,
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
    #: (row, column) element strides of block_table: a table is read through them like every other
    #: tensor, so a transposed, step-sliced or expanded view reads the blocks it names.
    table_strides: tuple[int, int] = (0, 0)
    #: What the backends derive from the plan alone (the descale shapes of modes 1 and 6, the
    #: first keys of TND v_descale's sequences), kept for the next call the plan serves: plans
    #: are cached per geometry. Not an argument (``dataclasses.replace`` starts a new one).
    derived: dict = field(default_factory=dict, init=False, compare=False, repr=False)

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
    # torch.Size is a tuple (equal and hashing alike): no conversion
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, softmax_scale,
            return_lse, table)


def bind(meta: AttentionMetadata, q, k, v, *, softmax_scale=None, return_softmax_lse: bool = False,
         attn_mask=None, block_table=None) -> AttentionPlan:
    """``meta`` applied to tensors q, k, v (already checked by :func:`check_run_tensors`): shape
    rules, lengths against the tensors, output geometry, tiles and grid. Host arithmetic only;
    the plan is cached in ``meta`` per geometry."""
    softmax_scale = check_softmax_scale(softmax_scale, meta.head_dim)
    return_lse = check_bool(return_softmax_lse, "return_softmax_lse")
    _check_attn_mask(attn_mask, meta.mask_mode)
    key = _geometry_key(q, k, v, softmax_scale, return_lse, block_table)
    plan = meta._plans.get(key)
    if plan is not None:
        return plan
    plan = _bind(meta, q, k, v, softmax_scale, return_lse, block_table)
    with meta._lock:
        return meta._plans.setdefault(key, plan)


def bound_plan(meta: AttentionMetadata, q, k, v, *, softmax_scale=None, return_softmax_lse: bool = False,
               block_table=None) -> AttentionPlan | None:
    """The plan :func:`bind` has made of ``meta`` for tensors of q, k, v and ``block_table``'s
    geometry (shapes, strides, dtype, device), or None: a lookup, which binds nothing."""
    key = _geometry_key(q, k, v, check_softmax_scale(softmax_scale, meta.head_dim), return_softmax_lse, block_table)
    return meta._plans.get(key)


def bound_mismatch(plan: AttentionPlan, q, k, v, block_table=None) -> str | None:
    """None when ``plan`` is the one :func:`bind` made of its metadata for tensors of q, k, v and
    ``block_table``'s geometry; else which of them differs from the tensors it was bound for
    (for callers that run one checked plan on many tensors of that geometry)."""
    key = _geometry_key(q, k, v, plan.softmax_scale, plan.return_lse, block_table)
    if plan.meta._plans.get(key) is plan:
        return None
    bound = next((known for known, p in list(plan.meta._plans.items()) if p is plan), None)
    if bound is None:
        return "the plan (not bound by its metadata)"
    parts = (("q", (0, 1, 6, 7)), ("k", (2, 3)), ("v", (4, 5)), ("block_table", (10,)))
    return next((name for name, at in parts if any(key[i] != bound[i] for i in at)), "q")


def _bind(meta: AttentionMetadata, q, k, v, softmax_scale: float, return_lse: bool, block_table=None) -> AttentionPlan:
    layout = meta.layout
    device = q.device
    if meta.device is not None and meta.device != device:
        raise ValueError(f"cu_seqlens / seqused must be on q's device {device}, got {meta.device}")
    check_devices(device, {"k": k, "v": v, "block_table": block_table})
    paged = meta.paged
    packed = layout in PACKED_LAYOUTS
    if paged:
        qs = _shape_of(q, "q", layout)
        batch = meta.batch if packed else qs["b"]
        ks, width = _check_paged(meta, q, k, v, block_table, qs, batch)
    else:
        if block_table is not None:
            check_unsupported(-1, -1, block_table=block_table)
        qs, ks = check_shapes(q, k, v, layout, HEAD_DIMS[meta.quant_mode], meta.layout_kv, _ALL_LAYOUTS)
        width = 0
    if qs["d"] != meta.head_dim:
        raise ValueError(f"head dim D of q must be the metadata's head_dim ({meta.head_dim}), got {qs['d']}")
    if (qs["n"], ks["n"]) != (meta.heads_q, meta.heads_kv):
        raise ValueError(f"q/k heads must match the metadata's ({meta.heads_q}, {meta.heads_kv}), "
                         f"got ({qs['n']}, {ks['n']})")
    if packed:
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
        check_batch_size(batch, MAX_BATCH)
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
    check_batch_size(batch, MAX_BATCH)
    _check_length_bounds(q_lens, kv_lens, meta.max_seqlen_q, meta.max_seqlen_kv)
    seq_kv = max(kv_lens, default=0) if paged or packed else ks["s"]
    out_layout = meta.out_layout
    axes = _AXES[out_layout]
    out_shape = tuple(qs[name] for name, _ in sorted(axes.items(), key=lambda item: item[1]))
    out_strides = _contiguous_strides(out_shape)
    out_norm = (out_strides[axes["b"]] if "b" in axes else 0, out_strides[axes["n"]], out_strides[axes["s"]],
                out_strides[axes["d"]])
    lse_sh = lse_shape(out_shape, out_layout)
    lse_st = (0, *_contiguous_strides(lse_sh)) if out_layout in PACKED_LAYOUTS else _contiguous_strides(lse_sh)
    n_tiles = math.ceil(max(rows, default=0) / BLOCK_M)
    kv_strides = (lambda t: paged_strides(t, meta.layout_kv)) if paged else (lambda t: normalised_strides(t, layout))
    return AttentionPlan(
        meta=meta, layout=layout, device=device, batch=batch, heads_q=meta.heads_q, heads_kv=meta.heads_kv,
        head_dim=meta.head_dim, seq_q=seq_q, seq_kv=seq_kv, q_starts=tuple(q_starts), kv_starts=tuple(kv_starts),
        q_lens=q_lens, kv_lens=kv_lens, rows=rows, strides_q=normalised_strides(q, layout),
        strides_kv=kv_strides(k), strides_v=kv_strides(v), out_shape=out_shape,
        out_strides=out_norm, lse_shape=lse_sh, lse_strides=lse_st, causal=meta.causal,
        softmax_scale=softmax_scale, return_lse=return_lse, block_m=BLOCK_M, block_n=KEY_BLOCK[meta.quant_mode],
        n_tiles=n_tiles,
        torch_rows=torch_tile_rows(meta.heads_q // meta.heads_kv),
        layout_kv=meta.layout_kv, block_size=ks["s"] if paged else 0, num_blocks=ks["blk"] if paged else 0,
        table_width=width, table_strides=tuple(block_table.stride()) if paged else (0, 0),
    )


def check_against_metadata(meta: AttentionMetadata, *, layout: str, mask_mode, cu_seqlens_q, cu_seqlens_kv,
                           seqused_q, seqused_kv, layout_kv: str | None = None, layout_out: str | None = None,
                           layout_q_descale: str | None = None) -> None:
    """A run with ``metadata=`` must pass what the metadata was planned with: the same layout and
    mask, and length tensors alike in dtype and shape (their values are the metadata's: reading
    them again would cost a device synchronisation)."""
    if layout != meta.layout:
        raise ValueError(f"layout must be the metadata's {meta.layout!r}, got {layout!r}")
    if layout_kv is not None and layout_kv != meta.layout_kv:
        raise ValueError(f"layout_kv must be the metadata's {meta.layout_kv!r}, got {layout_kv!r}")
    for name, value, planned in (("layout_out", layout_out, meta.out_layout),
                                 ("layout_q_descale", layout_q_descale, meta.layout_q_descale)):
        if value is not None and value != planned:
            raise ValueError(f"{name} must be the metadata's {planned!r}, got {value!r}")
    if check_mask_mode(mask_mode) != meta.mask_mode:
        raise ValueError(f"mask_mode must be the metadata's {int(meta.mask_mode)}, got {mask_mode!r}")
    given = _length_signature(cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, seqused_q=seqused_q,
                              seqused_kv=seqused_kv)
    for (name, planned), (_, got) in zip(meta.length_args, given):
        if planned != got:
            raise ValueError(f"{name} must be like the one the metadata was planned with "
                             f"({'None' if planned is None else planned}), got {'None' if got is None else got}")


#: Plans of calls without length tensors (HiF8, BNSD / BSND, contiguous k/v layout): each decode
#: step of a model is such a call, with the geometry of the step before. Such a plan is a function
#: of its key alone (layout, mask, max_seqlen bounds, softmax_scale, return_lse, and each of q, k,
#: v's shape, strides, dtype and device; never a tensor value), so a hit is the plan the call
#: would derive. Every check of plan_attention still runs on a hit (see :func:`_lengthless_plan`);
#: only the derivation is skipped. (The op itself skips plan_attention for a call like an earlier
#: successful one: qfa.attention.known_calls.) At most PLAN_CACHE_SIZE entries: a new one evicts
#: the oldest.
PLAN_CACHE_SIZE = 256
_plan_cache: dict[tuple, AttentionPlan] = {}
_plan_cache_lock = threading.Lock()


def _lengthless_plan(q, k, v, qs: dict, ks: dict, layout: str, mask_mode, max_seqlen_q, max_seqlen_kv,
                     softmax_scale, return_softmax_lse, attn_mask) -> AttentionPlan:
    """plan_metadata + bind of a HiF8 call without length tensors (BNSD / BSND, k/v in q's
    layout), whose :func:`plan_attention` checks have passed: the checks of those two that such a
    call can still fail run here, in their order and with their messages, then the plan comes
    from the cache (its length bounds checked against it) or is derived (and checked) in full."""
    mask = check_mask_mode(mask_mode)
    max_q = _check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    max_kv = _check_max_seqlen(max_seqlen_kv, "max_seqlen_kv")
    check_batch_size(qs["b"], MAX_BATCH)
    scale = check_softmax_scale(softmax_scale, qs["d"])
    return_lse = check_bool(return_softmax_lse, "return_softmax_lse")
    _check_attn_mask(attn_mask, mask)
    key = (layout, mask, max_q, max_kv, _geometry_key(q, k, v, scale, return_lse))
    plan = _plan_cache.get(key)
    if plan is not None:
        _check_length_bounds(plan.q_lens, plan.kv_lens, max_q, max_kv)
        return plan
    meta = plan_metadata(qs["n"], ks["n"], qs["d"], QuantMode.HIF8_PER_TENSOR, batch_size=qs["b"],
                         max_seqlen_q=max_q, max_seqlen_kv=max_kv, mask_mode=mask, layout=layout, total_q=qs["s"],
                         total_kv=ks["s"], layout_kv=layout)
    plan = bind(meta, q, k, v, softmax_scale=scale, return_softmax_lse=return_lse, attn_mask=attn_mask)
    with _plan_cache_lock:
        while len(_plan_cache) >= PLAN_CACHE_SIZE:
            del _plan_cache[next(iter(_plan_cache))]
        return _plan_cache.setdefault(key, plan)


def _metadata_key(head_args: tuple, meta_args: dict) -> tuple | None:
    """The cache key of a plan_metadata call: every argument as its type and value, length
    tensors by their dtype, shape and values (a host read, as plan_metadata's own), or None where
    an argument has no such key (a device or meta tensor, an object of another kind)."""
    key: list = ["metadata", head_args]
    append = key.append
    for name, value in meta_args.items():
        kind = type(value)
        if value is None or kind is int or kind is str or kind is bool:  # the usual ones, first
            # the type too: True == 1 and hash alike, but only one of them may pass a check
            append((name, kind, value))
        elif isinstance(value, torch.Tensor):
            if not value.is_cpu or value.dim() != 1:  # is_cpu: device.type == "cpu", no device object
                return None
            append((name, value.dtype, tuple(value.tolist())))
        elif isinstance(value, enum.Enum):
            append((name, kind, value))
        else:
            return None
    return tuple(key)


def _cached_metadata(head_args: tuple, meta_args: dict) -> AttentionMetadata:
    """plan_metadata(*head_args, **meta_args), from the plan cache where the same arguments were
    planned before: the layers of one forward step call the op with the same lengths, and modes
    1 and 6 (always with length tensors) would otherwise derive it on every call. The checks of
    plan_metadata are functions of the key, so a hit is a call that passes them; the value checks
    (scales, block table) run on every call after it."""
    key = _metadata_key(head_args, meta_args)
    meta = _plan_cache.get(key) if key is not None else None
    if meta is not None:
        return meta
    meta = plan_metadata(*head_args, **meta_args)
    if key is None:
        return meta
    with _plan_cache_lock:
        while len(_plan_cache) >= PLAN_CACHE_SIZE:
            del _plan_cache[next(iter(_plan_cache))]
        return _plan_cache.setdefault(key, meta)


#: resolve_layouts' results by their arguments (and the mode): a function of them alone, and the
#: op resolves a call's layouts twice (itself, then its plan). Only results are kept (a call that
#: fails runs the rules again, and raises), and only for arguments that are None or exact str: a
#: bounded set, the combinations the rules accept.
_layouts_cache: dict[tuple, Layouts] = {}


def resolved_layouts(layout, layout_q, layout_kv, layout_out, layout_q_descale=None,
                     quant_mode=QuantMode.HIF8_PER_TENSOR) -> Layouts:
    """:func:`resolve_layouts`, remembered (same results, same errors)."""
    mode = check_quant_mode(quant_mode)
    for value in (layout, layout_q, layout_kv, layout_out, layout_q_descale):
        if value is not None and type(value) is not str:
            return resolve_layouts(layout, layout_q, layout_kv, layout_out, layout_q_descale, mode)
    key = (mode, layout, layout_q, layout_kv, layout_out, layout_q_descale)
    layouts = _layouts_cache.get(key)
    if layouts is None:
        layouts = _layouts_cache.setdefault(key, resolve_layouts(layout, layout_q, layout_kv, layout_out,
                                                                 layout_q_descale, mode))
    return layouts


def check_call_tensors(quant_mode, q, k, v, q_descale, k_descale, v_descale, p_scale) -> QuantMode:
    """Static checks of one call's tensors in its mode (types, dtypes; no value read)."""
    mode = check_quant_mode(quant_mode)
    if mode == QuantMode.HIF8_PER_TENSOR:
        check_run_tensors(q, k, v, q_descale, k_descale, v_descale, p_scale)
    else:
        check_scaled_run_tensors(mode, q, k, v, q_descale, k_descale, v_descale, p_scale)
    return mode


def check_call_scales(plan: AttentionPlan, q_descale, k_descale, v_descale, p_scale, *, read_values: bool,
                      block_table=None) -> None:
    """The descales against the plan: their shapes (modes 1 and 6: they follow the layouts and
    lengths) always, and with ``read_values`` their values (a host read; for paged modes 1 and 6
    of the blocks the table names, so its values must have been checked first)."""
    if plan.meta.quant_mode == QuantMode.HIF8_PER_TENSOR:
        if read_values:
            check_scale_values(plan, q_descale, k_descale, v_descale, p_scale)
        return
    check_descale_shapes(plan, q_descale, k_descale, v_descale)
    if read_values:
        check_scaled_values(plan, q_descale, k_descale, v_descale, p_scale, block_table)


#: check_shapes' results by what they are a function of: q, k and v's shapes, the layouts and
#: the mode (its head dims). A hit is shapes that passed, which cannot fail now; a miss runs the
#: rules (and raises). Bounded as the plan cache is (a decode step's new Skv is a new entry).
_shapes_cache: dict[tuple, tuple[dict, dict]] = {}


def _checked_shapes(q, k, v, layout, mode: QuantMode, layout_kv) -> tuple[dict, dict]:
    """check_shapes(q, k, v, layout, HEAD_DIMS[mode], layout_kv, _ALL_LAYOUTS), remembered; the
    sizes it returns are shared between calls: read them, never change them."""
    if type(layout) is not str or type(layout_kv) is not str:
        return check_shapes(q, k, v, layout, HEAD_DIMS[mode], layout_kv, _ALL_LAYOUTS)
    key = (mode, layout, layout_kv, q.shape, k.shape, v.shape)
    sizes = _shapes_cache.get(key)
    if sizes is None:
        sizes = check_shapes(q, k, v, layout, HEAD_DIMS[mode], layout_kv, _ALL_LAYOUTS)
        with _plan_cache_lock:
            while len(_shapes_cache) >= PLAN_CACHE_SIZE:
                del _shapes_cache[next(iter(_shapes_cache))]
            sizes = _shapes_cache.setdefault(key, sizes)
    return sizes


def check_call_devices(q: torch.Tensor, named: dict) -> None:
    """check_devices(q.device, named): on the CPU, where every tensor's device is
    ``device("cpu")``, by ``is_cpu`` (no device object per tensor); anything else, or a tensor
    elsewhere, goes to check_devices, which raises its message."""
    if q.is_cpu:
        for t in named.values():
            if t is not None and (type(t) is not torch.Tensor or not t.is_cpu):
                break
        else:
            return
    check_devices(q.device, named)


def plan_attention(
    q, k, v, q_descale, k_descale, v_descale, quant_mode, *, p_scale=None, layout="BNSD", cu_seqlens_q=None,
    cu_seqlens_kv=None, seqused_q=None, seqused_kv=None, attn_mask=None, mask_mode=0, softmax_scale=None,
    return_softmax_lse=False, block_table=None, sinks=None, win_left=-1, win_right=-1, max_seqlen_q=-1,
    max_seqlen_kv=-1, layout_kv=None, layout_out=None, layout_q_descale=None,
) -> AttentionPlan:
    """Validate one quant_flash_attn call against the spec and derive its plan (metadata + bind).
    HiF8 mode: ``layout_kv`` None is ``layout``; a paged one (``PA_BBND`` / ``PA_BNBD``) needs
    block_table. Modes 1 and 6: ``layout`` is q's, the others their own (see ``resolve_layouts``)."""
    mode = check_call_tensors(quant_mode, q, k, v, q_descale, k_descale, v_descale, p_scale)
    if mode == QuantMode.HIF8_PER_TENSOR:
        layout_kv = layout if layout_kv is None else layout_kv
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    else:
        layouts = resolved_layouts(None, layout, layout_kv, layout_out, layout_q_descale, mode)
        layout, layout_kv, layout_out, layout_q_descale = layouts
        if layout_kv == "PA_NZ":
            raise ValueError("layout_kv PA_NZ must be converted to PA_BNBD before planning "
                             "(qfa.attention.nz_layout.to_bnbd; quant_flash_attn does it)")
    paged = layout_kv in PAGED_LAYOUTS
    if paged:
        check_unsupported(win_left, win_right, sinks=sinks)
    else:
        check_unsupported(win_left, win_right, sinks=sinks, block_table=block_table)
    check_call_devices(q, {"k": k, "v": v, "q_descale": q_descale, "k_descale": k_descale,
                            "v_descale": v_descale, "p_scale": p_scale, "cu_seqlens_q": cu_seqlens_q,
                            "cu_seqlens_kv": cu_seqlens_kv, "seqused_q": seqused_q, "seqused_kv": seqused_kv,
                            "attn_mask": attn_mask, "block_table": block_table})
    if paged:
        qs, ks = _shape_of(q, "q", layout), _paged_shape(k, "k", layout_kv)
    else:
        qs, ks = _checked_shapes(q, k, v, layout, mode, layout_kv)
    packed = layout in PACKED_LAYOUTS
    if (mode is QuantMode.HIF8_PER_TENSOR and layout_kv == layout and not packed
            and layout_q_descale in (None, "BSND") and cu_seqlens_q is None and cu_seqlens_kv is None
            and seqused_q is None and seqused_kv is None):
        plan = _lengthless_plan(q, k, v, qs, ks, layout, mask_mode, max_seqlen_q, max_seqlen_kv, softmax_scale,
                                return_softmax_lse, attn_mask)
    else:
        meta_args = dict(
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, seqused_q=seqused_q, seqused_kv=seqused_kv,
            batch_size=None if packed else qs["b"], max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
            mask_mode=mask_mode, layout=layout, total_q=qs["s"], total_kv=None if paged else ks["s"],
            layout_kv=layout_kv, layout_out=layout_out, layout_q_descale=layout_q_descale,
        )
        meta = _cached_metadata((qs["n"], ks["n"], qs["d"], mode), meta_args)
        plan = bind(meta, q, k, v, softmax_scale=softmax_scale, return_softmax_lse=return_softmax_lse,
                    attn_mask=attn_mask, block_table=block_table)
    if paged and (host_reads_are_free(plan.device) or mode != QuantMode.HIF8_PER_TENSOR):
        # A table changes every decode step: on a device it is read only where the scale checks of
        # modes 1 and 6, which read the blocks it names, synchronise anyway.
        check_block_table_values(plan, block_table)
    check_call_scales(plan, q_descale, k_descale, v_descale, p_scale, read_values=True, block_table=block_table)
    return plan
