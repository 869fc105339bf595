"""The public API, pinned: the names users import today keep working after the module moves of
issue 19, and each old module path is the same module object as its new one."""

from __future__ import annotations

import importlib
import sys

import pytest

import qfa
from qfa._moved import MOVED

TOP_LEVEL = ["HiF8Attention", "decode_from_hifloat8", "encode_to_hifloat8", "fp8_attention", "hif8_attention",
             "mxfp8_attention", "quant_flash_attn", "quant_flash_attn_metadata"]


def test_qfa_exports_exactly_its_documented_names():
    assert sorted(qfa.__all__) == sorted(TOP_LEVEL)
    for name in TOP_LEVEL:
        assert callable(getattr(qfa, name)), name


@pytest.mark.parametrize("name", ["HiF8Attention", "hif8_attention", "mxfp8_attention", "fp8_attention"])
def test_drop_in_names_are_one_object_wherever_imported(name):
    import qfa.attention
    import qfa.dropin

    assert getattr(qfa.attention, name) is getattr(qfa.dropin, name) is getattr(qfa, name)


def test_calibration_is_importable_from_the_attention_package():
    import qfa.attention
    import qfa.dropin.calibration

    from qfa.attention import calibration

    assert calibration is qfa.attention.calibration is qfa.dropin.calibration


def test_an_unknown_attribute_of_the_attention_package_is_an_attribute_error():
    import qfa.attention

    with pytest.raises(AttributeError, match="no_such_name"):
        qfa.attention.no_such_name  # noqa: B018


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_old_path_is_the_new_module(old):
    new = MOVED[old]
    old_module = importlib.import_module(old)
    new_module = importlib.import_module(new)
    assert old_module is new_module
    assert new_module.__name__ == new and new_module.__spec__.name == new
    assert sys.modules[old] is new_module


def test_a_monkeypatch_through_the_old_path_is_seen_through_the_new(monkeypatch):
    import qfa.attention.backends.cpu_kernel as new
    import qfa.attention.cpu_kernel as old

    monkeypatch.setattr("qfa.attention.cpu_kernel.TILE_ROWS", 7)
    assert new.TILE_ROWS == 7 and old.TILE_ROWS == 7


def test_moves_cover_the_old_flat_attention_package_and_nothing_else():
    olds = {name.rsplit(".", 1)[1] for name in MOVED}
    assert all(name.startswith("qfa.attention.") for name in MOVED)
    assert {"dropin", "dropin_module", "calibration", "torch_path", "cpu_kernel"} <= olds
    for name in ("op", "custom_ops", "nz_layout", "wording"):  # stayed where they were
        assert f"qfa.attention.{name}" not in MOVED
        importlib.import_module(f"qfa.attention.{name}")
