"""The serving caches as state machines (hypothesis.stateful): random valid and invalid
operations against a plain model of what each cache must hold.

* :class:`PagedMachine` drives ``PagedHiF8Cache``: add, append (NaN/Inf, loud values that
  saturate, bad shapes, wrong dtypes, a meta tensor, non-tensors, bad layers, out of blocks),
  free, double free, unknown and unhashable ids, attend (decode and chunks, bad batches, NaN
  queries, bad descales) and reset (every sequence freed).
* :class:`HiF8CacheMachine` drives ``HiF8Cache`` + ``cached_attention``: update (bad shapes,
  dtypes, batch, heads, devices, NaN/Inf/loud values, new layers), attention (padding masks,
  NaN queries, options the op refuses only after the queued tokens are encoded, layers
  without tokens) and reset.

The model predicts, for each operation, whether the cache must refuse it. After a refusal the
cache must be exactly as before (a snapshot of everything it holds, compared bit for bit);
after every step the invariants hold: blocks conserved and owned once, lengths, stored codes,
scales, key means and saturation counts equal to the model's, the spare code positions 0; and
attention equals, bit for bit, the op on the model's codes laid out contiguously (one call on
the packed sequences for the paged cache; one call per sequence, as the cache's docs promise,
for HiF8Cache). NaN compares equal to NaN at the same position (NaN tokens stored under a fixed
scale are accepted and reach the outputs; their payload is no promise).

The example budget comes from the hypothesis profile (tests/conftest.py: ``ci`` derandomised,
``QFA_HYPOTHESIS_PROFILE=long`` for a longer search); the steps per example are set here.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import qfa
from qfa.dropin import calibration as cal
from qfa.dropin import rotation
from qfa.dropin.smoothing import lse_shift
from qfa.cast import format as fmt
from qfa.serving import PagedHiF8Cache

NKV, NQ, D = 2, 4, 128
RULE = cal.get_rule(None)  # what both caches use when no rule is named
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Value kinds of new tokens: NaN / Inf are refused only where a scale is computed from them;
#: "loud" ones (finite, far past a unit scale) saturate under a fixed scale and are counted.
KINDS = ("normal",) * 5 + ("loud", "nan", "inf")
STEPS = 50  # per example; the number of examples is the profile's
#: One in RARE draws of a rule that clears the state (reset) really runs: with every rule
#: drawn alike, resets would otherwise keep the caches shallow.
RARE = 6


def _settings() -> settings:
    return settings(settings.default, stateful_step_count=STEPS)


# ----------------------------------------------------------------------------- shared helpers

def values(shape, seed: int, kind: str = "normal", dtype=torch.float32) -> torch.Tensor:
    """Random tokens; one element NaN / Inf for those kinds (at a seed-chosen position)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * (3000.0 if kind == "loud" else 1.0)
    if kind in ("nan", "inf") and x.numel():
        x.view(-1)[int(torch.randint(x.numel(), (1,), generator=g))] = float("nan" if kind == "nan" else "inf")
    return x.to(dtype)


def finite(x: torch.Tensor) -> bool:
    return bool(torch.isfinite(x.float()).all())


def saturated(x: torch.Tensor, scale: torch.Tensor) -> int:
    """Elements of ``x / scale`` that HiF8 clamps to +-MAX (finite, at or past the threshold)."""
    scaled = x.float() / scale
    return int(((scaled.abs() >= fmt.OVERFLOW_THRESHOLD) & torch.isfinite(scaled)).sum())


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit, NaN equal to NaN at the same positions."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    if not got.is_floating_point():
        assert torch.equal(got, want)
        return
    nan_g, nan_w = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_g, nan_w)
    ints = {2: torch.int16, 4: torch.int32}[got.element_size()]
    assert torch.equal(got.masked_fill(nan_g, 0).view(ints), want.masked_fill(nan_w, 0).view(ints))


