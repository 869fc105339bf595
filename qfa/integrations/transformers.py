"""HiF8 attention inside Hugging Face transformers models.

::

    import qfa.integrations.transformers as qfa_hf

    qfa_hf.register()                                   # "qfa_hif8"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="qfa_hif8")
    # or, on a loaded model:
    model.set_attn_implementation("qfa_hif8")

:func:`register` adds an attention function to transformers' ``AttentionInterface`` and a
matching mask function to ``AttentionMaskInterface`` under one name. The mask function does not
build a dense 4D mask: for causal attention it hands the attention function ``None`` (no padding)
or a 2D boolean key-validity mask that ends at the last query's position. The attention function
then calls :func:`qfa.hif8_attention`:

- no padding: one BNSD call, ``is_causal`` aligned bottom-right, which is what both a causal
  prefill (Sq == Skv) and a continuation / decode step on a KV cache (Sq < Skv) need;
- padding (left or right, with or without a cache): the valid tokens are gathered into the TND
  layout with per-sequence ``cu_seqlens`` (padding tokens take no part, not even in the
  per-tensor scales), attention runs on that, and the outputs are scattered back; padded query
  rows get zeros.

Everything else (sliding windows, packed sequences, custom mask overlays, bidirectional masks,
head_dim != 128) is not something the HiF8 op computes: those calls raise a clear error, or go
to transformers' ``sdpa`` when registered with ``fallback="sdpa"``.

The same plumbing takes any attention function with :func:`qfa.hif8_attention`'s calling
convention (``attention_fn=``): :func:`register_fp8_e4m3` registers a per-tensor FP8 E4M3
emulation this way, so both are compared through identical code in ``qfa eval-ppl``, and
:func:`register_mxfp8` / :func:`register_fp8` the drop-in's other formats (``qfa_mxfp8``,
``qfa_fp8``: :func:`qfa.mxfp8_attention`, :func:`qfa.fp8_attention`).

transformers is an optional dependency (``pip install 'qfa[transformers]'``); it is imported
inside :func:`register`, not when this module is imported.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from qfa.dropin import calibration as cal
from qfa.dropin import inputs as dropin_inputs
from qfa.serving.attention import cached_attention, hif8_cache_of
from qfa.tiling.checks import check_bool
from qfa.tiling.attention import HEAD_DIM  # the op's only head size

FALLBACKS = (None, "sdpa")

__all__ = ["register", "register_fp8", "register_fp8_e4m3", "register_mxfp8", "fp8_e4m3_adapter",
           "make_attention_function", "qfa_mask"]


# --------------------------------------------------------------------------------------------
# mask function (AttentionMaskInterface)
# --------------------------------------------------------------------------------------------


def _as_int(x) -> int:
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def qfa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
):
    """Mask function registered with ``AttentionMaskInterface``.

    Causal attention (transformers' ``causal_mask_function``) gives ``None`` when no key is
    masked, else a 2D bool (B, L) key-validity mask over the key window ``[kv_offset,
    q_offset + q_length)``: L ends at the last query's position, so a key beyond it (the unused
    tail of a static cache) is invalid, and the queries are the last ``q_length`` columns.
    Any other pattern (sliding window, packed sequences, overlays, bidirectional) gets the dense
    4D boolean mask transformers builds for sdpa; the attention function sends that to sdpa when
    a fallback was asked for, and raises otherwise.
    """
    from transformers import masking_utils as mu

    if mask_function is not mu.causal_mask_function:
        kwargs.pop("allow_is_causal_skip", None)
        kwargs.pop("allow_is_bidirectional_skip", None)
        return mu.sdpa_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
            kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
            allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kwargs,
        )
    end = _as_int(q_offset) + q_length  # one past the last query's position
    length = end - kv_offset
    if attention_mask is None:
        if length == kv_length:
            return None
        device = kwargs.get("device", "cpu")
        return torch.ones(batch_size, length, dtype=torch.bool, device=device)
    mask = attention_mask.to(torch.bool)
    if mask.shape[-1] < end:  # e.g. a static cache: the 2D mask covers only the tokens seen
        mask = torch.nn.functional.pad(mask, (0, end - mask.shape[-1]), value=False)
    mask = mask[:, kv_offset:end]
    if length == kv_length and bool(mask.all()):
        return None
    return mask


# --------------------------------------------------------------------------------------------
# attention function (AttentionInterface)
# --------------------------------------------------------------------------------------------


def _sdpa_mask_from_2d(valid: torch.Tensor, q_len: int, kv_len: int, is_causal: bool) -> torch.Tensor:
    """Dense 4D bool mask (B, 1, Sq, Skv) from our 2D key mask (queries = its last Sq columns)."""
    b, length = valid.shape
    keys = torch.zeros(b, kv_len, dtype=torch.bool, device=valid.device)
    keys[:, :length] = valid
    mask = keys[:, None, None, :].expand(b, 1, q_len, kv_len)
    if is_causal:
        rows = torch.arange(q_len, device=valid.device)[:, None] + (length - q_len)
        cols = torch.arange(kv_len, device=valid.device)[None, :]
        mask = mask & (cols <= rows)
    return mask


def _bottom_right_causal(q_len: int, kv_len: int, device) -> torch.Tensor:
    rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return torch.arange(kv_len, device=device)[None, :] <= rows


@dataclass(frozen=True)
class Packing:
    """How one forward pass's 2D key mask packs a layer's tokens into TND, shared by its layers.

    ``rows`` / ``keys``: flat indices into (B * Sq) and (B * Skv) of the valid query and key
    tokens (batch-major, ascending positions); ``cu_seqlens_q`` / ``cu_seqlens_kv``: int32 of
    the sequences that have a valid query; ``metadata``: the op's plan for them (None when the
    attention function takes none, or no query is valid).
    """

    rows: torch.Tensor
    keys: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    count: int
    metadata: object | None
    #: Every key of the layer is valid: the layer runs unpacked (BNSD), the other fields are unused.
    all_valid: bool = False


def check_mask(name: str, mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> None:
    """A 2D key-validity mask (B, L) that fits the layer: L covers the queries (its last Sq
    columns are the queries) and no more keys than the layer has."""
    if mask.shape[0] != batch:
        raise ValueError(f"{name}: attention_mask must have the query's batch size {batch} in its first "
                         f"dimension, got shape {tuple(mask.shape)}")
    if not q_len <= mask.shape[1] <= kv_len:
        raise ValueError(f"{name}: a 2D attention_mask must cover between the {q_len} queries (its last "
                         f"columns are the queries) and the layer's {kv_len} keys, got {mask.shape[1]} columns "
                         f"(shape {tuple(mask.shape)})")


def plan_packing(valid: torch.Tensor, batch: int, q_len: int, kv_len: int, heads_q: int, heads_kv: int,
                 is_causal: bool, device: torch.device, with_metadata: bool) -> Packing:
    """The :class:`Packing` of a checked mask: the one host read of a forward pass's lengths."""
    b, length = valid.shape
    if length == kv_len and bool(valid.all()):
        none = torch.zeros(0, dtype=torch.int64, device=device)
        return Packing(rows=none, keys=none, cu_seqlens_q=none, cu_seqlens_kv=none, count=b * q_len, metadata=None,
                       all_valid=True)
    keys = torch.zeros(b, kv_len, dtype=torch.bool, device=device)
    keys[:, :length] = valid.to(device=device, dtype=torch.bool)
    rows = keys[:, length - q_len:length]  # the queries are the last Sq columns of the mask
    lens_q = rows.sum(1)
    keys = keys & (lens_q > 0)[:, None]  # a sequence without a valid query: leave its keys out too
    lens_kv = keys.sum(1)
    has = lens_q > 0
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    cu_q = torch.cat([zero, lens_q[has].cumsum(0).to(torch.int32)])
    cu_kv = torch.cat([zero, lens_kv[has].cumsum(0).to(torch.int32)])
    count = int(cu_q[-1])
    metadata = None
    if with_metadata and count:
        from qfa.attention.op import quant_flash_attn_metadata

        metadata = quant_flash_attn_metadata(heads_q, heads_kv, layout="TND", cu_seqlens_q=cu_q,
                                             cu_seqlens_kv=cu_kv, mask_mode=3 if is_causal else 0)
    return Packing(rows=rows.reshape(-1).nonzero().squeeze(1), keys=keys.reshape(-1).nonzero().squeeze(1),
                   cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, count=count, metadata=metadata)


