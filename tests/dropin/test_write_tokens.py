"""``prepare.write_tokens``: a step's keys or values written straight into a paged cache's slots.

* The native pass (``cpu_prepare.write_token_rows``) against the torch path (``QFA_NATIVE=0``:
  ``encode_tokens`` in torch ops, then an indexed write) and against this file's reference (the
  rotation, the division and the encode of each token, placed slot by slot): same codes, same
  saturated count, for every dtype, with and without K means and rotation, int32 and int64
  slots, padding, strided tokens and a cache view whose blocks are strided (vLLM's K half).
* ``encode_token_rows`` (``encode_tokens`` with a static scale) at every SIMD level.
* A kept ``StaticEncoding`` (an engine's per-layer state) writes and encodes the reference's
  codes call after call, and checks its state once, naming what it refuses.
* ``write_keys_values`` (keys and values in one native pass) writes the reference's codes of
  each half, for one thread and two and at every SIMD level; a refused pair writes neither.
* The same bits for one thread and two, and for every team of the passes.
* All or nothing: a slot beyond the cache, a slot named twice, or a bad argument raises a
  ValueError naming it, on both paths, and the cache keeps every byte. A state machine writes
  random batches, valid and refused, against a model of what each slot should hold.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from qfa.attention.backends import cpu_kernel, cpu_prepare
from qfa.dropin import calibration as cal
from qfa.dropin import prepare, rotation

pytestmark = pytest.mark.skipif(not cpu_prepare.available(), reason="the native CPU preparation is not built")

D, HEADS, BLOCK = 128, 2, 16
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def tokens(n: int, seed: int, dtype=torch.float32, heads: int = HEADS, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(n, heads, D, generator=g) + 0.5) * scale).to(dtype)


def vllm_cache(blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A vLLM-shaped cache (blocks, heads, block, 2 * 128) of random bytes and its K and V views."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randint(0, 256, (blocks, HEADS, BLOCK, 2 * D), generator=g, dtype=torch.uint8)
    halves = cache.view(blocks, HEADS, 2, BLOCK, D)
    return cache, halves[:, :, 0], halves[:, :, 1]


def reference_write(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, scale: float, mean, rotate: bool) -> int:
    """Each token alone: (x - mean), the rotation, x / scale and the encode, put at its slot."""
    saturated = 0
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        y = x[t].float() if mean is None else x[t].float() - mean
        y = rotation.rotate(y) if rotate else y
        cache[slot // BLOCK, :, slot % BLOCK] = cal.quantize(y, scale)
        q = y / torch.tensor(scale, dtype=torch.float32)
        saturated += int(((q.abs() >= 40960.0) & torch.isfinite(q)).sum())
    return saturated


def slots_for(n: int, blocks: int, seed: int, padding: int = 0, dtype=torch.int64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(blocks * BLOCK, generator=g)[:n]
    slots[torch.randperm(n, generator=g)[:padding]] = -1
    return slots.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("with_mean", [True, False])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=str)
def test_native_write_is_the_torch_path_and_the_reference(dtype, rotate, with_mean, slot_dtype, monkeypatch):
    blocks, n = 7, 45
    # strided tokens: the key columns of a fused qkv projection
    qkv = tokens(n, seed=1, dtype=dtype, heads=3 * HEADS, scale=300.0)
    x = qkv[:, HEADS:2 * HEADS]
    assert not x.is_contiguous()
    mean = torch.randn(HEADS, D, generator=torch.Generator().manual_seed(2)) if with_mean else None
    slots = slots_for(n, blocks, seed=3, padding=5, dtype=slot_dtype)
    scale = torch.tensor([2.0 ** -6])  # small enough that some values saturate
    caches = []
    for native in ("1", "0"):
        monkeypatch.setenv(cpu_kernel.ENV_VAR, native)
        cache, k_view, _ = vllm_cache(blocks, seed=4)
        saturated = prepare.write_tokens(x, k_view, slots, scale, mean=mean, rotate=rotate)
        caches.append((cache, saturated))
    want, k_want, _ = vllm_cache(blocks, seed=4)
    want_saturated = reference_write(k_want, x, slots, 2.0 ** -6, mean, rotate)
    assert want_saturated > 0
    for cache, saturated in caches:
        assert torch.equal(cache, want) and saturated == want_saturated


@pytest.mark.parametrize("level", range(len(cpu_prepare.ISA_NAMES)), ids=cpu_prepare.ISA_NAMES)
def test_encode_token_rows_at_every_level_is_encode_tokens_torch_path(level, monkeypatch):
    if level > cpu_prepare.isa_level():
        pytest.skip(f"this CPU lacks {' / '.join(cpu_prepare.ISA_FLAGS[level])}")
    x, mean = tokens(33, seed=5, dtype=torch.bfloat16, heads=3, scale=50.0), torch.randn(3, D)
    got, saturated = cpu_prepare.encode_token_rows(x, 2.0 ** -10, prepare.ROTATION_C, mean=mean, isa=level)
    monkeypatch.setenv(cpu_kernel.ENV_VAR, "0")
    want, _, want_saturated = prepare.encode_tokens(x, mean=mean, scale=2.0 ** -10)
    assert torch.equal(got, want) and saturated == int(want_saturated) > 0


@pytest.mark.parametrize("team", ["automatic", "caller", "openmp", "pool"])
def test_no_bit_depends_on_the_threads_or_the_team(team):
    n, blocks = 600, 40  # 1200 rows: a parallel pass
    x, slots = tokens(n, seed=6, scale=400.0), slots_for(n, blocks, seed=7, padding=30)
    results = []
    try:
        cpu_prepare.set_team(team)
        for threads in (1, 2):
            with torch.inference_mode():
                before = torch.get_num_threads()
                torch.set_num_threads(threads)
                try:
                    cache, k_view, _ = vllm_cache(blocks, seed=8)
                    results.append((cache, prepare.write_tokens(x, k_view, slots, torch.tensor([2.0 ** -6]))))
                finally:
                    torch.set_num_threads(before)
    finally:
        cpu_prepare.set_team("automatic")
    assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1] > 0


REFUSALS = {
    "slot beyond the cache": (lambda s: s.index_fill(0, torch.tensor([3]), 6 * BLOCK), ValueError,
                              r"slot_mapping holds slot 96 \(token 3\), beyond the cache's 96 slots"),
    "slot named twice": (lambda s: s.index_fill(0, torch.tensor([1, 4]), 17), ValueError,
                         "slot_mapping names slot 17 for tokens 1 and 4: a call writes each slot once"),
    "slots of another length": (lambda s: s[:-1], ValueError, r"slot_mapping must be int32 / int64 of shape \(6,\)"),
    "float slots": (lambda s: s.float(), ValueError, "slot_mapping must be int32 / int64"),
}


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
@pytest.mark.parametrize("kind", sorted(REFUSALS))
def test_a_refused_write_leaves_every_byte(kind, native, monkeypatch):
    monkeypatch.setenv(cpu_kernel.ENV_VAR, native)
    change, exc, pattern = REFUSALS[kind]
    cache, k_view, _ = vllm_cache(6, seed=9)
    before = cache.clone()
    x = tokens(6, seed=10)
    slots = change(torch.tensor([5, 17, -1, 30, 41, 2]))
    with pytest.raises(exc, match=pattern):
        prepare.write_tokens(x, k_view, slots, torch.tensor([1.0]), slots_name="slot_mapping")
    assert torch.equal(cache, before)


@pytest.mark.parametrize("args,pattern", [
    ({"cache": torch.zeros(4, HEADS + 1, BLOCK, D, dtype=torch.uint8)}, r"cache must be uint8 \(blocks, heads"),
    ({"cache": torch.zeros(4, HEADS, BLOCK, D)}, "cache must be uint8"),
    ({"scale": torch.tensor([0.0])}, "scale must be positive and finite, got 0.0"),
    ({"mean": torch.zeros(HEADS + 1, D)}, r"mean must be fp32 of shape \(heads, 128\)"),
    ({"x": [1.0]}, "x must be a torch.Tensor, got list"),
    ({"x": torch.zeros(3, D)}, r"x must be \(tokens, heads, 128\), got shape \(3, 128\)"),
])
def test_bad_arguments_are_named_and_nothing_is_written(args, pattern):
    cache, k_view, _ = vllm_cache(4, seed=11)
    before = cache.clone()
    call = {"x": tokens(3, seed=12), "cache": k_view, "slots": torch.tensor([0, 1, 2]), "scale": torch.tensor([1.0]),
            **args}
    mean = call.pop("mean", None)
    with pytest.raises(TypeError if pattern.startswith("x must be a") else ValueError, match=pattern):
        prepare.write_tokens(call["x"], call["cache"], call["slots"], call["scale"], mean=mean)
    assert torch.equal(cache, before)


def test_write_tokens_leaves_its_inputs_alone():
    x, mean, slots, scale = tokens(5, seed=13, dtype=torch.float16), torch.randn(HEADS, D), torch.tensor([3, -1, 9, 0, 7]), \
        torch.tensor([0.125])
    before = [t.clone() for t in (x, mean, slots, scale)]
    _, k_view, _ = vllm_cache(2, seed=14)
    prepare.write_tokens(x, k_view, slots, scale, mean=mean)
    assert all(torch.equal(a, b) for a, b in zip((x, mean, slots, scale), before))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_restore_output_into_a_buffer_is_the_returned_tensor(dtype):
    out = tokens(9, seed=15, dtype=torch.bfloat16, heads=4, scale=1e3)
    want = prepare.restore_output(out, dtype)
    buffer = torch.full((9 * 4 * D,), 7.0, dtype=dtype)
    got = prepare.restore_output(out, dtype, into=buffer.view(9, 4, D))
    assert got.data_ptr() == buffer.data_ptr() and torch.equal(got, want)
    # a buffer it cannot fill (another dtype, a strided view) is left alone: None
    other = torch.zeros(9, 4, D, dtype=torch.float64)
    assert prepare.restore_output(out, dtype, into=other) is None and not other.any()
    strided = torch.zeros(9, 8, D, dtype=dtype)[:, ::2]
    assert prepare.restore_output(out, dtype, into=strided) is None and not strided.any()


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
@pytest.mark.parametrize("rotate", [True, False])
def test_a_kept_static_encoding_writes_and_encodes_the_reference_call_after_call(native, rotate, monkeypatch):
    """What an engine keeps per layer: one StaticEncoding, checked once, called for batches of
    every dtype and size, against this file's per-token reference and the documented encode."""
    monkeypatch.setenv(cpu_kernel.ENV_VAR, native)
    mean, scale = torch.randn(HEADS, D, generator=torch.Generator().manual_seed(20)), 2.0 ** -6
    encoding = prepare.StaticEncoding(torch.tensor([scale]), mean=mean, rotate=rotate)
    assert encoding.value == scale
    for seed, dtype, n in ((21, torch.float32, 1), (22, torch.bfloat16, 7), (23, torch.float16, 33)):
        x, slots = tokens(n, seed=seed, dtype=dtype, scale=300.0), slots_for(n, 6, seed=seed, padding=n // 5)
        cache, k_view, _ = vllm_cache(6, seed=seed)
        want, want_view, _ = vllm_cache(6, seed=seed)
        saturated = encoding.write(x, k_view, slots)
        assert saturated == reference_write(want_view, x, slots, scale, mean, rotate) and torch.equal(cache, want)
        codes, counted = encoding.encode(x)
        y = x.float() - mean
        y = rotation.rotate(y) if rotate else y
        assert torch.equal(codes, cal.quantize(y, scale))
        assert counted == reference_write(torch.zeros(n, HEADS, BLOCK, D, dtype=torch.uint8), x,
                                          torch.arange(n) * BLOCK, scale, mean, rotate) > 0


@pytest.mark.parametrize("kwargs, exc, pattern", [
    ({"scale": 0.0}, ValueError, "scale must be positive and finite, got 0.0"),
    ({"scale": torch.tensor([1.0, 2.0])}, ValueError, r"scale must hold one value \(shape \(1,\)\)"),
    ({"scale": "1"}, TypeError, "scale must be a float or an fp32 tensor of shape"),
    ({"mean": torch.zeros(HEADS, 64)}, ValueError, r"mean must be fp32 of shape \(heads, 128\)"),
    ({"mean": torch.zeros(HEADS, D, dtype=torch.float64)}, ValueError, "mean must be fp32"),
    ({"mean": [0.0]}, TypeError, "mean must be None or an fp32 tensor, got list"),
    ({"rotate": 1}, TypeError, "rotate must be a bool, got int 1"),
])
def test_a_static_encoding_checks_its_state_once_naming_it(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        prepare.StaticEncoding(kwargs.pop("scale", 1.0), **kwargs)


def test_a_static_encoding_refuses_tokens_its_mean_does_not_fit():
    encoding = prepare.StaticEncoding(1.0, mean=torch.zeros(HEADS, D))
    cache, k_view, _ = vllm_cache(2, seed=24)
    before = cache.clone()
    with pytest.raises(ValueError, match="x must have the mean's 2 heads"):
        encoding.write(tokens(3, seed=25, heads=HEADS + 1), torch.zeros(2, HEADS + 1, BLOCK, D, dtype=torch.uint8),
                       torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16, got torch.float64"):
        encoding.write(tokens(3, seed=25).double(), k_view, torch.tensor([0, 1, 2]))
    assert torch.equal(cache, before)


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                    (torch.bfloat16, torch.float16)], ids=["bf16", "fp32", "mixed"])
@pytest.mark.parametrize("n, threads, rotate", [(9, 2, True), (9, 1, False), (600, 1, True), (600, 2, True)])
def test_keys_and_values_in_one_call_are_the_reference(native, dtypes, n, threads, rotate, monkeypatch):
    """write_keys_values (one native pass over both where k and v share a dtype; two writes
    where not) against this file's per-token reference of each half, for one thread and two."""
    monkeypatch.setenv(cpu_kernel.ENV_VAR, native)
    mean = torch.randn(HEADS, D, generator=torch.Generator().manual_seed(30))
    keys = prepare.StaticEncoding(2.0 ** -6, mean=mean, rotate=rotate)
    values = prepare.StaticEncoding(2.0 ** -5, rotate=rotate)
    k, v = tokens(n, seed=31, dtype=dtypes[0], scale=300.0), tokens(n, seed=32, dtype=dtypes[1], scale=300.0)
    slots = slots_for(n, 40, seed=33, padding=n // 7)
    cache, k_view, v_view = vllm_cache(40, seed=34)
    want, k_want, v_want = vllm_cache(40, seed=34)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        saturated = prepare.write_keys_values(keys, values, k, v, k_view, v_view, slots, "slot_mapping")
    finally:
        torch.set_num_threads(before)
    want_saturated = reference_write(k_want, k, slots, 2.0 ** -6, mean, rotate) + \
        reference_write(v_want, v, slots, 2.0 ** -5, None, rotate)
    assert torch.equal(cache, want) and saturated == want_saturated > 0


@pytest.mark.parametrize("level", range(len(cpu_prepare.ISA_NAMES)), ids=cpu_prepare.ISA_NAMES)
def test_the_native_pair_at_every_level_is_the_reference(level):
    if level > cpu_prepare.isa_level():
        pytest.skip(f"this CPU lacks {' / '.join(cpu_prepare.ISA_FLAGS[level])}")
    mean = torch.randn(HEADS, D, generator=torch.Generator().manual_seed(35))
    k, v = tokens(40, seed=36, dtype=torch.bfloat16, scale=300.0), tokens(40, seed=37, dtype=torch.bfloat16, scale=300.0)
    slots = slots_for(40, 8, seed=38, padding=4, dtype=torch.int32)
    cache, k_view, v_view = vllm_cache(8, seed=39)
    want, k_want, v_want = vllm_cache(8, seed=39)
    saturated = cpu_prepare.write_kv_rows(k, v, k_view, v_view, slots, 2.0 ** -6, 2.0 ** -5, prepare.ROTATION_C,
                                          mean=mean, isa=level)
    want_saturated = reference_write(k_want, k, slots, 2.0 ** -6, mean, True) + \
        reference_write(v_want, v, slots, 2.0 ** -5, None, True)
    assert torch.equal(cache, want) and saturated == want_saturated > 0


PAIR_REFUSALS = {
    "slot beyond the cache": (dict(slots=torch.tensor([5, 96, 2])), ValueError, "slot_mapping holds slot 96"),
    "slot named twice": (dict(slots=torch.tensor([5, 17, 5])), ValueError, "slot_mapping names slot 5 for tokens 0 and 2"),
    "v of other heads": (dict(v=tokens(3, seed=40, heads=HEADS + 1)), ValueError, r"v must be shaped as k"),
    "v not a tensor": (dict(v=[0.0]), TypeError, "v must be a torch.Tensor, got list"),
    "v_cache of other blocks": (dict(v_cache=torch.zeros(5, HEADS, BLOCK, D, dtype=torch.uint8)), ValueError,
                                "v_cache must be shaped as k_cache"),
    "float slots": (dict(slots=torch.tensor([1.0, 2.0, 3.0])), ValueError, "slot_mapping must be int32 / int64"),
    "v_cache of strided rows": (dict(v_cache=torch.zeros(6, HEADS, BLOCK, 2 * D, dtype=torch.uint8)[..., ::2]),
                                ValueError, r"v_cache must have contiguous rows \(last stride 1\)"),
}


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
@pytest.mark.parametrize("kind", sorted(PAIR_REFUSALS))
def test_a_refused_pair_writes_neither(kind, native, monkeypatch):
    monkeypatch.setenv(cpu_kernel.ENV_VAR, native)
    change, exc, pattern = PAIR_REFUSALS[kind]
    cache, k_view, v_view = vllm_cache(6, seed=41)
    before = cache.clone()
    call = {"k": tokens(3, seed=42), "v": tokens(3, seed=43), "k_cache": k_view, "v_cache": v_view,
            "slots": torch.tensor([5, 17, 30]), **change}
    encodings = prepare.StaticEncoding(1.0, mean=torch.zeros(HEADS, D)), prepare.StaticEncoding(1.0)
    with pytest.raises(exc, match=pattern):
        prepare.write_keys_values(*encodings, call["k"], call["v"], call["k_cache"], call["v_cache"], call["slots"],
                                  "slot_mapping")
    assert torch.equal(cache, before)


def drawn_slots(data, n: int, capacity: int, kind: str) -> torch.Tensor:
    """n distinct slots of a cache of ``capacity``; ``kind`` "padded" makes one -1, "beyond" one
    past the cache, "twice" (n > 1) one a repeat of another."""
    slots = torch.tensor(data.draw(st.lists(st.integers(0, capacity - 1), min_size=n, max_size=n, unique=True)))
    if kind == "padded":
        slots[data.draw(st.integers(0, n - 1))] = -1
    elif kind == "beyond":
        slots[data.draw(st.integers(0, n - 1))] = capacity + data.draw(st.integers(0, 100))
    elif kind == "twice" and n > 1:
        a, b = data.draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True))
        slots[b] = slots[a]
    return slots


