"""The transformers adapter's 2D masks: wrong shapes are errors naming attention_mask (no silent
zeros, no failure deep in an expand), and one forward pass plans once for all its layers."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import qfa.integrations.transformers as qfa_hf  # noqa: E402
from qfa.tiling import attention as tiling  # noqa: E402
from qfa.tiling import checks  # noqa: E402
from test_transformers_integration import exact_attention, ids, tiny_model  # noqa: E402


def _qkv(b=2, sq=5, skv=9, nq=4, nkv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, nq, sq, 128, generator=g), torch.randn(b, nkv, skv, 128, generator=g),
            torch.randn(b, nkv, skv, 128, generator=g))


@pytest.mark.parametrize("fallback", [None, "sdpa"])
def test_a_2d_mask_of_the_wrong_batch_size_names_attention_mask(fallback):
    attention = qfa_hf.make_attention_function("t", fallback=fallback, attention_fn=exact_attention)
    q, k, v = _qkv()
    mask = torch.ones(3, 9, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"attention_mask must have the query's batch size 2.*\(3, 9\)"):
        attention(None, q, k, v, mask)


@pytest.mark.parametrize("columns", [4, 1, 10])
def test_a_2d_mask_that_does_not_cover_the_queries_or_exceeds_the_keys_is_rejected(columns):
    """Shorter than Sq (5) used to return all zeros, as if every query were padding."""
    attention = qfa_hf.make_attention_function("t", attention_fn=exact_attention)
    q, k, v = _qkv()
    mask = torch.ones(2, columns, dtype=torch.bool)
    with pytest.raises(ValueError, match=rf"attention_mask must cover between the 5 queries .* 9 keys, got {columns}"):
        attention(None, q, k, v, mask)


def test_a_mask_that_covers_exactly_the_queries_runs():
    """L == Sq (the keys before the queries are invalid): the rows see only their own window."""
    attention = qfa_hf.make_attention_function("t", attention_fn=exact_attention)
    q, k, v = _qkv()
    mask = torch.ones(2, 5, dtype=torch.bool)
    out, _ = attention(None, q, k, v, mask, is_causal=True)
    want = exact_attention(q, k[:, :, :5], v[:, :, :5], is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def _padded_batch(b=3, s=40):
    x = ids(b, s, seed=5)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[0, :7] = 0  # left padding of different lengths
    mask[1, :19] = 0
    return x, mask


def _count(monkeypatch):
    calls = {"plan_metadata": 0, "length reads": 0}
    plan, read = tiling.plan_metadata, checks.int32_vector

    def counted_plan(*args, **kwargs):
        calls["plan_metadata"] += 1
        return plan(*args, **kwargs)

    def counted_read(*args, **kwargs):
        calls["length reads"] += 1
        return read(*args, **kwargs)

    monkeypatch.setattr(tiling, "plan_metadata", counted_plan)
    monkeypatch.setattr(tiling, "int32_vector", counted_read)
    monkeypatch.setattr(checks, "int32_vector", counted_read)
    return calls


@torch.no_grad()
def test_one_forward_pass_plans_once_for_all_layers(monkeypatch):
    """A 4-layer model with padding: one plan (two host reads: cu_seqlens_q and _kv) per
    forward pass, not one per layer; the next forward pass (a new mask) plans again."""
    qfa_hf.register("qfa_hif8_plan_test")
    model = tiny_model("llama", num_hidden_layers=4)
    model.set_attn_implementation("qfa_hif8_plan_test")
    x, mask = _padded_batch()
    calls = _count(monkeypatch)
    model(x, attention_mask=mask)
    assert calls == {"plan_metadata": 1, "length reads": 2}
    model(x, attention_mask=mask)
    assert calls == {"plan_metadata": 2, "length reads": 4}


@torch.no_grad()
def test_the_shared_plan_gives_the_bits_of_per_layer_planning(monkeypatch):
    qfa_hf.register("qfa_hif8_plan_test")
    model = tiny_model("qwen2", num_hidden_layers=2)
    model.set_attn_implementation("qfa_hif8_plan_test")
    x, mask = _padded_batch()
    shared = model(x, attention_mask=mask).logits
    monkeypatch.setattr(qfa_hf, "_takes_metadata", lambda fn: False)  # every layer plans itself
    monkeypatch.setattr(tiling, "_metadata_key", lambda *args: None)  # ... from scratch, not from the cache
    calls = _count(monkeypatch)
    own = model(x, attention_mask=mask).logits
    assert calls["plan_metadata"] == 2  # one per layer: the test compares two different paths
    assert torch.equal(shared, own)


def test_an_in_place_change_of_the_mask_is_a_new_plan():
    """The cache keys on the mask's identity and version: editing it in place re-plans."""
    seen = []

    def recording(q, k, v, *, cu_seqlens_kv=None, **kw):
        seen.append(cu_seqlens_kv.tolist())
        return exact_attention(q, k, v, cu_seqlens_kv=cu_seqlens_kv, **kw)

    attention = qfa_hf.make_attention_function("t", attention_fn=recording)
    q, k, v = _qkv()
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, :3] = False
    attention(None, q, k, v, mask, is_causal=True)
    attention(None, q, k, v, mask, is_causal=True)
    mask[1, :2] = False
    attention(None, q, k, v, mask, is_causal=True)
    assert seen == [[0, 6, 15], [0, 6, 15], [0, 6, 13]]


