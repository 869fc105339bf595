"""Per-tensor scales for HiF8 quantisation: named calibration rules, observers, ``quantize``.

A *scale* ``s`` is an fp32 tensor of shape ``(1,)``: a tensor ``x`` is stored as the HiF8 codes
of ``x / s`` and recovered as ``decode(codes) * s`` (``s`` is what ``quant_flash_attn`` calls a
descale). A *calibration rule* maps a float tensor to such a scale. Rules are looked up by name
in a small registry (:data:`RULES`, :func:`register_rule`, :func:`get_rule`):

``"amax"``
    ``s = amax / 32768``: the tensor's absolute maximum lands on HiF8's MAX. This is the rule
    upstream's tests use. For a tapered format it is a poor choice: with amax at 2^15 the bulk
    of a tensor sits in the binades with 1 or 2 mantissa bits.
``"rms"``
    ``s = 2^round(log2(rms(x)))``: a power of two that puts the tensor's RMS within a factor
    sqrt(2) of 1, where HiF8 keeps 3 mantissa bits (|E| <= 3) and 22 binades of headroom
    below and 15 above.
``"mse"``
    The power-of-two scale that minimises the HiF8 round-trip MSE of the tensor, searched over
    the exponents around the RMS one (``MSE_EXPONENT_OFFSETS``), evaluated on a deterministic
    subsample of at most ``MSE_SAMPLE`` elements (plus the largest one), one vectorised encode
    per candidate.

Power-of-two scales make ``x / s`` exact, so the only rounding is HiF8's own. Every rule
returns 1.0 for an all-zero (or empty) tensor and raises ``ValueError`` on NaN or Inf.

For static (frozen) scales, :class:`ScaleObserver` gathers statistics over several sample
batches and applies a rule to them once at the end: the exact statistics of a rule's reducible
form when it has one, else the exact absolute maximum and a bounded, deterministic subsample.

Reducible rules and tensor parallel
-----------------------------------
A rule may have a *reducible form* (:class:`Reduction`): a few float64 statistics of the values,
each with the op that combines two sets of them (``"max"`` or ``"sum"``), and a finish step from
the combined statistics to the scale. ``"amax"`` has one (the absolute maximum, MAX) and so has
``"rms"`` (the sum of squares and the element count, SUM); ``"mse"`` has none (its search runs on
a strided subsample of the flattened tensor, which no per-shard statistic determines). The
reducible form lets a scale be computed from pieces: batches in :class:`ScaleObserver`, and head
shards across the ranks of a tensor-parallel group (:func:`sharded_scale`, one small all_reduce
per tensor). A rule without one is applied to the whole tensor, gathered from the shards (exact
for every rule, at the cost of moving the tensor). See :mod:`qfa.dropin.distributed`.

Exactness: MAX is exact in any order, so ``"amax"`` from shards or batches is bit for bit the
unsharded rule. The float64 sum of squares summed in another order (per shard, then across
ranks) can differ from the unsharded one in its last bits; ``"rms"`` rounds log2(rms) to an
integer, which hides that except when log2(rms) sits within a few float64 ulps of a
half-integer (a tie of the rounding), where the two can pick neighbouring powers of two.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

from qfa.cast import decode_from_hifloat8, encode_to_hifloat8
from qfa.attention.backends import cpu_prepare
from qfa.dropin import distributed
from qfa.cast import format as fmt

#: A calibration rule: float tensor -> fp32 scale of shape (1,).
Rule = Callable[[torch.Tensor], torch.Tensor]
#: What the public APIs accept for ``calibration``: a registered name or a rule.
RuleLike = Union[str, Rule]

#: Exponent offsets (relative to the RMS rule's exponent) that the ``"mse"`` rule tries.
MSE_EXPONENT_OFFSETS = tuple(range(-2, 7))
#: Elements the ``"mse"`` rule evaluates at most (a strided subsample above this size). Below
#: 2^16 elements per encode the cast runs eagerly (no one-off compile), which is cheapest here.
MSE_SAMPLE = (1 << 16) - 2
#: fp32 scales stay normal powers of two.
_MIN_SCALE_EXPONENT, _MAX_SCALE_EXPONENT = -126, 127

#: The rule used when none is named, chosen by ``python -m qfa bench calibration`` on a real
#: model's attention activations (Qwen2.5-Coder-1.5B-Instruct, all 28 layers, three text
#: windows; see the README's table). With K smoothing, "rms" and "mse" tie within 1 % of each
#: other in attention output error (rms best on 2 of 3 windows) and both cut "amax"'s error by
#: 3.5x; "rms" wins the tie for costing one reduction and no search.
DEFAULT_RULE = "rms"


def _as_float(x: torch.Tensor, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    return x.detach().reshape(-1).float()


def _amax(flat: torch.Tensor, name: str = "x") -> torch.Tensor:
    """Absolute maximum (0-d fp32); ValueError when ``flat`` holds NaN or Inf."""
    if flat.numel() == 0:
        return flat.new_zeros(())
    amax = flat.abs().amax()  # NaN propagates through amax
    if not bool(torch.isfinite(amax)):
        raise ValueError(f"{name} contains NaN or Inf values; a per-tensor HiF8 scale needs finite values")
    return amax


def check_finite(x: torch.Tensor, name: str, static: str = "scales=...") -> None:
    """ValueError naming ``name`` when ``x`` holds NaN or Inf (a per-tensor scale needs finite
    values); one reduction in ``x``'s dtype, no float copy. ``static``: how the caller gives a
    static scale instead (the error says so)."""
    if x.numel() and not bool(torch.isfinite(x.detach().abs().amax())):
        raise ValueError(f"{name} contains NaN or Inf values; a per-tensor HiF8 scale needs finite values "
                         f"(with static scales, {static}, NaN/Inf are quantised to HiF8's NaN/Inf codes)")


def _one(flat: torch.Tensor) -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32, device=flat.device)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    return torch.exp2(exponent.clamp(_MIN_SCALE_EXPONENT, _MAX_SCALE_EXPONENT)).reshape(1).float()


def _pow2_value(exponent: int) -> float:
    """:func:`_pow2` of a Python int: 2^exponent, clamped alike (an fp32 value)."""
    return math.ldexp(1.0, min(max(exponent, _MIN_SCALE_EXPONENT), _MAX_SCALE_EXPONENT))


def _rms_exponent(flat: torch.Tensor) -> torch.Tensor:
    """round(log2(rms)) as a 0-d fp32 tensor (rms > 0)."""
    # The norm accumulated in float64 (no overflow for fp32 inputs near their max), without
    # materialising a float64 copy: 10x faster than squaring one.
    rms = torch.linalg.vector_norm(flat, dtype=torch.float64) / math.sqrt(flat.numel())
    return torch.round(torch.log2(rms)).float()


def amax_scale(x: torch.Tensor) -> torch.Tensor:
    """``amax / 32768``: maps the absolute maximum onto HiF8's MAX (upstream's rule)."""
    flat = _as_float(x)
    amax = _amax(flat)
    if amax == 0:
        return _one(flat)
    return (amax / fmt.MAX).reshape(1).float()


def rms_scale(x: torch.Tensor) -> torch.Tensor:
    """The power of two nearest the tensor's RMS (in log2): puts the RMS within sqrt(2) of 1."""
    flat = _as_float(x)
    if _amax(flat) == 0:
        return _one(flat)
    return _pow2(_rms_exponent(flat))