class SlotWrites(RuleBasedStateMachine):
    """Random batches written into one cache, on either path, some refused; the model holds what
    each slot should hold (its last token's codes, written by the reference), or the cache's
    first bytes for a slot never written."""

    BLOCKS = 5

    @initialize(seed=st.integers(0, 2 ** 16))
    def start(self, seed):
        self.cache, self.k_view, _ = vllm_cache(self.BLOCKS, seed)
        self.model, self.model_view, _ = vllm_cache(self.BLOCKS, seed)
        self.mean = torch.randn(HEADS, D, generator=torch.Generator().manual_seed(seed))
        self.calls = 0

    @rule(n=st.integers(1, 12), native=st.booleans(), kind=st.sampled_from(["valid", "padded", "beyond", "twice"]),
          dtype=st.sampled_from(DTYPES), data=st.data())
    def write(self, n, native, kind, dtype, data):
        self.calls += 1
        slots = drawn_slots(data, n, self.BLOCKS * BLOCK, kind)
        refused = kind == "beyond" or (kind == "twice" and n > 1)
        x = tokens(n, seed=1000 + self.calls, dtype=dtype, scale=100.0)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(cpu_kernel.ENV_VAR, "1" if native else "0")
            if refused:
                with pytest.raises(ValueError, match="slot_mapping"):
                    prepare.write_tokens(x, self.k_view, slots, torch.tensor([0.5]), mean=self.mean,
                                         slots_name="slot_mapping")
                return
            saturated = prepare.write_tokens(x, self.k_view, slots, torch.tensor([0.5]), mean=self.mean)
        assert saturated == reference_write(self.model_view, x, slots, 0.5, self.mean, True)

    @invariant()
    def every_byte_is_the_models(self):
        assert torch.equal(self.cache, self.model)


