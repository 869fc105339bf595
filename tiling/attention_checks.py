"""The HiF8 mode's argument rules, for the plan (``qfa.tiling.attention``) and the drop-in.

Each check names the argument, what was expected and what was given (``TypeError`` for a type or
dtype, ``ValueError`` for a value or shape). Static checks read no tensor value; the value
checks (``check_scale_values``, ``check_block_table_values``) are host reads, done where that
costs no device synchronisation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch

from qfa.cast import format as fmt
from qfa.tiling.checks import check_codes, check_device, check_scalar_fp32, require_tensor
from qfa.tiling.spec import HEAD_DIM, HEAD_DIMS, LEGACY_QUANT_MODES, MaskMode, QuantMode, default_softmax_scale

if TYPE_CHECKING:
    from qfa.tiling.attention import AttentionMetadata, AttentionPlan

LAYOUTS = ("BNSD", "BSND", "TND")
#: Paged K/V layouts (with block_table): PA_BBND (blocks, block_size, Nkv, D), PA_BNBD
#: (blocks, Nkv, block_size, D). Their (block, position-in-block, head, dim) axes:
PAGED_LAYOUTS = ("PA_BBND", "PA_BNBD")
_PAGED_AXES = {"PA_BBND": {"blk": 0, "s": 1, "n": 2, "d": 3}, "PA_BNBD": {"blk": 0, "n": 1, "s": 2, "d": 3}}
#: Paged block sizes: multiples of PAGE_MULTIPLE up to MAX_PAGE (vLLM uses 16 by default).
PAGE_MULTIPLE = 16
MAX_PAGE = 1024
#: Modes 1 and 6 take upstream's block sizes only: MXFP8's v scales pair 32-key groups per block.
SCALED_PAGE_SIZES = {QuantMode.MXFP8: (64, 128, 256, 512, 1024), QuantMode.FP8_PER_TOKEN_HEAD: (128,)}
#: ``layout_q_descale`` of the HiF8 mode: a per-tensor scale has no layout; upstream names it so.
Q_DESCALE_LAYOUTS = ("BSND",)
MASK_MODES = {MaskMode.NONE: "none", MaskMode.CAUSAL: "causal (bottom-right aligned)"}
CAUSAL_MASK_SHAPE = (2048, 2048)
MAX_HEADS = 256
MAX_GROUP = 64
MAX_BATCH = 65535
FP32_MAX = torch.finfo(torch.float32).max
#: Valid p_scale: HiF8's normal binades, [2^-15, 2^15].
P_SCALE_RANGE = (fmt.MIN_NORMAL, fmt.MAX)
#: |Q . K| of two HiF8 vectors is at most D * 32768^2 = 2^37; dScale beyond this overflows.
MAX_DSCALE = FP32_MAX / (HEAD_DIM * fmt.MAX**2)
#: HiF8(P) <= P_OVERSHOOT * P: rounding up by half a step of the 1-mantissa-bit binades.
P8_OVERSHOOT = 1.25

# Positions of (batch, seq, head, dim) in each layout's shape; TND has no batch axis.
_AXES = {"BNSD": {"b": 0, "n": 1, "s": 2, "d": 3}, "BSND": {"b": 0, "s": 1, "n": 2, "d": 3}, "TND": {"s": 0, "n": 1, "d": 2},
         "NTD": {"n": 0, "s": 1, "d": 2}}
#: Each layout's axis names in the order of its shape.
_AXIS_NAMES = {layout: tuple(sorted(axes, key=axes.__getitem__)) for layout, axes in _AXES.items()}
#: Layouts whose token axis packs every sequence (cu_seqlens gives the segments; no batch axis).
PACKED_LAYOUTS = ("TND", "NTD")
#: Arguments that upstream has and this mode does not support yet: (name, value meaning "unused").
_UNSUPPORTED = {
    "block_table": "paged KV needs layout_kv 'PA_BBND' or 'PA_BNBD' (and seqused_kv); got a contiguous layout_kv",
    "sinks": "attention sinks are not supported (upstream rejects them too)",
}


# Value -> member lookups for the checks below (called several times per op call: an enum's
# constructor and a set built per call cost more than the rest of the check).
_QUANT_MODES = {**{m.value: m for m in QuantMode}, **LEGACY_QUANT_MODES}
_MASK_MODES = {m.value: m for m in MASK_MODES}


def check_quant_mode(quant_mode) -> QuantMode:
    """The mode, from 0 / 1 / 6, a ``QuantMode``, or the legacy 7 (HiF8 per-tensor)."""
    if isinstance(quant_mode, bool) or not isinstance(quant_mode, int):
        raise TypeError(f"quant_mode must be an int or qfa's QuantMode, got {type(quant_mode).__name__} {quant_mode!r}")
    mode = _QUANT_MODES.get(quant_mode)
    if mode is None:
        raise ValueError(f"quant_mode must be 0 (HiF8 per-tensor; 7 is its older number), 1 (MXFP8) or 6 (FP8 "
                         f"per-token-head), got {quant_mode!r}")
    return mode


def check_mask_mode(mask_mode) -> MaskMode:
    if isinstance(mask_mode, bool) or not isinstance(mask_mode, int):
        raise TypeError(f"mask_mode must be an int (0 none, 3 causal), got {type(mask_mode).__name__} {mask_mode!r}")
    mode = _MASK_MODES.get(mask_mode)
    if mode is None:
        raise ValueError(f"mask_mode must be 0 (none) or 3 (causal), got {mask_mode!r}")
    return mode


class Layouts(NamedTuple):
    """The per-operand layouts of one call, resolved and checked."""

    q: str
    kv: str
    out: str
    q_descale: str


#: Modes 1 and 6: the layouts each operand may have (the first is the default), from
#: ``docs/spec/quant-flash-attn.md``. MXFP8's PA_NZ is converted to PA_BNBD before planning
#: (``qfa.attention.nz_layout``): the plan and the backends never see it.
SCALED_MODE_LAYOUTS = {
    QuantMode.MXFP8: Layouts(q=("TND",), kv=("TND", "PA_BBND", "PA_BNBD", "PA_NZ"), out=("TND",),
                             q_descale=("TND", "N2TGD")),
    QuantMode.FP8_PER_TOKEN_HEAD: Layouts(q=("NTD",), kv=("PA_BNBD",), out=("TND",), q_descale=("NT",)),
}


def resolve_layouts(layout, layout_q, layout_kv, layout_out, layout_q_descale=None,
                    quant_mode=QuantMode.HIF8_PER_TENSOR) -> Layouts:
    """The per-operand layouts of a call in ``quant_mode``.

    HiF8 (mode 0): ``layout`` is shorthand for all three per-operand layouts; an operand layout
    left None is qfa's default ``"BNSD"``. q and out share one layout; k and v have it too, or a
    paged one (``PA_BBND`` / ``PA_BNBD``, with ``block_table``); ``layout_q_descale`` is
    ``"BSND"`` (or None). Modes 1 and 6: each operand takes the layouts of
    :data:`SCALED_MODE_LAYOUTS`, unset ones its first; ``layout`` sets q, kv and out where the
    mode allows one layout for all three (MXFP8's ``"TND"``).
    """
    mode = check_quant_mode(quant_mode)
    if mode != QuantMode.HIF8_PER_TENSOR:
        return _resolve_scaled_layouts(mode, layout, layout_q, layout_kv, layout_out, layout_q_descale)
    if layout_q is None and layout_kv is None and layout_out is None and layout_q_descale is None:
        # The usual call (``layout`` alone, or nothing): what the rules below give it.
        resolved = _HIF8_LAYOUTS.get(layout) if layout is None or type(layout) is str else None
        if resolved is not None:
            return resolved
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
    if layout_q_descale not in Q_DESCALE_LAYOUTS + (None,):
        raise ValueError(f"layout_q_descale must be 'BSND' in the HiF8 mode (a per-tensor descale), "
                         f"got {layout_q_descale!r}")
    return Layouts(q=chosen, kv=kv, out=chosen, q_descale="BSND")


_HIF8_LAYOUTS = {None: Layouts("BNSD", "BNSD", "BNSD", "BSND"),
                 **{name: Layouts(name, name, name, "BSND") for name in LAYOUTS}}


def _resolve_scaled_layouts(mode: QuantMode, layout, layout_q, layout_kv, layout_out, layout_q_descale) -> Layouts:
    allowed = SCALED_MODE_LAYOUTS[mode]
    given = Layouts(q=layout_q, kv=layout_kv, out=layout_out, q_descale=layout_q_descale)
    if layout is not None:
        if not (layout in allowed.q and layout in allowed.kv and layout in allowed.out):
            raise ValueError(f"layout={layout!r} sets layout_q, layout_kv and layout_out, but in quant_mode "
                             f"{int(mode)} ({mode.name}) they are q {allowed.q}, kv {allowed.kv}, out {allowed.out}: "
                             f"pass them one by one")
        clash = {f"layout_{n}": v for n, v in given._asdict().items() if n in ("q", "out") and v not in (None, layout)}
        if clash:
            raise ValueError(f"layout={layout!r} sets layout_q, layout_kv and layout_out; it contradicts {clash}")
        given = given._replace(q=layout, out=layout, kv=layout if layout_kv is None else layout_kv)
    chosen = {}
    for name, value in given._asdict().items():
        options = getattr(allowed, name)
        if value is not None and value not in options:
            raise ValueError(f"layout_{name} must be one of {options} in quant_mode {int(mode)} ({mode.name}), "
                             f"got {value!r}")
        chosen[name] = options[0] if value is None else value
    return Layouts(**chosen)


def check_softmax_scale(softmax_scale, head_dim: int = HEAD_DIM) -> float:
    if softmax_scale is None:
        return default_softmax_scale(head_dim)
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
            raise ValueError(f"{name} must be -1: sliding windows are not supported, got {value!r}")


def _shape_of(t: torch.Tensor, name: str, layout: str) -> dict[str, int]:
    names = _AXIS_NAMES[layout]
    shape = t.shape
    if len(shape) != len(names):
        raise ValueError(f"{name} must be {len(names)}-D for layout {layout} ({layout}), got shape {tuple(shape)}")
    return dict(zip(names, shape))


def lse_shape(q_shape, layout: str) -> tuple[int, ...]:
    """Shape of the fp32 LSE for a q of ``q_shape`` in ``layout``: (B, Nq, Sq), or (Nq, Tq) for TND.
    The one place this is known: the plan, the backends and the fake kernels all ask here."""
    axes = _AXES[layout]
    if layout in PACKED_LAYOUTS:
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


def check_heads(nq: int, nkv: int, names: tuple[str, str] | None = None) -> None:
    """GQA head counts. ``names``: the caller's arguments holding them (None: the tensors' head
    dimensions, q's and k/v's)."""
    q_name, kv_name = names or ("head count of q", "head count of k/v")
    for n, name in ((nq, q_name), (nkv, kv_name)):
        if not 1 <= n <= MAX_HEADS:
            raise ValueError(f"{name} must be in [1, {MAX_HEADS}], got {n}")
    if nq < nkv or nq % nkv:
        if names is None:
            raise ValueError(f"q heads must be a multiple of k/v heads (GQA), got Nq={nq}, Nkv={nkv}")
        raise ValueError(f"{q_name} must be a multiple of {kv_name} (GQA), got {q_name}={nq}, {kv_name}={nkv}")
    if nq // nkv > MAX_GROUP:
        group = "Nq/Nkv" if names is None else f"{q_name} / {kv_name}"
        raise ValueError(f"GQA group {group} must be <= {MAX_GROUP}, got {nq // nkv}")


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str,
                 head_dims: tuple[int, ...] = (HEAD_DIM,), layout_kv: str | None = None,
                 layouts: tuple[str, ...] = LAYOUTS) -> tuple[dict, dict]:
    """The op's static shape rules: rank per layout, D = 128, k and v alike, head counts, GQA,
    one batch size. Shared with the drop-in, which checks float q/k/v before quantising them.
    Returns q's and k's sizes by axis name (``b``, ``n``, ``s``, ``d``)."""
    if layout not in layouts:
        raise ValueError(f"layout must be one of {layouts}, got {layout!r}")
    layout_kv = layout if layout_kv is None else layout_kv
    qs, ks, vs = _shape_of(q, "q", layout), _shape_of(k, "k", layout_kv), _shape_of(v, "v", layout_kv)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    _check_head_dims(head_dims, (qs, "q"), (ks, "k"), (vs, "v"))
    check_heads(qs["n"], ks["n"])
    if layout not in PACKED_LAYOUTS:
        for shape, name in ((ks, "k"), (vs, "v")):
            if shape["b"] != qs["b"]:
                raise ValueError(f"batch size of {name} must equal q's ({qs['b']}), got {shape['b']}")
    return qs, ks


def _check_head_dims(head_dims: tuple[int, ...], *shapes) -> None:
    """Each operand's D in the mode's ``head_dims``, and all equal to the first's (q's)."""
    for shape, name in shapes:
        if shape["d"] not in head_dims:
            expected = head_dims[0] if len(head_dims) == 1 else f"one of {head_dims}"
            raise ValueError(f"head dim D of {name} must be {expected}, got {shape['d']}")
    first, first_name = shapes[0]
    for shape, name in shapes[1:]:
        if shape["d"] != first["d"]:
            raise ValueError(f"head dim D of {name} must equal {first_name}'s ({first['d']}), got {shape['d']}")


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
        if t is not None:
            check_device(t, name, device)


def check_run_tensors(q, k, v, q_descale, k_descale, v_descale, p_scale) -> None:
    """Static checks of one call's tensors (types, dtypes, shapes of the scales): no value read."""
    operands = ((q, "q"), (k, "k"), (v, "v"))
    for t, name in operands:
        require_tensor(t, name)
    for t, name in operands:
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


