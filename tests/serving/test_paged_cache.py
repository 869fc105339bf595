"""qfa.serving.PagedHiF8Cache: allocation, reuse of freed blocks, scales, errors, and attention
through the block table equal (bit for bit) to the op on the same codes laid out contiguously."""

from __future__ import annotations

import pytest
import torch

import qfa
from qfa.dropin import calibration as cal
from qfa.cast import format as fmt
from qfa.serving import PagedHiF8Cache

NKV, NQ, D = 2, 4, 128


def tokens(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, NKV, D, generator=torch.Generator().manual_seed(seed)) * scale


def filled(lengths: dict, *, block_size: int = 16, num_blocks: int = 64, layers: int = 1, chunk: int = 7):
    """A cache with the sequences appended round-robin in chunks, so their blocks interleave
    (a sequence's blocks are neither contiguous nor in order of index across sequences)."""
    cache = PagedHiF8Cache(layers, num_blocks, block_size, NKV)
    data = {s: [(tokens(n, 10 * i + layer), tokens(n, 10 * i + layer + 5)) for layer in range(layers)]
            for i, (s, n) in enumerate(lengths.items())}
    for s in lengths:
        cache.add_sequence(s)
    for start in range(0, max(lengths.values(), default=0), chunk):
        for s, n in lengths.items():
            for layer in range(layers):
                k, v = data[s][layer]
                cache.append(s, layer, k[start:min(n, start + chunk)], v[start:min(n, start + chunk)])
    return cache, data


# ----------------------------------------------------------------------------- allocation