TestSlotWrites = SlotWrites.TestCase


def qkv_view(n: int, seed: int, dtype, part: int, heads: int = HEADS) -> torch.Tensor:
    """Token rows as vLLM hands them over: one part of a fused qkv projection's rows (strided)."""
    return tokens(n, seed, dtype=dtype, heads=3 * heads, scale=300.0)[:, part * heads:(part + 1) * heads]


FORMS = {
    "fp32": lambda n, seed, part: tokens(n, seed, scale=300.0),
    "bf16": lambda n, seed, part: tokens(n, seed, dtype=torch.bfloat16, scale=300.0),
    "bf16 qkv view": lambda n, seed, part: qkv_view(n, seed, torch.bfloat16, part),
    "fp16 qkv view": lambda n, seed, part: qkv_view(n, seed, torch.float16, part),
}


class KVWriterWrites(RuleBasedStateMachine):
    """One KVWriter (an engine layer's writes) over many steps: tokens of every form and count,
    slots int32 or int64 with padding, some calls refused. A write like the one before takes the
    bound pass with only its geometry compared; the model is this file's per-token reference,
    and a refused call must leave every byte as it was."""

    BLOCKS = 5

    @initialize(seed=st.integers(0, 2 ** 16), rotate=st.booleans())
    def start(self, seed, rotate):
        self.cache, k_view, v_view = vllm_cache(self.BLOCKS, seed)
        self.model, self.model_k, self.model_v = vllm_cache(self.BLOCKS, seed)
        self.mean = torch.randn(HEADS, D, generator=torch.Generator().manual_seed(seed))
        self.rotate = rotate
        self.writer = prepare.KVWriter(prepare.StaticEncoding(2.0 ** -6, mean=self.mean, rotate=rotate),
                                       prepare.StaticEncoding(2.0 ** -5, rotate=rotate), k_view, v_view,
                                       "slot_mapping")
        self.calls = 0

    @rule(n=st.integers(1, 12), form=st.sampled_from(sorted(FORMS)), slot_dtype=st.sampled_from([torch.int32, torch.int64]),
          kind=st.sampled_from(["valid", "padded", "beyond", "twice", "v of other heads", "v shorter", "k not a tensor",
                                "slots of another length"]), data=st.data())
    def write(self, n, form, slot_dtype, kind, data):
        self.calls += 1
        slots = drawn_slots(data, n, self.BLOCKS * BLOCK, kind)
        k, v = FORMS[form](n, 2000 + self.calls, 1), FORMS[form](n, 3000 + self.calls, 2)
        if kind == "v of other heads":
            v = tokens(n, seed=4000 + self.calls, heads=HEADS + 1)
        elif kind == "v shorter":
            v = v[:-1]
        elif kind == "k not a tensor":
            k = k.tolist()
        elif kind == "slots of another length":
            slots = torch.cat([slots, slots[:1]])
        slots = slots.to(slot_dtype)
        if kind not in ("valid", "padded") and not (kind == "twice" and n == 1):
            before = self.cache.clone()
            with pytest.raises((ValueError, TypeError)):
                self.writer.write(k, v, slots)
            assert torch.equal(self.cache, before), f"a refused write ({kind}) changed the cache"
            return
        saturated = self.writer.write(k, v, slots)
        assert saturated == reference_write(self.model_k, k, slots, 2.0 ** -6, self.mean, self.rotate) + \
            reference_write(self.model_v, v, slots, 2.0 ** -5, None, self.rotate)

    @invariant()
    def every_byte_is_the_models(self):
        assert torch.equal(self.cache, self.model)