class PackingCache:
    """The last :class:`Packing` per thread, keyed on the mask object transformers passes to
    every layer of one forward pass (its identity and version: an in-place change is a new
    mask) and the layer's shapes, so the lengths are read once per forward pass, not per layer.
    A weak reference: the cache never keeps a mask alive, and a recycled id cannot match."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, mask: torch.Tensor, key: tuple, make: Callable[[], Packing]) -> Packing:
        entry = getattr(self._local, "entry", None)
        full_key = (id(mask), mask._version, tuple(mask.shape), *key)
        if entry is not None and entry[1] == full_key and entry[0]() is mask:
            return entry[2]
        packing = make()
        self._local.entry = (weakref.ref(mask), full_key, packing)
        return packing


def _run_padded(fn, query, key, value, scaling, options, packing: Packing, is_causal: bool):
    """Gather valid tokens to TND, run ``fn``, scatter back to BSND (zeros in padded rows)."""
    b, nq, sq, d = query.shape
    out = query.new_zeros(b * sq, nq, value.shape[-1])
    if packing.count == 0:
        return out.view(b, sq, nq, -1)
    flat = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[-1])  # noqa: E731  (B*S, N, D)
    q_t = flat(query).index_select(0, packing.rows)
    k_t = flat(key).index_select(0, packing.keys)
    v_t = flat(value).index_select(0, packing.keys)
    extra = {} if packing.metadata is None else {"metadata": packing.metadata}
    o_t = fn(q_t, k_t, v_t, is_causal=is_causal, softmax_scale=scaling, layout="TND",
             cu_seqlens_q=packing.cu_seqlens_q, cu_seqlens_kv=packing.cu_seqlens_kv, **extra, **options)
    out.index_copy_(0, packing.rows, o_t.to(out.dtype))
    return out.view(b, sq, nq, -1)


def _takes_metadata(fn: Callable) -> bool:
    try:
        return "metadata" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _default_attention_fn():
    from qfa.attention import hif8_attention

    return hif8_attention


#: The options a HiF8Cache decides for itself (its encoding of K and V): registered ones must agree.
_CACHE_OPTIONS = ("calibration", "smooth_k", "rotate")
#: The registered options a HiF8Cache's attention takes (the rest are the cache's or do not apply).
_CACHED_CALL_OPTIONS = ("p_scale", "backend")
#: What the attention function passes the drop-in on every call (the call's mask, scale and
#: layout; a plan of its own; out alone): not options to register.
_SUPPLIED = frozenset({"is_causal", "softmax_scale", "layout", "cu_seqlens_q", "cu_seqlens_kv", "seqused_q",
                       "seqused_kv", "metadata", "return_softmax_lse", "return_lse", "scale"})


def _check_registration(name, attention_fn, options: dict) -> None:
    """The registration's name and options, checked when registered rather than at the first
    forward pass (and never silently dropped): options the attention function does not take are
    a TypeError naming them; the drop-in's own options are checked by its checks."""
    if not isinstance(name, str) or not name.strip():
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if attention_fn is not None and not callable(attention_fn):
        raise TypeError(f"attention_fn must be callable, got {type(attention_fn).__name__}")
    fn = attention_fn if attention_fn is not None else _default_attention_fn()
    taken = _option_names(fn)
    if taken is not None and set(options) - taken:
        raise TypeError(f"{name}: options {sorted(set(options) - taken)} are not arguments of "
                        f"{getattr(fn, '__name__', fn)!r} (it takes {sorted(taken)})")
    if "calibration" in options:
        dropin_inputs.check_calibration(options["calibration"])
    for flag in ("smooth_k", "rotate"):
        if flag in options:
            check_bool(options[flag], flag)


