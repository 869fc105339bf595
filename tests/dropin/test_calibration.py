"""Calibration rules (``qfa.dropin.calibration``), quantize/dequantize and the scale observer,
on small synthetic tensors. The calibration benchmark's helpers are tested in test_tools.py."""

import math

import pytest
import torch

from qfa.dropin import calibration as cal
from qfa.cast import decode_from_hifloat8, encode_to_hifloat8
from qfa.cast import format as fmt

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _is_power_of_two(scale: torch.Tensor) -> bool:
    mantissa, _ = math.frexp(float(scale))
    return mantissa == 0.5


def _llm_like(shape=(1, 2, 64, 128), seed=0, offset=0.0):
    """Gaussian bulk, a few heavy channels (like RoPE'd Q/K) and optional channel offsets."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 0.7
    x[..., :4] *= 12.0
    if offset:
        x = x + offset * torch.randn(shape[-1], generator=g)
    return x


def _mse(x, scale):
    return (cal.hif8_roundtrip(x, scale) - x.float()).double().square().mean().item()


@pytest.mark.parametrize("dtype", FLOATS)
def test_amax_rule_is_upstreams_formula(dtype):
    x = _llm_like().to(dtype)
    s = cal.compute_scale(x, "amax")
    assert s.dtype == torch.float32 and s.shape == (1,)
    assert torch.equal(s, (x.float().abs().amax() / 32768.0).reshape(1))
    # amax lands exactly on (or rounds to) HiF8's MAX
    assert decode_from_hifloat8(cal.quantize(x, s), torch.float32).abs().max().item() == fmt.MAX


@pytest.mark.parametrize("rule", ["rms", "mse"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_tapered_rules_give_powers_of_two(rule, dtype):
    for seed in range(3):
        x = (_llm_like(seed=seed) * 10.0 ** (seed - 1)).to(dtype)
        s = cal.compute_scale(x, rule)
        assert s.dtype == torch.float32 and s.shape == (1,)
        assert _is_power_of_two(s), float(s)


def test_rms_rule_puts_rms_near_one():
    for seed, mag in enumerate((1e-3, 1.0, 7.0, 3e3)):
        x = _llm_like(seed=seed) * mag
        s = cal.rms_scale(x)
        rms = x.double().square().mean().sqrt().item()
        # round(log2 rms) -> rms / s within [2^-1/2, 2^1/2]
        assert 2 ** -0.5 <= rms / float(s) <= 2 ** 0.5


def test_mse_rule_minimises_roundtrip_error_over_its_candidates():
    x = _llm_like(offset=3.0)
    s = cal.mse_scale(x)
    e_rms = round(math.log2(x.double().square().mean().sqrt().item()))
    errors = {o: _mse(x, torch.tensor([2.0 ** (e_rms + o)])) for o in cal.MSE_EXPONENT_OFFSETS}
    assert _mse(x, s) == min(errors.values())
    # the RMS exponent is one of the candidates, so mse never does worse than rms
    assert _mse(x, s) <= _mse(x, cal.rms_scale(x))


def test_tapered_rules_beat_amax_on_llm_like_data():
    # The reason for the tapered rules: amax/32768 pushes the bulk into the 1-2 mantissa-bit binades.
    x = _llm_like()
    assert _mse(x, cal.rms_scale(x)) < 0.5 * _mse(x, cal.amax_scale(x))


def test_mse_rule_on_a_large_tensor_uses_a_deterministic_subsample():
    x = _llm_like(shape=(2, 4, 300, 128), seed=5)
    assert x.numel() > cal.MSE_SAMPLE
    s1, s2 = cal.mse_scale(x), cal.mse_scale(x.clone())
    assert torch.equal(s1, s2) and _is_power_of_two(s1)


@pytest.mark.parametrize("rule", sorted(cal.RULES))
def test_zero_and_empty_tensors_get_scale_one(rule):
    assert float(cal.compute_scale(torch.zeros(3, 128), rule)) == 1.0
    assert float(cal.compute_scale(torch.zeros(0, 128, dtype=torch.bfloat16), rule)) == 1.0


@pytest.mark.parametrize("rule", sorted(cal.RULES))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_rejected(rule, bad):
    x = torch.randn(4, 128)
    x[2, 7] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        cal.compute_scale(x, rule)


def test_rule_registry():
    with pytest.raises(ValueError, match="calibration must be one of .*'amax'.*got 'bogus'"):
        cal.get_rule("bogus")
    with pytest.raises(TypeError, match="calibration"):
        cal.get_rule(3)
    assert cal.get_rule(None) is cal.RULES[cal.DEFAULT_RULE]
    with pytest.raises(ValueError, match="already exists"):
        cal.register_rule("amax", cal.amax_scale)
    cal.register_rule("_test_fixed", lambda x: torch.tensor([0.25]))
    try:
        assert float(cal.compute_scale(torch.randn(8), "_test_fixed")) == 0.25
    finally:
        del cal.RULES["_test_fixed"]
    cal.register_rule("_test_bad", lambda x: torch.tensor([-1.0]))
    try:
        with pytest.raises(ValueError, match="positive and finite"):
            cal.compute_scale(torch.randn(8), "_test_bad")
    finally:
        del cal.RULES["_test_bad"]


def test_rules_reject_non_float_tensors():
    with pytest.raises(TypeError, match="floating-point"):
        cal.rms_scale(torch.ones(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="torch.Tensor"):
        cal.rms_scale([1.0, 2.0])


def test_quantize_is_a_saturating_encode_of_x_over_scale():
    x = _llm_like()
    s = torch.tensor([0.125])
    assert torch.equal(cal.quantize(x, s), encode_to_hifloat8(x / s))
    assert torch.equal(cal.quantize(x, 0.125), encode_to_hifloat8(x / s))  # float scale too
    big = torch.tensor([1e6, -1e6, 2.0])
    assert cal.quantize(big, 1.0).tolist() == [fmt.MAX_CODE, fmt.MAX_CODE | fmt.SIGN_BIT,
                                               int(encode_to_hifloat8(torch.tensor([2.0]))[0])]
    back = cal.dequantize(cal.quantize(x, s), s)
    # power-of-two scale: the round trip is HiF8 rounding alone, relative error <= 2^-2 (1 mantissa
    # bit, the coarsest normal binade) for the values far from underflow
    big_enough = x.abs() > 2.0 ** -12
    assert ((back - x).abs() <= 2.0 ** -2 * x.abs())[big_enough].all()
    with pytest.raises(ValueError, match="positive"):
        cal.quantize(x, 0.0)
    with pytest.raises(ValueError, match="shape"):
        cal.quantize(x, torch.ones(2))


def test_observer_matches_the_rule_on_all_batches():
    batches = [_llm_like(seed=s, shape=(1, 2, 32, 128)) * (1 + s) for s in range(3)]
    every = torch.cat([b.reshape(-1) for b in batches])
    amax_obs = cal.ScaleObserver("amax")
    rms_obs = cal.ScaleObserver("rms")
    for b in batches:
        amax_obs.observe(b)
        rms_obs.observe(b)
    # amax is tracked exactly; the batches are below the per-batch sample size, so rms sees all values
    assert torch.equal(amax_obs.scale(), cal.amax_scale(every))
    assert torch.equal(rms_obs.scale(), cal.rms_scale(every))
    with pytest.raises(ValueError, match="no .*batch"):
        cal.ScaleObserver("rms").scale()


def test_observer_subsamples_large_batches_and_stays_close():
    obs = cal.ScaleObserver("rms", per_batch=1000, max_pool=3000)
    batches = [_llm_like(seed=s, shape=(1, 2, 64, 128)) for s in range(6)]
    for b in batches:
        obs.observe(b)
    every = torch.cat([b.reshape(-1) for b in batches])
    true_exp = math.log2(float(cal.rms_scale(every)))
    # a strided sample of a few thousand values estimates the RMS within a few %; after rounding
    # log2 the exponent can differ by at most one binade at a rounding boundary
    assert abs(math.log2(float(obs.scale())) - true_exp) <= 1


@pytest.mark.parametrize("rule", ["amax", "rms"])
def test_observer_keeps_no_view_of_a_reused_input_buffer(rule):
    """A data loader refills one buffer: the observer must have copied what it needs (the
    extreme value, the subsample), so later batches in the same buffer change nothing of the
    earlier ones. A small pool is thinned after every batch, so the first batch's maximum soon
    survives only as the extreme value (a view of it would read a later, smaller batch)."""
    batches = [_llm_like(seed=s, shape=(1, 2, 64, 128)) * (100.0 if s == 0 else 0.01) for s in range(8)]
    fresh, reused = (cal.ScaleObserver(rule, per_batch=1000, max_pool=1500) for _ in range(2))
    buffer = torch.empty_like(batches[0])
    for b in batches:
        fresh.observe(b.clone())
        buffer.copy_(b)
        reused.observe(buffer)
    buffer.fill_(1e-3)  # and overwriting it after the last batch changes nothing either
    assert torch.equal(reused.scale(), fresh.scale())
    if rule == "amax":
        every = torch.cat([b.reshape(-1) for b in batches])
        assert torch.equal(reused.scale(), cal.amax_scale(every))


def test_module_calibration_from_a_reused_buffer_freezes_the_true_amax():
    """HiF8Attention.calibrate() fed batches copied into one reused buffer (issue 9)."""
    from qfa.dropin.module import HiF8Attention

    batches = [[_llm_like(seed=3 * s + i, shape=(1, 2, 256, 128)) * (100.0 if s == 0 else 0.01) for i in range(3)]
               for s in range(8)]
    attn = HiF8Attention(calibration="amax", rotate=False, smooth_k=False)
    attn.start_calibration()
    for obs in attn._observers:  # a small, often thinned pool: the max soon lives only in the extreme
        obs.per_batch, obs.max_pool = 1000, 1500
    buffers = [torch.empty_like(t) for t in batches[0]]
    for batch in batches:
        for buf, t in zip(buffers, batch):
            buf.copy_(t)
        attn.observe(*buffers)
    attn.freeze()
    expected = cal.amax_scale(torch.cat([batch[0].reshape(-1) for batch in batches]))
    assert torch.equal(attn.q_scale, expected)


def _rms_finish_by_tensor_ops(stats: torch.Tensor) -> torch.Tensor:
    """The rms reduction's finish as float64 tensor ops (the rule's spec: 2^round(log2(sqrt(
    sumsq / count))), clamped to fp32's normal powers of two)."""
    sumsq, count = stats[0], stats[1]
    if sumsq == 0:
        return torch.ones(1)
    exponent = torch.round(torch.log2(torch.sqrt(sumsq / count))).clamp(-126, 127)
    return torch.exp2(exponent.float()).reshape(1)


