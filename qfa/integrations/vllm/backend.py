"""qfa's attention backend for vLLM: a HiF8 KV cache in vLLM's paged cache, read in place.

vLLM allocates each layer's cache as ``[num_blocks, num_kv_heads, block_size, 2 * 128]`` bytes
(``kv_cache_dtype="fp8"``: ``torch.uint8``), CPU_ATTN's layout: per block and kv head, the
block's 128-byte keys, then its 128-byte values. This backend keeps that layout and fills it
with HiF8 codes:

* ``do_kv_cache_update`` prepares the step's new keys and values with the layer's frozen state
  (:class:`~qfa.integrations.vllm.layer_state.LayerState`: the K mean subtracted, the Hadamard
  rotation, the K/V scales; from the calibration file, or fixed by the first tokens written)
  and writes their codes at ``slot_mapping``. Values beyond a scale saturate and are counted.
* ``forward`` rotates and quantises the step's queries with the layer's static query scale
  (from the file, or fixed by the rule on the layer's first call, the same on every
  tensor-parallel rank; ``q_scale="call"`` measures each call's batch instead). A static scale
  keeps a request's numbers independent of the other requests in its batch. It runs the whole
  batch, prefill
  chunks and decodes alike, as **one** ``quant_flash_attn`` call: TND queries delimited by
  ``query_start_loc``, K and V as ``PA_BNBD`` views of the cache read through ``block_table``
  and ``seq_lens``, causal aligned bottom-right, GQA. The cache is never gathered, copied or
  dequantised. The output is rotated back and written into vLLM's output buffer in the model's
  dtype (fp32, bf16 or fp16).

The op is planned once per step by the metadata builder, and every layer of the step reuses the
plan. The step's first layer calls the op itself, which checks every argument; each later layer
whose cache is laid out alike runs the native kernel on the plan that call bound
(:func:`qfa.attention.backends.cpu_kernel.run_bound`, the same bits), with only its own tensors
checked, and the kernel writes the rotated-back output straight into vLLM's buffer: a decode
step's layer costs less host time than its attention. ``attn_metadata`` is None in vLLM's
profiling run: the backend then writes nothing and fixes no state.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from qfa.backends import resolve
from qfa.tiling.attention import bound_plan
from qfa.attention.backends import cpu_kernel, cpu_prepare
from qfa.dropin import calibration as cal
from qfa.attention.op import quant_flash_attn, quant_flash_attn_metadata
from qfa.dropin.prepare import ROTATION_C, StaticEncoding, restore_output
from qfa.integrations.vllm import calibration_file
from qfa.integrations.vllm import options as opts
from qfa.integrations.vllm.layer_state import LayerState, measured_scale
from qfa.tiling.spec import HEAD_DIM, MaskMode, QuantMode

logger = logging.getLogger("vllm.qfa")  # under vLLM's logger: its handler prints it

#: Block sizes the op's paged layouts take: multiples of 16 (up to 1024).
BLOCK_MULTIPLE = 16


class QfaHiF8Backend(AttentionBackend):
    """vLLM attention backend: HiF8 KV cache, ``quant_flash_attn`` on the native CPU kernel."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = [opts.VLLM_CACHE_DTYPE]

    @staticmethod
    def get_name() -> str:
        return opts.VLLM_BACKEND  # vLLM looks the name up in its enum

    @staticmethod
    def get_impl_cls() -> type["QfaHiF8Impl"]:
        return QfaHiF8Impl

    @staticmethod
    def get_builder_cls() -> type["QfaMetadataBuilder"]:
        return QfaMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [HEAD_DIM]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(BLOCK_MULTIPLE)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple:
        return (KVCacheLayout.LBHNC,)  # CPU_ATTN's: head-major block interiors

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sink(cls) -> bool:
        return False


@dataclass
class QfaMetadata:
    """One step's batch, as the op takes it (shared by every layer of the step)."""

    num_actual_tokens: int
    cu_seqlens_q: torch.Tensor  # int32 (B + 1,)
    seqused_kv: torch.Tensor  # int32 (B,)
    block_table: torch.Tensor  # int32 (B, max blocks)
    slot_mapping: torch.Tensor
    plan: object
    #: the plans the op checked in this step, by what they depend on beyond the step (query
    #: count, cache layout, softmax scale), each with the block table and its version then
    bound: dict = field(default_factory=dict, repr=False)

    def bound_plan(self, codes: torch.Tensor, k_cache: torch.Tensor, softmax_scale: float):
        """The plan the op checked in this step for a layer like this one, or None (none yet, or
        the block table changed since)."""
        entry = self.bound.get(_plan_key(codes, k_cache, softmax_scale))
        if entry is None or entry[1] is not self.block_table or entry[2] != self.block_table._version:
            return None
        return entry[0]

    def keep_plan(self, codes: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  softmax_scale: float) -> None:
        """Keeps the plan the op call just checked on these tensors (from the op's plan cache)."""
        plan = bound_plan(self.plan, codes, k_cache, v_cache, softmax_scale=softmax_scale,
                          block_table=self.block_table)
        if plan is not None:
            self.bound[_plan_key(codes, k_cache, softmax_scale)] = (plan, self.block_table,
                                                                   self.block_table._version)


