"""The op's light per-call path: the plan cache (calls without length tensors by geometry, the
metadata of calls with them by their lengths' values), the native kernel's scalars formed from
the descales' values, and the arguments the kernel is handed.

What must hold: a cache hit is the plan a fresh derivation gives (and the same bits out), a
changed geometry (shape, strides, layout, device, softmax_scale, return_lse, mask, bounds) is
never served another's plan, every check still fails a bad call after its geometry was cached,
and the kernel's fp32 scalars are bit for bit those of the tensor ops the torch path uses.
"""

from __future__ import annotations

import math
import random
import struct
import threading

import pytest
import torch

import qfa
from qfa.attention.backends import cpu_kernel, torch_path
from qfa.tiling import attention as tiling
from qfa.tiling import attention_checks as checks
from qfa.tiling.spec import MaskMode, QuantMode

D = 128
needs_kernel = pytest.mark.skipif(not cpu_kernel.available(), reason="native CPU kernel not built here")


def codes(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return qfa.encode_to_hifloat8(torch.empty(shape).uniform_(-2, 2, generator=g))


def scales(q=0.5, k=0.25, v=2.0):
    return [torch.full((1,), s) for s in (q, k, v)]


def decode_case(b=1, nq=12, nkv=2, sq=1, skv=300, layout="BNSD", seed=0):
    if layout == "BNSD":
        shapes = (b, nq, sq, D), (b, nkv, skv, D)
    else:
        shapes = (b, sq, nq, D), (b, skv, nkv, D)
    return codes(*shapes[0], seed=seed), codes(*shapes[1], seed=seed + 1), codes(*shapes[1], seed=seed + 2)


@pytest.fixture
def fresh_cache(monkeypatch):
    """An empty plan cache for the test (restored afterwards)."""
    monkeypatch.setattr(tiling, "_plan_cache", {})
    return tiling._plan_cache


def fresh_plan(*args, **kwargs):
    """The plan derived with nothing cached."""
    saved = dict(tiling._plan_cache)
    tiling._plan_cache.clear()
    try:
        return tiling.plan_attention(*args, **kwargs)
    finally:
        tiling._plan_cache.clear()
        tiling._plan_cache.update(saved)


def bits(out_lse):
    out, lse = out_lse
    return out.view(torch.int16).clone(), lse.clone()


# ----------------------------------------------------------------------------- the fp32 scalars

def _fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _torch_dscale(qd: float, kd: float, softmax_scale: float) -> float:
    """Today's scalar: the fp32 tensor ops of the torch path (AttentionPlan.scalars), read back."""
    return float((torch.tensor([qd]) * torch.tensor([kd])) * softmax_scale)


def _random_fp32(rng: random.Random) -> float:
    """fp32 values over every binade, subnormals (down to 2^-149) and the top binade included."""
    kind = rng.random()
    if kind < 0.15:  # subnormal: k * 2^-149
        return rng.randint(1, 2**23 - 1) * 2.0**-149
    if kind < 0.25:  # the top binade, products overflow
        return _fp32(rng.uniform(2.0**127, 3.4028234663852886e38))
    return _fp32(math.ldexp(rng.uniform(1.0, 2.0), rng.randint(-126, 127)))


def _random_softmax_scale(rng: random.Random) -> float:
    """Python floats (doubles): most are not fp32 values, so torch's rounding of them matters."""
    kind = rng.random()
    if kind < 0.1:
        return rng.choice([1.0, 1 / math.sqrt(128), 0.1, 1e-45, 1.5e-45, 3.4028235e38, 3.4028236e38, 1e300, 5e-324])
    return math.ldexp(rng.uniform(1.0, 2.0), rng.randint(-160, 140))


def test_dscale_is_the_fp32_tensor_product_bit_for_bit():
    rng = random.Random(20261201)
    cases = [(_random_fp32(rng), _random_fp32(rng), _random_softmax_scale(rng)) for _ in range(6000)]
    # Ties of the first product (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24: exactly half an ulp of 1.
    tie = 1 + 2.0**-12
    cases += [(tie, tie, 1.0), (tie, tie, 1 + 2.0**-24), (2.0**-149, 0.5, 1.0), (2.0**-149, 1.5, 1.0),
              (3.4028234663852886e38, 2.0, 1.0), (3.4028234663852886e38, 1.0, 1.0000001), (0.5, 0.25, 0.0)]
    kinds = {"subnormal": 0, "inf": 0, "zero": 0}
    for qd, kd, s in cases:
        want = _torch_dscale(qd, kd, s)
        got = cpu_kernel.dscale_of(qd, kd, s)
        same = struct.pack("f", got) == struct.pack("f", want) or (math.isnan(got) and math.isnan(want))
        assert same, (qd, kd, s, got, want)
        kinds["inf"] += math.isinf(want)
        kinds["zero"] += want == 0
        kinds["subnormal"] += 0 < abs(want) < 2.0**-126
    assert all(n > 10 for n in kinds.values()), kinds  # the edges were reached, not only the middle


def test_round_fp32_overflows_to_inf_as_a_cast_does():
    top = 3.4028234663852886e38
    half_ulp = 2.0**103  # half the top binade's ulp (2^104)
    assert cpu_kernel.round_fp32(top + half_ulp * 0.99) == top
    assert cpu_kernel.round_fp32(top + half_ulp) == math.inf  # the tie rounds to even: inf
    assert cpu_kernel.round_fp32(-1e39) == -math.inf
    assert math.isnan(cpu_kernel.round_fp32(math.nan))
    for x in (1e39, -1e39, top + half_ulp, 1e-46, 7e-46, 0.1):
        assert cpu_kernel.round_fp32(x) == torch.tensor([x], dtype=torch.float64).float().item()


@needs_kernel
def test_the_kernel_gets_the_torch_paths_scalars(monkeypatch, fresh_cache):
    """Through the op: the dscale, ln p_scale and v_descale handed to the kernel are the values of
    the tensor ops the torch path forms (AttentionPlan.scalars), bit for bit."""
    seen = []
    real = cpu_kernel._module

    class Recorder:
        def __getattr__(self, name):
            return getattr(real, name)

        def forward(self, *args):
            seen.append(args)
            return real.forward(*args)

    monkeypatch.setattr(cpu_kernel, "_module", Recorder())
    rng = random.Random(7)
    q, k, v = decode_case(skv=70)
    for i in range(40):
        qd, kd, vd = (_fp32(math.ldexp(rng.uniform(1, 2), rng.randint(-12, 4))) for _ in range(3))
        softmax_scale = None if i % 4 == 0 else math.ldexp(rng.uniform(1, 2), rng.randint(-8, 2))
        p = None if i % 3 == 0 else torch.tensor([_fp32(rng.choice([1.0, 0.7, 104.0, 3.3]))])
        descales = scales(qd, kd, vd)
        qfa.quant_flash_attn(q, k, v, *descales, p_scale=p, softmax_scale=softmax_scale)
        plan = tiling.plan_attention(q, k, v, *descales, 0, p_scale=p, softmax_scale=softmax_scale)
        want = plan.scalars(*descales, p).tolist()
        dscale, ln_p, v_descale = seen[-1][17:20]
        assert [dscale, ln_p, v_descale] == want


# ----------------------------------------------------------------------------- the plan cache

def test_a_repeated_call_reuses_its_plan_and_a_cache_hit_is_the_fresh_plan(fresh_cache):
    q, k, v = decode_case()
    first = tiling.plan_attention(q, k, v, *scales(), 0, mask_mode=3, return_softmax_lse=True)
    q2, k2, v2 = decode_case(seed=5)  # other codes, other descale values, same geometry
    again = tiling.plan_attention(q2, k2, v2, *scales(0.1, 3.0, 0.7), 0, mask_mode=3, return_softmax_lse=True)
    assert again is first and len(fresh_cache) == 1
    rebuilt = fresh_plan(q, k, v, *scales(), 0, mask_mode=3, return_softmax_lse=True)
    assert rebuilt is not first and rebuilt == first  # every field, the metadata's included


@needs_kernel
@pytest.mark.parametrize("layout", ["BNSD", "BSND"])
@pytest.mark.parametrize("mask_mode", [0, 3])
def test_cache_hits_give_the_bits_of_cache_misses(layout, mask_mode, fresh_cache):
    """Sq > Skv with the causal mask leaves rows that see no key (0 and +inf, from the kernel)."""
    call = dict(layout=layout, mask_mode=mask_mode, return_softmax_lse=True)
    for seed, (sq, skv) in enumerate([(1, 300), (4, 1029), (9, 5)]):
        q, k, v = decode_case(nq=8, nkv=2, sq=sq, skv=skv, layout=layout, seed=seed)
        fresh_cache.clear()
        miss = bits(qfa.quant_flash_attn(q, k, v, *scales(), **call))
        assert len(fresh_cache) == 1
        hit = bits(qfa.quant_flash_attn(q, k, v, *scales(), **call))
        assert torch.equal(hit[0], miss[0]) and torch.equal(hit[1], miss[1])
        plan = next(iter(fresh_cache.values()))
        want_out, want_lse = torch_path.forward(plan, q, k, v, *scales(), None)
        no_key = torch.isinf(want_lse)
        assert torch.equal(torch.isinf(hit[1]), no_key)
        if no_key.any():
            assert (hit[0].view(torch.bfloat16)[_rows(no_key, layout)] == 0).all()


def _rows(mask, layout):
    """lse's (B, N, S) mask as an index of out's rows in ``layout``."""
    return mask if layout == "BNSD" else mask.transpose(1, 2)


def _bsnd_view_as_bnsd(t):
    """A BNSD tensor with BSND memory: the same shape as a contiguous one, other strides."""
    view = t.transpose(1, 2).contiguous().transpose(1, 2)
    assert view.shape == t.shape and view.stride() != t.stride()
    return view


# Each change keeps a valid call; all but "layout" keep the tensors' shapes.
CHANGES = {
    "skv": lambda c: c | {"kv": decode_case(skv=301)[1:]},
    "sq": lambda c: c | {"q": decode_case(sq=3)[0]},
    "batch": lambda c: c | _batch2(),
    "heads": lambda c: c | {"q": decode_case(nq=6, sq=2)[0]},
    "layout": lambda c: c | {"q": codes(1, 4, 12, D), "kv": decode_case(nkv=4, skv=12)[1:],
                             "kw": c["kw"] | {"layout": "BSND"}},
    "q strides": lambda c: c | {"q": _bsnd_view_as_bnsd(c["q"])},
    "k strides": lambda c: c | {"kv": (_bsnd_view_as_bnsd(c["kv"][0]), c["kv"][1])},
    "v strides": lambda c: c | {"kv": (c["kv"][0], _bsnd_view_as_bnsd(c["kv"][1]))},
    "device": lambda c: c | {"q": c["q"].to("meta"), "kv": tuple(t.to("meta") for t in c["kv"]),
                             "scales": [s.to("meta") for s in c["scales"]]},
    "softmax_scale": lambda c: c | {"kw": c["kw"] | {"softmax_scale": 0.3}},
    "return_lse": lambda c: c | {"kw": c["kw"] | {"return_softmax_lse": True}},
    "mask": lambda c: c | {"kw": c["kw"] | {"mask_mode": 3}},
    "max_seqlen_kv": lambda c: c | {"kw": c["kw"] | {"max_seqlen_kv": 300}},
    "max_seqlen_q": lambda c: c | {"kw": c["kw"] | {"max_seqlen_q": 2}},
}


def _batch2():
    q, k, v = decode_case(b=2, sq=2)
    return {"q": q, "kv": (k, v)}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_geometry_is_not_served_a_stale_plan(change, fresh_cache):
    q, k, v = decode_case(nq=12, nkv=2, sq=2, skv=300)
    base = {"q": q, "kv": (k, v), "scales": scales(), "kw": {"layout": "BNSD"}}
    changed = CHANGES[change](base)
    if change == "layout":  # the same shape is a valid call in both layouts: (1, 4, 12, D)
        assert changed["q"].shape == (1, 4, 12, D)

    def plan(c):
        return tiling.plan_attention(c["q"], *c["kv"], *c["scales"], 0, **c["kw"])

    if change == "layout":
        base = base | {"q": changed["q"], "kv": changed["kv"]}  # same tensors, BNSD vs BSND
    old = plan(base)
    new = plan(changed)
    assert new is not old and new != old
    assert new == fresh_plan(changed["q"], *changed["kv"], *changed["scales"], 0, **changed["kw"])
    assert plan(base) is old and plan(changed) is new  # both stay cached, each under its own key


def test_the_cache_is_bounded_and_keeps_the_newest(monkeypatch, fresh_cache):
    monkeypatch.setattr(tiling, "PLAN_CACHE_SIZE", 4)
    plans = []
    for skv in range(10, 20):
        q, k, v = decode_case(skv=skv)
        plans.append(tiling.plan_attention(q, k, v, *scales(), 0))
    assert len(fresh_cache) == 4
    assert list(fresh_cache.values()) == plans[-4:]
    q, k, v = decode_case(skv=10)  # evicted: derived again, equal to the first
    again = tiling.plan_attention(q, k, v, *scales(), 0)
    assert again is not plans[0] and again == plans[0]


def test_calls_with_length_tensors_are_cached_by_their_values(fresh_cache):
    """Length tensors key the metadata by their values: the same lengths (the layers of one
    step) share it, other lengths never get it, and each is the plan a fresh derivation gives."""
    q, k, v = decode_case(b=2, skv=40)
    used = lambda *n: torch.tensor(n, dtype=torch.int32)  # noqa: E731
    a = tiling.plan_attention(q, k, v, *scales(), 0, seqused_kv=used(40, 7))
    b = tiling.plan_attention(q, k, v, *scales(), 0, seqused_kv=used(3, 40))
    assert a.kv_lens == (40, 7) and b.kv_lens == (3, 40)
    assert a == fresh_plan(q, k, v, *scales(), 0, seqused_kv=used(40, 7))
    assert b == fresh_plan(q, k, v, *scales(), 0, seqused_kv=used(3, 40))
    again = tiling.plan_attention(q, k, v, *scales(), 0, seqused_kv=used(40, 7))
    assert again is a  # the metadata and its bound plan, both from the cache
    with pytest.raises(TypeError, match="seqused_kv must be torch.int32, got torch.int64"):
        tiling.plan_attention(q, k, v, *scales(), 0, seqused_kv=used(40, 7).long())  # dtype is in the key
    with pytest.raises(ValueError, match="seqused_kv"):
        tiling.plan_attention(q, k, v, *scales(), 0, seqused_kv=used(41, 7))  # past Skv: still checked


def _mxfp8_call(q_descale=None):
    from qfa.cast import mxfp8

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, h, D, generator=g) for n, h in ((3, 4), (200, 2), (200, 2)))
    (qe, qs), (ke, ks), (ve, vs) = mxfp8.quantize(q), mxfp8.quantize(k), mxfp8.quantize(v, 0)
    qd = mxfp8.pack_q_descale(qs) if q_descale is None else q_descale(mxfp8.pack_q_descale(qs))
    cu = lambda n: torch.tensor([0, n], dtype=torch.int32)  # noqa: E731
    return qfa.quant_flash_attn(qe, ke, ve, qd, mxfp8.pack_k_descale(ks), mxfp8.pack_v_descale([vs]), 1,
                                cu_seqlens_q=cu(3), cu_seqlens_kv=cu(200), mask_mode=3,
                                p_scale=torch.tensor([448.0]), backend="torch")