def _option_names(fn) -> set[str] | None:
    """The keyword options ``fn`` takes, or None where its signature does not say (a ``**kwargs``
    function of the user's, a builtin). The drop-in's functions take ``hif8_attention``'s
    options and its deprecated spellings (their ``**`` catches only those)."""
    from qfa.dropin import function as dropin_function

    if fn in (dropin_function.hif8_attention, dropin_function.mxfp8_attention, dropin_function.fp8_attention):
        parameters = inspect.signature(dropin_function.hif8_attention).parameters
        return {n for n, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY} - _SUPPLIED
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    return {n for n, p in parameters.items() if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                             inspect.Parameter.POSITIONAL_OR_KEYWORD)} - _SUPPLIED


def _check_cache_options(name: str, cache, options: dict) -> None:
    """A HiF8Cache encodes K and V with its own calibration, smoothing and rotation: registered
    options that say otherwise are an error, not silently dropped, and so are options its
    attention does not take (static scales, another format)."""
    other = sorted(set(options) - set(_CACHE_OPTIONS) - set(_CACHED_CALL_OPTIONS))
    if other:
        raise ValueError(f"{name} was registered with {other}, which a qfa.serving.HiF8Cache's attention does not take "
                         f"(it takes {list(_CACHED_CALL_OPTIONS)}; the cache decides {list(_CACHE_OPTIONS)}): register "
                         f"a name without them for the cache")
    for option in _CACHE_OPTIONS:
        if option not in options:
            continue
        mine, its = options[option], getattr(cache, option)
        same = cal.get_rule(mine) is cal.get_rule(its) if option == "calibration" else mine == its
        if not same:
            raise ValueError(f"{name} was registered with {option}={mine!r}, but this qfa.serving.HiF8Cache was made "
                             f"with {option}={its!r}, and the cache's encoding decides: make the cache with the "
                             f"same {option}, or register without it")


