"""The calibration file: each layer's K/V scales and K mean, measured offline, for the engine.

``python -m qfa calibrate`` writes it; ``engine_kwargs(calibration=FILE)`` hands its path to
the engine, which loads it at start and checks it against the model it serves. JSON, so a person
can read it and every rank of a tensor-parallel engine reads the same numbers::

    {"format": "qfa-hif8-kv-calibration", "version": 1,
     "model": {"num_layers": 28, "num_kv_heads": 2, "head_dim": 128},
     "smooth_k": true, "rotate": true, "rule": "rms", "tokens": 4096,
     "layers": [{"q_scale": 1.0, "k_scale": 0.5, "v_scale": 0.125, "k_mean": [[...128 floats...], ...]},
                ...]}

K means are per kv head of the whole (unsharded) model: a tensor-parallel rank takes the rows
of the kv heads it holds (:func:`rank_heads`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from qfa.integrations.vllm.layer_state import LayerState, Transform

FORMAT = "qfa-hif8-kv-calibration"
VERSION = 1


@dataclass(frozen=True)
class ModelShape:
    """What a calibration file must agree with: the model's attention geometry."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def as_dict(self) -> dict:
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}


class CalibrationFileError(ValueError):
    """A calibration file that cannot be used: unreadable, malformed, or for another model."""


@dataclass(frozen=True)
class Calibration:
    """A loaded calibration file: per layer, ``(k_scale, v_scale, k_mean or None, q_scale or
    None)`` as floats."""

    path: str
    shape: ModelShape
    transform: Transform
    rule: str
    tokens: int
    layers: tuple

    def check_matches(self, shape: ModelShape) -> None:
        """A :class:`CalibrationFileError` naming the file and each mismatch with ``shape``."""
        wrong = [f"{name} {getattr(self.shape, name)} in the file, {getattr(shape, name)} in the model"
                 for name in ("num_layers", "num_kv_heads", "head_dim")
                 if getattr(self.shape, name) != getattr(shape, name)]
        if wrong:
            raise CalibrationFileError(f"calibration file {self.path} was made for another model: " + "; ".join(wrong))

    def check_transform(self, transform: Transform) -> None:
        if transform != self.transform:
            raise CalibrationFileError(
                f"calibration file {self.path} was measured with smooth_k={self.transform.smooth_k}, "
                f"rotate={self.transform.rotate}; the engine was asked for smooth_k={transform.smooth_k}, "
                f"rotate={transform.rotate} (a scale measured on other values does not fit)")

    def layer_state(self, layer: int, heads: Sequence[int], device: torch.device | str = "cpu") -> LayerState:
        """Layer ``layer``'s state for a rank holding kv heads ``heads`` (of the whole model)."""
        k_scale, v_scale, mean, q_scale = self.layers[layer]
        k_mean = None
        if mean is not None:
            k_mean = torch.tensor([mean[h] for h in heads], dtype=torch.float32, device=device)
        as_scale = lambda x: None if x is None else torch.tensor([x], dtype=torch.float32, device=device)  # noqa: E731
        return LayerState(as_scale(k_scale), as_scale(v_scale), k_mean, self.transform, q_scale=as_scale(q_scale))


def rank_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    """The kv heads (indices of the whole model's) that a tensor-parallel rank holds: vLLM
    splits them evenly when there are at least as many as ranks, and otherwise replicates each
    head on ``tp_size // total_kv_heads`` consecutive ranks."""
    if total_kv_heads >= tp_size:
        per = total_kv_heads // tp_size
        return list(range(tp_rank * per, (tp_rank + 1) * per))
    return [tp_rank * total_kv_heads // tp_size]


def write(path: os.PathLike | str, shape: ModelShape, states: Sequence[LayerState], *, rule: str,
          tokens: int) -> None:
    """Write ``states`` (one per layer, all heads) to ``path`` as a calibration file."""
    if len(states) != shape.num_layers:
        raise ValueError(f"states must have one entry per layer ({shape.num_layers}), got {len(states)}")
    transforms = {s.transform for s in states}
    if len(transforms) != 1:
        raise ValueError(f"every layer must be measured with one transform, got {sorted(map(str, transforms))}")
    (transform,) = transforms
    layers = [{"q_scale": None if s.q_scale is None else float(s.q_scale),
               "k_scale": float(s.k_scale), "v_scale": float(s.v_scale),
               "k_mean": None if s.k_mean is None else s.k_mean.tolist()} for s in states]
    doc = {"format": FORMAT, "version": VERSION, "model": shape.as_dict(), "smooth_k": transform.smooth_k,
           "rotate": transform.rotate, "rule": rule, "tokens": int(tokens), "layers": layers}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)  # a reader never sees half a file


def _positive_finite(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise CalibrationFileError(f"{where} must be a positive finite number, got {value!r}")
    return float(value)


def load(path: os.PathLike | str) -> Calibration:
    """Read and check a calibration file; :class:`CalibrationFileError` names what is wrong."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise CalibrationFileError(f"calibration file {path} does not exist") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CalibrationFileError(f"calibration file {path} cannot be read as JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CalibrationFileError(f"calibration file {path} is not a {FORMAT} file (made by `qfa calibrate`)")
    if doc.get("version") != VERSION:
        raise CalibrationFileError(f"calibration file {path} has version {doc.get('version')!r}; this qfa reads "
                                   f"version {VERSION}")
    try:
        model = doc["model"]
        shape = ModelShape(int(model["num_layers"]), int(model["num_kv_heads"]), int(model["head_dim"]))
        transform = Transform(smooth_k=bool(doc["smooth_k"]), rotate=bool(doc["rotate"]))
        entries = doc["layers"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CalibrationFileError(f"calibration file {path} lacks a field or has a malformed one: {exc!r}") from None
    if not isinstance(entries, list) or len(entries) != shape.num_layers:
        raise CalibrationFileError(f"calibration file {path} says {shape.num_layers} layers but holds "
                                   f"{len(entries) if isinstance(entries, list) else 'no list of'} layer entries")
    layers = []
    for i, entry in enumerate(entries):
        where = f"calibration file {path}, layer {i}"
        if not isinstance(entry, dict):
            raise CalibrationFileError(f"{where}: expected an object, got {type(entry).__name__}")
        k_scale = _positive_finite(entry.get("k_scale"), f"{where}: k_scale")
        v_scale = _positive_finite(entry.get("v_scale"), f"{where}: v_scale")
        q_scale = entry.get("q_scale")
        if q_scale is not None:
            q_scale = _positive_finite(q_scale, f"{where}: q_scale")
        mean = entry.get("k_mean")
        if transform.smooth_k:
            if (not isinstance(mean, list) or len(mean) != shape.num_kv_heads
                    or any(not isinstance(r, list) or len(r) != shape.head_dim for r in mean)):
                raise CalibrationFileError(f"{where}: k_mean must be {shape.num_kv_heads} x {shape.head_dim} numbers")
            if not all(isinstance(x, (int, float)) and math.isfinite(x) for r in mean for x in r):
                raise CalibrationFileError(f"{where}: k_mean holds a value that is not a finite number")
        elif mean is not None:
            raise CalibrationFileError(f"{where}: k_mean given but the file says smooth_k=false")
        layers.append((k_scale, v_scale, mean, q_scale))
    return Calibration(path, shape, transform, str(doc.get("rule", "")), int(doc.get("tokens", 0)), tuple(layers))


def load_optional(path: Optional[str]) -> Optional[Calibration]:
    return None if path is None else load(path)
