"""BackgroundTask: the start/stop life of the gateway's per-pair engine and watch loops."""
from __future__ import annotations

import asyncio

from ddtree_serve.plumbing.background import BackgroundTask


class Ticker(BackgroundTask):
    """Counts until cancelled, and notes that it saw the cancellation."""

    def __init__(self) -> None:
        self.task_name = "ticker-0"
        self.ticks = 0
        self.cancelled = False

    async def run(self) -> None:
        try:
            while True:
                self.ticks += 1
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.cancelled = True
            raise


def test_start_runs_the_loop_under_its_name_and_stop_ends_it() -> None:
    async def scenario() -> None:
        t = Ticker()
        t.start()
        assert any(task.get_name() == "ticker-0" for task in asyncio.all_tasks())
        await asyncio.sleep(0.01)
        assert t.ticks > 0
        await t.stop()
        assert t.cancelled
        ticks = t.ticks
        await asyncio.sleep(0.01)
        assert t.ticks == ticks                     # nothing of it runs after stop() returns
        assert not any(task.get_name() == "ticker-0" for task in asyncio.all_tasks())

    asyncio.run(scenario())


def test_stop_before_start_and_a_second_stop_do_nothing() -> None:
    async def scenario() -> None:
        t = Ticker()
        await t.stop()
        t.start()
        await asyncio.sleep(0)
        await t.stop()
        await t.stop()
        assert t.cancelled

    asyncio.run(scenario())


def test_stop_right_after_start_ends_the_task_before_it_ran() -> None:
    async def scenario() -> None:
        t = Ticker()
        t.start()
        await t.stop()
        assert t.ticks == 0 and not any(task.get_name() == "ticker-0" for task in asyncio.all_tasks())

    asyncio.run(scenario())