def make_attention_function(
    name: str = "qfa_hif8",
    *,
    fallback: str | None = None,
    attention_fn: Callable | None = None,
    **options,
) -> Callable:
    """The function :func:`register` hands to ``AttentionInterface`` (see the module docstring).

    ``attention_fn`` defaults to :func:`qfa.hif8_attention`; ``options`` are passed to it on every
    call (e.g. ``calibration="rms"``, ``smooth_k=True``, ``p_scale=None``, ``backend=None``).
    """
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    _check_registration(name, attention_fn, options)
    packings = PackingCache()

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                  is_causal=None, sliding_window=None, softcap=None, **kwargs):
        fn = attention_fn if attention_fn is not None else _default_attention_fn()
        if dropout:
            raise ValueError(f"{name}: attention dropout is not supported (inference only); put the model in eval()")
        if softcap is not None:
            raise ValueError(f"{name}: attention logit softcapping is not supported")
        is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        found = hif8_cache_of(key)  # a qfa.serving.HiF8Cache: attention on its stored codes
        if found is not None:
            if attention_fn is not None and attention_fn is not _default_attention_fn():
                raise ValueError(f"{name}: a qfa.serving.HiF8Cache holds HiF8 codes and is read by the HiF8 "
                                 f"attention only; use attn_implementation='qfa_hif8' with it, or a DynamicCache "
                                 f"with {name}")
            cache, layer_idx = found
            _check_cache_options(name, cache, options)
            return cached_attention(module, query, cache, layer_idx, softmax_scale=scaling,
                                    attention_mask=attention_mask, is_causal=bool(is_causal),
                                    p_scale=options.get("p_scale"), backend=options.get("backend")), None
        head_dim = query.shape[-1]
        why = None
        if head_dim != HEAD_DIM or key.shape[-1] != HEAD_DIM or value.shape[-1] != HEAD_DIM:
            kv_dims = "" if key.shape[-1] == value.shape[-1] == head_dim else f" (k/v {key.shape[-1]}/{value.shape[-1]})"
            why = (f"{name} needs head_dim {HEAD_DIM} (the HiF8 op's only size), but this model's head_dim is "
                   f"{head_dim}{kv_dims}")
        elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() != 2:
            pattern = (f"a sliding window of {sliding_window}" if sliding_window else
                       "a custom mask pattern (packed sequences, a bidirectional or a user-made 4D mask)")
            why = (f"{name} computes causal full attention (with padding and KV caches) only; this layer needs "
                   f"{pattern}")
        two_d = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
        if two_d:
            check_mask(name, attention_mask, query.shape[0], query.shape[2], key.shape[2])
        if why is not None:
            if fallback == "sdpa":
                from transformers.integrations.sdpa_attention import sdpa_attention_forward

                mask = attention_mask
                if two_d:
                    mask = _sdpa_mask_from_2d(mask, query.shape[2], key.shape[2], is_causal)
                elif mask is None and is_causal and query.shape[2] != key.shape[2] and query.shape[2] > 1:
                    mask = _bottom_right_causal(query.shape[2], key.shape[2], query.device)[None, None]
                return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                              is_causal=is_causal, **kwargs)
            raise ValueError(why + "; register with fallback='sdpa' to run such layers with sdpa instead")
        causal = bool(is_causal)
        packing = None
        if attention_mask is not None:
            # Under torch.compile the drop-in is one custom op that plans itself, and the cache's
            # identity test is not traceable: plan in the graph instead.
            compiling = torch.compiler.is_compiling()
            with_metadata = _takes_metadata(fn) and not compiling
            shapes = (query.shape[0], query.shape[2], key.shape[2], query.shape[1], key.shape[1])
            make = lambda: plan_packing(attention_mask, *shapes, causal, query.device, with_metadata)  # noqa: E731
            packing = make() if compiling else packings.get(attention_mask, (*shapes, causal, query.device,
                                                                             with_metadata), make)
        if packing is not None and not packing.all_valid:
            out = _run_padded(fn, query, key, value, scaling, options, packing, causal)
        else:
            out = fn(query, key, value, is_causal=causal, softmax_scale=scaling, layout="BNSD", **options)
            out = out.transpose(1, 2).contiguous()
        return out, None

    attention.__name__ = attention.__qualname__ = f"{name.replace('-', '_')}_attention_forward"
    return attention


