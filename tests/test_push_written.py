"""A push is written before the Verify answer goes out: PushSender.wait_written, against a real step socket whose
PushFeatures handler holds its answer (a drafter busy storing the rows)."""
from __future__ import annotations

import asyncio

import torch

from ddtree_serve.plumbing import auth
from ddtree_serve.plumbing.step_socket import StepMethod, StepSocketServer
from ddtree_serve.proto import drafter_pb2
from ddtree_serve.transport import FeatureRows
from ddtree_serve.transport.inline import InlineFeatureSender

PUSH = "DrafterService/PushFeatures"


class HeldDrafter:
    """A PushFeatures handler that records each push as it arrives and answers only once released."""

    def __init__(self) -> None:
        self.arrived: list[drafter_pb2.FeatureBatch] = []
        self.release = asyncio.Event()

    async def PushFeatures(self, request, context):
        self.arrived.append(request)
        await self.release.wait()
        return drafter_pb2.PushFeaturesResponse(bytes=1)


def rows(seq_id: str) -> list[FeatureRows]:
    return [FeatureRows(seq_id, 0, torch.ones(2, 4), next_token=7)]


async def held_sender(path, sender_type: type = InlineFeatureSender
                      ) -> tuple[InlineFeatureSender, HeldDrafter, StepSocketServer]:
    drafter = HeldDrafter()
    server = StepSocketServer(path, [StepMethod(PUSH, drafter_pb2.FeatureBatch, drafter.PushFeatures)], None,
                              auth.SESSION_HEADER)
    await server.start()
    sender = sender_type(drafter_address="unix:/nonexistent/unused.sock", step_socket=str(path), timeout_s=5.0)
    return sender, drafter, server


async def timed_wait(sender, timeout_s: float) -> tuple[bool, float]:
    """(wait_written's answer, seconds it took)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    written = await sender.wait_written(timeout_s)
    return written, loop.time() - t0


def test_wait_written_returns_once_the_push_is_on_the_wire_not_once_it_is_answered(tmp_path):
    async def go():
        sender, drafter, server = await held_sender(tmp_path / "d.sock")
        try:
            sender.submit(rows("a"))
            written = await sender.wait_written(5.0)
            arrived = len(drafter.arrived)
            await asyncio.sleep(0.05)
            answered_meanwhile = sender._idle()   # noqa: SLF001
            drafter.release.set()
            await sender.flush()
            return written, arrived, answered_meanwhile, sender._idle()   # noqa: SLF001
        finally:
            drafter.release.set()
            await sender.close()
            await server.close()

    written, arrived_at_return, answered_meanwhile, idle_at_end = asyncio.run(go())
    assert written is True
    assert answered_meanwhile is False and idle_at_end is True
    # The message left before wait_written returned; the handler may see it a moment later.
    assert arrived_at_return in (0, 1)


def test_a_push_queued_behind_an_unanswered_one_is_not_waited_for(tmp_path):
    """The Verify answer must not wait out a stalled drafter: only a push that found the sender idle is waited for."""
    async def go():
        sender, drafter, server = await held_sender(tmp_path / "d.sock")
        try:
            sender.submit(rows("a"))
            await sender.wait_written(5.0)
            sender.submit(rows("b"))                       # the first is still unanswered
            second, waited = await timed_wait(sender, 5.0)
            drafter.release.set()
            await sender.flush()
            return second, waited, [b.rows[0].seq_id for b in drafter.arrived]
        finally:
            drafter.release.set()
            await sender.close()
            await server.close()

    second, waited, order = asyncio.run(go())
    assert second is True and waited < 1.0
    assert order == ["a", "b"]


class SlowStagingSender(InlineFeatureSender):
    """An inline sender whose staging (before the message exists) takes until `staged` is set, as a GPU copy
    queued behind a long forward would."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.staged = asyncio.Event()

    async def _send(self, rows) -> None:
        await self.staged.wait()
        await super()._send(rows)


def test_wait_written_gives_up_after_its_timeout_while_the_push_is_not_ready(tmp_path):
    async def go():
        sender, drafter, server = await held_sender(tmp_path / "d.sock", SlowStagingSender)
        drafter.release.set()
        try:
            sender.submit(rows("a"))
            written, waited = await timed_wait(sender, 0.05)
            sender.staged.set()
            await sender.flush()
            return written, waited, len(drafter.arrived)
        finally:
            sender.staged.set()
            await sender.close()
            await server.close()

    written, waited, delivered = asyncio.run(go())
    assert written is False
    assert 0.04 <= waited < 1.0
    assert delivered == 1   # late, but delivered


def test_a_failed_push_releases_its_waiter(tmp_path):
    """No drafter at the socket path: the delivery fails at once, and whoever waits for it is let go, not hung."""
    async def go():
        sender = InlineFeatureSender(drafter_address="unix:/nonexistent/unused.sock",
                                     step_socket=str(tmp_path / "nobody.sock"), timeout_s=0.5)
        try:
            sender.submit(rows("a"))
            return await sender.wait_written(5.0), sender.stats.failures
        finally:
            await sender.close()

    written, failures = asyncio.run(go())
    assert written is True and failures == 1
