"""The plugin's options: what ``engine_kwargs`` puts in vLLM's ``additional_config["qfa"]`` and
what the engine reads back from it, defined once.

vLLM carries ``additional_config`` to the engine core and to every worker (and hashes it into
its compile cache key), so the options reach each rank of a tensor-parallel engine unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from qfa.dropin import calibration as cal
from qfa.dropin.call import DropinCall as _D
from qfa.integrations.vllm.layer_state import Transform

#: The key of ``additional_config`` the plugin owns.
CONFIG_KEY = "qfa"
#: vLLM's cache dtype whose 1-byte ``torch.uint8`` cache the plugin fills with HiF8 codes.
VLLM_CACHE_DTYPE = "fp8"
#: vLLM's name for an out-of-tree attention backend.
VLLM_BACKEND = "CUSTOM"
#: ``engine_kwargs(kv_cache=...)`` values.
KV_CACHES = ("hif8", "bf16")
#: How queries are scaled: "static", one scale per layer fixed like K's and V's (from the file,
#: or the layer's first call), so a request's numbers never depend on its batch; "call", the
#: rule on each call's batch.
Q_SCALES = ("static", "call")


@dataclass(frozen=True)
class Options:
    """The plugin's settings for one engine.

    Attributes:
        calibration_file: a file from ``qfa calibrate`` (scales and K means per layer), or None:
            each layer's state is fixed by the first tokens written to it.
        rule: the calibration rule (``"rms"``, ``"amax"``, ``"mse"``) for queries, every call,
            and for the first-write state when there is no file.
        smooth_k: subtract the layer's key mean (exact for attention; on by default).
        rotate: Hadamard-rotate queries, keys and values (exact; on by default).
        q_scale: ``"static"`` (default) or ``"call"`` (:data:`Q_SCALES`).
    """

    calibration_file: Optional[str] = None
    rule: str = cal.DEFAULT_RULE
    smooth_k: bool = _D.smooth_k
    rotate: bool = _D.rotate
    q_scale: str = "static"

    @property
    def transform(self) -> Transform:
        return Transform(smooth_k=self.smooth_k, rotate=self.rotate)

    def as_config(self) -> dict:
        return {"calibration_file": self.calibration_file, "rule": self.rule, "smooth_k": self.smooth_k,
                "rotate": self.rotate,
                "q_scale": self.q_scale}

    @classmethod
    def parse(cls, given: Mapping[str, Any], where: str = "qfa options") -> "Options":
        """Options from a mapping, each value checked; unknown names are an error naming them."""
        if not isinstance(given, Mapping):
            raise TypeError(f"{where} must be a mapping of option names to values, got {type(given).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"{where}: unknown option(s) {unknown}; known: {sorted(known)}")
        opts = dict(given)
        path = opts.get("calibration_file")
        if path is not None and not isinstance(path, str):
            raise TypeError(f"{where}: calibration_file must be a path (str) or None, got {type(path).__name__}")
        rule = opts.get("rule", cls.rule)
        if not isinstance(rule, str):
            raise TypeError(f"{where}: rule must be a calibration rule's name (str), got {type(rule).__name__} (a "
                            f"callable cannot travel to vLLM's worker processes; register it by name)")
        if rule not in cal.RULES:  # (get_rule's message would call it calibration)
            raise ValueError(f"{where}: rule must be one of {sorted(cal.RULES)} (or a rule registered by name), got "
                             f"{rule!r}")
        for flag in ("smooth_k", "rotate"):
            if flag in opts and not isinstance(opts[flag], bool):
                raise TypeError(f"{where}: {flag} must be a bool, got {type(opts[flag]).__name__}")
        if opts.get("q_scale", cls.q_scale) not in Q_SCALES:
            raise ValueError(f"{where}: q_scale must be one of {Q_SCALES}, got {opts['q_scale']!r}")
        return cls(**opts)


def from_vllm_config(vllm_config) -> Optional[Options]:
    """The plugin's options if this engine asked for qfa's backend, else None."""
    attention = getattr(vllm_config, "attention_config", None)
    backend = getattr(attention, "backend", None)
    if backend is None or getattr(backend, "name", None) != VLLM_BACKEND:
        return None
    extra = getattr(vllm_config, "additional_config", None) or {}
    given = extra.get(CONFIG_KEY, {}) if isinstance(extra, Mapping) else {}
    return Options.parse(given or {}, f"additional_config[{CONFIG_KEY!r}]")