def same_state(a, b) -> None:
    """Two snapshots (nested tuples / lists / dicts of tensors and plain values) are equal."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert_same_bits(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            same_state(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same_state(x, y)
    else:
        assert a == b, (a, b)


def refused(call, expected: type | None, snapshot, why: str = ""):
    """Run ``call``: with ``expected`` an exception type it must raise it and change nothing
    (``snapshot()`` equal before and after); with None it must return (its result returned).
    ``why`` labels the outcome in hypothesis' statistics (``--hypothesis-show-statistics``)."""
    event(f"{why or 'call'}: {'refused, ' + expected.__name__ if expected else 'done'}")
    if expected is None:
        return call()
    before = snapshot()
    with pytest.raises(expected):
        call()
    same_state(snapshot(), before)
    return None


# ----------------------------------------------------------------------------- PagedHiF8Cache

SEQ_IDS = ("a", "b", 7, ("t", 1))
LAYERS = 2
#: Append variants: which argument is broken, and how ("none" = a valid call).
PAGED_BAD = ("none",) * 10 + ("not_tensor", "int", "uint8", "heads", "dim", "rank", "meta", "count", "strided")


def _broken(x: torch.Tensor, bad: str):
    """``x`` (tokens, Nkv, D) broken the way ``bad`` says (``strided`` is a valid view)."""
    if bad == "not_tensor":
        return x.tolist()
    if bad == "int":
        return x.to(torch.int32)
    if bad == "uint8":
        return cal.quantize(x.float(), 1.0)
    if bad == "heads":
        return x[:, :1]
    if bad == "dim":
        return x[..., :64]
    if bad == "rank":
        return x.reshape(-1, D)
    if bad == "meta":
        return x.to("meta")
    if bad == "count":
        return torch.cat([x, x[:1]]) if x.shape[0] else x[:0].new_zeros(1, *x.shape[1:])
    if bad == "strided":  # same values, other strides: a transposed copy transposed back
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    return x


def _paged_append_error(bad: str) -> type | None:
    if bad in ("not_tensor", "int", "uint8"):
        return TypeError
    if bad in ("heads", "dim", "rank", "meta", "count"):
        return ValueError
    return None


