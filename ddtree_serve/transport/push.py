"""The sender loop every transport shares: pushes go out as PushFeatures messages on one stream, in submission
order, one at a time."""
from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from ddtree_serve.plumbing.metrics.interceptors import message_recorder
from ddtree_serve.plumbing.rpc import CHANNEL_OPTIONS
from ddtree_serve.plumbing.step_socket import SocketCalls
from ddtree_serve.plumbing.step_stream import StreamedCalls
from ddtree_serve.proto import drafter_pb2, drafter_pb2_grpc
from ddtree_serve.transport.base import FeatureRows, FeatureSender

log = logging.getLogger(__name__)


@dataclass
class TransportStats:
    """Running totals a metrics exporter can read."""

    bytes_sent: int = 0
    batches_sent: int = 0
    seconds: float = 0.0
    failures: int = 0
    consecutive_failures: int = 0
    last_error: str = ""


@dataclass
class PushSender(FeatureSender):
    """One long-lived channel and one sender task, so pushes reach the drafter in submission order."""

    drafter_address: str
    timeout_s: float = 30.0
    stats: TransportStats = field(default_factory=TransportStats)
    interceptors: list = field(default_factory=list)
    on_sent: Callable[[int, float], None] | None = None   # (bytes, seconds) of each delivered push
    step_socket: str = ""   # the drafter's step socket: pushes go there instead of its gRPC stream

    def __post_init__(self) -> None:
        self._channel: grpc.aio.Channel | None = None
        self._queue: asyncio.Queue[list[FeatureRows] | None] | None = None
        self._task: asyncio.Task | None = None
        self._sending = False   # a submission is being delivered (its rows may still be read by the drafter)
        self._closed = False    # close() began: nothing new is staged or queued

    def _ensure_started(self) -> None:
        if self._task is None:
            from ddtree_serve.plumbing import auth

            self._channel = auth.internal_channel(self.drafter_address, options=CHANNEL_OPTIONS,
                                                  interceptors=self.interceptors)
            self._stub = drafter_pb2_grpc.DrafterServiceStub(self._channel)
            # One message per push on a long-lived stream (plumbing/step_stream.py), or on the drafter's step socket
            # (plumbing/step_socket.py): a push is on every step's path.
            record = message_recorder(self.interceptors)
            if self.step_socket:
                sec = auth.current()
                self._pushes = SocketCalls(self.step_socket, "DrafterService/PushFeatures",
                                           drafter_pb2.PushFeaturesResponse, sec.secret, sec.session, record)
            else:
                self._pushes = StreamedCalls(self._stub.PushFeaturesStream, "DrafterService/PushFeatures", record)
            self._queue = asyncio.Queue()
            self._task = asyncio.create_task(self._run())

    def submit(self, rows: list[FeatureRows]) -> None:
        if not rows:
            return
        self._ensure_started()
        self._queue.put_nowait(self._prepare(rows))

    def _prepare(self, rows: list[FeatureRows]) -> list[FeatureRows]:
        """Runs at submit time, on the caller's thread (a transport may mark the rows' readiness here)."""
        return rows

    def _idle(self) -> bool:
        """Nothing submitted is waiting or being delivered: the drafter has answered every push so far."""
        return not self._sending and (self._queue is None or self._queue.empty())

    async def _run(self) -> None:
        while True:
            rows = await self._queue.get()
            try:
                if rows is None:
                    return
                self._sending = True
                await self._send(rows)
            except Exception as exc:  # noqa: BLE001 - a failed push must not kill the sender
                self.stats.failures += 1
                self.stats.consecutive_failures += 1
                self.stats.last_error = str(exc)
                # A dead drafter fails every push of every step: one error line per outage, not one per push.
                if self.stats.consecutive_failures == 1:
                    log.error("%s feature push to %s failed: %s (further failures are logged at debug level until "
                              "a push succeeds)", self.name, self.drafter_address, exc)
                else:
                    log.debug("%s feature push to %s failed: %s", self.name, self.drafter_address, exc)
            finally:
                self._sending = False
                self._queue.task_done()

    async def _push(self, batch: drafter_pb2.FeatureBatch) -> drafter_pb2.PushFeaturesResponse:
        """One PushFeatures message, answered once the drafter has stored (or dropped) its rows."""
        batch.sent_unix_ns = time.time_ns()   # the drafter hands it on to the gateway's step segments
        return await self._pushes(batch, self.timeout_s)

    @abc.abstractmethod
    async def _send(self, rows: list[FeatureRows]) -> None:
        """Delivers one submission (awaits the drafter's answer)."""

    def _delivered(self, nbytes: int, seconds: float) -> None:
        if self.stats.consecutive_failures:
            log.info("%s feature push to %s works again after %d failed pushes", self.name, self.drafter_address,
                     self.stats.consecutive_failures)
            self.stats.consecutive_failures = 0
        self.stats.bytes_sent += nbytes
        self.stats.batches_sent += 1
        self.stats.seconds += seconds
        if self.on_sent is not None:
            self.on_sent(nbytes, seconds)

    async def flush(self) -> None:
        if self._queue is not None:
            await self._queue.join()

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._queue.put_nowait(None)
            await self._task
            self._pushes.close()
            await self._channel.close()
            self._task = None
        self._release()

    def _release(self) -> None:
        """Frees what the transport holds besides the channel."""
