"""plumbing.waiters: a coroutine waiting for a predicate over loop state resumes once a wake() finds it true."""
from __future__ import annotations

import asyncio

import pytest

from ddtree_serve.plumbing.waiters import Waiters


def test_a_waiter_resumes_on_the_wake_that_finds_its_predicate_true_and_not_before():
    async def go():
        waiters, state, order = Waiters(), {"rows": 0}, []

        async def draft(need: int):
            await waiters.wait_for(lambda: state["rows"] >= need, timeout=5)
            order.append(need)

        tasks = [asyncio.create_task(draft(n)) for n in (3, 1)]
        await asyncio.sleep(0)
        assert len(waiters) == 2
        state["rows"] = 2
        waiters.wake()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert order == [1] and len(waiters) == 1
        state["rows"] = 3
        waiters.wake()
        await asyncio.gather(*tasks)
        return order, len(waiters)

    assert asyncio.run(go()) == ([1, 3], 0)


def test_a_predicate_already_true_returns_at_once_and_an_unmet_one_times_out_without_leaving_a_waiter():
    async def go():
        waiters = Waiters()
        await waiters.wait_for(lambda: True, timeout=0.01)
        with pytest.raises(asyncio.TimeoutError):
            await waiters.wait_for(lambda: False, timeout=0.05)
        return len(waiters)

    assert asyncio.run(go()) == 0


def test_a_cancelled_waiter_is_removed_and_later_wakes_skip_it():
    async def go():
        waiters = Waiters()
        task = asyncio.create_task(waiters.wait_for(lambda: False, timeout=5))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        waiters.wake()
        return len(waiters)

    assert asyncio.run(go()) == 0