class PagedMachine(RuleBasedStateMachine):
    """PagedHiF8Cache against a model: per sequence and layer the float chunks appended, per
    layer the scales (fixed by the first accepted tokens, or given) and saturation counts."""

    @initialize(block_size=st.sampled_from([16, 32]), num_blocks=st.integers(3, 8), static=st.booleans(),
                seqs=st.sets(st.sampled_from(SEQ_IDS), min_size=1), first=st.integers(1, 20), seed=st.integers(0, 99))
    def setup(self, block_size, num_blocks, static, seqs, first, seed):
        scales = [None, (0.25, 0.5)] if static else None  # layer 1 given up front: NaN tokens then stored
        self.cache = PagedHiF8Cache(LAYERS, num_blocks, block_size, NKV, scales=scales)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.chunks: dict = {}  # seq -> per layer, [(k, v)] accepted chunks
        self.scales: list = [None, (torch.tensor([0.25]), torch.tensor([0.5]))] if static else [None, None]
        self.saturated = [0] * LAYERS
        for seq in sorted(seqs, key=repr):
            self.add(seq)
        # layer 0's first tokens (valid: a state deep enough to attend on); layer 1's come later
        k, v = values((first, NKV, D), seed), values((first, NKV, D), seed + 1)
        self.cache.append(min(seqs, key=repr), 0, k, v)
        self.scales[0] = (RULE(k), RULE(v))
        self.chunks[min(seqs, key=repr)][0].append((k, v))

    # -- the model

    def some_id(self, data):
        """A known sequence most of the time, else one the cache does not know (drawn from the
        state: valid operations must be common enough to reach deep states)."""
        unknown = [s for s in SEQ_IDS if s not in self.chunks][:1]
        if not self.chunks or (unknown and data.draw(st.integers(0, RARE - 1), label="unknown?") == 0):
            return unknown[0]
        return data.draw(st.sampled_from(sorted(self.chunks, key=repr)), label="seq")

    def length(self, seq, layer: int) -> int:
        return sum(k.shape[0] for k, _ in self.chunks[seq][layer])

    def blocks_of(self, seq) -> int:
        return -(-max(self.length(seq, layer) for layer in range(LAYERS)) // self.block_size)

    def free_blocks(self) -> int:
        return self.num_blocks - sum(self.blocks_of(s) for s in self.chunks)

    def codes(self, seq, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's (n, Nkv, D) K and V codes of a sequence in a layer."""
        parts = self.chunks[seq][layer]
        if not parts:
            empty = torch.zeros(0, NKV, D, dtype=torch.uint8)
            return empty, empty
        k_scale, v_scale = self.scales[layer]
        return (torch.cat([cal.quantize(k, k_scale) for k, _ in parts]),
                torch.cat([cal.quantize(v, v_scale) for _, v in parts]))

    def snapshot(self):
        c = self.cache
        return ({s: list(b) for s, b in c._blocks.items()}, list(c._free), {s: list(n) for s, n in c._lengths.items()},
                [None if s is None else s.clone() for s in c.k_scales],
                [None if s is None else s.clone() for s in c.v_scales], c.saturated,
                [t.clone() for t in c.k_codes], [t.clone() for t in c.v_codes])

    # -- rules

    @rule(seq=st.sampled_from(SEQ_IDS))
    def add(self, seq):
        expected = ValueError if seq in self.chunks else None
        refused(lambda: self.cache.add_sequence(seq), expected, self.snapshot, "add")
        if expected is None:
            self.chunks[seq] = [[] for _ in range(LAYERS)]

    @rule(data=st.data())
    def free(self, data):  # a second free of the same id is an unknown id
        seq = self.some_id(data)
        expected = None if seq in self.chunks else ValueError
        refused(lambda: self.cache.free(seq), expected, self.snapshot, "free")
        self.chunks.pop(seq, None)

    @rule(method=st.sampled_from(["add_sequence", "free", "blocks"]))
    def unhashable_id(self, method):
        refused(lambda: getattr(self.cache, method)(["a"]), TypeError, self.snapshot)

    @rule(go=st.integers(0, RARE - 1))
    def reset(self, go):
        if go:
            return
        for seq in list(self.chunks):
            self.cache.free(seq)
        self.chunks.clear()
        assert self.cache.free_blocks == self.num_blocks

    @rule(data=st.data(), layer=st.sampled_from([0, 0, 0, 1, 1, 1, 2, -1, "0"]), n=st.integers(0, 40),
          seed=st.integers(0, 1 << 16), dtype=st.sampled_from(DTYPES), kind=st.sampled_from(KINDS),
          bad=st.sampled_from(PAGED_BAD), in_v=st.booleans())
    def append(self, data, layer, n, seed, dtype, kind, bad, in_v):
        seq = self.some_id(data)
        k = values((n, NKV, D), seed, kind if not in_v else "normal", dtype)
        v = values((n, NKV, D), seed + 1, kind if in_v else "normal", dtype)
        if in_v:
            v = _broken(v, bad)
        else:
            k = _broken(k, bad)
        expected = None
        if seq not in self.chunks:
            expected = ValueError
        elif layer == "0":
            expected = TypeError
        elif not 0 <= layer < LAYERS:
            expected = ValueError
        elif _paged_append_error(bad) is not None:
            expected = _paged_append_error(bad)
        elif -(-(self.length(seq, layer) + n) // self.block_size) - self.blocks_of(seq) > self.free_blocks():
            expected = ValueError  # out of blocks
        elif n and self.scales[layer] is None and not (finite(k) and finite(v)):
            expected = ValueError  # a computed scale needs finite values
        refused(lambda: self.cache.append(seq, layer, k, v), expected, self.snapshot, f"append, {bad}")
        if expected is None and n:
            if self.scales[layer] is None:
                self.scales[layer] = (RULE(k), RULE(v))
            self.chunks[seq][layer].append((k, v))
            self.saturated[layer] += saturated(k, self.scales[layer][0]) + saturated(v, self.scales[layer][1])

    @rule(data=st.data(), size=st.integers(1, 3), layer=st.sampled_from([0, 1]),
          decode=st.booleans(), q_lens=st.lists(st.integers(0, 5), min_size=3, max_size=3),
          given_descale=st.booleans(), causal=st.booleans(), seed=st.integers(0, 1 << 16),
          bad=st.sampled_from(("none",) * 5 + ("batch", "nan_q", "descale")))
    def attend(self, data, size, layer, decode, q_lens, given_descale, causal, seed, bad):
        seqs = [self.some_id(data) for _ in range(size)]
        # (a sequence may appear twice in a batch: two rows reading the same blocks)
        batch = len(seqs) + (1 if bad == "batch" else 0)
        q_lens = [1] * batch if decode else (q_lens * 2)[:batch]
        q = values((batch, NQ, 1, D) if decode else (sum(q_lens), NQ, D), seed, "nan" if bad == "nan_q" else "normal")
        cu_q = None if decode else torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        q_descale = torch.tensor([-0.5 if bad == "descale" else 0.125]) if given_descale or bad == "descale" else None
        kw = dict(q_descale=q_descale, cu_seqlens_q=cu_q, layout_q="BNSD" if decode else "TND", causal=causal,
                  return_softmax_lse=True)
        expected = None
        if any(s not in self.chunks for s in seqs) or bad in ("batch", "descale") or self.scales[layer] is None:
            expected = ValueError
        elif bad == "nan_q" and q_descale is None and q.numel():
            expected = ValueError  # a computed q scale needs finite values
        got = refused(lambda: self.cache.attend(layer, q, seqs, **kw), expected, self.snapshot, f"attend, {bad}")
        if expected is not None:
            return
        # the reference: the model's codes laid out contiguously, the same query codes
        q_scale = q_descale if q_descale is not None else RULE(q)
        q_codes = cal.quantize(q, q_scale)
        k_scale, v_scale = self.scales[layer]
        codes = [self.codes(s, layer) for s in seqs]
        lens = [k.shape[0] for k, _ in codes]
        mode = 3 if causal else 0
        if decode:
            width = max(lens + [1])
            dense = [torch.zeros(len(seqs), NKV, width, D, dtype=torch.uint8) for _ in range(2)]
            for b, (k, v) in enumerate(codes):
                dense[0][b, :, :lens[b]], dense[1][b, :, :lens[b]] = k.transpose(0, 1), v.transpose(0, 1)
            want = qfa.quant_flash_attn(q_codes, *dense, q_scale, k_scale, v_scale, 0, layout="BNSD",
                                        seqused_kv=torch.tensor(lens, dtype=torch.int32), mask_mode=mode,
                                        return_softmax_lse=True)
        else:
            cu_kv = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
            want = qfa.quant_flash_attn(q_codes, torch.cat([k for k, _ in codes]), torch.cat([v for _, v in codes]),
                                        q_scale, k_scale, v_scale, 0, layout="TND", cu_seqlens_q=cu_q,
                                        cu_seqlens_kv=cu_kv, mask_mode=mode, return_softmax_lse=True)
        for g, w in zip(got, want):
            assert_same_bits(g, w)

    # -- invariants

    @invariant()
    def blocks_are_conserved_and_owned_once(self):
        owned = [b for s in self.chunks for b in self.cache.blocks(s)]
        free = self.cache._free
        assert len(owned) == len(set(owned)) and not set(owned) & set(free)
        assert sorted(owned + free) == list(range(self.num_blocks))
        assert self.cache.free_blocks == len(free) == self.free_blocks()
        assert free == sorted(free, reverse=True)  # the lowest free block is handed out next

    @invariant()
    def lengths_codes_scales_and_counts_are_the_models(self):
        c = self.cache
        assert set(c._blocks) == set(self.chunks)
        for s in self.chunks:
            assert len(c.blocks(s)) == self.blocks_of(s)
        for layer in range(LAYERS):
            if self.scales[layer] is None:
                assert c.k_scales[layer] is None and c.v_scales[layer] is None
            else:
                assert_same_bits(c.scales(layer)[0], self.scales[layer][0])
                assert_same_bits(c.scales(layer)[1], self.scales[layer][1])
            ids = list(self.chunks)
            if ids:
                k, v, used = c.gather(layer, ids)
                for b, s in enumerate(ids):
                    assert int(used[b]) == c.length(s, layer) == self.length(s, layer)
                    want_k, want_v = self.codes(s, layer)
                    assert torch.equal(k[b, :, :int(used[b])], want_k.transpose(0, 1))
                    assert torch.equal(v[b, :, :int(used[b])], want_v.transpose(0, 1))
        assert c.saturated == self.saturated


PagedMachine.TestCase.settings = _settings()
TestPagedHiF8Cache = PagedMachine.TestCase


# ----------------------------------------------------------------------------- HiF8Cache

try:  # transformers is optional: without it only the paged machine runs
    from qfa.serving.attention import cached_attention
    from qfa.serving.hif8_cache import HiF8Cache
except ImportError:  # pragma: no cover
    HiF8Cache = None

#: Static scales of layer 1 in the machines that use them (q, k, v).
STATIC = {"none": None, "kv": (None, 0.25, 0.5), "qkv": (0.125, 0.25, 0.5)}
UPDATE_BAD = ("none",) * 10 + ("not_tensor", "int", "v_len", "dim", "rank", "batch", "heads", "meta")
ATTEND_BAD = ("none",) * 10 + ("nan_q", "p_scale", "softmax_neg", "softmax_huge", "mask_shape", "batch", "sq_big",
                              "backend")


def _model_layer(given=None) -> dict:
    return dict(geom=None, seen=0, pending=[], mask=None, k_codes=[], v_codes=[], k_mean=None, k_scale=None,
                v_scale=None, q_scale=None, given=given, sat_k=0, sat_v=0)


class HiF8CacheMachine(RuleBasedStateMachine):
    """HiF8Cache + cached_attention against a model: per layer the geometry, the queued chunks,
    the key mask given so far, per sequence the code chunks of each commit, the frozen key
    means and scales (computed from the documented transforms: mean of the first valid keys,
    smoothing, rotation, the rule on the batch's valid tokens) and the saturation counts."""

    @initialize(rotate=st.booleans(), smooth_k=st.booleans(), static=st.sampled_from(sorted(STATIC)),
                batch=st.sampled_from([1, 2]), use_mask=st.booleans(), prefill=st.integers(1, 24))
    def setup(self, rotate, smooth_k, static, batch, use_mask, prefill):
        given = STATIC[static]
        self.cache = HiF8Cache(rotate=rotate, smooth_k=smooth_k, scales=None if given is None else {1: given})
        self.rotate, self.smooth_k, self.batch, self.use_mask = rotate, smooth_k, batch, use_mask
        self.given = None if given is None else tuple(None if s is None else torch.tensor([s]) for s in given)
        self.layers: list[dict] = []
        # a valid prefill queued in layer 0: the first attention call calibrates on it
        self.update(layer_idx=0, s=prefill, seed=prefill, dtype=torch.bfloat16, kind="normal", bad="none")

    def new_layer(self, i: int) -> dict:
        return _model_layer(self.given if i == 1 else None)

    def snapshot(self):
        layers = []
        for layer in self.cache.layers:
            ptr = None if layer._k_store is None else (layer._k_store.data_ptr(), layer._v_store.data_ptr())
            layers.append((layer.is_initialized, layer.seen, [(id(k), id(v)) for k, v in layer._pending],
                           layer.host_lengths, ptr,
                           *[None if t is None else t.clone() for t in (layer._k_store, layer._v_store, layer.k_scale,
                                                                        layer.v_scale, layer.q_scale, layer.k_mean,
                                                                        layer.lengths)],
                           layer.saturated_k, layer.saturated_v))
        return layers

    # -- the model's transforms

    def transform(self, m: dict, tokens: list[torch.Tensor], is_k: bool) -> list[torch.Tensor]:
        """Per sequence (n_i, Nkv, D) float tokens as encoded: K smoothed by the frozen mean, both rotated."""
        if is_k and self.smooth_k:
            tokens = [t.float() - m["k_mean"][i] for i, t in enumerate(tokens)]
        return [rotation.rotate(t) if self.rotate else t for t in tokens]

    def staged(self, m: dict):
        """What committing ``m``'s queue gives: ``(ok, updates)``; ok False when the cache must
        refuse it (a computed scale on non-finite values)."""
        if not m["pending"]:
            return True, {}
        k = torch.cat([p[0] for p in m["pending"]], dim=2)
        v = torch.cat([p[1] for p in m["pending"]], dim=2)
        valid = m["mask"][:, m["seen"] - k.shape[2]:]
        k_seq = [k[i][:, valid[i]].transpose(0, 1).contiguous() for i in range(k.shape[0])]
        v_seq = [v[i][:, valid[i]].transpose(0, 1).contiguous() for i in range(k.shape[0])]
        if sum(t.shape[0] for t in k_seq) == 0:
            return True, {}
        new = dict(m)
        if self.smooth_k and m["k_mean"] is None:
            new["k_mean"] = torch.stack([t.float().mean(0) if t.shape[0] else torch.zeros(k.shape[1], D) for t in k_seq])
        k_rot, v_rot = self.transform(new, k_seq, True), self.transform(new, v_seq, False)
        k_all, v_all = torch.cat(k_rot), torch.cat(v_rot)
        for name, x in (("k_scale", k_all), ("v_scale", v_all)):
            if new[name] is None:
                if not finite(x):
                    return False, {}
                new[name] = RULE(x)
        new["k_codes"] = m["k_codes"] + [[cal.quantize(t, new["k_scale"]) for t in k_rot]]
        new["v_codes"] = m["v_codes"] + [[cal.quantize(t, new["v_scale"]) for t in v_rot]]
        new["sat_k"] = m["sat_k"] + saturated(k_all, new["k_scale"])
        new["sat_v"] = m["sat_v"] + saturated(v_all, new["v_scale"])
        return True, new

    def stored(self, m: dict, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence i's (Nkv, n, D) stored K and V codes in the model."""
        empty = torch.zeros(0, m["geom"][1], D, dtype=torch.uint8)
        k = [c[i] for c in m["k_codes"]] or [empty]
        v = [c[i] for c in m["v_codes"]] or [empty]
        return torch.cat(k).transpose(0, 1), torch.cat(v).transpose(0, 1)

    def spec_attention(self, m: dict, query: torch.Tensor, q_valid: torch.Tensor, scale: float, causal: bool):
        """The documented attention: per sequence its valid query rows (rotated) against its
        stored codes, the q scale from the batch's valid rows, one op call per sequence, the
        output rotated back, the LSE shifted back by q . mu."""
        b, nq, sq, _ = query.shape
        out = torch.zeros(b, sq, nq, D, dtype=query.dtype)
        lse = torch.full((b, nq, sq), float("inf"))
        rows = [torch.nonzero(q_valid[i], as_tuple=True)[0] for i in range(b)]
        if m["k_scale"] is None or max(r.numel() for r in rows) == 0:
            return out, lse
        q_seq = [query[i][:, r] for i, r in enumerate(rows)]
        q_rot = [rotation.rotate(t) if self.rotate else t.float() for t in q_seq]
        q_scale = m["q_scale"] if m["q_scale"] is not None else RULE(torch.cat([t.reshape(-1) for t in q_rot]))
        for i in range(b):
            if not rows[i].numel():
                continue
            k, v = self.stored(m, i)
            o, l = qfa.quant_flash_attn(cal.quantize(q_rot[i], q_scale)[None], k[None], v[None], q_scale, m["k_scale"],
                                        m["v_scale"], 0, layout="BNSD", mask_mode=3 if causal else 0,
                                        softmax_scale=scale, return_softmax_lse=True)
            o = rotation.rotate(o[0]) if self.rotate else o[0]
            out[i, rows[i]] = o.to(query.dtype).transpose(0, 1)
            l = l[0]
            if m["k_mean"] is not None:
                shift = lse_shift(q_seq[i][None], m["k_mean"][i][None], "BNSD", None, scale)[0]
                l = torch.where(torch.isinf(l), l, l + shift)
            lse[i][:, rows[i]] = l
        return out, lse

    def needs_finite_query(self, m: dict, query: torch.Tensor, q_valid: torch.Tensor) -> bool:
        """Whether the call computes a q scale from non-finite valid query rows."""
        if m["q_scale"] is not None:
            return False
        return not all(finite(query[i][:, q_valid[i]]) for i in range(query.shape[0]))

    # -- rules

    @rule(layer_idx=st.sampled_from([0, 0, 0, 1, 1, 2, -1]), s=st.integers(1, 12), seed=st.integers(0, 1 << 16),
          dtype=st.sampled_from(DTYPES), kind=st.sampled_from(KINDS), bad=st.sampled_from(UPDATE_BAD))
    def update(self, layer_idx, s, seed, dtype, kind, bad):
        m = self.layers[layer_idx] if 0 <= layer_idx < len(self.layers) else None
        b, n = m["geom"] if m is not None and m["geom"] is not None else (self.batch, NKV)
        if bad == "batch":
            b += 1
        if bad == "heads":  # 2 <-> 1: other kv heads, still dividing the NQ query heads
            n = 3 - n
        k = values((b, n, s, D), seed, kind, dtype)
        v = values((b, n, s + (bad == "v_len"), D), seed + 1, "normal", dtype)
        if bad == "dim":
            k, v = k[..., :64], v[..., :64]
        elif bad == "rank":
            k, v = k[0], v[0]
        elif bad == "int":
            k = k.to(torch.int32)
        elif bad == "not_tensor":
            k = k.tolist()
        elif bad == "meta":
            if m is None or m["geom"] is None:
                return  # a meta layer would be a valid, other machine
            k, v = k.to("meta"), v.to("meta")
        expected = None
        if layer_idx < 0:
            expected = ValueError
        elif bad in ("int", "not_tensor"):
            expected = TypeError
        elif bad in ("dim", "rank", "v_len", "meta"):
            expected = ValueError
        elif bad in ("batch", "heads") and m is not None and m["geom"] is not None:
            expected = ValueError
        refused(lambda: self.cache.update(k, v, layer_idx), expected, self.snapshot, f"update, {bad}")
        if expected is not None:
            return
        while len(self.layers) <= layer_idx:
            self.layers.append(self.new_layer(len(self.layers)))
        m = self.layers[layer_idx]
        if m["geom"] is None:  # lazy initialisation: the geometry, the static scales
            m["geom"] = (b, n)
            if m["given"] is not None:
                m["q_scale"], m["k_scale"], m["v_scale"] = m["given"]
            m["mask"] = torch.zeros(b, 0, dtype=torch.bool)
        g = torch.Generator().manual_seed(seed + 2)
        new_mask = torch.rand(b, s, generator=g) < 0.75 if self.use_mask else torch.ones(b, s, dtype=torch.bool)
        m["mask"] = torch.cat([m["mask"], new_mask], dim=1)
        m["pending"].append((k, v))
        m["seen"] += s

    @rule(layer_idx=st.sampled_from([0, 0, 0, 1, 1, 2]), last=st.booleans(), causal=st.booleans(),
          lse=st.booleans(), seed=st.integers(0, 1 << 16), bad=st.sampled_from(ATTEND_BAD))
    def attention(self, layer_idx, last, causal, lse, seed, bad):
        m = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        b = m["geom"][0] if m is not None and m["geom"] is not None else self.batch
        seen = m["seen"] if m is not None else 0
        sq = max(1, m["pending"][-1][0].shape[2] if m is not None and m["pending"] and last else 1)
        sq = seen + 1 if bad == "sq_big" else sq
        query = values((b + (bad == "batch"), NQ, sq, D), seed, "nan" if bad == "nan_q" else "normal",
                       torch.bfloat16)
        mask = None if m is None or m["mask"] is None or not self.use_mask else m["mask"]
        if bad == "mask_shape":
            mask = torch.ones(b, seen + 1, dtype=torch.bool)
        kw = dict(is_causal=causal, return_softmax_lse=lse, attention_mask=mask,
                  softmax_scale={"softmax_neg": -1.0, "softmax_huge": 1e35}.get(bad),
                  p_scale=1e9 if bad == "p_scale" else None, backend="nope" if bad == "backend" else None)
        expected, why = ValueError, bad
        if m is None or m["geom"] is None:
            why = "a layer without tokens"
        elif bad not in ("batch", "softmax_neg", "sq_big", "mask_shape"):
            ok, new = self.staged(m)
            after = {**m, **new}
            q_valid = (m["mask"] if self.use_mask else torch.ones(b, seen, dtype=torch.bool))[:, seen - sq:]
            runs_op = after["k_scale"] is not None and bool(q_valid.any())
            if not ok:
                why = "NaN/Inf queued under a computed scale"
            elif runs_op and bad in ("p_scale", "softmax_huge", "backend"):
                why = f"{bad} (refused by the op, after staging)"
            elif runs_op and self.needs_finite_query(after, query, q_valid):
                why = "NaN query under a computed scale"
            else:
                expected, why = None, f"{bad} ({'the op' if runs_op else 'no key or no query: zeros'})"
        got = refused(lambda: cached_attention(None, query, self.cache, layer_idx, **kw), expected, self.snapshot,
                      f"attention, {why}")
        if expected is not None:
            return
        want = self.spec_attention(after, query, q_valid, 1 / D ** 0.5, causal)
        if lse:
            assert_same_bits(got[0], want[0])
            assert_same_bits(got[1], want[1])
        else:
            assert_same_bits(got, want[0])
        m.update(new)
        m["pending"] = []

    @rule(kind=st.sampled_from(["identity", "bool", "beyond", "negative", "float", "list", "2-d", "repeats 0"]))
    def batch_operation(self, kind):
        """A beam search's reorder: an identity index is done (the model unchanged) unless a
        stored layer has tokens queued; every bad index or count is refused, changing nothing,
        whatever the layers hold."""
        stored = [m for m in self.layers if m["geom"] is not None]
        if kind == "identity" and any(m["geom"][0] != self.batch for m in stored):
            return  # (an identity of this batch would drop another layer's rows)
        rows = max([m["geom"][0] for m in stored] + [self.batch])
        index = {"identity": torch.arange(self.batch), "bool": torch.ones(self.batch, dtype=torch.bool),
                 "beyond": torch.tensor([rows]), "negative": torch.tensor([-1]), "float": torch.zeros(1),
                 "list": [0], "2-d": torch.zeros(1, 1, dtype=torch.long)}.get(kind)
        if kind == "repeats 0":
            call, expected = (lambda: self.cache.batch_repeat_interleave(0)), ValueError
        else:
            call = lambda: self.cache.reorder_cache(index)  # noqa: E731
            if kind in ("bool", "float", "list", "2-d"):
                expected = TypeError
            elif kind == "identity":
                expected = ValueError if any(m["pending"] for m in stored) else None
            else:
                expected = ValueError if stored else None  # (no layer stored: nothing to index)
        refused(call, expected, self.snapshot, f"batch operation, {kind}")

    @rule(go=st.integers(0, RARE - 1))
    def reset(self, go):
        if go:
            return
        self.cache.reset()
        self.layers = [self.new_layer(i) for i in range(len(self.layers))]

    # -- invariants

    @invariant()
    def layers_are_the_models(self):
        assert len(self.cache.layers) == len(self.layers)
        for layer, m in zip(self.cache.layers, self.layers):
            assert layer.is_initialized == (m["geom"] is not None)
            assert layer.seen == m["seen"] and layer.get_seq_length() == m["seen"]
            assert layer.pending == sum(k.shape[2] for k, _ in m["pending"])
            if m["geom"] is None:
                continue
            assert tuple(layer.keys.shape[:2]) == m["geom"]
            for name in ("k_scale", "v_scale", "q_scale", "k_mean"):
                if m[name] is None:
                    assert getattr(layer, name) is None, name
                else:
                    assert_same_bits(getattr(layer, name), m[name])
            assert (layer.saturated_k, layer.saturated_v) == (m["sat_k"], m["sat_v"])
            for i in range(m["geom"][0]):
                k, v = self.stored(m, i)
                n = k.shape[1]
                assert layer.host_lengths[i] == int(layer.lengths[i]) == n
                assert torch.equal(layer.keys[i, :, :n], k) and torch.equal(layer.values[i, :, :n], v)
                # past a sequence's length every code is 0, to the end of the capacity
                assert not layer._k_store[i, :, n:].any() and not layer._v_store[i, :, n:].any()


HiF8CacheMachine.TestCase.settings = _settings()
TestHiF8Cache = pytest.mark.skipif(HiF8Cache is None, reason="needs transformers")(HiF8CacheMachine.TestCase)