def test_a_mode_1_hit_still_checks_the_scales_and_gives_the_same_bits(fresh_cache):
    first = _mxfp8_call()
    assert any(key[0] == "metadata" for key in fresh_cache)
    second = _mxfp8_call()
    assert torch.equal(first[0].view(torch.int16), second[0].view(torch.int16))

    def out_of_range(t):
        t = t.clone()
        t.view(torch.uint8).view(-1)[0] = 250
        return t

    # The same geometry and lengths, a scale out of range: the hit must not skip its check.
    with pytest.raises(ValueError, match=r"^q_descale must hold E8M0 scales <= 2\^119"):
        _mxfp8_call(out_of_range)


def test_scalars_of_another_type_are_another_key(fresh_cache):
    """True == 1 and hash alike: a cached call with mask_mode=1 ... must not serve a bool."""
    key_int = tiling._metadata_key((12, 2, 128, QuantMode.HIF8_PER_TENSOR), {"mask_mode": 3})
    key_bool = tiling._metadata_key((12, 2, 128, QuantMode.HIF8_PER_TENSOR), {"mask_mode": True})
    key_one = tiling._metadata_key((12, 2, 128, QuantMode.HIF8_PER_TENSOR), {"mask_mode": 1})
    assert key_bool != key_one and key_int != key_one
    assert tiling._metadata_key((12, 2, 128, 0), {"max_seqlen_q": 1.0}) is None  # no key: derived
    assert tiling._metadata_key((12, 2, 128, 0), {"cu_seqlens_q": torch.zeros(2, device="meta")}) is None


