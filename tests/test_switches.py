"""Environment switches (ddtree_serve/switches.py): one spelling for every DDTREE_* on/off variable."""
from __future__ import annotations

import pytest

from ddtree_serve.switches import switched_off, switched_on

NAME = "DDTREE_TEST_SWITCH"


@pytest.mark.parametrize("value", ["off", "0", "false", "no", " OFF ", "No"])
def test_off_spellings_turn_a_default_on_feature_off(monkeypatch, value):
    monkeypatch.setenv(NAME, value)
    assert switched_off(NAME) and not switched_on(NAME)


@pytest.mark.parametrize("value", ["on", "1", "true", "yes", " On", "TRUE "])
def test_on_spellings_turn_a_default_off_feature_on(monkeypatch, value):
    monkeypatch.setenv(NAME, value)
    assert switched_on(NAME) and not switched_off(NAME)


@pytest.mark.parametrize("value", [None, "", "auto", "enabled", "2"])
def test_unset_or_unknown_values_keep_the_default(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(NAME, raising=False)
    else:
        monkeypatch.setenv(NAME, value)
    assert not switched_on(NAME) and not switched_off(NAME)
