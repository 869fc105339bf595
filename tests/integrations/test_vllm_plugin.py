"""The vLLM plugin's contract pieces without an engine: ``engine_kwargs``, the options, which
layers qfa runs, the calibration file, tensor-parallel head ownership, the entry points."""

from __future__ import annotations

import json
import math
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch

from qfa.dropin import calibration as cal
from qfa.integrations.vllm import Options, calibration_file, engine_kwargs
from qfa.integrations.vllm import options as opts
from qfa.integrations.vllm import support
from qfa.integrations.vllm.calibration_file import CalibrationFileError, ModelShape, rank_heads
from qfa.integrations.vllm.layer_state import LayerState, Transform, key_mean

# ---------------------------------------------------------------------------- engine_kwargs


def test_engine_kwargs_hif8_selects_the_backend_and_the_one_byte_cache():
    kw = engine_kwargs()
    assert kw["attention_backend"] == "CUSTOM" and kw["kv_cache_dtype"] == "fp8"
    assert kw["additional_config"]["qfa"] == Options().as_config()
    assert Options.parse(kw["additional_config"]["qfa"]) == Options()


def test_engine_kwargs_bf16_leaves_vllm_alone():
    assert engine_kwargs("bf16") == {}
    with pytest.raises(ValueError, match="calibration and qfa options do not apply"):
        engine_kwargs("bf16", rule="amax")


@pytest.mark.parametrize("bad, error, match", [
    ({"kv_cache": "fp16"}, ValueError, "kv_cache must be one of"),
    ({"rule": "nope"}, ValueError, r"rule must be one of \[.*'rms'.*\].*got 'nope'"),
    ({"rule": cal.rms_scale}, TypeError, "rule must be a calibration rule's name"),
    ({"smooth_k": 1}, TypeError, "smooth_k must be a bool"),
    ({"q_scale": "token"}, ValueError, "q_scale must be one of"),
    ({"colour": "red"}, ValueError, r"unknown option\(s\) \['colour'\]"),
])
def test_engine_kwargs_rejects_bad_options_by_name(bad, error, match):
    with pytest.raises(error, match=match):
        engine_kwargs(**bad)


def test_engine_kwargs_reads_the_file_and_refuses_a_bad_one(tmp_path):
    with pytest.raises(CalibrationFileError, match="does not exist"):
        engine_kwargs(calibration=tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CalibrationFileError, match="cannot be read as JSON"):
        engine_kwargs(calibration=bad)
    good = _write_file(tmp_path / "good.json")
    kw = engine_kwargs(calibration=good)
    assert kw["additional_config"]["qfa"]["calibration_file"] == str(good.resolve())


def test_engine_kwargs_refuses_a_target_device_that_skips_platform_plugins(monkeypatch):
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    with pytest.raises(RuntimeError, match="VLLM_TARGET_DEVICE=cpu"):
        engine_kwargs()


def test_from_vllm_config_is_none_unless_custom_was_asked_for():
    custom = SimpleNamespace(attention_config=SimpleNamespace(backend=SimpleNamespace(name="CUSTOM")),
                             additional_config={"qfa": {"rule": "amax"}})
    assert opts.from_vllm_config(custom) == Options(rule="amax")
    other = SimpleNamespace(attention_config=SimpleNamespace(backend=None), additional_config={})
    assert opts.from_vllm_config(other) is None


# ---------------------------------------------------------------------------- which layers


def selector(**changes):
    base = dict(head_size=128, kv_cache_dtype="fp8", use_mla=False, use_sparse=False, has_sink=False,
                has_sliding_window=False, attn_type="decoder", use_non_causal=False, use_mm_prefix=False)
    return SimpleNamespace(**{**base, **changes})


@pytest.mark.parametrize("changes, reason", [
    ({}, None),
    ({"kv_cache_dtype": "auto"}, "kv_cache_dtype 'auto'"),
    ({"head_size": 64}, "head size 64"),
    ({"has_sliding_window": True}, "a sliding window"),
    ({"has_sink": True}, "attention sinks"),
    ({"attn_type": "encoder_only"}, "attention type"),
    ({"use_mla": True}, "MLA"),
])
def test_unsupported_reason(changes, reason):
    found = support.unsupported_reason(selector(**changes))
    assert found == reason if reason is None else reason in found


def model_config(layers=4, head=128, layer_types=None, **text):
    hf = SimpleNamespace(layer_types=layer_types, **text)
    return SimpleNamespace(hf_text_config=hf, get_total_num_hidden_layers=lambda: layers,
                           get_head_size=lambda: head, get_total_num_kv_heads=lambda: 2)


def test_handed_back_layers_from_the_model_config():
    assert support.handed_back_layers(model_config()) == {}
    mixed = support.handed_back_layers(model_config(layer_types=["full_attention", "sliding_attention"] * 2))
    assert mixed == {1: "a sliding window", 3: "a sliding window"}
    assert set(support.handed_back_layers(model_config(head=64)).values()) == {"head size 64 (the HiF8 op takes 128)"}
    assert len(support.handed_back_layers(model_config(attn_logit_softcapping=30.0))) == 4


def test_ranges_are_short():
    assert support._ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


# ---------------------------------------------------------------------------- layer state