# ----------------------------------------------------------------------------- checks on cache hits

BAD_CALLS = {
    "negative q_descale": dict(scales=(-0.5, 0.25, 2.0)),
    "nan k_descale": dict(scales=(0.5, math.nan, 2.0)),
    "zero v_descale": dict(scales=(0.5, 0.25, 0.0)),
    "huge v_descale": dict(scales=(0.5, 0.25, 3e38)),
    "dscale overflow": dict(scales=(3e30, 3e30, 1.0)),
    "dscale underflow": dict(scales=(1e-30, 1e-30, 1.0), softmax_scale=5e-324),
    "p_scale range": dict(p_scale=torch.full((1,), 1e6)),
    "p_scale dtype": dict(p_scale=torch.ones(1, dtype=torch.float64)),
    "q_descale shape": dict(q_descale=torch.ones(2)),
    "softmax_scale type": dict(softmax_scale=torch.ones(())),
    "softmax_scale value": dict(softmax_scale=-1.0),
    "return_lse type": dict(return_softmax_lse=1),
    "mask_mode": dict(mask_mode=2),
    "attn_mask without mask": dict(attn_mask=torch.zeros(2048, 2048, dtype=torch.int8)),
    "max_seqlen_q type": dict(max_seqlen_q=1.0),
    "max_seqlen_kv bound": dict(max_seqlen_kv=299),
    "window": dict(win_left=3),
    "sinks": dict(sinks=torch.zeros(12)),
    "block_table": dict(block_table=torch.zeros(1, 2, dtype=torch.int32)),
    "k on meta": dict(k="meta"),
    "v dtype": dict(v=torch.float32),
}


