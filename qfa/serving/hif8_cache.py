"""``HiF8Cache``: a transformers ``Cache`` that stores K and V as HiF8 codes (1 byte per element).

::

    cache = HiF8Cache()                      # or HiF8Cache(config=model.config)
    model.generate(input_ids, past_key_values=cache, ...)   # attn_implementation="qfa_hif8"

Per layer it keeps uint8 codes of shape (B, Nkv, S, 128), one fp32 K scale and one V scale, and,
with ``smooth_k``, each sequence's per-head, per-channel key mean (fp32 (B, Nkv, 128)). All of
them are fixed when the layer's first tokens (the prefill) arrive, from the valid tokens only:
padding never enters a scale or a mean. Later tokens are smoothed with the frozen mean, rotated
and encoded with the frozen scales (saturating; :attr:`HiF8Layer.saturated` counts clamped
elements). Both transforms stay exact for softmax with a cache: subtracting a fixed vector from
every key shifts each score row by a constant, and the Hadamard rotation is one fixed orthogonal
map (``docs/serving.md``).

Tokens are stored *compacted*: sequence b's valid tokens occupy positions [0, lengths[b]) of its
row, in order, whatever the left or right padding of the input was. So the op reads the codes in
place, BNSD with ``seqused_kv``, and a decode step never gathers or re-encodes the cache.

The code tensors have room to spare: when an append does not fit, they grow to the tokens needed
plus 1/:data:`GROWTH_DIVISOR` of them, so a decode step writes its token in place and the tensors
are reallocated O(log n) times over n tokens. :meth:`HiF8Layer.nbytes` counts what is allocated,
at most 1/32 more than what is used.

Encoding waits for the attention call. ``update`` (which transformers calls before attention,
without the attention mask) only queues the new float K/V and returns placeholder tensors
(:class:`CacheHandle`) that lead the attention function to the cache;
:func:`qfa.serving.attention.cached_attention` then encodes the queued tokens with the mask it
is given and runs attention on the codes. The placeholders hold no data: any other use of them
(e.g. ``attn_implementation="sdpa"`` with this cache) raises an error saying so.

Every operation is all-or-nothing. ``update`` checks the new tokens against the layer (and
fixes its batch and head geometry only with tokens it accepts); the attention call encodes the
queued tokens into a :class:`Staged` state (scales and key means of a first call, codes,
counts, lengths) that the layer takes only once attention has succeeded. A call that raises
leaves the layer exactly as it was: its tokens still queued, no scale or mean fixed, the codes
past each sequence's length still 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

from qfa.dropin import calibration as cal
from qfa.dropin import rotation
from qfa.dropin.call import DropinCall as _D  # the drop-in's defaults, one source
from qfa.serving.encoding import encode
from qfa.tiling.checks import check_bool, check_float_tensor
from qfa.tiling.spec import HEAD_DIM

ScaleTriple = tuple  # (q_scale | None, k_scale | None, v_scale | None)

#: Headroom of a growth: the code tensors grow to n + n // GROWTH_DIVISOR tokens when n do not fit.
#: Geometric, so appends are amortised O(1); 1/32 keeps the bytes held within 3.2 % of those used
#: (a 2048-token prefill gets room for 2112: at most 0.516x a bf16 DynamicCache's bytes there,
#: inside the README's <= 0.52x; 256 tokens or 1/16 of headroom would not be).
GROWTH_DIVISOR = 32

#: How a caller of the cache gives static scales (said by the error on NaN/Inf in calibrated tokens).
STATIC_SCALES = "HiF8Cache(scales=...)"
#: The names of a layer's scale triple.
SCALE_NAMES = ("q_scale", "k_scale", "v_scale")

#: What may be done with a :class:`CacheHandle`: read its metadata.
_HANDLE_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__, torch.Tensor.ndim.__get__, torch.Tensor.numel, torch.Tensor.is_floating_point,
}


class CacheHandle(torch.Tensor):
    """What :meth:`HiF8Cache.update` returns in place of keys/values: a tensor with the shape,
    dtype and device the stored keys would have (B, Nkv, S, 128), no data, and the attributes
    ``hif8_cache`` and ``layer_idx`` that lead an attention function to the codes."""

    hif8_cache: "HiF8Cache"
    layer_idx: int

    @staticmethod
    def __new__(cls, shape, dtype, device, cache: "HiF8Cache", layer_idx: int):
        data = torch.empty((), dtype=dtype, device=device).expand(shape)  # zero strides: no memory
        handle = torch.Tensor._make_subclass(cls, data)
        handle.hif8_cache, handle.layer_idx = cache, layer_idx
        return handle

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _HANDLE_METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", repr(func))
        raise RuntimeError(
            f"HiF8Cache stores HiF8 codes and returns placeholders from update(), which only qfa's cached "
            f"attention reads (qfa.serving.attention.cached_attention, e.g. attn_implementation='qfa_hif8'); "
            f"got {name}() on one. Use a DynamicCache with other attention implementations."
        )

    def __repr__(self) -> str:  # printing must not run a torch function
        with torch._C.DisableTorchFunctionSubclass():
            shape = tuple(self.shape)
        return f"CacheHandle(layer {self.layer_idx}, shape {shape})"


@dataclass
class Staged:
    """A layer's state with its queued tokens encoded: what an attention call reads, and what
    :meth:`HiF8Layer.apply` makes the layer's once the call has succeeded.

    ``written`` lists the ``(row, start, count)`` runs written into the layer's own code tensors
    past its sequences' lengths (their spare capacity, 0 until then), which
    :meth:`HiF8Layer.discard` zeroes again; a grown state has its own tensors and none."""

    k_store: torch.Tensor
    v_store: torch.Tensor
    host_lengths: tuple[int, ...]
    lengths: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    k_mean: torch.Tensor | None
    saturated_k: torch.Tensor | int
    saturated_v: torch.Tensor | int
    written: list[tuple[int, int, int]]

    @property
    def keys(self) -> torch.Tensor:
        return self.k_store[:, :, :max(self.host_lengths, default=0)]

    @property
    def values(self) -> torch.Tensor:
        return self.v_store[:, :, :max(self.host_lengths, default=0)]


class HiF8Layer(DynamicLayer):
    """One layer of a :class:`HiF8Cache`: codes, frozen scales and key means, counts.

    Attributes:
        keys, values: uint8 (B, Nkv, max length, 128) codes; sequence b's valid tokens are
            positions [0, lengths[b]); past them the codes are 0 and never read. Views of the
            first max(lengths) positions of tensors with room for :attr:`capacity` tokens.
        lengths: int64 (B,) stored tokens per sequence (:attr:`host_lengths`: the same, a tuple).
        q_scale: static fp32 (1,) q scale, or None (the query is scaled per call by the rule).
        k_scale, v_scale: fp32 (1,) scales, fixed by the first tokens (or given).
        k_mean: fp32 (B, Nkv, 128) frozen per-sequence key means (``smooth_k``), else None.
        saturated_k, saturated_v: elements clamped to +-MAX when encoded.
    """

    is_croppable = False
    is_compileable = False

    def __init__(self, *, calibration: cal.RuleLike | None = None, smooth_k: bool = _D.smooth_k,
                 rotate: bool = _D.rotate, scales: ScaleTriple | None = None, **kwargs) -> None:
        super().__init__()
        self.rule = cal.get_rule(calibration)
        self.smooth_k, self.rotate = check_bool(smooth_k, "smooth_k"), check_bool(rotate, "rotate")
        self.q_scale = self.k_scale = self.v_scale = None
        # checked now (devices come with the first tokens): a bad scale is refused at construction
        self._given = tuple(None if s is None else cal.check_scale(s, n)
                            for s, n in zip(_scale_triple(scales), SCALE_NAMES))
        self.k_mean: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None
        self.host_lengths: tuple[int, ...] = ()
        self._k_store = self._v_store = None  # (B, Nkv, capacity, 128): keys / values are views of them
        self.seen = 0  # token columns passed to update (padding included): transformers' length
        self._saturated_k = self._saturated_v = 0  # device tensors once counted: read on demand
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def saturated_k(self) -> int:
        return int(self._saturated_k)

    @property
    def saturated_v(self) -> int:
        return int(self._saturated_v)

    @property
    def saturated(self) -> int:
        """Elements of K and V clamped to +-MAX when encoded with the frozen scales."""
        return self.saturated_k + self.saturated_v

    @property
    def capacity(self) -> int:
        """Tokens per sequence the allocated code tensors hold (``keys.shape[2]`` of them used)."""
        return 0 if self._k_store is None else self._k_store.shape[2]

    @property
    def pending(self) -> int:
        """Token columns given to ``update`` and not yet encoded (done by the attention call)."""
        return sum(k.shape[2] for k, _ in self._pending)

    def check_new(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Whether :meth:`queue` takes these tokens: float (B, Nkv, S_new, 128), one shape for
        both, and the layer's batch, heads and device once it has them. Changes nothing."""
        for t, name in ((key_states, "key_states"), (value_states, "value_states")):
            check_float_tensor(t, name)
            if t.dim() != 4 or t.shape[-1] != HEAD_DIM:
                raise ValueError(f"HiF8Cache needs {name} of shape (B, Nkv, S, {HEAD_DIM}) (the HiF8 op's only head "
                                 f"size), got {tuple(t.shape)}")
        if value_states.shape != key_states.shape:
            raise ValueError(f"value_states must have key_states' shape {tuple(key_states.shape)}, got "
                             f"{tuple(value_states.shape)}")
        if value_states.device != key_states.device:
            raise ValueError(f"value_states must be on key_states' device {key_states.device}, got "
                             f"{value_states.device}")
        if self.is_initialized:
            expected = (self.keys.shape[0], self.keys.shape[1], key_states.shape[2], HEAD_DIM)
            if tuple(key_states.shape) != expected:
                raise ValueError(f"key_states must have shape (B, Nkv, S_new, D) = {expected} for this layer, got "
                                 f"{tuple(key_states.shape)}")
            if key_states.device != self.device:
                raise ValueError(f"key_states must be on this layer's device {self.device}, got {key_states.device}")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.check_new(key_states, value_states)
        b, n, _, d = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self._set_store(torch.zeros(b, n, 0, d, dtype=torch.uint8, device=self.device),
                        torch.zeros(b, n, 0, d, dtype=torch.uint8, device=self.device), (0,) * b)
        self.q_scale, self.k_scale, self.v_scale = (None if s is None else s.to(self.device) for s in self._given)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise TypeError("HiF8Layer.update needs its cache: call HiF8Cache.update(key_states, value_states, layer_idx)")

    def queue(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Queue new float K/V (B, Nkv, S_new, 128) for encoding by the next attention call
        (the first tokens fix the layer's batch, heads and device; refused ones fix nothing)."""
        self.check_new(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._pending.append((key_states.detach(), value_states.detach()))
        self.seen += key_states.shape[2]

    def get_seq_length(self) -> int:
        return self.seen

    def commit(self, valid: torch.Tensor | None) -> None:
        """Encode the queued tokens. ``valid``: bool (B, pending) marking the real (non-padding)
        tokens among them, or None (all real). The first tokens fix the scales and key means.
        All or nothing (:meth:`stage`, then :meth:`apply`)."""
        self.apply(self.stage(valid))

    def _current(self) -> Staged:
        return Staged(self._k_store, self._v_store, self.host_lengths, self.lengths, self.k_scale, self.v_scale,
                      self.k_mean, self._saturated_k, self._saturated_v, [])

    def stage(self, valid: torch.Tensor | None) -> Staged:
        """The layer's state with the queued tokens encoded (see :meth:`commit` for ``valid``),
        without making it the layer's: the scales and key means a first call fixes, the codes,
        lengths and counts are the returned :class:`Staged`'s. The new codes are written into
        the layer's spare capacity when they fit (never read until :meth:`apply`; zeroed again
        by :meth:`discard`), else into grown copies. Raises (changing nothing) on tokens whose
        computed scale is refused (NaN or Inf)."""
        if not self._pending:
            return self._current()
        k = _cat([p[0] for p in self._pending], dim=2)
        v = _cat([p[1] for p in self._pending], dim=2)
        b, _, s, _ = k.shape
        if valid is None:  # every token real: no mask to read, no gather
            counts = [s] * b
            k_seq = [k[i].transpose(0, 1).contiguous() for i in range(b)]  # (n_i, Nkv, D)
            v_seq = [v[i].transpose(0, 1).contiguous() for i in range(b)]
        else:
            counts = valid.sum(1).tolist()  # the one host read of a commit
            index = [torch.nonzero(valid[i], as_tuple=True)[0] for i in range(b)]
            # one sequence at a time, on its own contiguous tokens: a sequence's codes are those it
            # gets alone (same shapes, same reductions), whatever the padding and the batch
            k_seq = [k[i][:, idx].transpose(0, 1).contiguous() for i, idx in enumerate(index)]
            v_seq = [v[i][:, idx].transpose(0, 1).contiguous() for i, idx in enumerate(index)]
        if sum(counts) == 0:  # only padding: nothing to store, nothing to calibrate on
            return self._current()
        k_mean = self.k_mean
        if self.smooth_k and k_mean is None:
            k_mean = torch.stack([_mean(t, k.shape[1]) for t in k_seq])
        if self.smooth_k:
            k_seq = [t.float() - k_mean[i] for i, t in enumerate(k_seq)]
        if self.rotate:
            k_seq = [rotation.rotate(t) for t in k_seq]
            v_seq = [rotation.rotate(t) for t in v_seq]
        k_new, v_new = _cat(k_seq), _cat(v_seq)  # (sum n_i, Nkv, D), batch-major
        # what is calibrated is smoothed and rotated, but NaN/Inf there comes from the caller's K/V
        k_scale = self.k_scale if self.k_scale is not None else cal.apply_rule(
            self.rule, k_new, "key_states (given to HiF8Cache.update)", STATIC_SCALES)
        v_scale = self.v_scale if self.v_scale is not None else cal.apply_rule(
            self.rule, v_new, "value_states (given to HiF8Cache.update)", STATIC_SCALES)
        k_codes, k_sat = encode(k_new, k_scale)
        v_codes, v_sat = encode(v_new, v_scale)
        k_store, v_store, lengths, written = self._written(k_codes, v_codes, counts)
        return Staged(k_store, v_store, lengths, torch.tensor(lengths, dtype=torch.long, device=k_store.device),
                      k_scale, v_scale, k_mean, self._saturated_k + k_sat, self._saturated_v + v_sat, written)

    def _written(self, k_codes: torch.Tensor, v_codes: torch.Tensor, counts: list[int]):
        """``(k_store, v_store, lengths, written)``: each sequence's new codes after its stored
        ones (compacted rows), in the layer's tensors past its lengths when they fit the
        capacity (``written``: those runs); otherwise in grown copies (see :data:`GROWTH_DIVISOR`)."""
        new_lengths = tuple(a + c for a, c in zip(self.host_lengths, counts))
        need = max(new_lengths, default=0)
        k_store, v_store = self._k_store, self._v_store
        in_place = need <= k_store.shape[2]
        if not in_place:
            k_store, v_store = _grown(k_store, need), _grown(v_store, need)
        start, written = 0, []
        for i, (old, c) in enumerate(zip(self.host_lengths, counts)):
            if c:
                k_store[i, :, old:old + c] = k_codes[start:start + c].transpose(0, 1)
                v_store[i, :, old:old + c] = v_codes[start:start + c].transpose(0, 1)
                written.append((i, old, c))
            start += c
        return k_store, v_store, new_lengths, written if in_place else []

    def apply(self, staged: Staged) -> None:
        """Make ``staged`` (from :meth:`stage`, nothing changed since) the layer's state: the
        queued tokens are then stored."""
        self._k_store, self._v_store = staged.k_store, staged.v_store
        self.host_lengths, self.lengths = staged.host_lengths, staged.lengths
        self.keys, self.values = staged.keys, staged.values
        self.k_scale, self.v_scale, self.k_mean = staged.k_scale, staged.v_scale, staged.k_mean
        self._saturated_k, self._saturated_v = staged.saturated_k, staged.saturated_v
        self._pending = []

    def discard(self, staged: Staged) -> None:
        """Drop ``staged`` (from :meth:`stage`): the codes it wrote into the layer's spare
        capacity are zeroed again, so the layer is exactly as before the stage."""
        for i, old, c in staged.written:
            self._k_store[i, :, old:old + c] = 0
            self._v_store[i, :, old:old + c] = 0

    def _set_store(self, k_store: torch.Tensor, v_store: torch.Tensor, lengths: tuple[int, ...]) -> None:
        self._k_store, self._v_store = k_store, v_store
        self.host_lengths = tuple(lengths)
        self.lengths = torch.tensor(self.host_lengths, dtype=torch.long, device=k_store.device)
        used = max(self.host_lengths, default=0)
        self.keys, self.values = k_store[:, :, :used], v_store[:, :, :used]

    def nbytes(self) -> int:
        """Bytes this layer holds: the allocated code tensors (all of :attr:`capacity`, not only the
        tokens used), scales, key means and lengths (queued float tokens excluded)."""
        if not self.is_initialized:
            return 0
        held = [self._k_store, self._v_store, self.k_scale, self.v_scale, self.q_scale, self.k_mean, self.lengths]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    # ---------------------------------------------------------------- batch operations (generate)

    def check_select(self, index: torch.Tensor, name: str = "index") -> None:
        """Raise, changing nothing, where :meth:`_select` could not take ``index``: a 1-D integer
        tensor of batch rows in [0, batch) (a bool mask would select rows by the mask but lengths
        by 0 and 1), and no tokens queued."""
        if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.dtype.is_floating_point or \
                index.dtype.is_complex or index.dtype == torch.bool:
            got = f"{index.dtype} {tuple(index.shape)}" if isinstance(index, torch.Tensor) else type(index).__name__
            raise TypeError(f"{name} must be a 1-D integer tensor of batch rows, got {got}")
        if not self.is_initialized:
            return
        if self._pending:
            raise ValueError("cannot reorder a HiF8 cache layer with tokens queued for encoding")
        batch = self._k_store.shape[0]
        if index.numel() and not (0 <= int(index.min()) and int(index.max()) < batch):
            raise ValueError(f"{name} must hold batch rows in [0, {batch}), got {index.tolist()}")

    def _select(self, index: torch.Tensor, name: str = "index", checked: bool = False) -> None:
        if not checked:  # (the cache's batch operations check every layer first; on a device
            self.check_select(index, name)  # each check reads the index's range: a sync)
        if not self.is_initialized:
            return
        index = index.to(self.device)
        host = [self.host_lengths[i] for i in index.tolist()]
        self._set_store(self._k_store[index], self._v_store[index], tuple(host))
        if self.k_mean is not None:
            self.k_mean = self.k_mean[index]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx, "beam_idx")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices, "indices")

    def repeat_index(self, repeats: int) -> torch.Tensor | None:
        """The rows :meth:`batch_repeat_interleave` selects (None before the first tokens)."""
        if isinstance(repeats, bool) or not isinstance(repeats, int):
            raise TypeError(f"repeats must be an int, got {type(repeats).__name__}")
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        if not self.is_initialized:
            return None
        return torch.arange(self._k_store.shape[0], device=self._k_store.device).repeat_interleave(repeats)

    def batch_repeat_interleave(self, repeats: int) -> None:
        index = self.repeat_index(repeats)
        if index is not None:
            self._select(index)

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("HiF8Cache cannot be cropped (its rows are compacted, padding removed)")

    def offload(self):
        raise ValueError("HiF8Cache does not support offloading")

    def reset(self) -> None:
        self.keys = self.values = self._k_store = self._v_store = None
        self.is_initialized = False
        self.q_scale = self.k_scale = self.v_scale = self.k_mean = self.lengths = None
        self.host_lengths = ()
        self.seen = self._saturated_k = self._saturated_v = 0
        self._pending = []


def _cat(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """torch.cat; one part is returned as it is (no copy of a decode step's token)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _grown(store: torch.Tensor, need: int) -> torch.Tensor:
    """``store`` (B, Nkv, capacity, D) copied into zeros with room for ``need`` + ``need //
    GROWTH_DIVISOR`` tokens."""
    b, n, cap, d = store.shape
    grown = torch.zeros(b, n, need + need // GROWTH_DIVISOR, d, dtype=store.dtype, device=store.device)
    grown[:, :, :cap] = store
    return grown


def _mean(tokens: torch.Tensor, heads: int) -> torch.Tensor:
    """fp32 per-head, per-channel mean of (n, Nkv, D) tokens; zeros when there are none."""
    if tokens.shape[0] == 0:
        return tokens.new_zeros((heads, HEAD_DIM), dtype=torch.float32)
    return tokens.float().mean(dim=0)


def _scale_triple(scales, name: str = "a layer's scales") -> tuple:
    if scales is None:
        return (None, None, None)
    if not isinstance(scales, (tuple, list)):
        raise TypeError(f"{name} must be a tuple (q_scale, k_scale, v_scale) (entries may be None), "
                        f"got {type(scales).__name__}")
    if len(scales) != 3:
        raise ValueError(f"{name} must be a tuple (q_scale, k_scale, v_scale) (entries may be None), got "
                         f"{len(scales)} entries")
    return tuple(scales)


def _checked_triple(scales, name: str) -> None:
    """``scales`` (one layer's entry of ``HiF8Cache(scales=)``, called ``name``) as a layer takes it."""
    for j, (s, n) in enumerate(zip(_scale_triple(scales, name), SCALE_NAMES)):
        if s is not None:
            cal.check_scale(s, f"{name}[{j}] ({n})")


class HiF8Cache(Cache):
    """A transformers cache storing K and V as HiF8 codes, read by qfa's attention in place.

    Args:
        config: optional model config: its layers are created up front (every layer must be
            full attention: the HiF8 op has no sliding window). Without it, layers are created
            as they are first updated.
        calibration: the rule that fixes each layer's K and V scales from its prefill
            (:mod:`qfa.dropin.calibration`; None: the default rule), and that scales each
            call's query when no static q scale is given.
        smooth_k: subtract each sequence's prefill key mean (per head, per channel; frozen).
            On by default, as in :func:`qfa.hif8_attention`.
        rotate: Hadamard-rotate K and V before encoding, and queries and outputs in attention.
            On by default, as in :func:`qfa.hif8_attention`. Saturation is counted on what is
            encoded: the smoothed, rotated values divided by the scale.
        scales: static scales, one ``(q_scale, k_scale, v_scale)`` triple per layer (a sequence
            or a mapping from layer index; entries may be None, meaning "from the rule"), e.g.
            ``(m.q_scale, m.k_scale, m.v_scale)`` of a calibrated :class:`qfa.HiF8Attention` run
            with the same ``smooth_k`` / ``rotate``.
    """

    def __init__(self, config=None, *, calibration: cal.RuleLike | None = None, smooth_k: bool = _D.smooth_k,
                 rotate: bool = _D.rotate,
                 scales: Sequence[ScaleTriple] | Mapping[int, ScaleTriple] | None = None) -> None:
        self.calibration = calibration
        cal.get_rule(calibration)  # an unknown rule fails here, not at the first token
        self.smooth_k, self.rotate = check_bool(smooth_k, "smooth_k"), check_bool(rotate, "rotate")
        if scales is not None and not isinstance(scales, (Sequence, Mapping)):
            raise TypeError(f"scales must be a sequence or mapping of (q_scale, k_scale, v_scale) per layer, "
                            f"got {type(scales).__name__}")
        if isinstance(scales, Mapping):
            for i, triple in scales.items():
                if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                    raise TypeError(f"scales' keys must be layer indices (ints >= 0), got {i!r}")
                _checked_triple(triple, f"scales[{i}]")
        elif scales is not None:
            for i, triple in enumerate(scales):
                _checked_triple(triple, f"scales[{i}]")
        self.static_scales = scales
        layers = []
        if config is not None:
            text = config.get_text_config(decoder=True)
            types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
            other = sorted({t for t in types if t != "full_attention"})
            if other:
                raise ValueError(f"HiF8Cache supports full-attention layers only (the HiF8 op has no sliding "
                                 f"window); this config has {other}")
            layers = [self._new_layer(i) for i in range(len(types))]
        #: The config's layer count, the bound of ``update``'s layer_idx (None without a config).
        self.num_config_layers = len(layers) if config is not None else None
        super().__init__(layers=layers)
        self._plan: tuple | None = None  # (key, plan) of shared_plan

    def shared_plan(self, key: tuple, make: Callable[[], object]) -> object:
        """The plan last made for ``key``, else ``make()`` (kept in its place). Every layer of one
        forward pass stores the same lengths, so the first layer plans the op and the others reuse
        it; one entry, replaced when the next step's lengths arrive."""
        if self._plan is None or self._plan[0] != key:
            self._plan = (key, make())
        return self._plan[1]

    def _new_layer(self, layer_idx: int) -> HiF8Layer:
        given = None
        if isinstance(self.static_scales, Mapping):
            given = self.static_scales.get(layer_idx)
        elif self.static_scales is not None:
            if layer_idx >= len(self.static_scales):
                raise ValueError(f"scales has {len(self.static_scales)} entries, but layer {layer_idx} was updated")
            given = self.static_scales[layer_idx]
        return HiF8Layer(calibration=self.calibration, smooth_k=self.smooth_k, rotate=self.rotate, scales=given)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Queue the new K/V of ``layer_idx`` (encoded by the attention call) and return
        :class:`CacheHandle` placeholders of the keys' and values' full shape. Refused tokens
        change nothing (no layer is created, no geometry fixed)."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            raise TypeError(f"layer_idx must be an int, got {type(layer_idx).__name__}")
        if layer_idx < 0:
            raise ValueError(f"layer_idx must be >= 0, got {layer_idx}")
        if self.num_config_layers is not None and layer_idx >= self.num_config_layers:
            raise ValueError(f"layer_idx must be below the config's {self.num_config_layers} layers, got {layer_idx}")
        new = [self._new_layer(i) for i in range(len(self.layers), layer_idx + 1)]
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else new[-1]
        layer.check_new(key_states, value_states)
        self.layers.extend(new)
        layer.queue(key_states, value_states)
        shape = (layer.keys.shape[0], layer.keys.shape[1], layer.seen, HEAD_DIM)
        return (CacheHandle(shape, key_states.dtype, key_states.device, self, layer_idx),
                CacheHandle(shape, value_states.dtype, value_states.device, self, layer_idx))

    # Batch operations: every layer checked before any changes (a refused one leaves them all as
    # they were, where the base class's loop would have changed the layers before it).
    def _select_all(self, indices: list, name: str) -> None:
        for layer, index in zip(self.layers, indices):
            if index is not None:
                layer.check_select(index, name)
        for layer, index in zip(self.layers, indices):
            if index is not None:
                layer._select(index, name, checked=True)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_all([beam_idx] * len(self.layers), "beam_idx")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_all([indices] * len(self.layers), "indices")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_all([layer.repeat_index(repeats) for layer in self.layers], "repeats")

    def layer(self, layer_idx: int) -> HiF8Layer:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            raise TypeError(f"layer_idx must be an int, got {type(layer_idx).__name__}")
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx must be in [0, {len(self.layers)}) (layers updated so far), got {layer_idx}")
        return self.layers[layer_idx]

    @property
    def saturated(self) -> list[int]:
        """Per layer, the K and V elements clamped to +-MAX by the frozen scales."""
        return [layer.saturated for layer in self.layers]

    def nbytes(self) -> int:
        """Bytes held by all layers: codes, scales, key means and lengths."""
        return sum(layer.nbytes() for layer in self.layers)


def is_hif8_cache(obj) -> bool:
    """Whether ``obj`` is a :class:`HiF8Cache` or a placeholder its ``update`` returned."""
    return isinstance(obj, HiF8Cache) or isinstance(obj, CacheHandle)