TestKVWriterWrites = KVWriterWrites.TestCase


def test_a_kv_writer_checks_in_full_only_writes_unlike_the_last(monkeypatch):
    """The first write, and each whose tokens or slots differ in dtype, heads or strides, runs
    write_keys_values whole; one like the last runs the bound pass, unless native code is off."""
    full = []
    whole = prepare.write_keys_values
    monkeypatch.setattr(prepare, "write_keys_values", lambda *a: full.append(a[2].dtype) or whole(*a))
    cache, k_view, v_view = vllm_cache(4, seed=50)
    writer = prepare.KVWriter(prepare.StaticEncoding(2.0 ** -6, mean=torch.zeros(HEADS, D)),
                              prepare.StaticEncoding(2.0 ** -5), k_view, v_view)
    # (form, slots dtype, whether the write is checked in full)
    steps = [(FORMS["bf16 qkv view"], torch.int64, 1), (FORMS["bf16 qkv view"], torch.int64, 0),
             (FORMS["bf16 qkv view"], torch.int64, 0), (FORMS["bf16"], torch.int64, 1),
             (FORMS["bf16"], torch.int32, 1), (FORMS["bf16"], torch.int32, 0)]
    for step, (form, slot_dtype, checked) in enumerate(steps):
        n = 1 + step % 3  # any token count is like the last
        k, v = form(n, 60 + step, 1), form(n, 70 + step, 2)
        before = len(full)
        writer.write(k, v, torch.arange(n, dtype=slot_dtype) + 8 * step)
        assert len(full) - before == checked, f"step {step}"
    monkeypatch.setenv(cpu_kernel.ENV_VAR, "0")  # native code off: the torch path, in full
    writer.write(FORMS["bf16"](2, 80, 1), FORMS["bf16"](2, 81, 2), torch.arange(2, dtype=torch.int32) + 60)
    assert len(full) == 4