def _bad_call(spec):
    q, k, v = decode_case(skv=300)
    descales = scales(*spec.get("scales", (0.5, 0.25, 2.0)))
    if "q_descale" in spec:
        descales[0] = spec["q_descale"]
    if spec.get("k") == "meta":
        k = k.to("meta")
    if "v" in spec:
        v = v.to(spec["v"])
    kw = {n: x for n, x in spec.items() if n not in ("scales", "q_descale", "k", "v")}
    return (q, k, v, *descales), kw


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_every_check_fails_a_bad_call_after_its_geometry_was_cached(name, fresh_cache):
    args, kw = _bad_call(BAD_CALLS[name])
    with pytest.raises((TypeError, ValueError)) as cold:
        qfa.quant_flash_attn(*args, **kw)
    fresh_cache.clear()
    good, _ = _bad_call({})
    qfa.quant_flash_attn(*good)
    assert fresh_cache  # the geometry is cached now: a value-bad call hits it, then fails its checks
    with pytest.raises(cold.type) as warm:
        qfa.quant_flash_attn(*args, **kw)
    assert str(warm.value) == str(cold.value)


# ----------------------------------------------------------------------------- the light path's other parts

@needs_kernel
def test_forward_hands_the_kernel_the_strides_run_into_derives(monkeypatch):
    """forward passes the plan's out/lse strides (for the contiguous outputs it allocates, which
    the kernel fills); run_into derives them from the tensors it is given. They must agree."""
    seen = []
    real = cpu_kernel._module

    class Recorder:
        def __getattr__(self, name):
            return getattr(real, name)

        def forward(self, *args):
            seen.append(args)
            return real.forward(*args)

    monkeypatch.setattr(cpu_kernel, "_module", Recorder())
    tnd_lens = dict(cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32),
                    cu_seqlens_kv=torch.tensor([0, 11, 20], dtype=torch.int32))
    cases = [("BNSD", (2, 4, 3, D), (2, 2, 9, D), {}), ("BSND", (1, 5, 8, D), (1, 7, 4, D), {}),
             ("BNSD", (1, 12, 1, D), (1, 2, 1, D), {}), ("BSND", (1, 0, 4, D), (1, 3, 2, D), {}),
             ("TND", (9, 4, D), (20, 2, D), tnd_lens), ("strided", (2, 4, 3, D), (2, 2, 9, D), {})]
    for name, q_shape, kv_shape, lens in cases:
        layout = "BNSD" if name == "strided" else name
        for lse in (True, False):
            q, k, v = codes(*q_shape), codes(*kv_shape, seed=1), codes(*kv_shape, seed=2)
            if name == "strided":  # q not contiguous: the outputs still are
                q = _bsnd_view_as_bnsd(q)
            plan = tiling.plan_attention(q, k, v, *scales(), 0, layout=layout, return_softmax_lse=lse, **lens)
            out, lse_t = cpu_kernel.forward(plan, q, k, v, *scales(), None)
            assert out.is_contiguous() and tiling.normalised_strides(out, layout) == plan.out_strides
            out2 = torch.zeros(q.shape, dtype=torch.bfloat16)
            lse2 = torch.full(plan.lse_shape, math.inf) if lse else torch.empty(0)
            cpu_kernel.run_into(plan, q, k, v, *scales(), None, out2, lse2)
            a, b = seen[-2:]
            assert len(a) == len(b)
            # fill: forward's fresh outputs, run_into's given ones; the only flag of the two that is
            # True in one call and False in the other
            flips = [i for i, (x, y) in enumerate(zip(a, b)) if x is True and y is False]
            assert len(flips) == 1, flips
            fill = flips[0]
            for x, y in zip(a[:fill] + a[fill + 1:], b[:fill] + b[fill + 1:]):
                if isinstance(x, torch.Tensor):
                    assert isinstance(y, torch.Tensor)
                elif isinstance(x, (tuple, list)):
                    assert list(x) == list(y)
                else:
                    assert x == y and type(x) is type(y)
            assert torch.equal(out.view(torch.int16), out2.view(torch.int16)) and torch.equal(lse_t, lse2)


