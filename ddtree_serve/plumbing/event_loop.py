"""The event loop a service runs on: uvloop when installed, else asyncio's own.

Every engine step crosses the services' event loops several times in series (the feature push, the Draft answer,
the Verify request, and each handler's hop to its model thread and back), so the loop's own cost per wake-up and
per socket read is on the step's critical path. uvloop (libuv) does both for less: the step calls, measured through
the real services by `python -m bench.rpc_hop --event-loops asyncio,uvloop` (docs/ENGINE.md). grpc.aio, uvicorn and
the step sockets all run on either loop unchanged.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
ENV = "DDTREE_EVENT_LOOP"


def default_event_loop() -> str:
    """$DDTREE_EVENT_LOOP, else auto."""
    return os.environ.get(ENV, "auto")


def loop_factory(kind: str) -> tuple[str, Callable[[], asyncio.AbstractEventLoop] | None]:
    """(the loop that `kind` resolves to, its factory or None for asyncio's default); ValueError for an unknown kind,
    RuntimeError for uvloop asked by name and not installed."""
    if kind not in EVENT_LOOPS:
        raise ValueError(f"event loop must be one of {', '.join(EVENT_LOOPS)}, got {kind!r}")
    if kind == "asyncio":
        return "asyncio", None
    try:
        import uvloop
    except ImportError:
        if kind == "uvloop":
            raise RuntimeError("--event-loop uvloop, but uvloop is not installed (pip install uvloop)") from None
        return "asyncio", None
    return "uvloop", uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], kind: str = "auto") -> T:
    """asyncio.run(main) on the event loop `kind` names (auto: uvloop when installed)."""
    name, factory = loop_factory(kind)
    log.debug("event loop: %s", name)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def running_loop_name() -> str:
    """'uvloop' or 'asyncio': the loop this coroutine runs on (for Info and the logs)."""
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