def test_allocation_blocks_table_and_lengths():
    lengths = {"a": 40, "b": 16, "c": 0, "d": 17}
    cache, _ = filled(lengths)
    for s, n in lengths.items():
        assert len(cache.blocks(s)) == -(-n // 16)
        assert cache.length(s, 0) == n
    used = [blk for s in lengths for blk in cache.blocks(s)]
    assert len(used) == len(set(used))  # no block owned twice
    assert cache.free_blocks == 64 - len(used)
    table = cache.block_table(list(lengths))
    assert table.dtype == torch.int32 and table.shape == (4, 3)
    for row, s in zip(table.tolist(), lengths):
        blocks = cache.blocks(s)
        assert row[:len(blocks)] == blocks and all(x == 0 for x in row[len(blocks):])
    assert cache.seqused_kv(0, list(lengths)).tolist() == list(lengths.values())
    # round-robin appends interleave the sequences' blocks
    assert cache.blocks("a") != list(range(cache.blocks("a")[0], cache.blocks("a")[0] + 3))


def test_stored_codes_are_the_tokens_encoded_with_the_layer_scale():
    lengths = {"a": 40, "b": 23}
    cache, data = filled(lengths, layers=2)
    for layer in range(2):
        k_scale, v_scale = cache.scales(layer)
        # the first append (7 tokens of "a") fixed the scales
        assert torch.equal(k_scale, cal.compute_scale(data["a"][layer][0][:7]))
        assert torch.equal(v_scale, cal.compute_scale(data["a"][layer][1][:7]))
        k, v, used = cache.gather(layer, list(lengths))
        for b, s in enumerate(lengths):
            n = lengths[s]
            assert torch.equal(k[b, :, :n], cal.quantize(data[s][layer][0], k_scale).transpose(0, 1))
            assert torch.equal(v[b, :, :n], cal.quantize(data[s][layer][1], v_scale).transpose(0, 1))


def test_freed_blocks_are_reused_and_other_sequences_are_untouched():
    cache, data = filled({"a": 48, "keep": 33}, num_blocks=8)
    keep_before = cache.gather(0, ["keep"])
    freed = cache.blocks("a")
    cache.free("a")
    assert cache.free_blocks == 8 - len(cache.blocks("keep"))
    cache.add_sequence("new")
    k, v = tokens(48, 99, scale=3.0), tokens(48, 98)
    cache.append("new", 0, k, v)
    assert sorted(cache.blocks("new")) == sorted(freed)  # handed out again
    for got, want in zip(cache.gather(0, ["keep"]), keep_before):
        assert torch.equal(got, want)
    k_scale, v_scale = cache.scales(0)
    got_k, got_v, _ = cache.gather(0, ["new"])
    assert torch.equal(got_k[0], cal.quantize(k, k_scale).transpose(0, 1))
    assert torch.equal(got_v[0], cal.quantize(v, v_scale).transpose(0, 1))
    with pytest.raises(ValueError, match="seq_id 'a' is an unknown sequence"):
        cache.length("a", 0)


def test_out_of_blocks_changes_nothing():
    cache, _ = filled({"a": 30}, num_blocks=3)
    before = (cache.blocks("a"), cache.free_blocks, cache.gather(0, ["a"]))
    with pytest.raises(ValueError, match=r"out of blocks: seq_id 'a' needs 2 more block\(s\)"):
        cache.append("a", 0, tokens(33, 1), tokens(33, 2))
    assert cache.blocks("a") == before[0] and cache.free_blocks == before[1] and cache.length("a", 0) == 30
    for got, want in zip(cache.gather(0, ["a"]), before[2]):
        assert torch.equal(got, want)
    cache.append("a", 0, tokens(18, 1), tokens(18, 2))  # exactly what is left fits
    assert cache.free_blocks == 0 and cache.length("a", 0) == 48


def test_later_tokens_saturate_and_are_counted():
    cache = PagedHiF8Cache(1, 8, 16, NKV)
    cache.add_sequence(0)
    cache.append(0, 0, tokens(16, 1), tokens(16, 2))
    assert cache.saturated == [0]
    k_scale, v_scale = cache.scales(0)
    k = tokens(3, 3)
    k[0, 0, :5] = 50000.0 * float(k_scale)    # beyond the overflow threshold: clamped
    k[1, 1, 0] = -1e9 * float(k_scale)
    k[2, 0, 0] = 39000.0 * float(k_scale)     # below it: rounds to MAX, not saturation
    v = tokens(3, 4)
    v[2, 1, 7] = 2 * fmt.OVERFLOW_THRESHOLD * float(v_scale)
    cache.append(0, 0, k, v)
    assert cache.saturated == [7]
    assert torch.equal(cache.scales(0)[0], k_scale)  # still the first tokens' scale
    codes, _, _ = cache.gather(0, [0])
    assert (codes[0, 0, 16, :5] == fmt.MAX_CODE).all() and int(codes[0, 0, 18, 0]) == fmt.MAX_CODE
    assert int(codes[0, 1, 17, 0]) == fmt.MAX_CODE | fmt.SIGN_BIT


def test_given_scales_are_used():
    cache = PagedHiF8Cache(2, 4, 16, NKV, scales=[(0.5, 2.0), None])
    cache.add_sequence("s")
    k, v = tokens(5, 1), tokens(5, 2)
    cache.append("s", 0, k, v)
    cache.append("s", 1, k, v)
    assert float(cache.scales(0)[0]) == 0.5 and float(cache.scales(0)[1]) == 2.0
    assert torch.equal(cache.scales(1)[0], cal.compute_scale(k))
    assert torch.equal(cache.gather(0, ["s"])[0][0], cal.quantize(k, 0.5).transpose(0, 1))


@pytest.mark.parametrize("kw, exc, match", [
    (dict(block_size=24), ValueError, "block_size must be a multiple of 16 up to 1024, got 24"),
    (dict(block_size=2048), ValueError, "block_size must be a multiple of 16 up to 1024, got 2048"),
    (dict(head_dim=64), ValueError, "head_dim must be 128"),
    (dict(num_blocks=0), ValueError, "num_blocks must be >= 1, got 0"),
    (dict(num_blocks=2.0), TypeError, "num_blocks must be an int, got float"),
    (dict(scales=[(1.0,)]), ValueError, r"scales\[0\] must be a \(k_scale, v_scale\) pair"),
    (dict(scales=[(1.0, -1.0)]), ValueError, "must be positive and finite"),
    (dict(device="meta"), ValueError, "device must hold memory .* got meta"),
    (dict(scales=[(1.0, 2.0), None]), ValueError, r"scales must be a sequence of 1 \(k_scale, v_scale\) pairs or None "
                                                   r"\(one per layer\), got 2 entries"),
])
def test_constructor_errors(kw, exc, match):
    args = dict(num_layers=1, num_blocks=4, block_size=16, num_kv_heads=NKV)
    args.update(kw)
    with pytest.raises(exc, match=match):
        PagedHiF8Cache(**args)


def test_append_and_lookup_errors():
    cache = PagedHiF8Cache(1, 4, 16, NKV)
    cache.add_sequence("s")
    with pytest.raises(ValueError, match="seq_id 's': that sequence already exists"):
        cache.add_sequence("s")
    with pytest.raises(ValueError, match="seq_id 'x' is an unknown sequence"):
        cache.append("x", 0, tokens(1, 1), tokens(1, 2))
    with pytest.raises(ValueError, match=r"seq_ids\[1\] 'x' is an unknown sequence"):
        cache.block_table(["s", "x"])
    with pytest.raises(ValueError, match="seq_id 'x' is an unknown sequence"):
        cache.free("x")
    with pytest.raises(ValueError, match=r"k must have shape \(tokens, Nkv=2, D=128\), got \(1, 3, 128\)"):
        cache.append("s", 0, torch.randn(1, 3, D), tokens(1, 2))
    with pytest.raises(TypeError, match="v must be float16, bfloat16 or float32, got torch.int32"):
        cache.append("s", 0, tokens(1, 1), torch.zeros(1, NKV, D, dtype=torch.int32))
    with pytest.raises(ValueError, match="k and v must have one shape"):
        cache.append("s", 0, tokens(2, 1), tokens(1, 2))
    with pytest.raises(ValueError, match=r"layer must be in \[0, 1\), got 1"):
        cache.append("s", 1, tokens(1, 1), tokens(1, 2))
    with pytest.raises(ValueError, match="layer 0 has no scales yet"):
        cache.scales(0)
    with pytest.raises(ValueError, match="q holds HiF8 codes"):
        cache.quantize_q(torch.zeros(1, NQ, D, dtype=torch.uint8))
    assert cache.length("s", 0) == 0 and cache.free_blocks == 4  # nothing was taken


# ----------------------------------------------------------------------------- attention

Q_DESCALE = torch.tensor([0.125])


def contiguous_tnd(cache, layer, seq_ids):
    k, v, used = cache.gather(layer, seq_ids)
    pack = lambda x: torch.cat([x[b, :, :n].transpose(0, 1) for b, n in enumerate(used.tolist())])  # noqa: E731
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), used.cumsum(0).to(torch.int32)])
    return pack(k), pack(v), cu