def register(name: str = "qfa_hif8", *, fallback: str | None = None, attention_fn: Callable | None = None,
             **options) -> str:
    """Register ``name`` with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``.

    After it, ``model.set_attn_implementation(name)`` and ``from_pretrained(...,
    attn_implementation=name)`` run the model's attention through :func:`qfa.hif8_attention`
    (or ``attention_fn``) with ``options`` (``calibration``, ``smooth_k``, ``p_scale``,
    ``backend``). Handles causal prefill, continuation with a KV cache (bottom-right causal), and
    left/right padding via per-sequence lengths. ``fallback="sdpa"`` sends layers the op cannot
    run (head_dim != 128, sliding-window or other custom masks) to transformers' sdpa instead of
    raising. Re-registering a name replaces it. Returns ``name``.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:  # pragma: no cover - exercised only without transformers
        raise ImportError("qfa.integrations.transformers needs transformers: pip install 'qfa[transformers]'") from exc
    fn = make_attention_function(name, fallback=fallback, attention_fn=attention_fn, **options)
    taken = getattr(AttentionInterface, "_global_mapping", {})
    if name in taken and name not in _REGISTERED:
        raise ValueError(f"name {name!r} is an attention transformers already has (not one qfa registered): "
                         f"registering it would replace it for the whole process; pick another name")
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, qfa_mask)
    _REGISTERED.add(name)
    return name


#: The names :func:`register` has registered in this process (it may replace only these).
_REGISTERED: set[str] = set()


def register_mxfp8(name: str = "qfa_mxfp8", *, fallback: str | None = None, **options) -> str:
    """Register the drop-in's MXFP8 format (:func:`qfa.mxfp8_attention`, quant_mode 1) as ``name``;
    ``options`` as :func:`register`'s (``smooth_k``, ``p_scale``, ``backend``)."""
    from qfa.attention import mxfp8_attention

    return register(name, fallback=fallback, attention_fn=mxfp8_attention, **options)