def check_scale_values(plan: AttentionPlan, q_descale, k_descale, v_descale, p_scale) -> None:
    """The scales' values against the ranges the numerics handle (a host read of up to 4 floats:
    one synchronisation on a device; on the CPU, where reads are free, one read per scale).

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
    scales = (q_descale, k_descale, v_descale) if p_scale is None else (q_descale, k_descale, v_descale, p_scale)
    if host_reads_are_free(plan.device):  # one read each: cheaper than the concatenation on the CPU
        read = [t.tolist()[0] for t in scales]
    else:  # one synchronisation for all four
        read = torch.cat(scales).tolist()
    check_scale_floats(plan, read[0], read[1], read[2], read[3] if p_scale is not None else 1.0)


def check_scale_floats(plan: AttentionPlan, q: float, k: float, v: float, p: float = 1.0) -> None:
    """:func:`check_scale_values` on the scales' values (q, k and v descale, p_scale)."""
    for name, value in (("q_descale", q), ("k_descale", k), ("v_descale", v)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite value > 0, got {value:g}")
    if not (math.isfinite(p) and P_SCALE_RANGE[0] <= p <= P_SCALE_RANGE[1]):
        raise ValueError(f"p_scale must be in [2^-15, 2^15] = [{P_SCALE_RANGE[0]:g}, {P_SCALE_RANGE[1]:g}] (HiF8's "
                         f"normal binades: P lies in (0, p_scale]), got {p:g}")
    dscale = plan.softmax_scale * q * k
    if dscale > MAX_DSCALE:
        raise ValueError(f"softmax_scale * q_descale * k_descale must be <= {MAX_DSCALE:.3g} (beyond it the scaled "
                         f"HiF8 scores overflow fp32), got {dscale:.3g} = {plan.softmax_scale:g} * {q:g} * {k:g}")
    if dscale == 0:
        raise ValueError(f"softmax_scale * q_descale * k_descale underflows to 0 ({plan.softmax_scale:g} * {q:g} * "
                         f"{k:g})")
    max_kv = max(plan.kv_lens, default=0)
    max_v = FP32_MAX / (P8_OVERSHOOT * fmt.MAX * max(max_kv, 1) * p)
    if v > max_v:
        raise ValueError(f"v_descale must be <= {max_v:.3g} for this call (FLT_MAX / (1.25 * 32768 * max Skv "
                         f"{max_kv} * p_scale {p:g}): beyond it P @ V * v_descale can overflow fp32), got {v:g}")


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


def check_paged_strides(t: torch.Tensor, name: str) -> None:
    """Paged k / v may have any strides (along the blocks too) except a zero one: its blocks (or
    heads, or positions) would alias one another, which no cache layout does."""
    if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
        raise ValueError(f"{name} must not have a zero stride in a paged layout (its blocks would alias one "
                         f"another), got strides {tuple(t.stride())} for shape {tuple(t.shape)}")


def _check_paged(meta: AttentionMetadata, q, k, v, block_table, qs: dict, batch: int) -> tuple[dict, int]:
    """Shapes of paged k/v and of the block table; returns k's sizes and the table width."""
    ks = _paged_shape(k, "k", meta.layout_kv)
    _paged_shape(v, "v", meta.layout_kv)
    for t, name in ((k, "k"), (v, "v")):
        check_paged_strides(t, name)
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    _check_head_dims(HEAD_DIMS[meta.quant_mode], (qs, "q"), (ks, "k"))
    check_heads(qs["n"], ks["n"])
    page = ks["s"]
    if meta.quant_mode in SCALED_PAGE_SIZES:
        if page not in SCALED_PAGE_SIZES[meta.quant_mode]:
            raise ValueError(f"block size of paged k/v must be one of {SCALED_PAGE_SIZES[meta.quant_mode]} in "
                             f"quant_mode {int(meta.quant_mode)} ({meta.quant_mode.name}), got {page}")
    elif not (0 < page <= MAX_PAGE and page % PAGE_MULTIPLE == 0):
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


def check_block_table_values(plan: AttentionPlan, block_table: torch.Tensor) -> None:
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
