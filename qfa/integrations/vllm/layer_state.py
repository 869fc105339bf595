"""A layer's frozen HiF8 cache state: K/V scales, the K mean, and how tokens are prepared.

One definition, used by the vLLM backend (its cache writes and queries) and by ``qfa
calibrate`` (the file it writes): what is measured offline is exactly what the engine applies.

A key is stored as ``HiF8((H (k - mu)) / k_scale)`` and a value as ``HiF8((H v) / v_scale)``:
``mu`` is the layer's per-head, per-channel key mean (K smoothing) and ``H`` the normalised
128 x 128 Hadamard rotation. Both are exact for attention: subtracting a fixed vector from every
key shifts each score row by a constant, which softmax ignores, and ``H`` is orthogonal, so a
query rotated by ``H`` scores rotated keys as it scores the originals, and ``P (V H) H = P V``.
Once ``mu`` and the scales are fixed, a token's codes depend on the token alone: blocks with the
same tokens hold the same codes, which is what vLLM's prefix caching shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from qfa.dropin import calibration as cal
from qfa.dropin import rotation
from qfa.dropin.prepare import KVWriter, StaticEncoding, write_keys_values


@dataclass(frozen=True)
class Transform:
    """What is applied to a layer's tokens before encoding: K smoothing and the rotation."""

    smooth_k: bool = True
    rotate: bool = True

    def rotated(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ H`` over the last dimension when rotating, else ``x`` in fp32."""
        return rotation.rotate(x) if self.rotate else x.float()


def _finite_values(x: torch.Tensor) -> torch.Tensor:
    """The finite elements of ``x``, flat: a scale is measured on them, never on NaN or Inf
    (which are stored as HiF8 NaN / saturate, as any later token's would)."""
    flat = x.reshape(-1)
    finite = torch.isfinite(flat)
    return flat if bool(finite.all()) else flat[finite]


def key_mean(k: torch.Tensor) -> torch.Tensor:
    """fp32 (Nkv, 128) mean over tokens of ``k`` (T, Nkv, 128), finite values only per channel."""
    kf = k.float()
    finite = torch.isfinite(kf)
    count = finite.sum(0).clamp_min(1)
    return torch.where(finite, kf, 0.0).sum(0) / count


def measured_scale(x: torch.Tensor, rule: cal.Rule, name: str, process_group=None) -> torch.Tensor:
    """The scale ``rule`` gives the finite values of ``x``; with ``process_group`` (a
    tensor-parallel group whose ranks hold head shards of one tensor) the whole tensor's scale,
    the same on every rank."""
    values = _finite_values(x)
    if process_group is None:
        return cal.check_scale(rule(values), f"{name} scale from the calibration rule")
    from qfa.dropin import distributed

    return cal.sharded_scale(rule, values, name, process_group, lambda: distributed.gather_flat(values, process_group))


@dataclass
class LayerState:
    """A layer's cache state once fixed: fp32 (1,) scales, the K mean (Nkv, 128) or None, and
    the layer's query scale where one was measured with it (``qfa calibrate``; the engine keeps
    its own per layer, since a layer may read another layer's cache)."""

    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_mean: Optional[torch.Tensor]
    transform: Transform
    q_scale: Optional[torch.Tensor] = None
    saturated: int = field(default=0)

    @classmethod
    def measure(cls, k: torch.Tensor, v: torch.Tensor, transform: Transform, rule: cal.Rule,
                process_group=None) -> "LayerState":
        """The state the first tokens ``k``, ``v`` (T, Nkv, 128) fix: the mean of their keys
        (per head: no reduction across ranks), then each scale from the rule on the prepared
        (smoothed, rotated) tokens, all-reduced across ``process_group`` when given."""
        mean = key_mean(k) if transform.smooth_k else None
        k_prepared = transform.rotated(k.float() - mean if mean is not None else k)
        v_prepared = transform.rotated(v)
        return cls(measured_scale(k_prepared, rule, "key", process_group),
                   measured_scale(v_prepared, rule, "value", process_group), mean, transform)

    def __post_init__(self) -> None:
        # checked once, here: each write and encode then checks only its tokens
        self.keys = StaticEncoding(self.k_scale, mean=self.k_mean, rotate=self.transform.rotate, name="k_scale")
        self.values = StaticEncoding(self.v_scale, rotate=self.transform.rotate, name="v_scale")
        self.k_scale, self.v_scale = self.keys.scale, self.values.scale

    def prepare_queries(self, q: torch.Tensor) -> torch.Tensor:
        """Queries (T, Nq, 128) as the op scores them against this layer's keys: rotated, fp32."""
        return self.transform.rotated(q)

    def encode_keys(self, k: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``(codes, saturated)`` of keys (T, Nkv, 128): smoothed, rotated, scaled, saturating
        (:class:`qfa.dropin.prepare.StaticEncoding`: one native pass on CPU, the bits of
        ``quantize(rotate(k.float() - mean), k_scale)``)."""
        return self.keys.encode(k)

    def encode_values(self, v: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``(codes, saturated)`` of values (T, Nkv, 128): rotated, scaled, saturating."""
        return self.values.encode(v)

    def query_encoding(self, scale: torch.Tensor) -> StaticEncoding:
        """How queries (T, Nq, 128) are encoded with the query scale ``scale``: rotated as this
        layer's keys, scaled, saturating."""
        return StaticEncoding(scale, rotate=self.transform.rotate, name="q_scale")

    def write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slots: torch.Tensor) -> int:
        """Writes the codes of :meth:`encode_keys` and :meth:`encode_values` of a step's keys and
        values (T, Nkv, 128) straight into a paged cache's K and V views (blocks, Nkv,
        block_size, 128) at ``slots`` (vLLM's ``slot_mapping``: negative slots are padding and
        skipped); returns how many values saturated. All or nothing: a slot beyond the cache or
        named twice raises a ValueError naming ``slot_mapping``, with nothing written."""
        return write_keys_values(self.keys, self.values, k, v, k_cache, v_cache, slots, "slot_mapping")

    def writer(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> KVWriter:
        """:meth:`write` into these cache views, step after step: a :class:`KVWriter`, which
        checks in full only the first write and writes that are not like it."""
        return KVWriter(self.keys, self.values, k_cache, v_cache, "slot_mapping")
