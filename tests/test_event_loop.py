"""The services' event loop: uvloop when installed (auto), asyncio by name, a clear error otherwise."""
from __future__ import annotations

import builtins

import pytest

from ddtree_serve.plumbing import event_loop
from launch import cli

uvloop = pytest.importorskip("uvloop")


async def _loop_name() -> str:
    return event_loop.running_loop_name()


def test_auto_runs_on_uvloop_when_it_is_installed():
    assert event_loop.run(_loop_name(), "auto") == "uvloop"


def test_asyncio_by_name_runs_on_asyncios_own_loop():
    assert event_loop.run(_loop_name(), "asyncio") == "asyncio"


def test_auto_falls_back_to_asyncio_without_uvloop(monkeypatch):
    real_import = builtins.__import__

    def no_uvloop(name, *args, **kwargs):
        if name == "uvloop":
            raise ImportError("no uvloop here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    assert event_loop.loop_factory("auto") == ("asyncio", None)
    with pytest.raises(RuntimeError, match="uvloop is not installed"):
        event_loop.loop_factory("uvloop")


def test_an_unknown_loop_is_refused():
    with pytest.raises(ValueError, match="event loop must be one of"):
        event_loop.loop_factory("trio")


def test_the_environment_sets_the_default(monkeypatch):
    monkeypatch.setenv(event_loop.ENV, "asyncio")
    assert event_loop.default_event_loop() == "asyncio"
    monkeypatch.delenv(event_loop.ENV)
    assert event_loop.default_event_loop() == "auto"


def test_every_service_takes_an_event_loop_option():
    parser = cli.build_parser()
    for command in (["target", "--model", "m"], ["drafter", "--drafter", "d", "--target-model", "m"],
                    ["gateway", "--target", "t:1", "--drafter", "d:1"]):
        args = parser.parse_args([*command, "--event-loop", "asyncio"])
        assert args.event_loop == "asyncio"
    with pytest.raises(SystemExit):
        parser.parse_args(["target", "--model", "m", "--event-loop", "trio"])