def test_a_kept_encoding_refuses_after_native_encodes_naming_what():
    """After an encode has bound the native pass, tokens unlike it are checked in full again."""
    encoding = prepare.StaticEncoding(2.0 ** -6, mean=torch.zeros(HEADS, D))
    for seed, x in enumerate((tokens(3, seed=90), tokens(5, seed=91), qkv_view(4, 92, torch.bfloat16, 1))):
        codes, _ = encoding.encode(x)
        assert torch.equal(codes, cal.quantize(rotation.rotate(x.float()), 2.0 ** -6)), seed
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        encoding.encode([0.0])
    with pytest.raises(ValueError, match="x must have the mean's 2 heads"):
        encoding.encode(tokens(3, seed=93, heads=HEADS + 1))
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16, got torch.float64"):
        encoding.encode(tokens(3, seed=94).double())
    with pytest.raises(ValueError, match=r"x must be \(tokens, heads, 128\), got shape \(3, 128\)"):
        encoding.encode(torch.zeros(3, D))


def test_an_encode_binds_only_rows_read_in_place():
    """An empty strided batch is encoded as it is (nothing to copy); the next batch with those
    strides must still be made contiguous, not read through a pass bound to 128-wide rows."""
    encoding = prepare.StaticEncoding(2.0 ** -6)
    encoding.encode(torch.empty(0, HEADS, 2 * D)[:, :, ::2])
    x = tokens(3, seed=95, heads=HEADS * 2).reshape(3, HEADS, 2 * D)[:, :, ::2]
    assert torch.equal(encoding.encode(x)[0], cal.quantize(rotation.rotate(x.float()), 2.0 ** -6))


