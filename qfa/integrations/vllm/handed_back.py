"""vLLM's CPU_ATTN for the layers qfa hands back with a cache in the model's dtype.

An engine that asked for qfa has ``kv_cache_dtype="fp8"`` (the 1-byte cache qfa fills with HiF8
codes), and the layers qfa cannot run keep a cache in the model's dtype through vLLM's
``kv_cache_dtype_skip_layers`` (see :mod:`qfa.integrations.vllm.platform`). vLLM's CPU_ATTN
metadata builder reads the engine-wide cache dtype rather than its layers' own, so for those
layers it believed the cache was fp8: on a CPU without AVX-512 or AMX its ISA check then refused
to start the engine ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX", measured on an
AVX2-only Zen 3 EPYC, 2026-12-03), and elsewhere it handed its scheduler an fp8 cache dtype for
an unquantized cache. This backend is CPU_ATTN with a builder that sees the layers' own dtype.
"""

from __future__ import annotations

import copy

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionMetadataBuilder

#: The cache dtype a builder of unquantized layers is given: the model's own.
UNQUANTIZED_CACHE_DTYPE = "auto"


def _quantized(spec_dtype: torch.dtype) -> bool:
    """Whether a layer's KV cache spec holds 1-byte (fp8 / uint8) values."""
    return spec_dtype in (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)


def with_cache_dtype(vllm_config, cache_dtype: str):
    """A shallow copy of ``vllm_config`` whose cache config (itself copied) has ``cache_dtype``;
    the engine's own config is untouched."""
    config = copy.copy(vllm_config)
    config.cache_config = copy.copy(vllm_config.cache_config)
    config.cache_config.cache_dtype = cache_dtype
    return config


class HandedBackMetadataBuilder(CPUAttentionMetadataBuilder):
    """CPU_ATTN's builder, told the layers' own (unquantized) cache dtype."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        if not _quantized(kv_cache_spec.dtype):
            vllm_config = with_cache_dtype(vllm_config, UNQUANTIZED_CACHE_DTYPE)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)


class HandedBackCpuBackend(CPUAttentionBackend):
    """vLLM's CPU_ATTN (same name, impl and layout) with :class:`HandedBackMetadataBuilder`."""

    @staticmethod
    def get_builder_cls() -> type[HandedBackMetadataBuilder]:
        return HandedBackMetadataBuilder
