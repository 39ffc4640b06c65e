"""Base for an object whose `run()` coroutine runs as a background asyncio task: started once, stopped by cancelling."""
from __future__ import annotations

import asyncio


class BackgroundTask:
    """`start()` runs `self.run()` as a task named `self.task_name`; `await stop()` cancels it and waits for its end."""

    task_name = "background"
    _task: asyncio.Task | None = None

    async def run(self) -> None:
        """The work; subclasses loop here until cancelled."""
        raise NotImplementedError

    def start(self) -> None:
        """Starts `run()` in the running event loop."""
        self._task = asyncio.create_task(self.run(), name=self.task_name)

    async def stop(self) -> None:
        """Cancels `run()` and waits until it has ended, so nothing of it runs afterwards; a no-op before `start()`."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
