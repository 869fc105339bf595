"""MXFP8 (OCP Microscaling v1.0, E4M3 elements): the codec, and quant_mode 1's descale layouts.

A block of 32 consecutive values along one axis shares an E8M0 scale (a power of two, 2^(c - 127)
for the byte c = 0..254, 0xFF = NaN, no zero) and stores each value as an FP8 E4M3 element:

* ``scale = 2^max(floor(log2 amax) - 8, -127)``: 8 is E4M3's largest exponent (448 = 1.75 * 2^8),
  so amax lands in E4M3's top binade. floor(log2 amax) is read from amax's fp32 exponent field,
  never from a float log2 (a value just below 2^k has exponent k - 1). The clamp at -127 is
  Ascend's reference helper; it covers amax = 0 (the smallest scale, 2^-127) and every fp32
  subnormal amax (their exponent is below -126, so the clamp decides).
* ``elements = E4M3(x / scale)``: nearest, ties to even, saturating at +-448; the sign of zero is
  kept. Dividing by a power of two is exact, so no value is rounded twice. amax / scale lies in
  [256, 512), so a block's largest values in [448, 512) * scale become 448 * scale (up to 12.5 %
  off: OCP's choice of the scale, not a rounding step); everything else is within half an E4M3
  step (2^-4 relative, 2^-10 * scale among the subnormals).
* A block holding a NaN or an +-Inf gets the NaN scale (0xFF), the OCP reference's rule
  (microsoft/microxcaling; torchao instead clamps Inf to 448), and NaN elements: it dequantises
  to NaN throughout.

Blocks start at index 0 of the axis; a tail shorter than 32 (D = 72: 8 values) is a block of its
own. fp16 and bf16 inputs are widened to fp32 exactly, so they quantise like the same fp32 values.

Scales are ``torch.float8_e8m0fnu`` tensors (torch 2.13 has the dtype: ``.float()`` decodes
every byte exactly, 0xFF to NaN; its float -> e8m0 cast rounds and drops the sign, and it has no
arithmetic, so the codes here are built as uint8 bits and viewed as the dtype).

Upstream's op reads the scales in pairs (a trailing axis of 2, the count padded to even with
:data:`PAIR_PAD_CODE`); :func:`pack_q_descale`, :func:`pack_k_descale` and
:func:`pack_v_descale` put the per-block scales of :func:`quantize` into the layouts of
``docs/spec/quant-flash-attn.md``, and the ``unpack_*`` functions take them back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

import torch

from qfa.cast.fp8 import (
    E4M3,
    E4M3_NAN_CODE,
    binade,
    check_dtype,
    check_e4m3,
    check_float_input,
    check_output_dtype,
    normalise_axis,
    on_e4m3_grid,
    pow2,
    run,
    with_nan,
)

E8M0: Final = torch.float8_e8m0fnu
#: Values sharing one scale.
BLOCK: Final = 32
#: E4M3's largest exponent (emax): the scale puts amax in [2^8, 2^9).
E4M3_EMAX: Final = 8
#: E8M0 bias; code 0 is 2^-127, the smallest scale (Ascend clamps the exponent here).
E8M0_BIAS: Final = 127
E8M0_NAN_CODE: Final = 0xFF
#: Scales per pair in upstream's descale layouts, and what fills the odd count's last slot:
#: 2^0, harmless in any arithmetic a kernel might do with the padding (there are no elements).
PAIR: Final = 2
PAIR_PAD_CODE: Final = 127
#: Values per pair of scales (two blocks of 32): ceil(D/64) pairs per token, and each
#: sequence's keys rounded up to 64 in v_descale.
VALUES_PER_PAIR: Final = PAIR * BLOCK
#: Tokens per group of PA_NZ's k_descale, channels per group of its v_descale.
NZ_GROUP: Final = 16

Q_DESCALE_LAYOUTS: Final = ("TND", "N2TGD")
KV_LAYOUTS: Final = ("TND", "PA_BBND", "PA_BNBD", "PA_NZ")
#: The axis of v (in each kv layout) along which its 32-key blocks run.
V_KEY_AXIS: Final = {"TND": 0, "PA_BBND": 1, "PA_BNBD": 2, "PA_NZ": 3}


def _check_e8m0(scales, name: str) -> torch.Tensor:
    return check_dtype(scales, name, E8M0)


def _codes(scales: torch.Tensor) -> torch.Tensor:
    return scales.view(torch.uint8)


def _as_e8m0(codes: torch.Tensor) -> torch.Tensor:
    return codes.to(torch.uint8).view(E8M0)


def blocks(n: int) -> int:
    """Scales along an axis of ``n`` values: ceil(n / 32)."""
    return -(-n // BLOCK)


def quantize(x: torch.Tensor, axis: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 quantisation of fp32/fp16/bf16 ``x`` in blocks of 32 along ``axis``.

    Returns ``(elements, scales)``: float8_e4m3fn elements of x's shape and float8_e8m0fnu scales
    of x's shape with ``ceil(n / 32)`` along ``axis``, so that ``x ~= elements * scale`` of each
    element's block (see the module docstring for the rule).
    """
    check_float_input(x, "x")
    if x.ndim == 0:
        raise ValueError("x must have at least one axis, got a 0-D tensor")
    axis = normalise_axis(axis, x.ndim)
    n = x.shape[axis]
    nb = blocks(n)
    x32 = x.to(torch.float32).movedim(axis, -1)
    lead = x32.shape[:-1]
    if x32.numel() == 0:  # an empty axis (e.g. a sequence with no keys) has no blocks
        empty = torch.empty((*lead, nb), dtype=torch.uint8, device=x.device)
        return x.to(E4M3), _as_e8m0(empty.movedim(-1, axis).contiguous())
    # Zero padding (a copy only for a tail block): it changes no block's amax and is cut off below.
    padded = torch.nn.functional.pad(x32, (0, nb * BLOCK - n)) if n % BLOCK else x32
    values, code = run(_blocks, padded.reshape(-1, nb, BLOCK))
    elements = with_nan(values.to(E4M3), (code == E8M0_NAN_CODE).unsqueeze(-1)).reshape(*lead, nb * BLOCK)
    elements = elements[..., :n].movedim(-1, axis).contiguous()
    return elements, _as_e8m0(code.reshape(*lead, nb).movedim(-1, axis).contiguous())


