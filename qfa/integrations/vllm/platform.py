"""vLLM's CPU platform, honouring ``attention_backend="CUSTOM"`` per layer.

vLLM's ``CpuPlatform.get_attn_backend_cls`` answers every request with CPU_ATTN. Of the two ways
round that, re-registering CPU_ATTN's path would swap the backend of every layer of every engine
in the process, whatever was asked; a platform plugin only changes the answer when the engine asked
for CUSTOM. So qfa ships a ``vllm.platform_plugins`` entry whose platform is ``CpuPlatform`` with
two changes, both inert unless CUSTOM was asked for:

* **Selection, per layer.** A decoder layer with head size 128, no sliding window and no sinks,
  whose cache is the 1-byte one, gets qfa's backend; any other layer gets CPU_ATTN, as before
  (with a cache in the model's dtype: CPU_ATTN with a metadata builder told that dtype, see
  :mod:`qfa.integrations.vllm.handed_back`).
* **Configuration, at engine start.** The cache dtype must be ``"fp8"`` (the 1-byte cache qfa
  fills with HiF8 codes); the layers qfa cannot run are listed in vLLM's
  ``kv_cache_dtype_skip_layers`` so that they keep a cache in the model's dtype (vLLM's fp8
  cache with its default scales is far less accurate), and one log line names them; a
  calibration file is loaded and checked against the model, so a file for another model fails
  here, naming the file and the mismatch.
"""

from __future__ import annotations

import logging

from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from qfa.integrations.vllm import options as opts
from qfa.integrations.vllm import support

logger = logging.getLogger("vllm.qfa")  # under vLLM's logger: its handler prints it

BACKEND_PATH = "qfa.integrations.vllm.backend.QfaHiF8Backend"
#: CPU_ATTN for the layers handed back with a cache in the model's dtype (see handed_back.py).
HANDED_BACK_PATH = "qfa.integrations.vllm.handed_back.HandedBackCpuBackend"


class QfaCpuPlatform(CpuPlatform):
    """``CpuPlatform`` that runs qfa's HiF8 backend on the layers it supports when asked."""

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if selected_backend != AttentionBackendEnum.CUSTOM:
            return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)
        reason = support.unsupported_reason(attn_selector_config)
        if reason is None:
            return BACKEND_PATH
        if attn_selector_config.kv_cache_dtype == opts.VLLM_CACHE_DTYPE and reason not in cls._warned:
            # the layer's cache dtype was fixed before its backend was chosen: the engine-start
            # check did not see this feature, so the layer keeps vLLM's own fp8 cache
            cls._warned.add(reason)
            logger.warning("qfa: layers with %s run on vLLM's CPU_ATTN with vLLM's own fp8 e4m3 cache (its scales, "
                           "1.0 unless the checkpoint has them); list their indices in kv_cache_dtype_skip_layers "
                           "to give them a cache in the model's dtype", reason)
        path = super().get_attn_backend_cls(None, attn_selector_config, num_heads)
        if path == AttentionBackendEnum.CPU_ATTN.get_path() and attn_selector_config.kv_cache_dtype != opts.VLLM_CACHE_DTYPE:
            return HANDED_BACK_PATH
        return path

    _warned: set = set()

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        super().check_and_update_config(vllm_config)
        options = opts.from_vllm_config(vllm_config)
        if options is None:
            return
        support.configure_engine(vllm_config, options)
