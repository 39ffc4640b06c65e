"""On/off switches read from the environment, one spelling for every DDTREE_* switch.

"off", "0", "false", "no" turn a default-on feature off; "on", "1", "true", "yes" turn a default-off one on;
case and surrounding spaces do not matter, and anything else (unset included) keeps the default.
"""
from __future__ import annotations

import os

_OFF = frozenset({"off", "0", "false", "no"})
_ON = frozenset({"on", "1", "true", "yes"})


def _value(name: str) -> str:
    return os.environ.get(name, "").strip().lower()


def switched_off(name: str) -> bool:
    """True when the environment variable `name` turns its default-on feature off."""
    return _value(name) in _OFF


def switched_on(name: str) -> bool:
    """True when the environment variable `name` turns its default-off feature on."""
    return _value(name) in _ON
