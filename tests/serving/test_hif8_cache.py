"""qfa.serving.HiF8Cache and cached_attention: a transformers Cache of HiF8 codes read in place.

* Plumbing against the spec, exactly: through the cache, a prefill, decode steps and a chunk
  give the bits of ``quant_flash_attn`` on codes built here from the documented transforms (the
  prefill's key mean frozen, the Hadamard rotation, the frozen scales, q scaled per call).
* Padding, exactly: a left-padded batch gives each sequence the bits it gets alone (the scales
  are then equal, asserted: padding 100x the data would change them if it leaked in), and a
  model's valid logits do not depend on what the padding tokens are.
* Decode reads codes: stored codes, scales and means do not change across steps, and a step
  encodes only its new tokens.
* Saturation of later tokens is counted exactly; KV bytes against a bf16 DynamicCache.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

import qfa  # noqa: E402
import qfa.integrations.transformers as qfa_hf  # noqa: E402
from qfa.dropin import calibration as cal  # noqa: E402
from qfa.dropin import rotation  # noqa: E402
from qfa.dropin.smoothing import lse_shift  # noqa: E402
from qfa.cast import format as fmt  # noqa: E402
from qfa.serving import hif8_cache as hc  # noqa: E402
from qfa.serving.attention import cached_attention, hif8_cache_of  # noqa: E402
from qfa.serving.hif8_cache import HiF8Cache, is_hif8_cache  # noqa: E402

NQ, NKV, D = 4, 2, 128
IMPL = "qfa_hif8_cache_test"
VOCAB = 512


@pytest.fixture(scope="module", autouse=True)
def registered():
    """The real adapter: "qfa_hif8"'s attention function hands a HiF8Cache's placeholders to
    cached_attention (qfa.integrations.transformers), everything else to the drop-in."""
    qfa_hf.register(IMPL)


def test_the_adapter_exposes_the_cache_under_its_issue_name():
    assert qfa_hf.HiF8Cache is HiF8Cache


def randn(*shape, seed: int, dtype=torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def step(cache, layer_idx, q, k, v, mask=None, **kw):
    cache.update(k, v, layer_idx)
    return cached_attention(None, q, cache, layer_idx, attention_mask=mask, return_softmax_lse=True, **kw)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)


# ----------------------------------------------------------------------------- the spec, exactly

def spec_attention(q, k_chunks, v_chunks, *, rotate: bool, smooth_k: bool, rule="rms"):
    """One sequence (B = 1): what the cache promises, built from the documented transforms.

    k_chunks / v_chunks: the (1, Nkv, n, D) chunks given to the cache so far, the first being
    the prefill; q: (1, Nq, Sq, D), the last Sq tokens. Returns (out BSND, lse)."""
    tok = lambda x: x[0].transpose(0, 1).contiguous()  # noqa: E731  (n, Nkv, D), as a chunk arrives
    mu = tok(k_chunks[0]).float().mean(0) if smooth_k else None
    ks = [tok(c).float() - mu if smooth_k else tok(c) for c in k_chunks]
    vs = [tok(c) for c in v_chunks]
    if rotate:
        ks, vs = [rotation.rotate(c) for c in ks], [rotation.rotate(c) for c in vs]
    k_scale, v_scale = cal.get_rule(rule)(ks[0]), cal.get_rule(rule)(vs[0])
    k_codes = torch.cat([cal.quantize(c, k_scale) for c in ks]).transpose(0, 1)[None]
    v_codes = torch.cat([cal.quantize(c, v_scale) for c in vs]).transpose(0, 1)[None]
    q_in = rotation.rotate(q[0]) if rotate else q[0].float()
    q_scale = cal.get_rule(rule)(q_in)
    out, lse = qfa.quant_flash_attn(cal.quantize(q_in, q_scale)[None], k_codes, v_codes, q_scale, k_scale, v_scale,
                                    0, layout="BNSD", mask_mode=3, return_softmax_lse=True)
    out = rotation.rotate(out[0]) if rotate else out[0]
    if smooth_k:
        shift = lse_shift(q, mu[None], "BNSD", None, 1 / D ** 0.5)
        lse = torch.where(torch.isinf(lse), lse, lse + shift)
    return out.transpose(0, 1).to(q.dtype)[None], lse


@pytest.mark.parametrize("rotate, smooth_k", [(True, True), (False, True), (True, False)])
def test_prefill_decode_and_chunk_are_the_spec(rotate, smooth_k):
    cache = HiF8Cache(rotate=rotate, smooth_k=smooth_k)
    chunks = [40, 1, 1, 1, 5]  # prefill, three decode steps, a chunk of 5 (Sq < Skv, causal bottom-right)
    ks, vs = [], []
    for i, n in enumerate(chunks):
        k = randn(1, NKV, n, D, seed=10 + i) + randn(1, NKV, 1, D, seed=99, scale=3.0)  # a K channel offset
        v = randn(1, NKV, n, D, seed=20 + i)
        q = randn(1, NQ, n, D, seed=30 + i)
        ks.append(k)
        vs.append(v)
        out, lse = step(cache, 0, q, k, v)
        want_out, want_lse = spec_attention(q, ks, vs, rotate=rotate, smooth_k=smooth_k)
        assert out.shape == (1, n, NQ, D) and out.dtype == torch.bfloat16
        assert torch.equal(bits(out), bits(want_out)), f"step {i}"
        assert torch.equal(bits(lse), bits(want_lse)), f"step {i}"
    layer = cache.layer(0)
    assert layer.lengths.tolist() == [sum(chunks)] and cache.get_seq_length() == sum(chunks)
    assert (layer.k_mean is not None) == smooth_k


def _left_padded(lengths, garbage: float = 100.0):
    """Per sequence (q, k, v) of its own length, and the left-padded batch holding exactly those
    values at its valid positions and garbage 100x larger in the padding."""
    n = max(lengths)
    seqs = [tuple(randn(1, h, s, D, seed=7 * i + j) for j, h in enumerate((NQ, NKV, NKV)))
            for i, s in enumerate(lengths)]
    batch = [randn(len(lengths), h, n, D, seed=50 + j, scale=garbage) for j, h in enumerate((NQ, NKV, NKV))]
    mask = torch.zeros(len(lengths), n, dtype=torch.bool)
    for i, s in enumerate(lengths):
        mask[i, n - s:] = True
        for j in range(3):
            batch[j][i, :, n - s:] = seqs[i][j][0]
    return seqs, batch, mask


def test_left_padded_batch_gives_each_sequence_its_own_bits():
    lengths = [29, 11, 20]
    seqs, (q, k, v), mask = _left_padded(lengths)
    batched = HiF8Cache()
    outs = [step(batched, 0, q, k, v, mask)]
    for t in range(2):  # decode steps: one new real token per sequence
        mask = torch.cat([mask, torch.ones(len(lengths), 1, dtype=torch.bool)], 1)
        new = [randn(len(lengths), h, 1, D, seed=70 + 3 * t + j) for j, h in enumerate((NQ, NKV, NKV))]
        outs.append(step(batched, 0, *new, mask))
        seqs = [tuple(torch.cat([s[j], new[j][i:i + 1]], 2) for j in range(3)) for i, s in enumerate(seqs)]
    n = max(lengths)
    for i, s in enumerate(lengths):
        alone = HiF8Cache()
        q_i, k_i, v_i = seqs[i]
        got = [step(alone, 0, q_i[:, :, :s], k_i[:, :, :s], v_i[:, :, :s])]
        got += [step(alone, 0, q_i[:, :, s + t:s + t + 1], k_i[:, :, s + t:s + t + 1], v_i[:, :, s + t:s + t + 1])
                for t in range(2)]
        for name in ("k_scale", "v_scale"):  # padding 100x the data would have moved them
            assert torch.equal(getattr(batched.layer(0), name), getattr(alone.layer(0), name))
        assert torch.equal(batched.layer(0).k_mean[i], alone.layer(0).k_mean[0])
        assert torch.equal(batched.layer(0).keys[i, :, :s + 2], alone.layer(0).keys[0])
        (out0, lse0), (want0, wlse0) = outs[0], got[0]
        assert not out0[i, :n - s].any() and torch.isinf(lse0[i, :, :n - s]).all()  # padded rows
        assert torch.equal(bits(out0[i, n - s:]), bits(want0[0]))
        assert torch.equal(bits(lse0[i, :, n - s:]), bits(wlse0[0]))
        for (o, l), (wo, wl) in zip(outs[1:], got[1:]):
            assert torch.equal(bits(o[i]), bits(wo[0])) and torch.equal(bits(l[i]), bits(wl[0]))
    assert batched.layer(0).lengths.tolist() == [s + 2 for s in lengths]


def test_static_scales_are_used_and_q_scale_is_static():
    scales = {0: (0.25, 2.0, 0.5)}
    cache = HiF8Cache(scales=scales, rotate=False, smooth_k=False)
    q, k, v = randn(1, NQ, 8, D, seed=1), randn(1, NKV, 8, D, seed=2), randn(1, NKV, 8, D, seed=3)
    out, lse = step(cache, 0, q, k, v, p_scale=16.0)
    layer = cache.layer(0)
    assert [float(s) for s in (layer.q_scale, layer.k_scale, layer.v_scale)] == [0.25, 2.0, 0.5]
    codes = [cal.quantize(t, s) for t, s in zip((q, k, v), (0.25, 2.0, 0.5))]
    want, wlse = qfa.quant_flash_attn(*codes, *[torch.tensor([s]) for s in (0.25, 2.0, 0.5)], 0, layout="BNSD",
                                      mask_mode=3, p_scale=torch.tensor([16.0]), return_softmax_lse=True)
    other, _ = qfa.quant_flash_attn(*codes, *[torch.tensor([s]) for s in (0.25, 2.0, 0.5)], 0, layout="BNSD",
                                    mask_mode=3)
    assert not torch.equal(want, other)  # p_scale moves P on the grid: it did arrive
    assert torch.equal(bits(out), bits(want.transpose(1, 2))) and torch.equal(bits(lse), bits(wlse))
    assert torch.equal(layer.keys, codes[1])


def test_later_tokens_saturate_and_are_counted():
    cache = HiF8Cache(rotate=False)  # no rotation: a spike stays in its own element
    step(cache, 0, randn(1, NQ, 16, D, seed=1), randn(1, NKV, 16, D, seed=2), randn(1, NKV, 16, D, seed=3))
    layer = cache.layer(0)
    k_scale, v_scale = float(layer.k_scale), float(layer.v_scale)
    assert cache.saturated == [0]
    k, v = randn(1, NKV, 1, D, seed=4, dtype=torch.float32), randn(1, NKV, 1, D, seed=5, dtype=torch.float32)
    k[0, 0, 0, :3] = 2 * fmt.OVERFLOW_THRESHOLD * k_scale
    k[0, 1, 0, 9] = -1e6 * k_scale
    v[0, 1, 0, 0] = 0.9 * fmt.OVERFLOW_THRESHOLD * v_scale  # below the threshold: rounds to MAX, not counted
    step(cache, 0, randn(1, NQ, 1, D, seed=6, dtype=torch.float32), k, v)
    assert (layer.saturated_k, layer.saturated_v, cache.saturated) == (4, 0, [4])
    assert float(layer.k_scale) == k_scale and float(layer.v_scale) == v_scale  # frozen
    assert (layer.keys[0, 0, 16, :3] == fmt.MAX_CODE).all() and int(layer.keys[0, 1, 16, 9]) == fmt.MAX_CODE | 0x80


def test_errors_and_placeholders():
    cache = HiF8Cache()
    with pytest.raises(ValueError, match=r"HiF8Cache needs key_states of shape \(B, Nkv, S, 128\)"):
        cache.update(torch.zeros(1, NKV, 3, 64), torch.zeros(1, NKV, 3, 64), 0)
    k, v = cache.update(randn(2, NKV, 3, D, seed=1), randn(2, NKV, 3, D, seed=2), 0)
    assert is_hif8_cache(cache) and is_hif8_cache(k) and not is_hif8_cache(torch.zeros(1))
    assert k.shape == (2, NKV, 3, D) and k.dtype == torch.bfloat16 and hif8_cache_of(k) == (cache, 0)
    assert hif8_cache_of(torch.zeros(1)) is None
    with pytest.raises(RuntimeError, match="only qfa's cached attention reads"):
        torch.nn.functional.scaled_dot_product_attention(randn(2, NKV, 3, D, seed=3), k, v)
    q = randn(2, NQ, 3, D, seed=3)
    with pytest.raises(ValueError, match=r"attention_mask must be None or a 2D key mask \(B, keys\) = \(2, 3\)"):
        cached_attention(None, q, cache, 0, attention_mask=torch.ones(2, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="query must have the cache's batch 2"):
        cached_attention(None, q[:1], cache, 0)
    with pytest.raises(ValueError, match=r"layer_idx must be in \[0, 1\)"):
        cached_attention(None, q, cache, 1)
    with pytest.raises(TypeError, match="cache must be a qfa.serving.HiF8Cache, got DynamicCache"):
        cached_attention(None, q, DynamicCache(), 0)
    with pytest.raises(ValueError, match="unknown|must be one of"):
        HiF8Cache(calibration="nope")
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(-1)


# ----------------------------------------------------------------------------- a model

def tiny_model(seed: int = 0, **extra):
    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=NQ,
              num_key_value_heads=NKV, head_dim=D, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
    kw.update(extra)
    model = Qwen2ForCausalLM(Qwen2Config(**kw)).to(torch.bfloat16).eval()
    model.generation_config.pad_token_id = 0
    return model


def ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_constructors():
    model = tiny_model()
    assert len(HiF8Cache()) == 0
    with pytest.raises(ValueError, match=r"scales\[0\] must be a tuple \(q_scale, k_scale, v_scale\) .*got 2 entries"):
        HiF8Cache(scales=[(1.0, 2.0)])
    assert len(HiF8Cache(config=model.config)) == 2
    sliding = Qwen2Config(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"],
                          use_sliding_window=True, sliding_window=8)
    with pytest.raises(ValueError, match="full-attention layers only"):
        HiF8Cache(config=sliding)
    bounded = HiF8Cache(config=model.config)
    with pytest.raises(ValueError, match="layer_idx must be below the config's 2 layers, got 2"):
        bounded.update(randn(1, 2, 3, 128, seed=1), randn(1, 2, 3, 128, seed=2), 2)
    assert len(bounded) == 2  # (an index without a config is unbounded: nothing to check it against)


def test_generate_greedy_bytes_and_decode_reads_codes(monkeypatch):
    model = tiny_model()
    model.set_attn_implementation(IMPL)
    prompt, new = ids(1, 40, seed=3), 24
    encoded = []
    real_encode = hc.encode
    monkeypatch.setattr(hc, "encode", lambda x, s: (encoded.append(tuple(x.shape)), real_encode(x, s))[1])
    cache = HiF8Cache(config=model.config)
    snapshots = []

    class Watch(transformers.LogitsProcessor):  # runs once per generated token, after the forward
        def __call__(self, input_ids, scores):
            snapshots.append([(l.keys.clone(), l.values.clone(), l.k_scale.clone(), l.k_mean.clone())
                              for l in cache.layers])
            return scores

    with torch.no_grad():
        out = model.generate(prompt, past_key_values=cache, max_new_tokens=new, do_sample=False,
                             logits_processor=transformers.LogitsProcessorList([Watch()]))
    assert out.shape == (1, 40 + new)
    # a step encodes only its new token per layer (K then V); the prefill its 40
    assert encoded[:4] == [(40, NKV, D)] * 4 and encoded[4:] == [(1, NKV, D)] * (4 * (new - 1))
    for before, after in zip(snapshots, snapshots[1:]):  # stored codes, scales, means never change
        for (k0, v0, s0, m0), (k1, v1, s1, m1) in zip(before, after):
            n = k0.shape[2]
            assert k1.shape[2] == n + 1
            assert torch.equal(k1[:, :, :n], k0) and torch.equal(v1[:, :, :n], v0)
            assert torch.equal(s1, s0) and torch.equal(m1, m0)
    model.set_attn_implementation("sdpa")
    dynamic = DynamicCache(config=model.config)
    with torch.no_grad():
        ref = model.generate(prompt, past_key_values=dynamic, max_new_tokens=new, do_sample=False)
    assert ref.shape == out.shape  # same token count: the two caches hold the same tokens
    bf16_bytes = sum(l.keys.nbytes + l.values.nbytes for l in dynamic.layers)
    code_bytes = sum(l.keys.nbytes + l.values.nbytes for l in cache.layers)
    assert dynamic.layers[0].keys.dtype == torch.bfloat16 and code_bytes * 2 == bf16_bytes  # 1 byte vs 2
    ratio = cache.nbytes() / bf16_bytes
    assert ratio <= 0.52, ratio


def test_generate_with_sampling_runs():
    model = tiny_model()
    model.set_attn_implementation(IMPL)
    cache = HiF8Cache()
    with torch.no_grad():
        out = model.generate(ids(2, 12, seed=4), past_key_values=cache, max_new_tokens=5, do_sample=True, top_k=20)
    assert out.shape == (2, 17) and cache.get_seq_length() == 16


def _left_pad(seqs, pad_ids):
    n = max(len(s) for s in seqs)
    input_ids = torch.stack([torch.cat([pad_ids[i, :n - len(s)], s]) for i, s in enumerate(seqs)])
    mask = torch.stack([torch.cat([torch.zeros(n - len(s), dtype=torch.long), torch.ones(len(s), dtype=torch.long)])
                        for s in seqs])
    return input_ids, mask


def test_model_padding_never_enters_scales_means_or_attention():
    """Left-padded batches that differ only in the padding tokens: same valid logits (bits),
    same scales, means and stored codes; greedy generation continues identically."""
    model = tiny_model()
    model.set_attn_implementation(IMPL)
    seqs = [ids(1, 29, seed=3)[0], ids(1, 11, seed=4)[0], ids(1, 20, seed=5)[0]]
    results = []
    for pad_seed in (6, 7):
        input_ids, mask = _left_pad(seqs, ids(3, 29, seed=pad_seed))
        cache = HiF8Cache()
        with torch.no_grad():
            logits = model(input_ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
            gen = model.generate(input_ids, attention_mask=mask, past_key_values=HiF8Cache(), max_new_tokens=6,
                                 do_sample=False)
        results.append((logits, mask, cache, gen))
    (l0, m0, c0, g0), (l1, _, c1, g1) = results
    valid = m0.bool()
    assert not torch.equal(l0[~valid], l1[~valid])  # the padding did change (its own rows)
    assert torch.equal(bits(l0[valid]), bits(l1[valid]))
    for a, b in zip(c0.layers, c1.layers):
        for name in ("k_scale", "v_scale", "k_mean", "keys", "values", "lengths"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert c0.layers[0].lengths.tolist() == [29, 11, 20]
    assert torch.equal(g0[:, 29:], g1[:, 29:])


# ----------------------------------------------------------------------------- capacity, in-place appends

def _commit(cache, layer_idx, k, v, mask=None):
    """Store k/v in a layer without attention (what cached_attention's commit does)."""
    cache.update(k, v, layer_idx)
    cache.layer(layer_idx).commit(mask)


def _held_bytes(layer, batch: int) -> int:
    """What a layer holds: both code tensors at full capacity, two fp32 scales, the fp32 key
    means and the int64 lengths."""
    return 2 * batch * NKV * layer.capacity * D + 2 * 4 + batch * NKV * D * 4 + batch * 8


def test_appends_within_capacity_write_in_place_and_growth_is_geometric():
    cache = HiF8Cache()
    prefill = 256
    _commit(cache, 0, randn(1, NKV, prefill, D, seed=1), randn(1, NKV, prefill, D, seed=2))
    layer = cache.layer(0)
    want_capacity = prefill + prefill // hc.GROWTH_DIVISOR
    assert layer.capacity == want_capacity and layer.keys.shape[2] == prefill
    assert cache.nbytes() == _held_bytes(layer, 1)
    k_ptr, v_ptr = layer.keys.data_ptr(), layer.values.data_ptr()
    stored = layer.keys.clone()
    n = prefill
    while n < want_capacity:  # every append that fits: written in place, nothing reallocated
        _commit(cache, 0, randn(1, NKV, 1, D, seed=100 + n), randn(1, NKV, 1, D, seed=200 + n))
        n += 1
        assert (layer.keys.data_ptr(), layer.values.data_ptr()) == (k_ptr, v_ptr)
        assert layer.capacity == want_capacity and layer.keys.shape[2] == n and layer.host_lengths == (n,)
    before = layer.keys.clone()
    _commit(cache, 0, randn(1, NKV, 1, D, seed=3), randn(1, NKV, 1, D, seed=4))  # one past: it grows
    n += 1
    assert layer.capacity == n + n // hc.GROWTH_DIVISOR and layer.keys.data_ptr() != k_ptr
    assert torch.equal(layer.keys[:, :, :n - 1], before) and torch.equal(layer.keys[:, :, :prefill], stored)
    assert layer.lengths.tolist() == [n] and cache.nbytes() == _held_bytes(layer, 1)


def test_kv_bytes_within_the_claim_at_2048_tokens():
    """The README's claim, counted on what is allocated: a 2048-token prefill and 11 decode
    tokens (qfa generate --prompt-tokens 2048 --max-new-tokens 12) against a bf16 DynamicCache."""
    cache, dynamic = HiF8Cache(), DynamicCache()
    k, v = randn(1, NKV, 2048, D, seed=1), randn(1, NKV, 2048, D, seed=2)
    _commit(cache, 0, k, v)
    dynamic.update(k, v, 0)
    for t in range(11):
        k, v = randn(1, NKV, 1, D, seed=10 + t), randn(1, NKV, 1, D, seed=30 + t)
        _commit(cache, 0, k, v)
        dynamic.update(k, v, 0)
    bf16 = dynamic.layers[0].keys.nbytes + dynamic.layers[0].values.nbytes
    assert cache.layer(0).capacity > cache.layer(0).keys.shape[2] == 2059  # there is headroom, and it counts
    assert cache.nbytes() == _held_bytes(cache.layer(0), 1)
    assert cache.nbytes() / bf16 <= 0.52, cache.nbytes() / bf16


def test_padded_batch_appends_in_place_per_sequence():
    lengths = [29, 11]
    _, (q, k, v), mask = _left_padded(lengths)
    cache = HiF8Cache()
    _commit(cache, 0, k, v, mask)
    layer = cache.layer(0)
    assert layer.capacity == 29 and layer.host_lengths == (29, 11)  # 29 // 32 == 0: no headroom yet
    ptr = layer.keys.data_ptr()
    # the shorter sequence gets two tokens, the longer one none (its column is padding): fits in place
    new_k, new_v = randn(2, NKV, 2, D, seed=5), randn(2, NKV, 2, D, seed=6)
    step_mask = torch.tensor([[False, False], [True, True]])
    _commit(cache, 0, new_k, new_v, step_mask)
    assert layer.keys.data_ptr() == ptr and layer.host_lengths == (29, 13) and layer.lengths.tolist() == [29, 13]
    alone = HiF8Cache()
    _commit(alone, 0, k[1:, :, 29 - 11:], v[1:, :, 29 - 11:])
    _commit(alone, 0, new_k[1:], new_v[1:])
    assert torch.equal(layer.keys[1, :, :13], alone.layer(0).keys[0])
    assert torch.equal(layer.values[1, :, :13], alone.layer(0).values[0])
    assert not layer.keys[1, :, 13:].any()  # past a sequence's length: zeros, never read


def test_batch_repeat_keeps_lengths_and_capacity():
    cache = HiF8Cache()
    _commit(cache, 0, randn(1, NKV, 64, D, seed=1), randn(1, NKV, 64, D, seed=2))
    layer = cache.layer(0)
    layer.batch_repeat_interleave(2)
    assert layer.keys.shape == (2, NKV, 64, D) and layer.host_lengths == (64, 64) and layer.capacity == 66
    assert torch.equal(layer.keys[0], layer.keys[1])
    ptr = layer.keys.data_ptr()
    _commit(cache, 0, randn(2, NKV, 1, D, seed=3), randn(2, NKV, 1, D, seed=4))
    assert layer.keys.data_ptr() == ptr and layer.lengths.tolist() == [65, 65]


# ----------------------------------------------------------------------------- one plan per step

def _decode_logits(model, input_ids, mask, steps: int):
    """Prefill and ``steps`` greedy steps: (last logits of every forward, the cache, how many
    steps appended to layer 0 in place: its keys kept their address)."""
    cache = HiF8Cache()
    logits, addresses = [], []
    with torch.no_grad():
        out = model(input_ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]
        for _ in range(steps):
            logits.append(out)
            addresses.append(cache.layer(0).keys.data_ptr())
            mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], 1)
            out = model(out.argmax(-1)[:, None], attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]
    logits.append(out)
    addresses.append(cache.layer(0).keys.data_ptr())
    return torch.stack(logits), cache, sum(a == b for a, b in zip(addresses, addresses[1:]))