@needs_kernel
def test_outputs_are_new_inputs_untouched_and_no_graph(fresh_cache):
    q, k, v = decode_case()
    descales = scales()
    descales[0].requires_grad_(True)
    p = torch.full((1,), 2.0, requires_grad=True)
    before = [t.detach().clone() for t in (q, k, v, *descales, p)]
    a = qfa.quant_flash_attn(q, k, v, *descales, p_scale=p, return_softmax_lse=True)
    b = qfa.quant_flash_attn(q, k, v, *descales, p_scale=p, return_softmax_lse=True)
    for x, y in zip(a, b):
        assert x.data_ptr() != y.data_ptr() and torch.equal(x, y)
        assert not x.requires_grad and x.grad_fn is None
    for t, want in zip((q, k, v, *descales, p), before):
        assert torch.equal(t.detach(), want)
    plain = qfa.quant_flash_attn(q, k, v, *scales(), p_scale=torch.full((1,), 2.0), return_softmax_lse=True)
    assert torch.equal(a[0].view(torch.int16), plain[0].view(torch.int16)) and torch.equal(a[1], plain[1])
    empties = [qfa.quant_flash_attn(q, k, v, *scales())[1] for _ in range(2)]
    assert empties[0].numel() == 0 and empties[0] is not empties[1]


