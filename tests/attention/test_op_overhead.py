"""The op's light per-call path: the plan cache (calls without length tensors by geometry, the
metadata of calls with them by their lengths' values), the native kernel's scalars formed from
the descales' values, and the arguments the kernel is handed.

What must hold: a cache hit is the plan a fresh derivation gives (and the same bits out), a
changed geometry (shape, strides, layout, device, softmax_scale, return_lse, mask, bounds) is
never served another's plan, every check still fails a bad call after its geometry was cached,
and the kernel's fp32 scalars are bit for bit those of the tensor ops the torch path uses. For
modes 1 and 6 also: what a plan derives once (descale shapes, TND v's first keys), the remembered
layouts and shapes, the q_descale view and the ln p_scale memo hand the kernel the general
derivation's arguments, and every scale value is still checked on a cached call.
"""

from __future__ import annotations

import math
import random
import struct
import threading

import pytest
import torch

import qfa
from qfa.attention import known_calls
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
    known_calls.forget()
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
    if cpu_kernel.available():  # each case's first call remembered it, whichever thread made it
        assert len(known_calls._plans) == len(cases)


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


# ----------------------------------------------------------------------------- modes 1 and 6's light path

def _mode1_case(q_lens=(3, 1), kv_lens=(200, 70), nq=4, nkv=2, seed=1):
    """A TND MXFP8 call (D = 128) as (args, kwargs) of quant_flash_attn."""
    from qfa.cast import mxfp8

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(sum(n), h, D, generator=g) for n, h in ((q_lens, nq), (kv_lens, nkv), (kv_lens, nkv)))
    (qe, qs), (ke, ks) = mxfp8.quantize(q), mxfp8.quantize(k)
    starts = [0, *torch.tensor(kv_lens).cumsum(0).tolist()]
    v_parts = [mxfp8.quantize(v[a:b], 0) for a, b in zip(starts[:-1], starts[1:])]
    ve = torch.cat([e.view(torch.uint8) for e, _ in v_parts]).view(torch.float8_e4m3fn)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    args = [qe, ke, ve, mxfp8.pack_q_descale(qs), mxfp8.pack_k_descale(ks),
            mxfp8.pack_v_descale([s for _, s in v_parts]), 1]
    return args, dict(cu_seqlens_q=cu(q_lens), cu_seqlens_kv=cu(kv_lens), p_scale=torch.tensor([104.0]),
                      return_softmax_lse=True, backend="torch")