@pytest.mark.parametrize("layout", ["TND", "BSND"])
def test_dropin_with_metadata_gives_the_bits_of_planning_per_call(layout):
    """hif8_attention(metadata=...) runs the op on a ready plan: same bits, no length read."""
    import qfa

    g = torch.Generator().manual_seed(9)
    if layout == "TND":
        q, k, v = (torch.randn(50, 4, 128, generator=g) for _ in range(3))
        lengths = dict(cu_seqlens_q=torch.tensor([0, 20, 20, 50], dtype=torch.int32),
                       cu_seqlens_kv=torch.tensor([0, 10, 30, 50], dtype=torch.int32))
    else:
        q, k, v = (torch.randn(3, 30, 4, 128, generator=g) for _ in range(3))
        lengths = dict(seqused_q=torch.tensor([30, 0, 7], dtype=torch.int32),
                       seqused_kv=torch.tensor([30, 4, 20], dtype=torch.int32))
    want = qfa.hif8_attention(q, k, v, layout=layout, is_causal=True, return_softmax_lse=True, **lengths)
    meta = qfa.quant_flash_attn_metadata(4, 4, layout=layout, mask_mode=3, **lengths)
    reads, read = [], checks.int32_vector
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checks, "int32_vector", lambda *a, **kw: reads.append(a[1]) or read(*a, **kw))
        got = qfa.hif8_attention(q, k, v, layout=layout, is_causal=True, return_softmax_lse=True, metadata=meta,
                                 **lengths)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert reads == []


@torch.no_grad()
def test_layers_that_plan_themselves_hit_the_metadata_cache(monkeypatch):
    """Without the shared plan each layer plans, but the same lengths key the same metadata:
    one derivation per forward pass, not one per layer, and the same bits as the shared plan."""
    qfa_hf.register("qfa_hif8_plan_test")
    model = tiny_model("qwen2", num_hidden_layers=3)
    model.set_attn_implementation("qfa_hif8_plan_test")
    x, mask = _padded_batch()
    shared = model(x, attention_mask=mask).logits
    monkeypatch.setattr(qfa_hf, "_takes_metadata", lambda fn: False)
    monkeypatch.setattr(tiling, "_plan_cache", {})
    calls = _count(monkeypatch)
    own = model(x, attention_mask=mask).logits
    assert calls["plan_metadata"] == 1
    assert torch.equal(shared, own)
