"""The model thread: one thread, work in submission order, results and errors back to the awaiting caller."""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from ddtree_serve.plumbing.model_thread import ModelThread, ModelThreadStopped
from ddtree_serve.plumbing.rpc import status_for


def test_work_runs_in_order_on_one_thread_that_is_not_the_event_loops():
    async def main():
        mt = ModelThread("model")
        seen = []

        def work(i):
            seen.append((i, threading.get_ident()))
            return i * 2

        results = await asyncio.gather(*(mt.run(work, i) for i in range(20)))
        mt.shutdown()
        return results, seen, threading.get_ident()

    results, seen, loop_thread = asyncio.run(main())
    assert results == [i * 2 for i in range(20)]
    assert [i for i, _ in seen] == list(range(20))
    assert len({t for _, t in seen}) == 1 and seen[0][1] != loop_thread


def test_an_error_on_the_model_thread_reaches_the_caller_and_the_thread_goes_on():
    async def main():
        mt = ModelThread("model")
        with pytest.raises(KeyError, match="gone"):
            await mt.run(lambda: {}["gone"])
        with pytest.raises(RuntimeError, match="StopIteration"):
            await mt.run(next, iter(()))
        return await mt.run(sum, [1, 2, 3])

    assert asyncio.run(main()) == 6


def test_work_whose_caller_gave_up_before_it_started_is_skipped():
    async def main():
        mt = ModelThread("model")
        ran = []
        first = mt.submit(time.sleep, 0.2)
        second = mt.submit(ran.append, "second")
        second.cancel()
        await first
        await mt.run(ran.append, "third")
        return ran

    assert asyncio.run(main()) == ["third"]


def test_shutdown_cancels_the_queued_work_and_refuses_new_work():
    async def main():
        mt = ModelThread("model")
        running = mt.submit(time.sleep, 0.2)
        queued = mt.submit(lambda: "never")
        await asyncio.sleep(0.05)
        mt.shutdown()
        await asyncio.sleep(0.3)
        with pytest.raises(ModelThreadStopped, match="shutdown"):
            mt.submit(int)
        return running.done() and not running.cancelled(), queued.cancelled()

    assert asyncio.run(main()) == (True, True)


def test_a_call_refused_by_a_stopped_model_thread_is_unavailable_not_an_internal_error():
    code, message = status_for(ModelThreadStopped("cannot schedule new work after shutdown"))
    assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in message


def test_the_error_hook_sees_each_failure_on_the_model_thread_and_a_failing_hook_stops_nothing():
    seen = []

    def hook(exc):
        seen.append((type(exc).__name__, threading.get_ident()))
        raise RuntimeError("the hook itself failed")

    async def main():
        mt = ModelThread("model", on_error=hook)
        with pytest.raises(KeyError):
            await mt.run(lambda: {}["gone"])
        worker = await mt.run(threading.get_ident)
        result = await mt.run(sum, [1, 2, 3])
        mt.shutdown()
        return worker, result

    worker, result = asyncio.run(main())
    assert seen == [("KeyError", worker)] and result == 6