def test_reduction_finishes_in_python_floats_give_the_tensor_ops_scales():
    """The reductions finish in Python floats (a tenth of the time of tensor ops): the same fp32
    scale as float64 tensor ops, on random statistics over the whole clamped range and beyond, and
    on RMS values a few ulps either side of 2^(k + 1/2), where round() decides."""
    gen = torch.Generator().manual_seed(0)
    rms = torch.exp2((torch.rand(4000, generator=gen, dtype=torch.float64) - 0.5) * 400)
    edges = torch.tensor([2.0 ** (k + 0.5) for k in range(-140, 140)], dtype=torch.float64)
    for ulps in (-3, -1, 0, 1, 3):
        rms = torch.cat([rms, edges + ulps * torch.finfo(torch.float64).eps * edges])
    for count in (1.0, 3.0, 131072.0, 7e6):
        for r in rms.tolist():
            stats = torch.tensor([r * r * count, count], dtype=torch.float64)
            assert torch.equal(cal.RMS_REDUCTION.finish(stats, "x"), _rms_finish_by_tensor_ops(stats)), (r, count)
    amax = (torch.exp2((torch.rand(2000, generator=gen) - 0.5) * 250) * torch.rand(2000, generator=gen)).float()
    for a in amax.tolist() + [0.0]:
        stats = torch.tensor([a], dtype=torch.float64)
        want = torch.ones(1) if a == 0 else (stats / fmt.MAX).float().reshape(1)
        assert torch.equal(cal.AMAX_REDUCTION.finish(stats, "x"), want), a
    with pytest.raises(ValueError, match="q contains NaN or Inf"):
        cal.RMS_REDUCTION.finish(torch.tensor([math.inf, 4.0], dtype=torch.float64), "q")
    with pytest.raises(ValueError, match="k contains NaN or Inf"):
        cal.AMAX_REDUCTION.finish(torch.tensor([math.nan], dtype=torch.float64), "k")


def test_reductions_and_observers_pickle():
    """torch.save of a module calibrating holds its observers, and so their reductions."""
    import pickle

    for reduction in (cal.AMAX_REDUCTION, cal.RMS_REDUCTION):
        back = pickle.loads(pickle.dumps(reduction))
        stats = torch.tensor([3.0, 7.0][: len(reduction.ops)], dtype=torch.float64)
        assert back.ops == reduction.ops and torch.equal(back.finish(stats, "x"), reduction.finish(stats, "x"))
        assert back.finish_value(stats.tolist(), "x") == reduction.finish_value(stats.tolist(), "x")
    obs = cal.ScaleObserver("rms")
    obs.observe(torch.randn(1000, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(pickle.loads(pickle.dumps(obs)).scale(), obs.scale())