def _subsample(flat: torch.Tensor, limit: int) -> torch.Tensor:
    """At most ``limit`` (+1) elements: a strided subsample plus the element of largest magnitude.

    The stride is odd, hence coprime with the power-of-two head dimension, so the sample walks
    through all channels instead of repeating a few (K's channels differ a lot).
    """
    n = flat.numel()
    if n <= limit:
        return flat
    step = -(-n // limit) | 1
    return torch.cat([flat[::step], flat[flat.abs().argmax()].reshape(1)])


def hif8_roundtrip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``decode(quantize(x, scale)) * scale`` in fp32: what HiF8 storage with ``scale`` keeps of ``x``."""
    return decode_from_hifloat8(quantize(x, scale), torch.float32) * scale.float()


def mse_scale(x: torch.Tensor) -> torch.Tensor:
    """The power-of-two scale minimising HiF8 round-trip MSE, among exponents near the RMS one."""
    flat = _as_float(x)
    if _amax(flat) == 0:
        return _one(flat)
    sample = _subsample(flat, MSE_SAMPLE)
    e0 = _rms_exponent(flat)
    exps = [(e0 + o).clamp(_MIN_SCALE_EXPONENT, _MAX_SCALE_EXPONENT) for o in MSE_EXPONENT_OFFSETS]
    errors = []
    for e in exps:  # one vectorised encode/decode per candidate (powers of two: exact division)
        s = torch.exp2(e)
        back = decode_from_hifloat8(encode_to_hifloat8(sample / s), torch.float32) * s
        errors.append((back - sample).double().square().mean())
    # argmin takes the first minimum: on ties the smallest scale (most resolution) wins.
    return _pow2(exps[int(torch.argmin(torch.stack(errors)))])


@dataclass(frozen=True)
class Reduction:
    """A rule's reducible form: statistics that combine by ``ops`` and a finish step.

    ``statistics(flat)`` maps the 1-D fp32 values to a float64 tensor of ``len(ops)`` entries
    (NaN or Inf values must give non-finite statistics, so the finish can refuse them after the
    combination, on every rank alike); ``ops[i]`` (``"max"`` or ``"sum"``) combines entry ``i``
    of two sets of statistics; ``finish(stats, name)`` turns combined statistics into the fp32
    (1,) scale, raising ValueError naming ``name`` when they are not finite. ``finish_value``,
    optional, is the same finish on the statistics as Python floats, returning the scale's value
    (a float whose fp32 rounding is the scale): the native preparation calls it where given,
    which spares the tensor ops (see :func:`finish_in_floats`).
    """

    ops: tuple[str, ...]
    statistics: Callable[[torch.Tensor], torch.Tensor]
    finish: Callable[[torch.Tensor, str], torch.Tensor]
    finish_value: Optional[Callable[[Sequence[float], str], float]] = None

    def merge(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Two sets of statistics combined by :attr:`ops` (what batches in an observer need)."""
        return torch.stack([torch.maximum(x, y) if op == "max" else x + y for x, y, op in zip(a, b, self.ops)])


def _finish_tensor(value: Callable[[Sequence[float], str], float], stats: torch.Tensor, name: str = "x") -> torch.Tensor:
    return torch.tensor([value(stats.tolist(), name)], dtype=torch.float32, device=stats.device)


def finish_in_floats(value: Callable[[Sequence[float], str], float]) -> Callable[[torch.Tensor, str], torch.Tensor]:
    """A Reduction's tensor ``finish`` from its float one: the statistics read as Python floats,
    the value rounded to the fp32 (1,) scale on their device (one definition serves both; a
    partial of module-level functions, so a Reduction pickles)."""
    return functools.partial(_finish_tensor, value)


def _nonfinite_error(name: str) -> ValueError:
    return ValueError(f"{name} contains NaN or Inf values; a per-tensor HiF8 scale needs finite values")


def _amax_statistics(flat: torch.Tensor) -> torch.Tensor:
    if flat.numel() == 0:
        return torch.zeros(1, dtype=torch.float64, device=flat.device)
    amax = flat.abs().amax()
    # NaN through a MAX all_reduce is backend-defined: make any non-finite value +inf first.
    return torch.where(torch.isfinite(amax), amax, math.inf).double().reshape(1)


def _amax_finish(stats: Sequence[float], name: str = "x") -> float:
    (amax,) = stats
    if not math.isfinite(amax):
        raise _nonfinite_error(name)
    if amax == 0:
        return 1.0
    # a power-of-two division: exact in float64, and the fp32 amax's quotient is an fp32 value
    # (or, below fp32's range, one that the scale's fp32 tensor rounds, as the tensor rule does)
    return amax / fmt.MAX


def _rms_statistics(flat: torch.Tensor) -> torch.Tensor:
    # The squared float64 norm (as _rms_exponent takes it: no float64 copy of the tensor); the
    # count is exact in float64 below 2^53 elements.
    sumsq = torch.linalg.vector_norm(flat, dtype=torch.float64).square()
    return torch.stack([sumsq, sumsq.new_tensor(float(flat.numel()))])


def _rms_finish(stats: Sequence[float], name: str = "x") -> float:
    # In Python floats: the tensor rule's float64 steps (IEEE division and square root, log2,
    # round half to even), without the dozen tensor ops that cost 67 us per tensor in the
    # drop-in's preparation (a fifth of it at S = 1024 on the Zen 4 EPYC).
    sumsq, count = stats
    if not math.isfinite(sumsq):
        raise _nonfinite_error(name)
    if sumsq == 0:  # a float64 square of a nonzero fp32 value is never 0: all values are 0
        return 1.0
    return _pow2_value(round(math.log2(math.sqrt(sumsq / count))))


AMAX_REDUCTION = Reduction(("max",), _amax_statistics, finish_in_floats(_amax_finish), _amax_finish)
RMS_REDUCTION = Reduction(("sum", "sum"), _rms_statistics, finish_in_floats(_rms_finish), _rms_finish)

#: name -> rule. Add your own with :func:`register_rule`.
RULES: dict[str, Rule] = {"amax": amax_scale, "rms": rms_scale, "mse": mse_scale}
#: rule -> its reducible form, for the rules that have one (keyed by the function itself).
_REDUCTIONS: dict[Rule, Reduction] = {amax_scale: AMAX_REDUCTION, rms_scale: RMS_REDUCTION}


def reduction_of(rule: Rule) -> Optional[Reduction]:
    """``rule``'s reducible form, or None when it has none (then shards must be gathered)."""
    return _REDUCTIONS.get(rule)


def register_rule(name: str, rule: Rule, *, overwrite: bool = False, reduction: Optional[Reduction] = None) -> None:
    """Make ``rule`` (float tensor -> fp32 (1,) scale) selectable as ``calibration=name``.

    ``reduction``: optionally its reducible form (:class:`Reduction`), which must give the
    rule's scale from the statistics of the whole tensor; without one, tensor-parallel calls
    gather the whole tensor for this rule and observers keep a subsample.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if not callable(rule):
        raise TypeError(f"rule must be callable (tensor -> fp32 scale of shape (1,)), got {type(rule).__name__}")
    if reduction is not None and not isinstance(reduction, Reduction):
        raise TypeError(f"reduction must be a qfa.dropin.calibration.Reduction or None, "
                        f"got {type(reduction).__name__}")
    if reduction is not None and any(op not in distributed.REDUCE_OPS for op in reduction.ops):
        raise ValueError(f"reduction.ops must each be one of {distributed.REDUCE_OPS}, got {reduction.ops!r}")
    if name in RULES and not overwrite:
        raise ValueError(f"calibration rule {name!r} already exists; pass overwrite=True to replace it")
    RULES[name] = rule
    if reduction is not None:
        _REDUCTIONS[rule] = reduction


def get_rule(calibration: RuleLike | None) -> Rule:
    """The rule named by ``calibration`` (None: :data:`DEFAULT_RULE`), or ``calibration`` if callable."""
    if calibration is None:
        calibration = DEFAULT_RULE
    if isinstance(calibration, str):
        try:
            return RULES[calibration]
        except KeyError:
            raise ValueError(
                f"calibration must be one of {sorted(RULES)} or a callable, got {calibration!r}"
            ) from None
    if callable(calibration):
        return calibration
    raise TypeError(f"calibration must be a rule name (str) or a callable, got {type(calibration).__name__}")


def apply_rule(rule: Rule, x: torch.Tensor, name: str, static: str = "scales=...") -> torch.Tensor:
    """``rule(x)`` checked as a scale, its errors naming ``x`` as the caller knows it (``name``).

    A rule names its own parameter (``x contains NaN or Inf``), which the caller of a cache or
    of the drop-in never passed; NaN or Inf is what makes the built-in rules raise, so when a
    rule raises ValueError on a non-finite ``x`` the error names ``name`` instead. The
    finiteness is looked at only then: the happy path costs the rule alone. ``static``: as in
    :func:`check_finite`."""
    try:
        scale = rule(x)
    except ValueError:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            check_finite(x, name, static)
        raise
    return check_scale(scale, f"{name} scale from the calibration rule")


def compute_scale(x: torch.Tensor, calibration: RuleLike | None = None, *, name: str = "x",
                  static: str = "scales=...") -> torch.Tensor:
    """fp32 scale of shape (1,) for ``x`` by the named rule (default :data:`DEFAULT_RULE`);
    errors call ``x`` ``name`` (the caller's name for it; ``static`` as in :func:`check_finite`)."""
    return apply_rule(get_rule(calibration), x, name, static)


def sharded_scale(rule: Rule, part: torch.Tensor, name: str, process_group: distributed.ProcessGroup,
                  whole: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The scale ``rule`` gives the tensor whose head shards the ranks of ``process_group`` hold.

    ``part`` is this rank's shard (its valid values); ``whole()`` gathers the whole tensor's
    valid values (a collective, so every rank calls it or none). A rule with a reducible form
    all-reduces its statistics (exact for ``"amax"``; ``"rms"`` up to a tie, see the module
    doc); any other rule runs on ``whole()``: exact, at the cost of the gather. NaN or Inf on
    any rank is a ValueError on every rank (found after the collective, so none is left
    waiting in it).
    """
    reduction = reduction_of(rule)
    if reduction is not None:
        stats = distributed.all_reduce_statistics(reduction.statistics(_as_float(part, name)), reduction.ops,
                                                  process_group)
        return check_scale(reduction.finish(stats, name), f"{name} scale from calibration rule")
    full = whole()
    check_finite(full, name)
    return check_scale(rule(full), f"{name} scale from calibration rule")


def check_scale(scale, name: str = "scale", device: torch.device | None = None) -> torch.Tensor:
    """``scale`` as a positive, finite fp32 tensor of shape (1,); float/int accepted."""
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        # checked here, so a number is refused even for a meta device (where a tensor has no value);
        # on the CPU unless told: a default device of meta (model building) must not swallow it
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{name} must be positive and finite, got {float(scale)}")
        scale = torch.tensor([float(scale)], dtype=torch.float32, device="cpu" if device is None else device)
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a float or an fp32 tensor of shape (1,), got {type(scale).__name__}")
    if scale.numel() != 1:
        raise ValueError(f"{name} must hold one value (shape (1,)), got shape {tuple(scale.shape)}")
    if not scale.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {scale.dtype}")
    if scale.device.type == "meta" and (device is None or device.type != "meta"):
        raise ValueError(f"{name} is on the meta device, which holds no value: pass a float or a tensor on "
                         f"{'a real device' if device is None else device}")
    scale = scale.detach().reshape(1).float()
    if scale.device.type != "meta":  # a meta scale of a meta call has no value to check (its outputs are meta)
        value = float(scale)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be positive and finite, got {value}")
    if device is not None and scale.device != device:
        scale = scale.to(device)
    return scale


def quantize(x: torch.Tensor, scale) -> torch.Tensor:
    """HiF8 codes (uint8) of ``x / scale``, saturating: finite values beyond MAX become +-MAX.

    ``scale`` is a positive float or an fp32 tensor of shape (1,). The division runs in fp32.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    scale = check_scale(scale, "scale", x.device)
    if x.dtype in cpu_prepare.DTYPE_CODES and cpu_prepare.usable(x):  # the same bits in one pass, no fp32 copy
        return cpu_prepare.quantize_flat(x.detach().contiguous(), float(scale))[0]
    return encode_to_hifloat8(x.float() / scale, overflow="saturate")


def dequantize(codes: torch.Tensor, scale, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``decode(codes) * scale`` as ``dtype`` (the product is formed in fp32)."""
    scale = check_scale(scale, "scale", codes.device if isinstance(codes, torch.Tensor) else None)
    return (decode_from_hifloat8(codes, torch.float32) * scale).to(dtype)


class ScaleObserver:
    """Gathers one tensor's statistics over sample batches; :meth:`scale` applies a rule to them.

    For a rule with a reducible form (``"amax"``, ``"rms"``; :class:`Reduction`) it keeps that
    form's exact statistics, combined over the batches: the frozen scale is the rule's scale of
    all observed values together (for ``"rms"`` up to a rounding tie, see the module doc).
    For other rules it keeps copies, never views of the observed tensors (the caller may reuse
    its buffers): the exact absolute maximum and a deterministic, bounded subsample (an odd
    stride through each observed batch, at most ``per_batch`` values; the pool is thinned by
    half when it exceeds ``max_pool``), and the rule sees the pool plus the extreme value.

    ``process_group``: the tensor-parallel group whose ranks observe the head shards of the
    same tensors. :meth:`scale` then combines the ranks' statistics (all_reduce; every rank must
    call it): for reducible rules the scale is then the unsharded observer's (bit for bit for
    ``"amax"``, up to a tie for ``"rms"``). For pool-based rules the ranks' pools (each with its
    extreme value) are gathered in rank order and the rule runs on their concatenation: a
    sample of all shards, but not the unsharded observer's sample, so the scale can differ
    from the unsharded one.
    """

    def __init__(self, calibration: RuleLike | None = None, *, per_batch: int = 1 << 15, max_pool: int = 1 << 18,
                 process_group: Optional[distributed.ProcessGroup] = None):
        self.rule = get_rule(calibration)
        self.reduction = reduction_of(self.rule)
        self.process_group = distributed.check_process_group(process_group)
        self.per_batch = int(per_batch)
        self.max_pool = int(max_pool)
        self.reset()

    def reset(self) -> None:
        self._pool: list[torch.Tensor] = []
        self._pooled = 0
        self._extreme: torch.Tensor | None = None
        self._stats: torch.Tensor | None = None
        self.batches = 0

    def observe(self, x: torch.Tensor, name: str = "x") -> None:
        flat = _as_float(x, name)
        if flat.numel() == 0:
            return
        amax = _amax(flat, name)
        self.batches += 1
        if self.reduction is not None:  # fresh tensors: nothing aliases the caller's buffer
            stats = self.reduction.statistics(flat)
            self._stats = stats if self._stats is None else self.reduction.merge(self._stats, stats)
            return
        # Copies, never views: ``flat`` may alias the caller's tensor (a data loader refills one
        # buffer), and a view would see the next batch's values instead of this one's.
        if self._extreme is None or amax > self._extreme.abs()[0]:
            self._extreme = flat[flat.abs().argmax()].reshape(1).clone()
        sample = _subsample(flat, self.per_batch)
        self._pool.append(sample.clone())
        self._pooled += sample.numel()
        if self._pooled > self.max_pool:
            merged = torch.cat(self._pool)[::2]
            self._pool, self._pooled = [merged], merged.numel()

    def scale(self) -> torch.Tensor:
        if self.batches == 0:
            raise ValueError("no (non-empty) batch was observed: nothing to calibrate from")
        name = "scale returned by the calibration rule"
        if self.reduction is not None:
            stats = self._stats
            if self.process_group is not None:
                stats = distributed.all_reduce_statistics(stats, self.reduction.ops, self.process_group)
            return check_scale(self.reduction.finish(stats, "observed values"), name)
        values = torch.cat([*self._pool, self._extreme])
        if self.process_group is not None:
            values = distributed.gather_flat(values, self.process_group)
        return check_scale(self.rule(values), name)