def test_copies_and_pickles_bind_afresh():
    """The bound passes hold addresses (the mean's, the caches'), not tensors: a copy must use its
    own, and a pickle must not carry them."""
    import copy
    import pickle

    mean = torch.randn(HEADS, D, generator=torch.Generator().manual_seed(96))
    encoding = prepare.StaticEncoding(2.0 ** -6, mean=mean)
    x = tokens(4, seed=97)
    encoding.encode(x)  # binds
    twin = copy.deepcopy(encoding)
    twin.mean.zero_()
    twin._native_mean.zero_()
    assert torch.equal(twin.encode(x)[0], cal.quantize(rotation.rotate(x.float()), 2.0 ** -6))
    assert torch.equal(pickle.loads(pickle.dumps(encoding)).encode(x)[0], encoding.encode(x)[0])
    cache, k_view, v_view = vllm_cache(3, seed=98)
    writer = prepare.KVWriter(encoding, prepare.StaticEncoding(2.0 ** -5), k_view, v_view)
    writer.write(x, x, torch.arange(4))  # binds
    before = cache.clone()
    other = copy.deepcopy(writer)
    other.write(x, x, torch.arange(4) + 20)
    assert torch.equal(cache, before), "a copy wrote into the original's cache"
    assert not torch.equal(other.k_cache[1, :, 4:8], before.view(3, HEADS, 2, BLOCK, D)[1, :, 0, 4:8])


def test_a_cache_re_pointed_in_place_is_written_where_it_now_lies():
    k_cache, v_cache = (torch.zeros(3, HEADS, BLOCK, D, dtype=torch.uint8) for _ in range(2))
    writer = prepare.KVWriter(prepare.StaticEncoding(2.0 ** -6), prepare.StaticEncoding(2.0 ** -5), k_cache, v_cache)
    x = tokens(2, seed=99)
    writer.write(x, x, torch.tensor([0, 1]))  # binds
    old = k_cache.clone()
    kept = k_cache.untyped_storage()  # the old storage stays alive: it must not be written
    fresh = torch.zeros_like(k_cache)
    k_cache.set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())
    writer.write(x, x, torch.tensor([5, 6]))
    assert torch.equal(torch.empty(0, dtype=torch.uint8).set_(kept).view(old.shape), old)
    assert k_cache[0, :, 5:7].any() and torch.equal(k_cache[0, :, 5:7], old[0, :, 0:2])
