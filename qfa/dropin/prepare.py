"""What the HiF8 drop-in does to its float inputs, in at most two passes per tensor; and
:func:`encode_tokens`, the same passes for a batch of tokens (a serving engine's per-call Q and
its cache writes).

Each of q, k and v becomes HiF8 codes of ``H (x - mu) / scale``: ``mu`` the K means (K smoothing,
:mod:`qfa.dropin.smoothing`), ``H`` the rotation (:mod:`qfa.dropin.rotation`), ``scale``
static or from the calibration rule on the smoothed, rotated values. On CPU that is two sweeps
over the input in the native row kernel (:mod:`qfa.attention.backends.cpu_prepare`), reading the
input in its own dtype and strides, each sweep of q, k and v together in one parallel region
(:func:`encode_tensors`; with one core busy elsewhere that cut the three inputs' preparation by
about 13 % against a region per tensor and sweep, and changed nothing measurable on a quiet host):

1. only when the scale is computed: the rule's statistics (the float64 sum of squares for
   ``"rms"``, the absolute maximum for ``"amax"``: their reducible forms,
   :data:`qfa.dropin.calibration.RMS_REDUCTION` / ``AMAX_REDUCTION``, finished by the same
   code) of ``H (x - mu)`` over the valid rows; for K first its means, per (sequence, head) slab,
   which is then read again from cache;
2. the codes of every row, rotated and divided in registers (and, for :func:`encode_tokens`,
   the count of saturated values).

After the op, the output is rotated back and cast to the caller's dtype: by the native attention
kernel as it writes each row, where it runs (:class:`qfa.attention.backends.cpu_kernel.RotatedOutput`),
else by :func:`restore_output` in one more sweep (the same code, ``csrc/row_rotation.h``, the
same bits). The alternative, one TorchInductor graph for the chain, was measured: its first
call in a fresh process compiled for 19 s with a cold cache (5 s warm), it fuses the rotation
only as a GEMM, and its 10-odd kernels each open a parallel region; the native passes build once
in about a second and open none (see docs/benchmarks.md).

Bits: the codes are those of ``calibration.quantize(rotation.rotate(x.float() - mu), scale)``,
the K means those of :func:`qfa.dropin.smoothing.key_means`, the output that of
``rotation.rotate(out)`` cast with saturation: one definition of each step, whichever path runs.
A computed ``"amax"`` scale is the same bits as the rule on the materialised tensor; ``"rms"``
sums its squares in another order (rows in sequence order), so the two can differ only when
log2(rms) ties a half-integer to within float64 rounding (as between tensor-parallel shards, see
:mod:`qfa.dropin.calibration`). Other rules (``"mse"``, callables), non-CPU tensors and
``torch.compile`` tracing take the materialised path (the same functions, in torch ops).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch

from qfa.dropin import calibration as cal
from qfa.attention.backends import cpu_kernel, cpu_prepare
from qfa.dropin import rotation
from qfa.dropin.call import DropinCall
from qfa.cast import format as fmt
from qfa.tiling.checks import check_bool

#: The head dimension the native passes take (rotation's native row).
HEAD_DIM = rotation.NATIVE_SIZE
#: The rotation's fp32 normalisation fl(1/sqrt(128)).
ROTATION_C = rotation.normalisation(HEAD_DIM)


def row_strides(t: torch.Tensor, layout: str) -> tuple[tuple[int, int, int], int]:
    """``t`` seen as (A, N, S, 128): its element strides (sA, sN, sS) and N. BNSD and BSND have
    A = batch, S = positions; TND has A = 1 and S = packed tokens."""
    if layout == "BNSD":
        return (t.stride(0), t.stride(1), t.stride(2)), t.shape[1]
    if layout == "BSND":
        return (t.stride(0), t.stride(2), t.stride(1)), t.shape[2]
    return (0, t.stride(1), t.stride(0)), t.shape[1]


def segments(t: torch.Tensor, layout: str, cu_seqlens: Optional[torch.Tensor],
             seqused: Optional[torch.Tensor]) -> Optional[list[int]]:
    """The rows of ``t`` by sequence: flat quadruples (a, first row, valid rows, all rows), one
    per sequence (host reads of the length tensors). The values are checked before, unless a
    caller's plan vouched for them: rows outside ``t`` then give None (the native passes must
    never read out of bounds; the materialised path runs instead)."""
    used = None if seqused is None else seqused.tolist()
    out: list[int] = []
    if layout == "TND":
        cu = cu_seqlens.tolist()
        if any(not 0 <= lo <= hi <= t.shape[0] for lo, hi in zip(cu, cu[1:])) or \
                (used is not None and len(used) != len(cu) - 1):
            return None
        for b, (lo, hi) in enumerate(zip(cu, cu[1:])):
            out += [0, lo, hi - lo if used is None else max(0, min(used[b], hi - lo)), hi - lo]
        return out
    length = t.shape[2 if layout == "BNSD" else 1]
    if used is not None and len(used) != t.shape[0]:
        return None
    for b in range(t.shape[0]):
        out += [b, 0, length if used is None else max(0, min(used[b], length)), length]
    return out


def native_rows(*tensors: torch.Tensor) -> bool:
    """Whether the native passes take these tensors: float dtypes they read, rows of 128, CPU,
    not traced."""
    return all(t.dtype in cpu_prepare.DTYPE_CODES and t.shape[-1] == HEAD_DIM for t in tensors) and \
        cpu_prepare.usable(*tensors)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.numel() == 0 else t.contiguous()


def fused_reduction(calibration: cal.RuleLike | None) -> Optional[cal.Reduction]:
    """The reducible form whose statistics pass 1 computes, or None for rules it does not
    (``"mse"``, user rules: those run on the materialised tensor)."""
    reduction = cal.reduction_of(cal.get_rule(calibration))
    return reduction if reduction is cal.RMS_REDUCTION or reduction is cal.AMAX_REDUCTION else None


def _finish(reduction: cal.Reduction, sumsq: float, amax: float, count: int, name: str) -> tuple[torch.Tensor, float]:
    """The computed scale (fp32 (1,)) and its value. In Python floats, one torch op: the torch ops
    of the tensor finish and of check_scale were a third of this module's host time, and a
    cache-cold call (after SDPA's, in a model) takes many times its warm time for each."""
    stats = (sumsq, float(count)) if reduction is cal.RMS_REDUCTION else (amax,)
    if reduction.finish_value is None:  # pass 1 computes only the built-in reductions, which have it
        scale = cal.check_scale(reduction.finish(torch.tensor(stats, dtype=torch.float64, device="cpu"), name),
                                f"{name} scale from calibration rule")
        return scale, float(scale)
    value = cpu_kernel.round_fp32(reduction.finish_value(stats, name))
    scale = torch.full((1,), value, dtype=torch.float32, device="cpu")
    if not 0 < value < math.inf:  # what check_scale refuses: it raises, naming it
        cal.check_scale(scale, f"{name} scale from calibration rule")
    return scale, value


def key_means(k: torch.Tensor, layout: str, segs: Sequence[int]) -> torch.Tensor:
    """The K means (sequences, N, 128), fp32, of the valid rows of ``segs`` (native pass)."""
    k = _rows(k)
    strides, heads = row_strides(k, layout)
    mu = torch.empty(len(segs) // 4, heads, HEAD_DIM, dtype=torch.float32, device="cpu")
    cpu_prepare.key_means(k, strides, segs, heads, mu)
    return mu


class Rows(NamedTuple):
    """One tensor of :func:`encode_tensors`: float ``x`` (rows of 128 on CPU) and its rows by
    sequence (:func:`segments`); ``scale`` static or None (computed by the rule), and ``check``
    the static scale's check (None: checked already); ``smooth``: subtract the K means, computed
    here, or ``mean`` when given ((sequences, N, 128) fp32); ``name`` for the errors."""

    x: torch.Tensor
    segs: Sequence[int]
    scale: Optional[torch.Tensor] = None
    smooth: bool = False
    mean: Optional[torch.Tensor] = None
    name: str = "x"
    check: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


Encoded = tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int]


def encode_tensors(items: Sequence[Rows], layout: str, *, rotate: bool, reduction: Optional[cal.Reduction]
                   ) -> Optional[list[Encoded]]:
    """The two native passes over each of ``items``, every tensor's pass 1 in one parallel region
    and every pass 2 in another (each region's hand-over costs tens of microseconds, and under
    load each is a chance to wait for a late thread): per item ``(codes, scale, mu, saturated)``,
    codes uint8 contiguous in x's shape, ``mu`` the K means subtracted (None unless ``smooth``).
    A computed scale comes from ``reduction`` over the valid rows. None when a value that a
    computed scale would read is NaN or Inf: the caller's materialised path then raises the error
    naming it. Each tensor's results are those of its passes alone."""
    passes, mus, codes = [], [], []
    for it in items:
        x = _rows(it.x)
        strides, heads = row_strides(x, layout)
        mu, compute = it.mean, False
        if it.smooth and mu is None:
            if it.scale is None:  # pass 1 computes the means first
                mu, compute = torch.empty(len(it.segs) // 4, heads, HEAD_DIM, dtype=torch.float32, device="cpu"), True
            else:
                mu = key_means(x, layout, it.segs)
        mu = mu if it.smooth else None
        out = torch.empty(x.shape, dtype=torch.uint8, device="cpu")
        passes.append(cpu_prepare.RowPass(x, strides, it.segs, heads, rotate, mu, compute, out,
                                          row_strides(out, layout)[0]))
        mus.append(mu)
        codes.append(out)
    # Pass 1 takes the computed scales' tensors, K computing its means first (whole-slab chunks,
    # so that none is left for the region's end); pass 2 all of them in the same order.
    order = sorted(range(len(items)), key=lambda i: (items[i].scale is not None, not passes[i].compute_mean))
    native = cpu_prepare.Passes([passes[i] for i in order])
    computed = [i for i in order if items[i].scale is None]
    found = dict(zip(computed, native.stats(len(computed), ROTATION_C)))
    # The scales in the items' order, as the materialised path takes them: the first bad one is
    # the error raised (a static scale's check, a computed one's finish), or a NaN / Inf met
    # first returns None so that path names its tensor.
    scales, values = list(it.scale for it in items), [0.0] * len(items)
    for i, it in enumerate(items):
        if i not in found:
            scales[i] = it.scale if it.check is None else it.check(it.scale)
            values[i] = float(scales[i])
            continue
        sumsq, amax, nonfinite = found[i]
        if nonfinite:
            return None
        scales[i], values[i] = _finish(reduction, sumsq, amax, sum(it.segs[2::4]) * passes[i].heads * HEAD_DIM, it.name)
    saturated = dict(zip(order, native.encode([values[i] for i in order], ROTATION_C)))
    return [(codes[i], scales[i], mus[i], saturated[i]) for i in range(len(items))]


def encode_rows(x: torch.Tensor, layout: str, segs: Sequence[int], *, rotate: bool, scale: Optional[torch.Tensor],
                reduction: Optional[cal.Reduction], smooth: bool = False, mean: Optional[torch.Tensor] = None,
                name: str = "x") -> Optional[Encoded]:
    """:func:`encode_tensors` of one tensor: ``(codes, scale, mu, saturated)``, or None."""
    done = encode_tensors([Rows(x, segs, scale, smooth, mean, name)], layout, rotate=rotate, reduction=reduction)
    return None if done is None else done[0]


def quantized_inputs(c: DropinCall, check_static: Callable[[torch.Tensor, str, torch.device], torch.Tensor]
                     ) -> Optional[tuple[list[torch.Tensor], list[torch.Tensor], Optional[torch.Tensor]]]:
    """The HiF8 format's codes, scales and K means (or None) of a checked call, by the native
    passes (``check_static(scale, "q" / "k" / "v", device)``: the drop-in's check of a given
    scale); None where they do not apply (another format, a rule pass 1 does not compute, tensors
    off the CPU, tracing) or a computed scale meets NaN/Inf (the materialised path then runs,
    and raises the error naming the tensor)."""
    if c.format != "hif8" or not native_rows(c.q, c.k, c.v):
        return None
    given = (c.q_scale, c.k_scale, c.v_scale)
    reduction = None
    if any(s is None for s in given):
        reduction = fused_reduction(c.calibration)
        if reduction is None:
            return None
    seg_q = segments(c.q, c.layout, c.cu_seqlens_q, c.seqused_q)
    seg_kv = segments(c.k, c.layout, c.cu_seqlens_kv, c.seqused_kv)
    if seg_q is None or seg_kv is None:
        return None
    items = [Rows(t, segs, s, c.smooth_k and name == "k", None, name,
                  None if s is None else (lambda s, name=name, device=t.device: check_static(s, name, device)))
             for t, s, name, segs in ((c.q, c.q_scale, "q", seg_q), (c.k, c.k_scale, "k", seg_kv),
                                      (c.v, c.v_scale, "v", seg_kv))]
    done = encode_tensors(items, c.layout, rotate=c.rotate, reduction=reduction)
    if done is None:
        return None
    return [d[0] for d in done], [d[1] for d in done], done[1][2]


def restore_output(out: torch.Tensor, dtype: torch.dtype, *, into: Optional[torch.Tensor] = None
                   ) -> Optional[torch.Tensor]:
    """``rotation.rotate(out)`` cast to ``dtype`` (finite values beyond its range saturate, as
    :func:`qfa.dropin.eager.saturating_cast`), in one native pass, written into ``into`` (a
    contiguous ``dtype`` tensor of out's shape, e.g. an engine's output buffer) when given; None
    where the native pass does not apply (nothing written)."""
    if not native_rows(out) or dtype not in cpu_prepare.DTYPE_CODES:
        return None
    if into is not None and (into.dtype != dtype or into.shape != out.shape or not into.is_contiguous()
                             or into.device.type != "cpu"):
        return None
    return cpu_prepare.rotate_rows(out.contiguous(), dtype, ROTATION_C, out=into)


def _check_token_rows(x, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in cpu_prepare.DTYPE_CODES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() != 3 or x.shape[-1] != HEAD_DIM:
        raise ValueError(f"{name} must be (tokens, heads, {HEAD_DIM}), got shape {tuple(x.shape)}")


def _check_tokens(x, mean, rotate, scale, calibration) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    check_bool(rotate, "rotate")
    _check_token_rows(x)
    _check_mean(mean, x.shape[1], x.device)
    if scale is not None:
        scale = cal.check_scale(scale, "scale", x.device)
    else:
        cal.get_rule(calibration)  # an unknown name or a non-callable fails here, named
    return mean, scale


def _check_mean(mean, heads: Optional[int], device: Optional[torch.device]) -> None:
    """``mean``: None, or fp32 (heads, 128) on ``device`` (either None: any)."""
    if mean is None:
        return
    if not isinstance(mean, torch.Tensor):
        raise TypeError(f"mean must be None or an fp32 tensor, got {type(mean).__name__}")
    if mean.dtype != torch.float32 or mean.dim() != 2 or mean.shape[1] != HEAD_DIM or \
            (heads is not None and mean.shape[0] != heads):
        expected = f"(heads, {HEAD_DIM})" + ("" if heads is None else f" = {(heads, HEAD_DIM)}")
        raise ValueError(f"mean must be fp32 of shape {expected}, got {mean.dtype} {tuple(mean.shape)}")
    if device is not None and mean.device != device:
        raise ValueError(f"mean must be on x's device {device}, got {mean.device}")


class StaticEncoding:
    """Tokens prepared with a frozen state, as :func:`encode_tokens` and :func:`write_tokens`
    prepare them with a static ``scale``: the codes of ``H (x - mean) / scale``. The state is
    checked once, here; each call checks only its tokens, cache and slots. A serving engine keeps
    one per layer and tensor (its keys, its values, its queries), since a decode step calls each
    for a handful of tokens and the state's checks cost more than the encoding.

    Args:
        scale: positive finite float or fp32 (1,) tensor.
        mean: None, or fp32 (heads, 128): subtracted from every token before the rotation (K
            smoothing with a frozen per-head key mean), in fp32. Its heads fix the tokens'.
        rotate: apply the normalised Hadamard rotation (:func:`qfa.dropin.rotation.rotate`).
        name: what errors call the scale (e.g. ``"k_scale"``).
    """

    def __init__(self, scale: Union[float, torch.Tensor], *, mean: Optional[torch.Tensor] = None,
                 rotate: bool = True, name: str = "scale") -> None:
        check_bool(rotate, "rotate")
        _check_mean(mean, None, None)
        self._set(cal.check_scale(scale, name, mean.device if mean is not None else None), mean, rotate)

    @classmethod
    def _checked(cls, scale: torch.Tensor, mean: Optional[torch.Tensor], rotate: bool) -> "StaticEncoding":
        """One of arguments :func:`_check_tokens` has checked (no second check)."""
        encoding = cls.__new__(cls)
        encoding._set(scale, mean, rotate)
        return encoding

    def _set(self, scale: torch.Tensor, mean: Optional[torch.Tensor], rotate: bool) -> None:
        self.scale = scale
        self.value = float(scale)  # the fp32 value, which the native passes divide by
        self.mean = mean
        self.rotate = rotate
        # the native passes read the mean where it lies, contiguous
        self._native_mean = None if mean is None or mean.device.type != "cpu" else mean.contiguous()
        #: (the token rows' geometry, the native pass bound to it) after a native encode
        self._encoder: Optional[tuple] = None

    def __getstate__(self) -> dict:
        # a copy or a pickle binds afresh: the bound pass holds the mean's address, not the mean
        return {**self.__dict__, "_encoder": None}

    def _check(self, x, name: str = "x") -> None:
        _check_token_rows(x, name)
        if self.mean is not None and (x.shape[1] != self.mean.shape[0] or x.device != self.mean.device):
            raise ValueError(f"{name} must have the mean's {self.mean.shape[0]} heads on its device "
                             f"{self.mean.device}, got {x.shape[1]} heads on {x.device}")

    def _native(self, x: torch.Tensor) -> bool:
        return native_rows(x) and (self.mean is None or self._native_mean is not None)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``(codes, saturated)``: uint8 codes of x's shape (contiguous) of the tokens ``x``
        (tokens, heads, 128; float32, bfloat16 or float16, any strides, not modified), and how
        many finite values of ``H (x - mean) / scale`` reached HiF8's overflow threshold
        (stored as +-MAX). Bit for bit ``calibration.quantize(rotation.rotate(x.float() -
        mean), scale)``: one native pass on CPU, those torch ops elsewhere.

        Rows like the last native call's (a serving engine's queries, step after step) skip
        the checks that call passed: only their geometry is compared."""
        known = self._encoder
        if known is not None and cpu_prepare.usable(x) and _token_geometry(x) == known[0]:
            return known[1](x)
        self._check(x)
        if self._native(x):
            x = _rows(x)  # (an empty x keeps its strides: it is bound only with rows of 128 in place)
            encoder = cpu_prepare.token_encoder(x.dtype, x.shape[1], x.stride(), self.value, ROTATION_C,
                                                mean=self._native_mean, rotate=self.rotate)
            if x.stride(-1) == 1:
                self._encoder = (_token_geometry(x), encoder)
            return encoder(x)
        if self.scale.device != x.device:
            self.scale = self.scale.to(x.device)
        y = x.float() if self.mean is None else x.float() - self.mean
        y = rotation.rotate(y) if self.rotate else y
        codes = cal.quantize(y, self.scale)
        scaled = y / self.scale  # quantize's own division
        saturated = ((scaled.abs() >= fmt.OVERFLOW_THRESHOLD) & torch.isfinite(scaled)).sum()
        return codes.contiguous(), int(saturated)

    def write(self, x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, slots_name: str = "slots") -> int:
        """:meth:`encode`'s codes of ``x`` written into a paged cache: ``cache`` is uint8
        (blocks, heads, block_size, 128) (a PA_BNBD K or V view), and token t's rows go to block
        ``slots[t] // block_size`` at offset ``slots[t] % block_size``; a negative slot skips
        its token (a serving engine's padding). Returns the saturated count. All or nothing: a
        slot beyond the cache, or one two tokens name, raises a ValueError naming
        ``slots_name`` and leaves the cache as it was. On CPU one native pass (no codes tensor in
        between); elsewhere :meth:`encode` and an indexed write, same bits."""
        self._check(x)
        _check_cache(cache, x, "cache")
        _check_slots(slots, x, slots_name)
        capacity = cache.shape[0] * cache.shape[2]
        if self._native(x) and cpu_prepare.usable(cache, slots):
            written = cpu_prepare.write_token_rows(_rows(x), cache, slots.contiguous(), self.value, ROTATION_C,
                                                   mean=self._native_mean, rotate=self.rotate)
            if isinstance(written, cpu_prepare.SlotRefused):
                raise _slot_error(written, slots, capacity, slots_name)
            return written
        real = slots >= 0
        named = slots[real].long()
        if named.numel() and int(named.max()) >= capacity:
            token = int(((slots >= capacity) & real).nonzero()[0, 0])
            raise _slot_error(cpu_prepare.SlotRefused(token, False), slots, capacity, slots_name)
        if named.unique().numel() != named.numel():
            order = slots.tolist()
            token = next(t for t, s in enumerate(order) if s >= 0 and s in order[:t])
            raise _slot_error(cpu_prepare.SlotRefused(token, True), slots, capacity, slots_name)
        codes, saturated = self.encode(x if bool(real.all()) else x[real])
        block_size = cache.shape[2]
        cache[named // block_size, :, named % block_size] = codes.to(cache.device)
        return saturated


def _check_cache(cache, x: torch.Tensor, name: str) -> None:
    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8 or cache.dim() != 4 or \
            tuple(cache.shape[1::2]) != (x.shape[1], HEAD_DIM):
        raise ValueError(f"{name} must be uint8 (blocks, heads, block_size, {HEAD_DIM}) with x's {x.shape[1]} "
                         f"heads, got {getattr(cache, 'dtype', type(cache).__name__)} "
                         f"{tuple(getattr(cache, 'shape', ()))}")
    if cache.numel() and cache.stride(-1) != 1:  # what the native pass needs, refused on every path alike
        raise ValueError(f"{name} must have contiguous rows (last stride 1), got strides {cache.stride()}")


def _check_slots(slots, x: torch.Tensor, name: str) -> None:
    if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.int32, torch.int64) or \
            tuple(slots.shape) != (x.shape[0],):
        raise ValueError(f"{name} must be int32 / int64 of shape ({x.shape[0]},) (one slot per token), got "
                         f"{getattr(slots, 'dtype', type(slots).__name__)} {tuple(getattr(slots, 'shape', ()))}")


def write_keys_values(keys: StaticEncoding, values: StaticEncoding, k: torch.Tensor, v: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                      slots_name: str = "slots") -> int:
    """``keys.write(k, k_cache, slots) + values.write(v, v_cache, slots)`` as one call (a serving
    engine's step: its keys and values into a paged cache's K and V views), all or nothing:
    every argument and slot is checked before a byte of either is written. On CPU, with k and
    v alike in dtype and the views alike in layout, one native pass over both."""
    keys._check(k, "k")
    values._check(v, "v")
    if v.shape != k.shape:
        raise ValueError(f"v must be shaped as k {tuple(k.shape)}, got {tuple(v.shape)}")
    _check_cache(k_cache, k, "k_cache")
    _check_cache(v_cache, v, "v_cache")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must be shaped as k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    _check_slots(slots, k, slots_name)
    if _one_pass(keys, values, k, v, k_cache, v_cache, slots):
        written = cpu_prepare.write_kv_rows(_rows(k), _rows(v), k_cache, v_cache, slots.contiguous(), keys.value,
                                            values.value, ROTATION_C, mean=keys._native_mean, rotate=keys.rotate)
        return _written(written, slots, k_cache, slots_name)
    # what the first write accepts (its slots, against the same cache geometry), the second does
    return keys.write(k, k_cache, slots, slots_name) + values.write(v, v_cache, slots, slots_name)


def _one_pass(keys: StaticEncoding, values: StaticEncoding, k: torch.Tensor, v: torch.Tensor,
              k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> bool:
    """Whether :func:`write_keys_values` (its arguments checked) writes keys and values in one
    native pass."""
    return keys.rotate == values.rotate and values.mean is None and v.dtype == k.dtype and keys._native(k) and \
        values._native(v) and v_cache.stride() == k_cache.stride() and \
        cpu_prepare.usable(k_cache, v_cache, slots)


def _written(written, slots: torch.Tensor, k_cache: torch.Tensor, slots_name: str) -> int:
    if isinstance(written, cpu_prepare.SlotRefused):
        raise _slot_error(written, slots, k_cache.shape[0] * k_cache.shape[2], slots_name)
    return written


def _token_geometry(x: torch.Tensor) -> tuple:
    """What a bound native pass fixes of token rows (T, N, 128), T aside: dtype, heads, strides,
    on the CPU, the SIMD level asked for."""
    return x.dtype, x.shape[1:], x.stride(), x.is_cpu, cpu_prepare.ISA


class KVWriter:
    """:func:`write_keys_values` with its encodings and paged cache views fixed: a serving
    engine's layer writes each step's few tokens into the same cache. The first write checks
    everything, as write_keys_values does, and binds its native pass (a single pass over keys
    and values with rows of 128 in place and contiguous slots). Each later write whose keys,
    values and slots are like the bound one's (dtype, heads, strides, CPU, the slots' dtype; any
    token count), into caches still at the bound addresses, compares only that and runs the
    same pass, which checks the slots' values before writing (all or nothing). Anything else
    takes write_keys_values whole. Copies and pickles bind afresh."""

    def __init__(self, keys: StaticEncoding, values: StaticEncoding, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots_name: str = "slots") -> None:
        self.keys, self.values, self.k_cache, self.v_cache = keys, values, k_cache, v_cache
        self.slots_name = slots_name
        self._bound: Optional[tuple] = None  # (the tokens' geometry, the bound native pass)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_bound": None}  # the bound pass holds the caches' addresses

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> int:
        """:func:`write_keys_values` of ``k`` and ``v`` at ``slots``; returns the saturated count."""
        bound = self._bound
        if bound is not None and cpu_prepare.usable(k, v, slots) and self._geometry(k, v, slots) == bound[0]:
            return _written(bound[1](k, v, slots), slots, self.k_cache, self.slots_name)
        written = write_keys_values(self.keys, self.values, k, v, self.k_cache, self.v_cache, slots, self.slots_name)
        if _one_pass(self.keys, self.values, k, v, self.k_cache, self.v_cache, slots) and k.stride(-1) == 1 and \
                v.stride(-1) == 1 and slots.stride() == (1,):
            writer = cpu_prepare.kv_writer(self.k_cache, self.v_cache, k.dtype, k.stride(), v.stride(),
                                           self.keys.value, self.values.value, ROTATION_C,
                                           mean=self.keys._native_mean, rotate=self.keys.rotate)
            self._bound = (self._geometry(k, v, slots), writer)
        return written

    def _geometry(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> tuple:
        tokens = k.shape[:1]  # any dimensions: a 0-d tensor differs here, and is then refused, named
        # the caches' addresses too: a cache re-pointed in place (set_, a storage resize) binds afresh
        return (_token_geometry(k), _token_geometry(v), v.shape[:1] == tokens, slots.shape == tokens, slots.dtype,
                slots.stride(), slots.is_cpu, self.k_cache.data_ptr(), self.v_cache.data_ptr())


def encode_tokens(x: torch.Tensor, *, mean: Optional[torch.Tensor] = None, rotate: bool = True,
                  scale: Union[float, torch.Tensor, None] = None,
                  calibration: cal.RuleLike | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HiF8 codes of a batch of tokens, prepared as the drop-in prepares K or V (or Q): the
    codes of ``H (x - mean) / scale``, in at most two passes over ``x`` and no fp32 copy of it.

    Args:
        x: (tokens, heads, 128), float32, bfloat16 or float16, any strides (the last one 1 is
            fastest). Not modified.
        mean: None, or fp32 (heads, 128) on x's device: subtracted from every token before the
            rotation (K smoothing with a frozen per-head key mean), in fp32.
        rotate: apply the normalised Hadamard rotation (:func:`qfa.dropin.rotation.rotate`).
        scale: a static scale (positive finite float or fp32 (1,) tensor); None computes it
            from the prepared tokens with ``calibration``.
        calibration: the rule for a computed scale (a registered name or a callable; None is
            :data:`~qfa.dropin.calibration.DEFAULT_RULE`). Ignored when ``scale`` is given.

    Returns:
        ``(codes, scale, saturated)``: uint8 codes of x's shape (contiguous), the fp32 (1,) scale
        used, and a 0-d int64 tensor counting the finite values of ``(H (x - mean)) / scale``
        at or beyond HiF8's overflow threshold (stored as +-MAX; nonzero means the scale is too
        small for these tokens). The codes are bit for bit
        ``calibration.quantize(rotation.rotate(x.float() - mean), scale)`` and a computed scale
        is ``calibration.compute_scale`` of that tensor (for ``"rms"`` up to a float64 tie, see
        the module doc).

    Raises:
        TypeError / ValueError naming the argument for a bad ``x``, ``mean``, ``scale`` or
        ``calibration``; ValueError when a computed scale meets NaN or Inf in the prepared
        tokens (with a static scale they become HiF8's NaN / +-Inf codes).

    On CPU this is the native passes (pass 1 only for a computed ``"rms"`` / ``"amax"`` scale);
    elsewhere, and for other rules, the same functions in torch ops.
    """
    mean, scale = _check_tokens(x, mean, rotate, scale, calibration)
    if scale is not None:
        codes, saturated = StaticEncoding._checked(scale, mean, rotate).encode(x)
        return codes, scale, torch.tensor(saturated, dtype=torch.int64, device=x.device)
    reduction = fused_reduction(calibration)
    if native_rows(x) and (mean is None or mean.device.type == "cpu") and reduction is not None:
        segs = [0, 0, x.shape[0], x.shape[0]]
        mu = None if mean is None else mean.reshape(1, *mean.shape).contiguous()
        done = encode_rows(x, "TND", segs, rotate=rotate, scale=None, reduction=reduction, smooth=mu is not None,
                           mean=mu, name="x")
        if done is not None:
            codes, scale, _, saturated = done
            return codes, scale, torch.tensor(saturated, dtype=torch.int64, device=x.device)
    y = x.float() if mean is None else x.float() - mean
    y = rotation.rotate(y) if rotate else y
    cal.check_finite(y, "x")
    scale = cal.compute_scale(y, calibration)
    codes = cal.quantize(y, scale)
    scaled = y / scale  # quantize's own division
    saturated = ((scaled.abs() >= fmt.OVERFLOW_THRESHOLD) & torch.isfinite(scaled)).sum()
    return codes.contiguous(), scale, saturated


def _slot_error(refused: cpu_prepare.SlotRefused, slots: torch.Tensor, capacity: int, name: str) -> ValueError:
    slot = int(slots[refused.token])
    if refused.repeated:
        first = int((slots == slot).nonzero()[0, 0])
        return ValueError(f"{name} names slot {slot} for tokens {first} and {refused.token}: a call writes each slot once")
    return ValueError(f"{name} holds slot {slot} (token {refused.token}), beyond the cache's {capacity} slots")


def write_tokens(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor, *,
                 mean: Optional[torch.Tensor] = None, rotate: bool = True, slots_name: str = "slots") -> int:
    """:func:`encode_tokens`' codes of ``x`` (tokens, heads, 128) with a static ``scale`` written
    into a paged cache (:meth:`StaticEncoding.write`, which says how; an engine writing many
    calls with one state keeps the :class:`StaticEncoding`)."""
    mean, scale = _check_tokens(x, mean, rotate, scale, None)
    return StaticEncoding._checked(scale, mean, rotate).write(x, cache, slots, slots_name)