def assert_same_bits(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.view(torch.int16) if g.dtype == torch.bfloat16 else g.view(torch.int32),
                           w.view(torch.int16) if w.dtype == torch.bfloat16 else w.view(torch.int32))


@pytest.mark.parametrize("block_size", [16, 48])
def test_decode_equals_the_contiguous_call(block_size):
    """Sq = 1 per sequence, unequal lengths including an empty sequence, BNSD queries."""
    lengths = {"a": 70, "b": 1, "c": 0, "d": 300}
    cache, _ = filled(lengths, block_size=block_size, num_blocks=64)
    ids = list(lengths)
    q = torch.randn(len(ids), NQ, 1, D, generator=torch.Generator().manual_seed(5))
    got = cache.attend(0, q, ids, q_descale=Q_DESCALE, layout_q="BNSD", return_softmax_lse=True)
    k, v, used = cache.gather(0, ids)
    q_codes = cal.quantize(q, Q_DESCALE)
    want = qfa.quant_flash_attn(q_codes, k, v, Q_DESCALE, *cache.scales(0), 0, layout="BNSD", seqused_kv=used,
                                mask_mode=3, return_softmax_lse=True)
    assert_same_bits(got, want)
    assert torch.isinf(got[1][2]).all() and not got[0][2].any()  # the empty sequence sees no key


