"""Coroutines waiting for a condition on the event loop's own state, woken the moment it holds.

The drafter's Draft waits until the target's features (and the draft made from them) have arrived. An
asyncio.Condition does this with a lock to re-acquire and, before Python 3.12, a task per wait_for: several turns
of the event loop between the push that completes a sequence's context and the Draft that answers from it, on the
engine step's critical path (~0.2 ms measured on a 2-vCPU box). Here a waiter is a bare future, resolved by the
wake() that finds its predicate true: the waiting coroutine runs on the next turn.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from ddtree_serve.plumbing.step_stream import within


class Waiters:
    """Futures waiting for predicates over loop-owned state; wake() after every change that may satisfy one."""

    def __init__(self) -> None:
        self._waiting: list[tuple[Callable[[], bool], asyncio.Future]] = []

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Returns once predicate() holds (checked now, then at each wake()); asyncio.TimeoutError after timeout s."""
        if predicate():
            return
        entry = (predicate, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            await within(entry[1], timeout)
        finally:
            self._waiting.remove(entry)

    def wake(self) -> None:
        """Resolves every waiter whose predicate now holds (in the order they began waiting)."""
        for predicate, future in self._waiting:
            if not future.done() and predicate():
                future.set_result(None)

    def __len__(self) -> int:
        return len(self._waiting)