def test_layer_state_measure_is_the_rule_on_the_prepared_tokens():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(40, 2, 128, generator=g) * 3 + 5
    v = torch.randn(40, 2, 128, generator=g)
    state = LayerState.measure(k, v, Transform(), cal.get_rule("rms"))
    mean = k.mean(0)
    assert torch.allclose(state.k_mean, mean, atol=1e-5)
    from qfa.dropin import rotation

    assert torch.equal(state.k_scale, cal.rms_scale(rotation.rotate(k - state.k_mean)))
    assert torch.equal(state.v_scale, cal.rms_scale(rotation.rotate(v)))
    codes, sat = state.encode_keys(k)
    assert torch.equal(codes, cal.quantize(rotation.rotate(k - state.k_mean), state.k_scale)) and int(sat) == 0
    plain = LayerState.measure(k, v, Transform(smooth_k=False, rotate=False), cal.get_rule("rms"))
    assert plain.k_mean is None and torch.equal(plain.k_scale, cal.rms_scale(k))


def test_non_finite_first_tokens_neither_raise_nor_enter_the_state():
    k = torch.ones(4, 2, 128)
    k[1, 0, 3] = float("nan")
    k[2, 1, 5] = float("inf")
    mean = key_mean(k)
    assert torch.isfinite(mean).all() and float(mean[0, 3]) == 1.0
    state = LayerState.measure(k, torch.ones(4, 2, 128), Transform(rotate=False), cal.get_rule("rms"))
    assert math.isfinite(float(state.k_scale))


# ---------------------------------------------------------------------------- calibration file


def _write_file(path, layers=2, heads=2, smooth_k=True):
    g = torch.Generator().manual_seed(1)
    states = [LayerState(torch.tensor([0.5]), torch.tensor([0.25]),
                         torch.randn(heads, 128, generator=g) if smooth_k else None,
                         Transform(smooth_k=smooth_k), q_scale=torch.tensor([2.0])) for _ in range(layers)]
    calibration_file.write(path, ModelShape(layers, heads, 128), states, rule="rms", tokens=64)
    return path


def test_calibration_file_round_trip_and_rank_slices(tmp_path):
    path = _write_file(tmp_path / "c.json", heads=4)
    found = calibration_file.load(path)
    assert found.shape == ModelShape(2, 4, 128) and found.transform == Transform() and found.tokens == 64
    whole = found.layer_state(1, range(4))
    part = found.layer_state(1, rank_heads(4, 2, 1))
    assert torch.equal(part.k_mean, whole.k_mean[2:]) and float(part.q_scale) == 2.0
    found.check_matches(ModelShape(2, 4, 128))


@pytest.mark.parametrize("shape, words", [
    (ModelShape(3, 2, 128), "num_layers 2 in the file, 3 in the model"),
    (ModelShape(2, 8, 128), "num_kv_heads 2 in the file, 8 in the model"),
    (ModelShape(2, 2, 64), "head_dim 128 in the file, 64 in the model"),
])
def test_a_file_for_another_model_names_the_file_and_the_mismatch(tmp_path, shape, words):
    path = _write_file(tmp_path / "c.json")
    with pytest.raises(CalibrationFileError, match=words) as info:
        calibration_file.load(path).check_matches(shape)
    assert str(path) in str(info.value)


def test_a_file_measured_with_another_transform_is_refused(tmp_path):
    found = calibration_file.load(_write_file(tmp_path / "c.json"))
    with pytest.raises(CalibrationFileError, match="rotate=True.*rotate=False"):
        found.check_transform(Transform(rotate=False))


@pytest.mark.parametrize("edit, words", [
    (lambda d: d.update(format="other"), "is not a qfa-hif8-kv-calibration file"),
    (lambda d: d.update(version=9), "version 9"),
    (lambda d: d["layers"].pop(), "says 2 layers but holds 1"),
    (lambda d: d["layers"][0].update(k_scale=-1), "layer 0: k_scale must be a positive finite number"),
    (lambda d: d["layers"][1].update(v_scale=float("nan")), "layer 1: v_scale"),
    (lambda d: d["layers"][0].update(q_scale=0), "layer 0: q_scale"),
    (lambda d: d["layers"][0]["k_mean"].pop(), r"k_mean must be 2 x 128"),
    (lambda d: d.pop("model"), "lacks a field"),
])
def test_malformed_files_are_refused_with_what_is_wrong(tmp_path, edit, words):
    path = _write_file(tmp_path / "c.json")
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(CalibrationFileError, match=words):
        calibration_file.load(path)


def test_rank_heads_split_and_replicate_like_vllm():
    assert [rank_heads(4, 2, r) for r in range(2)] == [[0, 1], [2, 3]]
    assert [rank_heads(2, 4, r) for r in range(4)] == [[0], [0], [1], [1]]
    assert rank_heads(2, 1, 0) == [0, 1]


# ---------------------------------------------------------------------------- installation


def test_entry_points_are_installed():
    general = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    platform = {e.name: e.value for e in entry_points(group="vllm.platform_plugins")}
    assert general.get("qfa") == "qfa.integrations.vllm:register"
    assert platform.get("qfa") == "qfa.integrations.vllm:platform_plugin"


def test_the_package_imports_no_vllm_until_a_plugin_runs():
    import subprocess
    import sys

    code = ("import sys, qfa.integrations.vllm as p; p.engine_kwargs(); "
            "print(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