def test_chunked_prefill_equals_the_contiguous_call():
    """TND query chunks (Sq > 1, unequal, one empty) against longer caches, causal bottom-right."""
    lengths = {"a": 260, "b": 33, "c": 5, "d": 0}
    q_lens = [17, 33, 0, 0]
    cache, _ = filled(lengths, block_size=32, num_blocks=64, chunk=50)
    ids = list(lengths)
    q = torch.randn(sum(q_lens), NQ, D, generator=torch.Generator().manual_seed(6))
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    got = cache.attend(0, q, ids, q_descale=Q_DESCALE, cu_seqlens_q=cu_q, layout_q="TND", return_softmax_lse=True)
    k, v, cu_kv = contiguous_tnd(cache, 0, ids)
    want = qfa.quant_flash_attn(cal.quantize(q, Q_DESCALE), k, v, Q_DESCALE, *cache.scales(0), 0, layout="TND",
                                cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, mask_mode=3, return_softmax_lse=True)
    assert_same_bits(got, want)


def test_attention_after_free_and_reuse_equals_the_contiguous_call():
    cache, _ = filled({"a": 64, "b": 40}, num_blocks=8)
    cache.free("a")
    cache.add_sequence("c")
    cache.append("c", 0, tokens(50, 7), tokens(50, 8))
    q = torch.randn(2, NQ, 1, D, generator=torch.Generator().manual_seed(9))
    got = cache.attend(0, q, ["c", "b"], layout_q="BNSD", calibration="rms")
    k, v, used = cache.gather(0, ["c", "b"])
    qs = cal.compute_scale(q, "rms")
    want = qfa.quant_flash_attn(cal.quantize(q, qs), k, v, qs, *cache.scales(0), 0, layout="BNSD", seqused_kv=used,
                                mask_mode=3)
    assert_same_bits(got[:1], want[:1])


@pytest.mark.parametrize("layout_q", ["BNSD", "TND"])
def test_triton_backend_through_the_cache_equals_its_contiguous_call(layout_q):
    """The same through the Triton kernel (under the interpreter on CPU: small sizes)."""
    pytest.importorskip("triton")
    lengths = {"a": 37, "b": 0, "c": 20}
    cache, _ = filled(lengths, block_size=16, num_blocks=16, chunk=9)
    ids = list(lengths)
    if layout_q == "BNSD":  # decode
        q = torch.randn(3, NQ, 1, D, generator=torch.Generator().manual_seed(11))
        got = cache.attend(0, q, ids, q_descale=Q_DESCALE, layout_q="BNSD", return_softmax_lse=True,
                           backend="triton")
        k, v, used = cache.gather(0, ids)
        want = qfa.quant_flash_attn(cal.quantize(q, Q_DESCALE), k, v, Q_DESCALE, *cache.scales(0), 0,
                                    layout="BNSD", seqused_kv=used, mask_mode=3, return_softmax_lse=True,
                                    backend="triton")
    else:  # chunks of 5, 0 and 20 queries (the last a whole prefill)
        cu_q = torch.tensor([0, 5, 5, 25], dtype=torch.int32)
        q = torch.randn(25, NQ, D, generator=torch.Generator().manual_seed(12))
        got = cache.attend(0, q, ids, q_descale=Q_DESCALE, cu_seqlens_q=cu_q, layout_q="TND",
                           return_softmax_lse=True, backend="triton")
        k, v, cu_kv = contiguous_tnd(cache, 0, ids)
        want = qfa.quant_flash_attn(cal.quantize(q, Q_DESCALE), k, v, Q_DESCALE, *cache.scales(0), 0, layout="TND",
                                    cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, mask_mode=3, return_softmax_lse=True,
                                    backend="triton")
    assert_same_bits(got, want)