def register_fp8(name: str = "qfa_fp8", *, fallback: str | None = None, **options) -> str:
    """Register the drop-in's FP8 E4M3 per-token-head format (:func:`qfa.fp8_attention`,
    quant_mode 6) as ``name``; ``options`` as :func:`register`'s."""
    from qfa.attention import fp8_attention

    return register(name, fallback=fallback, attention_fn=fp8_attention, **options)


# --------------------------------------------------------------------------------------------
# per-tensor FP8 E4M3 emulation (the comparison point for HiF8)
# --------------------------------------------------------------------------------------------


def fp8_e4m3_adapter(q, k, v, *, is_causal: bool = False, softmax_scale: float | None = None, layout: str = "BNSD",
                     cu_seqlens_q=None, cu_seqlens_kv=None, smooth_k: bool = True, rotate: bool = False) -> torch.Tensor:
    """:func:`qfa.dropin.fp8_emulation.fp8_e4m3_attention` with :func:`qfa.hif8_attention`'s
    calling convention, so the same plumbing runs it: BNSD, or TND with ``cu_seqlens``.

    The emulation: K smoothed (on by default here, like HiF8's ``smooth_k``, so the comparison
    isolates the number format), Q, K and V fake-quantised to E4M3 with one scale amax / 448
    each, exact fp32 scores, P = exp(S - rowmax) times 448 cast to E4M3 before P @ V, the row
    sum from the unquantised P; causal aligned bottom-right. TND runs each sequence on its own
    (its own scales and K mean); the output comes back in q's dtype.
    """
    from qfa.dropin.fp8_emulation import fp8_e4m3_attention

    if layout == "BNSD":
        return fp8_e4m3_attention(q, k, v, is_causal=is_causal, scale=softmax_scale, smooth_k=smooth_k,
                                  rotate=rotate).to(q.dtype)
    if layout != "TND":
        raise ValueError(f"layout must be 'BNSD' or 'TND', got {layout!r}")
    cq, ckv = cu_seqlens_q.tolist(), cu_seqlens_kv.tolist()
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    for i in range(len(cq) - 1):
        if cq[i + 1] == cq[i] or ckv[i + 1] == ckv[i]:
            continue
        seq = [t[a:b].transpose(0, 1)[None] for t, a, b in
               ((q, cq[i], cq[i + 1]), (k, ckv[i], ckv[i + 1]), (v, ckv[i], ckv[i + 1]))]
        o = fp8_e4m3_attention(*seq, is_causal=is_causal, scale=softmax_scale, smooth_k=smooth_k, rotate=rotate)
        out[cq[i]:cq[i + 1]] = o[0].transpose(0, 1).to(q.dtype)
    return out


def register_fp8_e4m3(name: str = "fp8_e4m3", *, fallback: str | None = None, smooth_k: bool = True,
                      rotate: bool = False) -> str:
    """Register the per-tensor FP8 E4M3 emulation (:func:`fp8_e4m3_adapter`) as ``name``."""
    return register(name, fallback=fallback,
                    attention_fn=functools.partial(fp8_e4m3_adapter, smooth_k=smooth_k, rotate=rotate))


def __getattr__(name: str):
    """``HiF8Cache`` (the HiF8 KV cache, :mod:`qfa.serving.hif8_cache`) loads transformers, so it
    is imported on first use rather than with this module."""
    if name == "HiF8Cache":
        from qfa.serving.hif8_cache import HiF8Cache

        return HiF8Cache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