def _blocks(padded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The core for fp32 blocks (R, nb, 32): (element values on the E4M3 grid, E8M0 codes int32
    (R, nb), 0xFF for a block with NaN or Inf)."""
    amax = padded.abs().amax(dim=-1)
    nonfinite = ~torch.isfinite(padded).all(dim=-1)
    # E8M0 code = (floor(log2 amax) - 8) + 127: fp32 shares E8M0's bias, so it is amax's fp32
    # exponent field minus 8, clamped at 0 (exponent -127). Finite codes are <= 254 - 8.
    code = (binade(amax) + E8M0_BIAS - E4M3_EMAX).clamp_min(0)
    code = torch.where(nonfinite, torch.zeros_like(code), code)
    # x / 2^(code - 127) as x * 2^(127 - code): the multiplier is a normal fp32 (code <= 246), and
    # a power-of-two product is exact.
    values = on_e4m3_grid(padded * pow2(E8M0_BIAS - code).unsqueeze(-1))
    return values, torch.where(nonfinite, torch.full_like(code, E8M0_NAN_CODE), code)


def _check_scales_shape(elements: torch.Tensor, scales: torch.Tensor, axis: int, name: str = "scales") -> None:
    want = list(elements.shape)
    want[axis] = blocks(want[axis])
    if list(scales.shape) != want:
        raise ValueError(f"{name} must have shape {tuple(want)} (ceil(n / 32) along axis {axis} of elements "
                         f"{tuple(elements.shape)}), got {tuple(scales.shape)}")


def dequantize(elements: torch.Tensor, scales: torch.Tensor, axis: int = -1,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of MXFP8 ``elements`` (float8_e4m3fn) with their per-32 ``scales``
    (float8_e8m0fnu, ceil(n / 32) along ``axis``), as ``dtype`` (fp32/fp16/bf16/fp64).

    The products are exact in fp32 and float64 unless they overflow fp32 (448 * 2^127 is past
    its range: +-Inf); fp16 and bf16 round the exact product to nearest even. A NaN scale or a
    NaN element gives NaN.
    """
    check_e4m3(elements, "elements")
    _check_e8m0(scales, "scales")
    if elements.ndim == 0:
        raise ValueError("elements must have at least one axis, got a 0-D tensor")
    axis = normalise_axis(axis, elements.ndim)
    _check_scales_shape(elements, scales, axis)
    check_output_dtype(dtype)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    n = elements.shape[axis]
    per_element = scales.to(work).repeat_interleave(BLOCK, dim=axis).narrow(axis, 0, n)
    return (elements.to(work) * per_element).to(dtype)


# --- Upstream's paired descale layouts -------------------------------------------------------


def pair_scales(scales: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """Scales in pairs: ``axis`` padded to an even count with :data:`PAIR_PAD_CODE`, split into
    (count / 2, 2), the 2 moved to a new last axis. (.., 3) -> (.., 2, 2) along the last axis."""
    _check_e8m0(scales, "scales")
    axis = normalise_axis(axis, scales.ndim)
    codes = _codes(scales).movedim(axis, -1)
    count = codes.shape[-1]
    codes = torch.nn.functional.pad(codes, (0, count % PAIR), value=PAIR_PAD_CODE)
    paired = codes.reshape(*codes.shape[:-1], -1, PAIR).movedim(-2, axis)
    return _as_e8m0(paired.contiguous())


def unpair_scales(paired: torch.Tensor, count: int, axis: int = -1) -> torch.Tensor:
    """The inverse of :func:`pair_scales`: ``paired`` has a last axis of 2 and its pairs along
    ``axis`` (counted without that last axis); returns ``count`` scales along ``axis``."""
    _check_e8m0(paired, "paired")
    if paired.ndim < 2 or paired.shape[-1] != PAIR:
        raise ValueError(f"paired must have a last axis of {PAIR}, got shape {tuple(paired.shape)}")
    axis = normalise_axis(axis, paired.ndim - 1)
    pairs = paired.shape[axis]
    if isinstance(count, bool) or not isinstance(count, int) or not 2 * pairs - 1 <= count <= 2 * pairs:
        raise ValueError(f"count must be {2 * pairs - 1} or {2 * pairs} for {pairs} pairs along axis {axis}, got {count!r}")
    codes = _codes(paired).movedim(axis, -2)
    codes = codes.reshape(*codes.shape[:-2], 2 * pairs)[..., :count]
    return _as_e8m0(codes.movedim(-1, axis).contiguous())


def _check_layout(layout, name: str, allowed: tuple[str, ...]) -> str:
    if layout not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {layout!r}")
    return layout


def _check_ndim(t: torch.Tensor, name: str, ndim: int, what: str) -> None:
    if t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D {what}, got shape {tuple(t.shape)}")


def _check_divisible(value: int, by: int, name: str, what: str) -> None:
    if value % by:
        raise ValueError(f"{name}: {what} must be a multiple of {by}, got {value}")


def pack_q_descale(scales: torch.Tensor, layout: str = "TND", *, num_heads_kv: int | None = None) -> torch.Tensor:
    """q_descale in upstream's layout from ``scales`` = ``quantize(q, -1)[1]`` of q (Q_T, Q_N, D):
    TND (Q_T, Q_N, ceil(D/64), 2), or N2TGD (KV_N, Q_T, G, ceil(D/64), 2) with Q_N = KV_N * G
    (q head h = n * G + g, the GQA grouping)."""
    _check_e8m0(scales, "scales")
    _check_layout(layout, "layout", Q_DESCALE_LAYOUTS)
    _check_ndim(scales, "scales", 3, "(Q_T, Q_N, ceil(D/32))")
    if layout == "N2TGD":
        scales = scales.unflatten(1, (_group_split(scales.shape[1], num_heads_kv), -1)).transpose(0, 1)
    return pair_scales(scales, -1)


def _group_split(heads_q: int, num_heads_kv) -> int:
    if isinstance(num_heads_kv, bool) or not isinstance(num_heads_kv, int) or num_heads_kv <= 0:
        raise ValueError(f"num_heads_kv must be a positive int for layout N2TGD, got {num_heads_kv!r}")
    if heads_q % num_heads_kv:
        raise ValueError(f"num_heads_kv must divide Q_N = {heads_q}, got {num_heads_kv}")
    return num_heads_kv


def unpack_q_descale(descale: torch.Tensor, head_dim: int, layout: str = "TND") -> torch.Tensor:
    """The inverse of :func:`pack_q_descale`: (Q_T, Q_N, ceil(D/32)) scales."""
    if (isinstance(descale, torch.Tensor) and descale.dtype == E8M0 and descale.ndim == 4 and layout == "TND"
            and type(head_dim) is int and head_dim > 0 and head_dim % VALUES_PER_PAIR == 0
            and descale.shape[3] == PAIR and descale.shape[2] == head_dim // VALUES_PER_PAIR
            and descale.is_contiguous()):
        # The per-call case (the op's TND q at D = 64 / 128 / 256): no pad slot to drop, so the
        # general path's result is a view of these bytes, with the strides this view gets.
        return descale.view(descale.shape[0], descale.shape[1], 2 * descale.shape[2])
    return _unpack_q_descale(descale, head_dim, layout)


def _unpack_q_descale(descale: torch.Tensor, head_dim: int, layout: str) -> torch.Tensor:
    """:func:`unpack_q_descale` for every input (its shortcut's results are this one's)."""
    _check_e8m0(descale, "descale")
    _check_layout(layout, "layout", Q_DESCALE_LAYOUTS)
    _check_ndim(descale, "descale", 4 if layout == "TND" else 5, f"q_descale in layout {layout}")
    scales = unpair_scales(descale, _count(head_dim, descale.shape[-2]), -1)
    if layout == "N2TGD":
        scales = scales.transpose(0, 1).flatten(1, 2)
    return scales.contiguous()


def _count(n: int, pairs: int, name: str = "head_dim") -> int:
    """ceil(n / 32), checked against the number of pairs stored for it."""
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"{name} must be a positive int, got {n!r}")
    if math.ceil(n / VALUES_PER_PAIR) != pairs:
        raise ValueError(f"{name} {n} needs {math.ceil(n / VALUES_PER_PAIR)} scale pairs, the descale holds {pairs}")
    return blocks(n)


def pack_k_descale(scales: torch.Tensor, layout_kv: str = "TND") -> torch.Tensor:
    """k_descale in upstream's layout from ``scales`` = ``quantize(k, -1)[1]`` of k in
    ``layout_kv``: TND (KV_T, KV_N, ceil(D/64), 2); PA_BBND (Bn, Bs, KV_N, ceil(D/64), 2);
    PA_BNBD (Bn, KV_N, Bs, ceil(D/64), 2); PA_NZ, where k is (Bn, KV_N, D/32, Bs, 32) and its
    scales (Bn, KV_N, D/32, Bs, 1): (Bn, KV_N, Bs/16, D/64, 16, 2)."""
    _check_e8m0(scales, "scales")
    _check_layout(layout_kv, "layout_kv", KV_LAYOUTS)
    if layout_kv != "PA_NZ":
        _check_ndim(scales, "scales", 3 if layout_kv == "TND" else 4, f"k scales in layout {layout_kv}")
        return pair_scales(scales, -1)
    _check_ndim(scales, "scales", 5, "k scales in layout PA_NZ (Bn, KV_N, D/32, Bs, 1)")
    bn, n, groups, bs, one = scales.shape
    if one != 1:
        raise ValueError(f"scales of PA_NZ k must have a last axis of 1 (32 channels), got shape {tuple(scales.shape)}")
    _check_divisible(bs, NZ_GROUP, "scales", "the block size Bs")
    # (Bn, KV_N, Bs/16, 16, D/32) -> pairs of channel blocks -> (Bn, KV_N, Bs/16, D/64, 16, 2).
    per_token = scales.squeeze(-1).transpose(2, 3).unflatten(2, (bs // NZ_GROUP, NZ_GROUP))
    return pair_scales(per_token, -1).transpose(3, 4).contiguous()


def unpack_k_descale(descale: torch.Tensor, head_dim: int, layout_kv: str = "TND") -> torch.Tensor:
    """The inverse of :func:`pack_k_descale`: the scales ``quantize(k, -1)`` gives in ``layout_kv``."""
    _check_e8m0(descale, "descale")
    _check_layout(layout_kv, "layout_kv", KV_LAYOUTS)
    if layout_kv != "PA_NZ":
        _check_ndim(descale, "descale", 4 if layout_kv == "TND" else 5, f"k_descale in layout {layout_kv}")
        return unpair_scales(descale, _count(head_dim, descale.shape[-2]), -1)
    _check_ndim(descale, "descale", 6, "k_descale in layout PA_NZ (Bn, KV_N, Bs/16, D/64, 16, 2)")
    count = _count(head_dim, descale.shape[3])
    per_token = unpair_scales(descale.transpose(3, 4), count, -1)  # (Bn, KV_N, Bs/16, 16, D/32)
    return per_token.flatten(2, 3).transpose(2, 3).unsqueeze(-1).contiguous()


def pack_v_descale(scales: torch.Tensor | Sequence[torch.Tensor], layout_kv: str = "TND") -> torch.Tensor:
    """v_descale in upstream's layout: per channel, one scale per 32 keys of a sequence.

    ``scales``: TND: one tensor per sequence b, ``quantize(v_b, 0)[1]`` of its keys v_b
    (kv_len_b, KV_N, D), i.e. (ceil(kv_len_b/32), KV_N, D); each is padded to an even count (the
    sequence's keys rounded up to 64) and they are stacked: (sum_b ceil(kv_len_b/64), KV_N, D, 2).
    Paged: ``quantize(v, V_KEY_AXIS[layout_kv])[1]`` of the whole cache (Bs a multiple of 64):
    PA_BBND (Bn, Bs/32, KV_N, D) -> (Bn, Bs/64, KV_N, D, 2); PA_BNBD (Bn, KV_N, Bs/32, D) ->
    (Bn, KV_N, Bs/64, D, 2); PA_NZ (Bn, KV_N, D/32, Bs/32, 32) -> (Bn, KV_N, D/16, Bs/64, 16, 2).
    """
    _check_layout(layout_kv, "layout_kv", KV_LAYOUTS)
    if layout_kv == "TND":
        if isinstance(scales, torch.Tensor) or not isinstance(scales, Sequence) or not scales:
            raise TypeError(f"scales must be a non-empty sequence of per-sequence tensors for layout TND, "
                            f"got {type(scales).__name__}")
        for b, s in enumerate(scales):
            _check_e8m0(s, f"scales[{b}]")
            _check_ndim(s, f"scales[{b}]", 3, "(ceil(kv_len/32), KV_N, D)")
            if s.shape[1:] != scales[0].shape[1:] or s.device != scales[0].device:
                raise ValueError(f"scales[{b}] must be (ceil(kv_len/32), KV_N, D) with scales[0]'s (KV_N, D) = "
                                 f"{tuple(scales[0].shape[1:])} on {scales[0].device}, got {tuple(s.shape)} on "
                                 f"{s.device}")
        return torch.cat([pair_scales(s, 0) for s in scales], dim=0)
    _check_e8m0(scales, "scales")
    key_axis = V_KEY_AXIS[layout_kv]
    if layout_kv != "PA_NZ":
        _check_ndim(scales, "scales", 4, f"v scales in layout {layout_kv}")
        _check_divisible(scales.shape[key_axis], PAIR, "scales", "the number of 32-key blocks per paged block")
        return pair_scales(scales, key_axis)
    _check_ndim(scales, "scales", 5, "v scales in layout PA_NZ (Bn, KV_N, D/32, Bs/32, 32)")
    bn, n, d32, bs32, width = scales.shape
    _check_divisible(bs32, PAIR, "scales", "the number of 32-key blocks per paged block")
    # (Bn, KV_N, Bs/32, D) -> pairs of key blocks (Bn, KV_N, Bs/64, D, 2) -> channels in 16s.
    per_channel = scales.permute(0, 1, 3, 2, 4).reshape(bn, n, bs32, d32 * width)
    paired = pair_scales(per_channel, 2).unflatten(3, (d32 * width // NZ_GROUP, NZ_GROUP))
    return paired.transpose(2, 3).contiguous()


def unpack_v_descale(descale: torch.Tensor, layout_kv: str = "TND", *,
                     kv_lens: Sequence[int] | None = None) -> torch.Tensor | list[torch.Tensor]:
    """The inverse of :func:`pack_v_descale`. TND needs ``kv_lens`` (each sequence's key count)
    and returns the list of per-sequence (ceil(kv_len_b/32), KV_N, D) scales; paged layouts
    return the scales ``quantize(v, V_KEY_AXIS[layout_kv])`` gives."""
    _check_e8m0(descale, "descale")
    _check_layout(layout_kv, "layout_kv", KV_LAYOUTS)
    if layout_kv == "TND":
        _check_ndim(descale, "descale", 4, "v_descale in layout TND (sum ceil(kv_len/64), KV_N, D, 2)")
        if kv_lens is None or isinstance(kv_lens, torch.Tensor) and kv_lens.ndim != 1:
            raise ValueError("kv_lens must be given (one key count per sequence) for layout TND")
        lens = [int(n) for n in kv_lens]
        if any(n < 0 for n in lens):
            raise ValueError(f"kv_lens must be key counts >= 0, got {lens}")
        pairs = [math.ceil(n / VALUES_PER_PAIR) for n in lens]
        if sum(pairs) != descale.shape[0]:
            raise ValueError(f"kv_lens {lens} need {sum(pairs)} rows of scale pairs, v_descale has {descale.shape[0]}")
        out, row = [], 0
        for n, p in zip(lens, pairs):
            out.append(unpair_scales(descale[row : row + p], blocks(n), 0) if p else
                       _as_e8m0(torch.empty((0, *descale.shape[1:3]), dtype=torch.uint8, device=descale.device)))
            row += p
        return out
    if layout_kv != "PA_NZ":
        _check_ndim(descale, "descale", 5, f"v_descale in layout {layout_kv}")
        axis = V_KEY_AXIS[layout_kv]
        return unpair_scales(descale, 2 * descale.shape[axis], axis)
    _check_ndim(descale, "descale", 6, "v_descale in layout PA_NZ (Bn, KV_N, D/16, Bs/64, 16, 2)")
    bn, n, d16, bs64, width, _ = descale.shape
    _check_divisible(d16 * width, BLOCK, "descale", "the head size D")
    per_channel = unpair_scales(descale.transpose(2, 3).flatten(3, 4), 2 * bs64, 2)  # (Bn, KV_N, Bs/32, D)
    return per_channel.unflatten(3, (-1, BLOCK)).permute(0, 1, 3, 2, 4).contiguous()


__all__ = [
    "BLOCK", "E8M0", "E8M0_BIAS", "E8M0_NAN_CODE", "E4M3_NAN_CODE", "KV_LAYOUTS", "PAIR_PAD_CODE",
    "Q_DESCALE_LAYOUTS", "V_KEY_AXIS", "blocks", "dequantize", "pack_k_descale", "pack_q_descale",
    "pack_v_descale", "pair_scales", "quantize", "unpack_k_descale", "unpack_q_descale",
    "unpack_v_descale", "unpair_scales",
]