@needs_kernel
def test_threads_sharing_the_cache_get_their_own_plans(fresh_cache):
    cases = [decode_case(skv=s, seed=s) for s in (20, 33, 47, 300)]
    want = [bits(qfa.quant_flash_attn(*c, *scales(), return_softmax_lse=True)) for c in cases]
    fresh_cache.clear()
    failures = []

    def work(i):
        for j in range(12):
            c = (i + j) % len(cases)
            got = bits(qfa.quant_flash_attn(*cases[c], *scales(), return_softmax_lse=True))
            if not (torch.equal(got[0], want[c][0]) and torch.equal(got[1], want[c][1])):
                failures.append((i, j))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures and len(fresh_cache) == len(cases)


@pytest.mark.parametrize("layout", [None, "BNSD", "BSND", "TND"])
def test_resolve_layouts_shortcut_is_the_rules_result(layout):
    short = checks.resolve_layouts(layout, None, None, None, None, 0)
    full = checks.resolve_layouts(layout, None, None, None, "BSND", 0)  # layout_q_descale set: the full rules
    assert short == full and short.q == (layout or "BNSD") == short.kv == short.out


@pytest.mark.parametrize("layout", ["NTD", "bnsd", 3, ["BNSD"]])
def test_resolve_layouts_refuses_bad_layouts_with_the_rules_message(layout):
    with pytest.raises(ValueError, match=r"^layout must be one of \('BNSD', 'BSND', 'TND'\), got"):
        checks.resolve_layouts(layout, None, None, None, None, 0)


def test_mode_lookups_keep_the_rules():
    assert checks.check_quant_mode(7) is QuantMode.HIF8_PER_TENSOR
    assert checks.check_quant_mode(QuantMode.MXFP8) is checks.check_quant_mode(1) is QuantMode.MXFP8
    assert checks.check_mask_mode(3) is MaskMode.CAUSAL and checks.check_mask_mode(MaskMode.NONE) is MaskMode.NONE
    for bad, error in ((True, TypeError), (1.0, TypeError), (2, ValueError), (-1, ValueError)):
        with pytest.raises(error, match="^quant_mode must be"):
            checks.check_quant_mode(bad)
    for bad, error in ((False, TypeError), ("3", TypeError), (1, ValueError), (7, ValueError)):
        with pytest.raises(error, match="^mask_mode must be"):
            checks.check_mask_mode(bad)
