"""The one thread a model service runs its model work on, handed work by the event loop.

Every Verify, Prefill, PushFeatures and (un-prefetched) Draft crosses to this thread and back, so the crossing is
on each RPC's path. A ThreadPoolExecutor via `loop.run_in_executor` did the same job with more machinery per item
(a concurrent future chained to an asyncio future, the pool's idle-thread bookkeeping); this thread takes
(future, fn, args) off a queue and hands the result back with one `call_soon_threadsafe`. bench/rpc_hop.py
measured an RPC that crosses once ~0.1 ms faster on a 2-core CPU box (see bench/README.md).
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

_STOP = None   # queued by shutdown(): the thread ends after the work before it


class ModelThreadStopped(RuntimeError):
    """Work handed to a model thread that was shut down (the service is stopping)."""


class ModelThread:
    """One dedicated thread for a service's model work: device work stays serialised, the event loop stays free."""

    def __init__(self, name: str, on_error: Callable[[BaseException], None] | None = None):
        self.name = name
        self.on_error = on_error   # called on this thread with each failure of a work item (diagnostics)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped = False

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs fn(*args) on the model thread and awaits its result."""
        return await self.submit(fn, *args)

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Queues fn(*args) on the model thread now (behind the work already queued) without awaiting it."""
        if self._stopped:
            raise ModelThreadStopped("cannot schedule new work after shutdown")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if self._thread is None:
            # Daemon: a service that fails before close() must still be able to exit.
            self._thread = threading.Thread(target=self._work, name=f"{self.name}_0", daemon=True)
            self._thread.start()
        self._queue.put((loop, future, fn, args))
        return future

    def shutdown(self) -> None:
        """Cancels the work not yet started; the thread ends after the item it is running (not waited for)."""
        self._stopped = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                loop, future = item[0], item[1]
                try:
                    loop.call_soon_threadsafe(future.cancel)
                except RuntimeError:   # its loop is closed: nobody awaits it
                    pass
        self._queue.put(_STOP)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            loop, future, fn, args = item
            if future.cancelled():   # its caller gave up before it started (as a pool skips a cancelled future)
                continue
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # noqa: BLE001 - every failure goes back to the awaiting caller
                result, error = None, exc
                if self.on_error is not None:
                    try:
                        self.on_error(exc)
                    except Exception:  # noqa: BLE001 - a diagnostic hook must not stop the thread
                        pass
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:   # the loop closed meanwhile: nobody is waiting any more
                return


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """On the event loop: hands the outcome to the awaiting caller unless it was cancelled meanwhile."""
    if future.cancelled():
        return
    if error is None:
        future.set_result(result)
    elif isinstance(error, StopIteration):   # a future cannot hold StopIteration (it would end a generator)
        future.set_exception(RuntimeError(f"StopIteration raised on the model thread: {error!r}"))
    else:
        future.set_exception(error)
