"""Which layers qfa's backend runs, and the engine-start checks: one place for both rules.

A layer runs on qfa when it is decoder self-attention with head size 128 (the HiF8 op's only
one), no sliding window, no attention sinks, no ALiBi and no logit soft cap, and its cache is
vLLM's 1-byte ``"fp8"`` cache. Everything else is handed back to vLLM's CPU_ATTN, with its cache
in the model's dtype.
"""

from __future__ import annotations

import logging
from typing import Optional

from qfa.integrations.vllm import calibration_file
from qfa.integrations.vllm import options as opts
from qfa.tiling.spec import HEAD_DIM

logger = logging.getLogger("vllm.qfa")  # under vLLM's logger: its handler prints it

#: vLLM's name for decoder self-attention (``AttentionType.DECODER``).
DECODER = "decoder"
#: Block sizes the op's paged layouts take: multiples of 16 up to 1024.
BLOCK_MULTIPLE, MAX_BLOCK = 16, 1024
#: Model types whose attention is always ALiBi (their configs carry no flag saying so).
ALIBI_MODEL_TYPES = ("bloom",)


def unsupported_reason(selector) -> Optional[str]:
    """Why qfa cannot run a layer vLLM is selecting a backend for (its AttentionSelectorConfig),
    or None when it can."""
    checks = (
        (selector.kv_cache_dtype != opts.VLLM_CACHE_DTYPE,
         f"kv_cache_dtype {selector.kv_cache_dtype!r} (qfa fills the 1-byte {opts.VLLM_CACHE_DTYPE!r} cache)"),
        (selector.head_size != HEAD_DIM, f"head size {selector.head_size} (the HiF8 op takes {HEAD_DIM})"),
        (selector.use_mla, "MLA"),
        (selector.use_sparse, "sparse attention"),
        (selector.has_sink, "attention sinks"),
        (selector.has_sliding_window, "a sliding window"),
        (getattr(selector.attn_type, "value", selector.attn_type) != DECODER, f"attention type {selector.attn_type}"),
        (getattr(selector, "use_non_causal", False), "non-causal attention"),
        (getattr(selector, "use_mm_prefix", False), "a multimodal prefix"),
    )
    for failed, reason in checks:
        if failed:
            return reason
    return None


def _layer_types(hf_text_config, num_layers: int) -> list[str]:
    types = getattr(hf_text_config, "layer_types", None)
    if types:
        return list(types)
    return ["full_attention"] * num_layers


def _uses_alibi(text) -> bool:
    """ALiBi as model configs say it: a flag (falcon, baichuan-style, step), MPT's attn_config,
    or a model type that has no other attention."""
    if any(getattr(text, flag, False) for flag in ("alibi", "use_alibi", "use_alibi_sqrt")):
        return True
    attn_config = getattr(text, "attn_config", None)
    if isinstance(attn_config, dict) and attn_config.get("alibi"):
        return True
    return getattr(text, "model_type", None) in ALIBI_MODEL_TYPES


def handed_back_layers(model_config) -> dict[int, str]:
    """Layer index -> reason, for the layers of the model that qfa cannot run, read from the
    model's config before any layer is built."""
    text = model_config.hf_text_config
    num_layers = model_config.get_total_num_hidden_layers()
    head = model_config.get_head_size()
    model_wide = None
    if head != HEAD_DIM:
        model_wide = f"head size {head} (the HiF8 op takes {HEAD_DIM})"
    elif getattr(text, "attn_logit_softcapping", None):
        model_wide = "a logit soft cap"
    elif _uses_alibi(text):
        model_wide = "ALiBi"
    if model_wide is not None:
        return {i: model_wide for i in range(num_layers)}
    return {i: "a sliding window" for i, t in enumerate(_layer_types(text, num_layers)) if t != "full_attention"}


def model_shape(model_config) -> calibration_file.ModelShape:
    """The whole (unsharded) model's attention geometry, what a calibration file records."""
    return calibration_file.ModelShape(model_config.get_total_num_hidden_layers(),
                                       model_config.get_total_num_kv_heads(), model_config.get_head_size())


def configure_engine(vllm_config, options: opts.Options) -> None:
    """Engine-start checks and settings for an engine that asked for qfa (see the platform)."""
    cache = vllm_config.cache_config
    if cache.cache_dtype != opts.VLLM_CACHE_DTYPE:
        raise ValueError(
            f"qfa's HiF8 backend (attention_backend={opts.VLLM_BACKEND!r}) stores 1-byte codes in vLLM's "
            f"kv_cache_dtype={opts.VLLM_CACHE_DTYPE!r} cache; got kv_cache_dtype={cache.cache_dtype!r}. Use "
            f"qfa.integrations.vllm.engine_kwargs(), or pass --kv-cache-dtype {opts.VLLM_CACHE_DTYPE}")
    block = cache.block_size
    if block is not None and (block % BLOCK_MULTIPLE or block > MAX_BLOCK):
        raise ValueError(f"qfa's HiF8 backend reads paged blocks of a multiple of {BLOCK_MULTIPLE} tokens up to "
                         f"{MAX_BLOCK}; got block_size={block}")
    model = vllm_config.model_config
    if model is None:
        return
    if options.calibration_file is not None:
        found = calibration_file.load(options.calibration_file)
        found.check_matches(model_shape(model))
        found.check_transform(options.transform)
    back = handed_back_layers(model)
    if back:
        skip = [str(i) for i in sorted(back)]
        cache.kv_cache_dtype_skip_layers = sorted(set(cache.kv_cache_dtype_skip_layers) | set(skip), key=str)
        reasons = sorted(set(back.values()))
        logger.warning("qfa: layers %s run on vLLM's CPU_ATTN with a %s cache (%s); the other %d on qfa's HiF8 "
                       "backend", _ranges(sorted(back)), model.dtype, "; ".join(reasons),
                       model.get_total_num_hidden_layers() - len(back))
    else:
        logger.info("qfa: all %d layers run on qfa's HiF8 backend (HiF8 KV cache, 1 byte per element)",
                    model.get_total_num_hidden_layers())


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``: a long list of layers in one short line."""
    out, start = [], None
    for i, x in enumerate(indices):
        if start is None:
            start = x
        if i + 1 == len(indices) or indices[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)
