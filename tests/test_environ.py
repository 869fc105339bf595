"""``qfa._environ.read``: ``os.environ.get`` for the switches the hot paths read on every call,
through every way a program changes its environment."""

from __future__ import annotations

import os

import pytest

from qfa import _environ

NAME = "QFA_TEST_ENVIRON_SWITCH"


@pytest.mark.parametrize("value", ["0", "1", "", "own", "é"])
def test_read_is_os_environ_get_as_the_environment_changes(value, monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert _environ.read(NAME, "dflt") == os.environ.get(NAME, "dflt") == "dflt"
    monkeypatch.setenv(NAME, value)
    assert _environ.read(NAME, "dflt") == os.environ.get(NAME, "dflt") == value
    os.environ[NAME] = value + "x"
    assert _environ.read(NAME, "dflt") == value + "x"
    del os.environ[NAME]
    assert _environ.read(NAME, "dflt") == "dflt"
    os.environ.update({NAME: "u"})
    assert _environ.read(NAME, "dflt") == "u"
    os.environ.pop(NAME)
    assert _environ.read(NAME, "") == ""