def test_decode_plans_once_per_step_and_keeps_the_bits_of_fresh_plans_and_exact_tensors(monkeypatch):
    """A left-padded batch of 2 decoding 40 steps (the code tensors grow several times) through
    a 3-layer model: the op is planned once per forward pass, not per layer, and the logits and
    the stored codes are the bits of the cache planning every call anew on code tensors sized
    exactly to their tokens (reallocated on every append, as the cache did before)."""
    from qfa.serving import attention as sa

    model = tiny_model(num_hidden_layers=3)
    model.set_attn_implementation(IMPL)
    input_ids, mask = _left_pad([ids(1, 70, seed=3)[0], ids(1, 45, seed=4)[0]], ids(2, 70, seed=5))
    steps = 40
    plans = []
    real_metadata = sa.quant_flash_attn_metadata
    monkeypatch.setattr(sa, "quant_flash_attn_metadata", lambda *a, **kw: (plans.append(1), real_metadata(*a, **kw))[1])
    got, cache, in_place = _decode_logits(model, input_ids, mask, steps)
    assert len(plans) == steps + 1  # the prefill and every step: one plan for all 3 layers
    assert steps // 2 < in_place < steps  # it grew, and most steps appended in place
    monkeypatch.setattr(HiF8Cache, "shared_plan", lambda self, key, make: make())
    monkeypatch.setattr(hc, "GROWTH_DIVISOR", 1 << 60)  # no headroom: every append reallocates
    plans.clear()
    want, exact, in_place = _decode_logits(model, input_ids, mask, steps)
    assert in_place == 0
    assert len(plans) == 3 * (steps + 1)
    assert exact.layer(0).capacity == exact.layer(0).keys.shape[2] == 70 + steps
    assert torch.equal(bits(got), bits(want))
    for a, b in zip(cache.layers, exact.layers):
        for name in ("keys", "values", "lengths", "k_scale", "v_scale", "k_mean"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_hadamard_is_made_once_per_device():
    assert rotation.hadamard(D) is rotation.hadamard(D, "cpu") is rotation.hadamard(D, torch.device("cpu"))


@pytest.mark.parametrize("shape", [(1, 1, D), (1, NKV, D), (2, 1, D), (12, 1, D), (NQ, 5, D), (40, 2, D), (256, D)])
def test_small_rotations_have_the_bits_of_the_definition_on_any_thread_count(shape):
    """A decode step's rotations (a few rows per layer) run in the native row kernel on the
    calling thread; they must give the bits of the rotation's definition (the torch butterfly)
    whatever the thread count, on whatever CPU the tests run."""
    x = randn(*shape, seed=sum(shape), scale=5.0)
    threads = torch.get_num_threads()
    want = rotation.butterfly(x.float())
    try:
        for n in (1, threads):
            torch.set_num_threads(n)
            assert torch.equal(bits(rotation.rotate(x)), bits(want))
    finally:
        torch.set_num_threads(threads)


def _filled(lens=(10, 6), layers: int = 2) -> HiF8Cache:
    """A cache whose layers hold a left-padded batch of sequences of these lengths."""
    cache, s = HiF8Cache(), max(lens)
    mask = torch.zeros(len(lens), s, dtype=torch.bool)
    for i, n in enumerate(lens):
        mask[i, s - n:] = True
    for layer in range(layers):
        k, v = randn(len(lens), 2, s, 128, seed=layer), randn(len(lens), 2, s, 128, seed=layer + 10)
        step(cache, layer, randn(len(lens), 4, s, 128, seed=layer + 20), k, v, mask=mask)
    return cache


def _state(cache: HiF8Cache) -> list:
    return [(layer.host_lengths, layer.seen, len(layer._pending),
             *[None if t is None else t.clone() for t in (layer._k_store, layer._v_store, layer.k_mean, layer.lengths)])
            for layer in cache.layers]


def _same(a: list, b: list) -> bool:
    return all(x == y if not isinstance(x, torch.Tensor) else torch.equal(x, y)
               for la, lb in zip(a, b) for x, y in zip(la, lb)) and len(a) == len(b)


@pytest.mark.parametrize("call, error, match", [
    (lambda c: c.reorder_cache(torch.tensor([True, False])), TypeError, "beam_idx must be a 1-D integer tensor"),
    (lambda c: c.reorder_cache(torch.tensor([0, 2])), ValueError, r"beam_idx must hold batch rows in \[0, 2\)"),
    (lambda c: c.reorder_cache(torch.tensor([-1, 0])), ValueError, "batch rows"),
    (lambda c: c.reorder_cache(torch.tensor([0.0, 1.0])), TypeError, "integer tensor"),
    (lambda c: c.reorder_cache([1, 0]), TypeError, "got list"),
    (lambda c: c.batch_select_indices(torch.tensor([[0]])), TypeError, "indices must be a 1-D"),
    (lambda c: c.batch_repeat_interleave(-1), ValueError, "repeats must be >= 1, got -1"),
    (lambda c: c.batch_repeat_interleave(1.5), TypeError, "repeats must be an int"),
])
def test_a_refused_batch_operation_changes_nothing(call, error, match):
    """A bool mask used to select the rows by the mask but the lengths by 0 and 1 (a later step
    then read a 10-token row as 6 tokens); bad indices raised IndexError or AttributeError."""
    cache = _filled()
    before = _state(cache)
    with pytest.raises(error, match=match):
        call(cache)
    assert _same(_state(cache), before)


def test_a_reorder_refused_by_a_later_layer_changes_no_layer():
    """The base class's loop permuted layer 0 before layer 1 refused (tokens queued there)."""
    cache = _filled()
    cache.update(randn(2, 2, 1, 128, seed=5), randn(2, 2, 1, 128, seed=6), 1)
    before = _state(cache)
    with pytest.raises(ValueError, match="tokens queued"):
        cache.reorder_cache(torch.tensor([1, 0]))
    assert _same(_state(cache), before)


def test_a_reorder_permutes_every_layer_with_its_lengths():
    cache = _filled()
    before = _state(cache)
    cache.reorder_cache(torch.tensor([1, 0, 1]))
    for (lengths, _, _, k, v, mean, lens), layer in zip(before, cache.layers):
        assert layer.host_lengths == (lengths[1], lengths[0], lengths[1])
        assert torch.equal(layer._k_store, k[[1, 0, 1]]) and torch.equal(layer.k_mean, mean[[1, 0, 1]])


@pytest.mark.parametrize("option, value, cache_kw", [
    ("smooth_k", False, {}), ("rotate", False, {}), ("calibration", "amax", {}),
    ("smooth_k", True, {"smooth_k": False}),
])
def test_registered_options_the_cache_decides_must_agree_with_it(option, value, cache_kw):
    """With a HiF8Cache only p_scale and backend of the registered options were used: a name
    registered with smooth_k=False smoothed anyway. Now a disagreement is an error naming both."""
    name = f"qfa_hif8_options_{option}_{value}"
    qfa_hf.register(name, **{option: value})
    model = tiny_model()
    model.set_attn_implementation(name)
    with torch.no_grad(), pytest.raises(ValueError, match=rf"^{name} was registered with {option}={value!r}, but this "
                                                          rf"qfa.serving.HiF8Cache was made with {option}="):
        model(ids(1, 8), past_key_values=HiF8Cache(**cache_kw), use_cache=True)
    agreeing = qfa_hf.register(f"{name}_agrees", **{option: value})
    model.set_attn_implementation(agreeing)
    with torch.no_grad():  # the same options on both sides run
        model(ids(1, 8), past_key_values=HiF8Cache(**{**cache_kw, option: value}), use_cache=True)


@pytest.mark.parametrize("call, error, match", [
    (lambda: qfa_hf.register("qfa_bad_option", foo=1), TypeError, r"options \['foo'\] are not arguments of"),
    (lambda: qfa_hf.register("qfa_own_layout", layout="TND"), TypeError, r"options \['layout'\] are not arguments"),
    (lambda: qfa_hf.register("qfa_own_lse", return_softmax_lse=True), TypeError, "return_softmax_lse"),
    (lambda: qfa_hf.register("qfa_bad_rule", calibration="bogus"), ValueError, "bogus"),
    (lambda: qfa_hf.register("qfa_bad_flag", smooth_k="yes"), TypeError, "smooth_k"),
    (lambda: qfa_hf.register("sdpa"), ValueError, "'sdpa' is an attention transformers already has"),
    (lambda: qfa_hf.register(123), TypeError, "name must be a non-empty str, got 123"),
    (lambda: qfa_hf.register(""), TypeError, "name must be a non-empty str"),
    (lambda: qfa_hf.register("qfa_bad_fn", attention_fn=3), TypeError, "attention_fn must be callable, got int"),
])
def test_register_checks_its_name_and_options_when_registering(call, error, match):
    """They used to be accepted and fail at the first forward pass (or, for "sdpa", replace
    transformers' own attention for the whole process)."""
    from transformers import AttentionInterface

    before = dict(AttentionInterface._global_mapping)
    with pytest.raises(error, match=match):
        call()
    assert AttentionInterface._global_mapping == before


def test_options_a_cache_does_not_take_are_refused_with_it():
    """Registered static scales (or another format) were dropped without a word with a HiF8Cache."""
    qfa_hf.register("qfa_hif8_with_scales", scales=(0.1, 0.1, 0.1))
    model = tiny_model()
    model.set_attn_implementation("qfa_hif8_with_scales")
    with torch.no_grad(), pytest.raises(ValueError, match=r"registered with \['scales'\], which a qfa.serving.HiF8Cache"):
        model(ids(1, 8), past_key_values=HiF8Cache(), use_cache=True)