def _plan_key(codes: torch.Tensor, k_cache: torch.Tensor, softmax_scale: float) -> tuple:
    return codes.shape, k_cache.shape, k_cache.stride(), softmax_scale


def runs_native(device: torch.device, *tensors: torch.Tensor) -> bool:
    """Whether the op runs the backend's calls on the native kernel and the output's rotation on
    the native pass (the kernel's epilogue computes the same bits): then a step's later layers
    run the plan its first layer's op call checked. ``tensors``: the call's own (plain memory,
    nothing intercepting torch: :mod:`qfa._plain_memory`)."""
    return device.type == "cpu" and resolve(device) != "triton" and cpu_kernel.available() and \
        cpu_prepare.usable(*tensors)


class QfaMetadataBuilder(AttentionMetadataBuilder[QfaMetadata]):
    """Builds :class:`QfaMetadata` once per step and plans the op for it."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        from vllm.v1.attention.backends.utils import get_num_attention_heads_from_layers

        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.num_heads = (get_num_attention_heads_from_layers(vllm_config, layer_names)
                          or vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config))

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> QfaMetadata:
        return make_metadata(common_attn_metadata, self.num_heads, self.num_kv_heads)


def make_metadata(common: CommonAttentionMetadata, num_heads: int, num_kv_heads: int) -> QfaMetadata:
    """The step's :class:`QfaMetadata` from vLLM's common metadata: the op planned for the batch
    (its lengths read on the host once, here, for every layer of the step)."""
    cu = common.query_start_loc_cpu.to(torch.int32)
    seqused = common.seq_lens.to(torch.int32)
    # a copy: vLLM writes its persistent table in place (through numpy, which no version counter
    # sees), and the step's plans are checked against this table's values. A normal tensor, also
    # in vLLM's inference mode: an inference tensor has no version counter to show a write.
    with torch.inference_mode(False):
        table = common.block_table_tensor.to(torch.int32, copy=True)
    plan = quant_flash_attn_metadata(num_heads, num_kv_heads, layout_q="TND", layout_kv="PA_BNBD", layout_out="TND",
                                     cu_seqlens_q=cu, seqused_kv=seqused, mask_mode=MaskMode.CAUSAL)
    return QfaMetadata(common.num_actual_tokens, cu, seqused, table, common.slot_mapping, plan)


def cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)``: PA_BNBD views (num_blocks, Nkv, block_size, 128) of a layer's cache tensor
    ``[num_blocks, Nkv, block_size, 2 * 128]`` (per block and head: its keys, then its values)."""
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * HEAD_DIM:
        raise ValueError(f"kv_cache must be uint8 [num_blocks, num_kv_heads, block_size, {2 * HEAD_DIM}] (vLLM's "
                         f"fp8 cache), got {kv_cache.dtype} {tuple(kv_cache.shape)}")
    blocks, heads, block_size, _ = kv_cache.shape
    halves = kv_cache.view(blocks, heads, 2, block_size, HEAD_DIM)
    return halves[:, :, 0], halves[:, :, 1]


def _tp_group():
    """vLLM's tensor-parallel CPU group, or None with one rank (or outside an engine)."""
    try:
        from vllm.distributed import get_tp_group

        group = get_tp_group()
    except (AssertionError, ImportError):
        return None
    return group.cpu_group if group.world_size > 1 else None


def _tp_rank_size() -> tuple[int, int]:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (AssertionError, ImportError):
        return 0, 1