def _mode6_case(q_lens=(2, 1), kv_lens=(300, 129), nq=4, nkv=2, seed=2):
    """An FP8 per-token-head call (q NTD, k/v PA_BNBD blocks of 128, one spare block)."""
    from qfa.cast import fp8

    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // 128) for n in kv_lens]
    blocks = sum(per_seq) + 1
    (qe, qs) = fp8.quantize_per_token_head(torch.randn(nq, sum(q_lens), D, generator=g))
    (ke, ks) = fp8.quantize_per_token_head(torch.randn(blocks, nkv, 128, D, generator=g))
    ve, vs = fp8.quantize_per_head(torch.randn(blocks, nkv, 128, D, generator=g), 1)
    table = torch.zeros(len(kv_lens), max(per_seq), dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = torch.arange(used, used + n, dtype=torch.int32)
        used += n
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return [qe, ke, ve, qs, ks, vs, 6], dict(block_table=table, cu_seqlens_q=cu_q, p_scale=torch.tensor([448.0]),
                                             seqused_kv=torch.tensor(kv_lens, dtype=torch.int32),
                                             return_softmax_lse=True, backend="torch")


SCALED_CASES = {1: _mode1_case, 6: _mode6_case}


def _scaled_plan(args, kw):
    """The plan the op makes for a mode 1 / 6 call (its default layouts)."""
    layouts = tiling.resolved_layouts(None, None, None, None, None, args[6])
    return tiling.plan_attention(*args, layout=layouts.q, layout_kv=layouts.kv, layout_out=layouts.out,
                                 layout_q_descale=layouts.q_descale, **{n: x for n, x in kw.items() if n != "backend"})


class _Recorder:
    """The native module, its forward's arguments kept (the kernel still runs)."""

    def __init__(self, real):
        self.real, self.seen = real, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def forward(self, *args):
        self.seen.append(args)
        return self.real.forward(*args)


def _same_argument(x, y) -> bool:
    """The same kernel argument: tensors of one dtype, shape and strides holding the same bytes
    (the decode tables hold NaN), sequences element by element, scalars of one type and value."""
    if isinstance(x, torch.Tensor):
        as_bytes = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
        return (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
                and x.stride() == y.stride() and torch.equal(as_bytes(x), as_bytes(y)))
    if isinstance(x, (tuple, list)):
        return isinstance(y, (tuple, list)) and len(x) == len(y) and all(map(_same_argument, x, y))
    return type(x) is type(y) and x == y


@needs_kernel
@pytest.mark.parametrize("mode", [1, 6])
def test_the_op_hands_the_kernel_the_arguments_of_the_general_derivation(mode, monkeypatch, fresh_cache):
    """Through the op (available() known, the plan's derived descriptors, the q_descale view, the
    ln p_scale memo) the kernel gets the arguments a direct forward_scaled call derives, and those
    are the general path's values: the unpacked q scales' bytes and strides, TND v's first keys
    from the segment lengths, torch.log's fp32 ln p_scale as a double, bf16_dot() as the flag."""
    from qfa.cast import mxfp8
    from qfa.tiling.scaled_checks import kv_segment_lengths

    recorder = _Recorder(cpu_kernel._module)
    monkeypatch.setattr(cpu_kernel, "_module", recorder)
    monkeypatch.setattr(cpu_kernel, "_ln_p", {})
    args, kw = SCALED_CASES[mode]()
    for p in (104.0, 448.0, 104.0, 1.0):  # a p_scale value again: the memo's entry
        kw["p_scale"] = torch.tensor([0.0, p])[1:]  # at an offset: a tensor the memo has not seen
        outs = [bits(qfa.quant_flash_attn(*args, **kw)) for _ in range(2)]  # cold, then cached
        plan = _scaled_plan(args, kw)
        direct = bits(cpu_kernel.forward_scaled(plan, *args[:6], kw["p_scale"], block_table=kw.get("block_table")))
        op_cold, op_warm, direct_args = recorder.seen[-3:]
        for got in (op_cold, op_warm):
            assert len(got) == len(direct_args) and all(map(_same_argument, got, direct_args))
        for out in outs:
            assert torch.equal(out[0], direct[0]) and torch.equal(out[1], direct[1])
        assert direct_args[18] == torch.log(torch.tensor([p])).item()
        assert direct_args[29] is cpu_kernel.bf16_dot()
        if mode == 1:
            q_s, q_st, starts = direct_args[33], direct_args[34], direct_args[39]
            want = mxfp8._unpack_q_descale(args[3], D, "TND")  # E8M0: the kernel reads its bytes
            assert q_s.dtype == want.dtype == torch.float8_e8m0fnu and q_s.data_ptr() == want.data_ptr()
            assert torch.equal(q_s.view(torch.uint8), want.view(torch.uint8))
            assert list(q_st) == list(want.stride()[:2])
            rows, want_starts = 0, []
            for n in kv_segment_lengths(plan):
                want_starts.append(64 * rows)
                rows += -(-n // 64)
            assert list(starts) == want_starts == [0, 256]


def test_ln_p_scale_is_torch_log_of_every_tensor_holding_the_value(monkeypatch):
    """The memo's entries are torch.log's results for other tensors of the same fp32 value too
    (fresh, at an offset, strided, cast from float64), bit for bit; NaN and float64 p_scales are
    not memoised, and the memo is bounded."""
    monkeypatch.setattr(cpu_kernel, "_ln_p", {})
    monkeypatch.setattr(cpu_kernel, "_LN_P_SIZE", 40)
    rng = random.Random(3)
    values = [1.0, 448.0, 104.0, 1.5, 0.0, -0.0, -1.0, math.inf, 2.0**-149, 3.4028234663852886e38]
    values += [_fp32(rng.uniform(1.0, 448.0)) for _ in range(60)]

    def double_bits(x: float) -> bytes:
        return struct.pack("d", x)

    for x in values:
        forms = [torch.tensor([x]), torch.tensor([7.0, x])[1:], torch.tensor([x, 0.0, 5.0])[::2][:1],
                 torch.tensor([x], dtype=torch.float64).float()]
        for t in forms:
            assert double_bits(cpu_kernel._ln_p_scale(t)) == double_bits(torch.log(t).item()), (x, t)
    assert len(cpu_kernel._ln_p) == 40  # bounded: later values were computed, not kept
    nan = cpu_kernel._ln_p_scale(torch.tensor([math.nan]))
    assert math.isnan(nan) and all(k == k for k in cpu_kernel._ln_p)
    wide = torch.tensor([1.1], dtype=torch.float64)
    assert cpu_kernel._ln_p_scale(wide) == torch.log(wide).item() != torch.log(wide.float()).item()
    assert cpu_kernel._ln_p_scale(None) == 0.0


SCALED_BAD_VALUES = {
    # (mode, descale index, what to do to it, message)
    "mode 1 q scale": (1, 3, lambda t: t.view(torch.uint8).view(-1).__setitem__(0, 250),
                       r"^q_descale must hold E8M0 scales <= 2\^119"),
    "mode 1 k scale": (1, 4, lambda t: t.view(torch.uint8).view(-1).__setitem__(5, 250),
                       r"^k_descale must hold E8M0 scales <= 2\^119"),
    "mode 1 v scale": (1, 5, lambda t: t.view(torch.uint8).view(-1).__setitem__(9, 247),
                       r"^v_descale must hold E8M0 scales <= 2\^119"),
    "mode 1 q and k too large together": (1, 3, lambda t: t.view(torch.uint8).fill_(240),
                                          r"^q_descale and k_descale are too large for fp32 scores"),
    "mode 6 q scale": (6, 3, lambda t: t.view(-1).__setitem__(1, -1.0), r"^q_descale must hold finite scales > 0"),
    "mode 6 k scale": (6, 4, lambda t: t[0].view(-1).__setitem__(3, math.inf),
                       r"^k_descale must hold finite scales > 0"),
    "mode 6 v scale": (6, 5, lambda t: t.__setitem__(1, 0.0), r"^v_descale must hold finite scales > 0"),
    "mode 6 v too large": (6, 5, lambda t: t.fill_(3e38), r"^v_descale is too large for this call"),
}


@needs_kernel
@pytest.mark.parametrize("name", list(SCALED_BAD_VALUES))
def test_a_scaled_call_whose_plan_is_cached_still_checks_every_scale_value(name, fresh_cache):
    """The metadata, the plan and what it derives are cached by the good call: a call with the
    same geometry and a bad scale value fails as it does from scratch."""
    mode, index, spoil, message = SCALED_BAD_VALUES[name]
    args, kw = SCALED_CASES[mode]()
    bad = list(args)
    bad[index] = args[index].clone()
    spoil(bad[index])
    with pytest.raises(ValueError, match=message) as cold:
        qfa.quant_flash_attn(*bad, **kw)
    fresh_cache.clear()
    good = qfa.quant_flash_attn(*args, **kw)
    assert fresh_cache and good[0].shape[0] == args[0].shape[0 if mode == 1 else 1]
    with pytest.raises(ValueError) as warm:
        qfa.quant_flash_attn(*bad, **kw)
    assert str(warm.value) == str(cold.value)


@needs_kernel
@pytest.mark.parametrize("mode", [1, 6])
def test_a_cached_scaled_plan_still_checks_the_descale_shapes_and_dtypes(mode, fresh_cache):
    """The descale shapes are derived once per plan and the tensors' dtypes by one test of all:
    a call on the cached plan with a descale of another shape or dtype fails with the message
    it gets from scratch (naming the argument, the expected and the given)."""
    args, kw = SCALED_CASES[mode]()
    spoiled = []
    for index in (3, 4, 5):
        shape = list(args)
        shape[index] = args[index][:1]
        dtype = list(args)
        dtype[index] = args[index].view(torch.uint8) if mode == 1 else args[index].double()
        spoiled += [shape, dtype]
    cold = []
    for bad in spoiled:
        fresh_cache.clear()
        with pytest.raises((TypeError, ValueError)) as error:
            qfa.quant_flash_attn(*bad, **kw)
        cold.append((error.type, str(error.value)))
    fresh_cache.clear()
    plan = _scaled_plan(args, kw)
    qfa.quant_flash_attn(*args, **kw)
    assert plan.derived  # the plan's descale shapes are kept
    for bad, (kind, message) in zip(spoiled, cold):
        with pytest.raises(kind) as warm:
            qfa.quant_flash_attn(*bad, **kw)
        assert str(warm.value) == message
        assert any(n in message for n in ("q_descale", "k_descale", "v_descale")) and "got" in message


def test_a_replaced_plan_derives_afresh_and_equality_ignores_what_was_derived(fresh_cache):
    import dataclasses

    from qfa.tiling.scaled_checks import check_descale_shapes

    args, kw = _mode1_case()
    plan = _scaled_plan(args, kw)
    check_descale_shapes(plan, *args[3:6])
    assert "descale_shapes" in plan.derived
    other = dataclasses.replace(plan, kv_lens=(199, 70))
    assert other.derived == {} and other.derived is not plan.derived
    assert dataclasses.replace(plan) == plan and hash(dataclasses.replace(plan)) == hash(plan)


@needs_kernel
def test_scaled_outputs_are_new_inputs_untouched_and_no_graph(fresh_cache):
    """Modes 1 and 6 run the native kernel outside no_grad: fp32 descales and a p_scale that
    require grad still give outputs with no graph, fresh each call, inputs unchanged."""
    args, kw = _mode6_case()
    for t in args[3:6]:
        t.requires_grad_(True)
    kw["p_scale"] = torch.tensor([448.0], requires_grad=True)
    before = [t.detach().clone() for t in (*args[:6], kw["p_scale"])]
    a, b = qfa.quant_flash_attn(*args, **kw), qfa.quant_flash_attn(*args, **kw)
    for x, y in zip(a, b):
        assert x.data_ptr() != y.data_ptr() and torch.equal(x, y)
        assert not x.requires_grad and x.grad_fn is None
    for t, want in zip((*args[:6], kw["p_scale"]), before):
        assert torch.equal(t.detach().view(torch.uint8), want.view(torch.uint8))
    plain = [t.detach() for t in args[:6]] + [6]
    kw["p_scale"] = kw["p_scale"].detach()
    assert torch.equal(bits(qfa.quant_flash_attn(*plain, **kw))[0], bits(a)[0])


@pytest.mark.parametrize("mode", [0, 1, 6, 7])
def test_resolved_layouts_are_the_rules_results_and_errors(mode):
    """Remembered layouts: the rules' result for every combination, twice (the second from the
    memo), and the rules' error for every bad one, also after good ones were remembered."""
    import itertools

    values = [None, "TND", "NTD", "BNSD", "PA_BNBD", "PA_BBND", "N2TGD", "NT", "BSND", "tnd", 3, ["TND"]]
    for combo in itertools.product(values, values[:8], values, values[:5], values):
        if sum(isinstance(x, (int, list)) for x in combo) > 1:
            continue
        outcomes = []
        for resolve in (checks.resolve_layouts, tiling.resolved_layouts, tiling.resolved_layouts):
            try:
                outcomes.append(resolve(*combo, mode))
            except (TypeError, ValueError) as error:
                outcomes.append((type(error), str(error)))
        assert outcomes[0] == outcomes[1] == outcomes[2], combo
    with pytest.raises(TypeError, match="^quant_mode must be"):
        tiling.resolved_layouts(None, None, None, None, None, True)  # True == 1 hashes alike: still refused


def test_checked_shapes_are_check_shapes_results_and_errors(monkeypatch):
    """Remembered shapes: check_shapes' sizes for a good call, its error for a bad one whether or
    not a good call of other shapes was remembered; bounded."""
    monkeypatch.setattr(tiling, "_shapes_cache", {})
    monkeypatch.setattr(tiling, "PLAN_CACHE_SIZE", 4)
    q, k, v = (torch.zeros(s, dtype=torch.float8_e4m3fn) for s in ((5, 4, D), (9, 2, D), (9, 2, D)))
    want = checks.check_shapes(q, k, v, "TND", (64, 72, 128, 256), "TND", tuple(checks._AXES))
    for _ in range(2):
        assert tiling._checked_shapes(q, k, v, "TND", QuantMode.MXFP8, "TND") == want
    bad_cases = [(q, k, v[:8]), (q, k[:, :1], v[:, :1].expand(9, 3, D)), (q[..., :64], k, v),
                 (q[:, :3], k, v), (q.unsqueeze(0), k, v), (q, k, v)]
    for bq, bk, bv in bad_cases[:-1]:
        with pytest.raises(ValueError) as cold:
            checks.check_shapes(bq, bk, bv, "TND", (64, 72, 128, 256), "TND", tuple(checks._AXES))
        with pytest.raises(ValueError) as warm:
            tiling._checked_shapes(bq, bk, bv, "TND", QuantMode.MXFP8, "TND")
        assert str(warm.value) == str(cold.value)
    with pytest.raises(ValueError, match="head dim D of q must be 128, got 64"):  # the mode's head dims
        tiling._checked_shapes(q[..., :64], k[..., :64], v[..., :64], "TND", QuantMode.HIF8_PER_TENSOR, "TND")
    for n in range(1, 7):
        tiling._checked_shapes(q[:n], k, v, "TND", QuantMode.MXFP8, "TND")
    assert len(tiling._shapes_cache) == 4


def test_the_device_check_on_cpu_is_check_devices():
    q = torch.zeros(3, 4, D, dtype=torch.float8_e4m3fn)
    param = torch.nn.Parameter(torch.ones(1), requires_grad=False)
    tiling.check_call_devices(q, {"k": q, "p_scale": param, "block_table": None, "sinks": [1, 2]})
    for named in ({"k": q.to("meta")}, {"k": q, "cu_seqlens_q": torch.zeros(2, dtype=torch.int32, device="meta")},
                  {"p_scale": torch.nn.Parameter(torch.ones(1, device="meta"), requires_grad=False)}):
        with pytest.raises(ValueError) as cold:
            checks.check_devices(q.device, named)
        with pytest.raises(ValueError) as fast:
            tiling.check_call_devices(q, named)
        assert str(fast.value) == str(cold.value) and "must be on q's device cpu, got meta" in str(cold.value)
    with pytest.raises(ValueError, match="k must be on q's device meta, got cpu"):
        tiling.check_call_devices(q.to("meta"), {"k": q})


@pytest.mark.parametrize("mode", [1, 6])
def test_the_scaled_dtype_checks_keep_their_messages(mode):
    """check_scaled_run_tensors' one test of all dtypes passes only calls the rules pass; every
    other call gets the rules' message for its first bad argument."""
    from qfa.tiling.scaled_checks import check_scaled_run_tensors

    args, kw = SCALED_CASES[mode]()
    names = ("q", "k", "v", "q_descale", "k_descale", "v_descale")
    check_scaled_run_tensors(QuantMode(mode), *args[:6], kw["p_scale"])
    for i, name in enumerate(names):
        for wrong in (args[i].view(torch.uint8) if args[i].dtype.itemsize == 1 else args[i].double(), [1.0]):
            bad = list(args[:6])
            bad[i] = wrong
            with pytest.raises(TypeError, match=f"^{name} must be ") as error:
                check_scaled_run_tensors(QuantMode(mode), *bad, kw["p_scale"])
            assert "got" in str(error.value)
    for p, error in ((torch.ones(1, dtype=torch.float64), TypeError), (torch.ones(2), ValueError), (1.0, TypeError)):
        with pytest.raises(error, match="^p_scale must"):
            check_scaled_run_tensors(QuantMode(mode), *args[:6], p)