class QfaHiF8Impl(AttentionImpl):
    """One layer's attention on HiF8 codes (see the module docstring)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Optional[list[float]], sliding_window: Optional[int], kv_cache_dtype: str,
                 logits_soft_cap: Optional[float] = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None, **extra) -> None:
        unsupported = [name for name, given in (("alibi_slopes", alibi_slopes), ("sliding_window", sliding_window),
                                                 ("logits_soft_cap", logits_soft_cap), ("sinks", extra.get("sinks")))
                       if given is not None]
        if head_size != HEAD_DIM or attn_type != AttentionType.DECODER or unsupported:
            # the platform hands such layers to CPU_ATTN before they get here; reaching this means
            # the model has a feature its config does not show
            raise ValueError(f"qfa's HiF8 backend cannot run this layer (head_size {head_size}, attn_type {attn_type}, "
                             f"{unsupported or 'no unsupported options'}); qfa hands back layers with head size != "
                             f"{HEAD_DIM}, sliding windows, sinks, ALiBi or soft caps that the model config declares")
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        from vllm.config import get_current_vllm_config

        self.options = opts.from_vllm_config(get_current_vllm_config()) or opts.Options()
        self.rule = cal.get_rule(self.options.rule)
        self.state: Optional[LayerState] = None
        # the query scale is the layer's own, also when it reads another layer's cache
        self.q_scale: Optional[torch.Tensor] = None
        self._calibration = calibration_file.load_optional(self.options.calibration_file)
        self._warned_saturation = 0
        self._queries: tuple = (None, None, None)  # (the query scale, rotate, its StaticEncoding)
        self._views: tuple = (None, None, None)  # (a weak reference to the cache, its layout, its views)
        self._writer: tuple = (None, None, None)  # (the state, the K view, their KVWriter)

    # ------------------------------------------------------------------ the layer's state

    def _layer_state(self, layer, key: torch.Tensor, value: torch.Tensor) -> LayerState:
        """The frozen state, or the one the first real write makes (not kept here: the caller
        commits it once the write has succeeded): from the file, or measured on these tokens
        (all-reduced across tensor-parallel ranks, so every rank fixes the same scales)."""
        if self.state is not None:
            return self.state
        if self._calibration is not None:
            from vllm.model_executor.models.utils import extract_layer_index

            rank, size = _tp_rank_size()
            heads = calibration_file.rank_heads(self._calibration.shape.num_kv_heads, size, rank)
            return self._calibration.layer_state(extract_layer_index(layer.layer_name), heads, key.device)
        return LayerState.measure(key, value, self.options.transform, self.rule, _tp_group())

    def _count_saturated(self, layer, n: int) -> None:
        state = self.state
        if n == 0:
            return
        state.saturated += n
        if state.saturated >= 2 * self._warned_saturation:  # each doubling, not every token
            self._warned_saturation = max(state.saturated, 1)
            logger.warning("qfa: %s has clamped %d K/V values to HiF8's largest magnitude so far (scales k %g, v %g); "
                           "a calibration file (qfa calibrate) fixes scales on representative text",
                           getattr(layer, "layer_name", "a layer"), state.saturated, float(state.k_scale),
                           float(state.v_scale))

    # ------------------------------------------------------------------ vLLM's calls

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        if is_forward_context_available() and get_forward_context().attn_metadata is None:
            return  # profiling run: dummy tokens, which must not fix the layer's scales
        tokens = slot_mapping.shape[0]
        expected = (self.num_kv_heads, self.head_size)
        for name, t in (("key", key), ("value", value)):
            if t.dim() != 3 or t.shape[1:] != expected or t.shape[0] < tokens:
                raise ValueError(f"{name} must be (>= {tokens} tokens, {expected[0]} kv heads, {expected[1]}) for "
                                 f"slot_mapping's {tokens} slots, got {tuple(t.shape)}")
        if key.shape[0] != tokens or value.shape[0] != tokens:
            key, value = key[:tokens], value[:tokens]
        k_cache, v_cache = self._cache_views(kv_cache)
        # everything is checked before anything is kept: a call that fails leaves the cache and
        # the layer's state as they were
        state = self.state
        if state is not None:
            self._count_saturated(layer, self._writer_of(state, k_cache, v_cache).write(key, value, slot_mapping))
            return
        # the first real tokens fix the scales (vLLM pads a batch with slot -1)
        real = slot_mapping >= 0
        if not bool(real.any()):
            return
        state = self._layer_state(layer, key[real], value[real])
        saturated = state.write(key, value, k_cache, v_cache, slot_mapping)
        self.state = state
        if self._calibration is None:
            logger.info("qfa: %s fixed its HiF8 scales from its first %d tokens: k_scale %g, v_scale %g",
                        getattr(layer, "layer_name", "a layer"), int((slot_mapping >= 0).sum()),
                        float(state.k_scale), float(state.v_scale))
        self._count_saturated(layer, saturated)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Optional[QfaMetadata], output: Optional[torch.Tensor] = None,
                output_scale: Optional[torch.Tensor] = None, output_block_scale: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("qfa's HiF8 backend does not fuse output quantisation")
        if attn_metadata is None:  # profiling run
            return output
        n = attn_metadata.num_actual_tokens
        state = self._kv_state()
        out = output[:n].view(n, self.num_heads, self.head_size)
        if state is None:  # no key written yet (every sequence empty): nothing to attend to
            out.zero_()
            return output
        q = query[:n].view(n, self.num_heads, self.head_size)
        q_scale = self._static_q_scale(layer, q.device)
        fixes_q_scale = q_scale is None and self.options.q_scale == "static"
        if q_scale is None or self.options.q_scale == "call":
            q_scale = measured_scale(state.prepare_queries(q), self.rule, "query", _tp_group())
        queries = self._query_encoding(state, q_scale)
        codes = queries.encode(q)[0]
        k_cache, v_cache = self._cache_views(kv_cache)
        native = runs_native(q.device, q, kv_cache, out)
        plan = attn_metadata.bound_plan(codes, k_cache, self.scale) if native else None
        if plan is not None:
            self._run_bound(plan, attn_metadata, codes, k_cache, v_cache, queries, state, out)
        else:
            o, _ = quant_flash_attn(
                codes, k_cache, v_cache, queries.scale, state.k_scale, state.v_scale, QuantMode.HIF8_PER_TENSOR,
                block_table=attn_metadata.block_table, cu_seqlens_q=attn_metadata.cu_seqlens_q,
                seqused_kv=attn_metadata.seqused_kv, metadata=attn_metadata.plan, softmax_scale=self.scale,
                mask_mode=MaskMode.CAUSAL, layout_q="TND", layout_kv="PA_BNBD", layout_out="TND",
            )
            if not state.transform.rotate:
                out.copy_(o)
            elif restore_output(o, out.dtype, into=out) is None:  # no native pass here: the torch rotation
                out.copy_(state.transform.rotated(o))
            if native:  # the op ran the native kernel: later layers run its plan
                attn_metadata.keep_plan(codes, k_cache, v_cache, self.scale)
        if fixes_q_scale:  # kept once the call has succeeded
            self.q_scale = q_scale
        return output

    def _run_bound(self, plan, metadata: QfaMetadata, codes: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, queries: StaticEncoding, state: LayerState, out: torch.Tensor) -> None:
        """The op's numbers on a plan the op checked in this step: the kernel writes the
        rotated-back rows into ``out`` in its dtype (or bf16 rows, copied, without the rotation)."""
        rotate = state.transform.rotate
        target = out if rotate or out.dtype == torch.bfloat16 else torch.empty_like(out, dtype=torch.bfloat16)
        cpu_kernel.run_bound(plan, codes, k_cache, v_cache, target, q_descale=queries.value,
                             k_descale=state.keys.value, v_descale=state.values.value,
                             block_table=metadata.block_table, rotate_c=ROTATION_C if rotate else 0.0)
        if target is not out:
            out.copy_(target)

    def _cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`cache_views` of the layer's cache, kept while it is the same tensor with the
        same storage, layout and dtype (vLLM passes the same one every step), and dropped with
        the tensor (the views would keep its storage alive)."""
        kept = self._views
        layout = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), kv_cache.dtype)
        if kept[0] is not None and kept[0]() is kv_cache and kept[1] == layout:
            return kept[2]
        views = cache_views(kv_cache)
        self._views = (weakref.ref(kv_cache, self._drop_views), layout, views)
        return views

    def _drop_views(self, gone: weakref.ref) -> None:
        if self._views[0] is gone:
            self._views = (None, None, None)
            self._writer = (None, None, None)

    def _writer_of(self, state: LayerState, k_cache: torch.Tensor, v_cache: torch.Tensor):
        """The state's :class:`~qfa.dropin.prepare.KVWriter` into these views (the kept
        :meth:`_cache_views`), kept while both are the layer's."""
        kept_state, kept_views, writer = self._writer
        if kept_state is not state or kept_views is not k_cache:
            writer = state.writer(k_cache, v_cache)
            self._writer = (state, k_cache, writer)
        return writer

    def _query_encoding(self, state: LayerState, q_scale: torch.Tensor) -> StaticEncoding:
        """The queries' encoding with ``q_scale``, kept while the scale is the layer's."""
        scale, rotate, encoding = self._queries
        if scale is not q_scale or rotate != state.transform.rotate:
            encoding = state.query_encoding(q_scale)
            self._queries = (q_scale, state.transform.rotate, encoding)
        return encoding

    def _kv_state(self) -> Optional[LayerState]:
        """The state of the codes this layer reads: its own, or, for a layer that shares an
        earlier layer's cache (vLLM writes only the target's), the target layer's."""
        if self.kv_sharing_target_layer_name is None:
            return self.state
        target = get_forward_context().no_compile_layers[self.kv_sharing_target_layer_name]
        return target.impl.state

    def _static_q_scale(self, layer, device) -> Optional[torch.Tensor]:
        """The layer's fixed query scale: kept from an earlier call, or the calibration file's."""
        if self.q_scale is None and self._calibration is not None and self.options.q_scale == "static":
            from vllm.model_executor.models.utils import extract_layer_index

            entry = self._calibration.layers[extract_layer_index(layer.layer_name)]
            if entry[3] is not None:
                self.q_scale = torch.tensor([entry[3]], dtype=torch.float32, device=device)
        return self.q_scale
