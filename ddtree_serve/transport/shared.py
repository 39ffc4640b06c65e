"""Shared-buffer transports (`shm`, `cuda-ipc`): rows are copied once into a staging buffer the drafter has
mapped, and the PushFeatures message carries only their offsets.

Early pushes: a verify's rows can go out while the verify still runs on the device (`stage_early`, called on the
target's model thread right after the verify is queued). The copies into the buffer are queued behind the rows'
ready event and followed by an interprocess CUDA event (cuda-ipc); the message carries an upper bound of each
sequence's rows and where the device writes (accepted rows, next token), so the drafter queues its store and its
draft behind that event and nobody's host waits for the verify in between. They use their own regions at the end
of the buffer (EARLY_REGIONS, so that the next step's push can be staged while the last one is being answered);
plain pushes use the rest.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from ddtree_serve.proto import drafter_pb2
from ddtree_serve.transport.base import EarlyRows, FeatureRows, dtype_name
from ddtree_serve.transport.push import PushSender
from ddtree_serve.transport.shared_buffer import (HEADER_BYTES, ROW_ALIGN, StagingBuffer, header_view, plan_pieces,
                                                  rows_view)

log = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 64 << 20   # a bigger push (a long prompt's rows) goes out in several
READY_SPIN_S = 0.0005                # a staging copy is polled this long without yielding, then
READY_POLLS = 32                     # event-loop turns spent polling it before waiting on a thread
EARLY_REGIONS = 2                    # early pushes staged at once (one being answered, the next step's)


@dataclass
class _Submission:
    rows: list[FeatureRows]
    ready: torch.cuda.Event | None   # recorded after the work that produced the rows (CUDA only)
    staged: tuple[int, object] | None = None   # (bytes, copy-done event or None) when staged at submit time


@dataclass
class _EarlyPush:
    """A push stage_early made: its message, ready to go, and the buffer region it holds until answered."""

    batch: drafter_pb2.FeatureBatch
    region: int
    nbytes: int
    # The copies' sources, held until the drafter has answered (so after the copies ran: it read what they wrote):
    # the caller drops them at once, and their memory must not be reused under a copy still queued.
    sources: list = field(default_factory=list)


@dataclass
class SharedBufferFeatureSender(PushSender):
    """Stages rows in a buffer of `staging_bytes` (allocated on first push, on the rows' device for cuda-ipc)."""

    name: str = "shm"
    staging_bytes: int = DEFAULT_STAGING_BYTES

    def __post_init__(self) -> None:
        super().__post_init__()
        self._staging: StagingBuffer | None = None
        self._copy_stream = None
        # Early pushes get EARLY_REGIONS eighths at the end of the buffer, plain pushes the rest.
        self._early_bytes = self.staging_bytes // 8 // ROW_ALIGN * ROW_ALIGN
        self._plain_bytes = self.staging_bytes - EARLY_REGIONS * self._early_bytes
        self._early_busy = [False] * EARLY_REGIONS
        self._lock = threading.Lock()   # stage_early runs on the model thread, the rest on the event loop
        self._ready_event = None        # cuda-ipc: the interprocess event early pushes are recorded on
        self._ready_handle = b""

    def _prepare(self, rows: list[FeatureRows]) -> _Submission:
        submission = self._submission(rows)
        device = rows[0].data.device
        ready = submission.ready
        # The push is on every step's critical path: when the sender is idle (the drafter has answered every push,
        # so nothing reads the buffer) and the rows fit it at once, stage them now rather than when the sender
        # task next runs, after the Verify answer has gone out. Whatever goes wrong here is left to the sender,
        # which fails the push (and only the push) as before.
        if self._idle() and _uniform(rows):
            try:
                pieces = self._pieces(rows)
                if len(pieces) == 1:
                    submission.staged = self._enqueue_stage(self._buffer_for(device), pieces[0], rows, ready)
            except (ValueError, RuntimeError, OSError) as exc:
                log.debug("%s: rows not staged at submit (%s); the sender stages them", self.name, exc)
        return submission

    @staticmethod
    def _submission(rows: list[FeatureRows]) -> _Submission:
        """The rows and, on CUDA, the event a copy of them waits for: the rows' own (a verify's, recorded before its
        commit was queued, so the copy runs beside the commit), else one recorded on the model thread's stream now
        (the forward that made them was queued before this call)."""
        ready = None
        device = rows[0].data.device
        if device.type == "cuda":
            ready = rows[0].ready if all(r.ready is rows[0].ready for r in rows) else None
            if ready is None:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.default_stream(device))
        return _Submission(rows, ready)

    def _pieces(self, rows: list[FeatureRows]):
        row_bytes = int(rows[0].data.shape[1]) * rows[0].data.element_size()
        return plan_pieces([r.num_rows for r in rows], row_bytes, self._plain_bytes)

    def _buffer_for(self, device: torch.device) -> StagingBuffer:
        with self._lock:
            if self._staging is None:
                self._staging = StagingBuffer(self.name, self.staging_bytes,
                                              device if self.name == "cuda-ipc" else torch.device("cpu"))
                if self._staging.device.type == "cuda":
                    self._copy_stream = torch.cuda.Stream(self._staging.device)
            return self._staging

    # ---- early pushes ------------------------------------------------------------------------------------------
    def stage_early(self, rows: list[EarlyRows]) -> _EarlyPush | None:
        """Model thread: the rows and headers copied into a free early region (queued behind their ready events on
        CUDA), and the push that describes them; None when they cannot go early (shm with CUDA rows: nothing could
        tell the drafter when the copies are done; no free region; too many rows)."""
        if not rows or self._closed:   # a closed sender (the drafter re-attached meanwhile): the plain way
            return None
        first = rows[0].data
        device = first.device
        if (device.type == "cuda") != (self.name == "cuda-ipc") or any(
                r.data.device != device or r.data.dtype != first.dtype or r.data.shape[1] != first.shape[1]
                for r in rows):
            return None
        row_bytes = int(first.shape[1]) * first.element_size()
        offsets, used = [], 0
        for r in rows:
            offsets.append(used)
            used = (used + r.data.shape[0] * row_bytes + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
        headers_at = used
        if headers_at + HEADER_BYTES * len(rows) > self._early_bytes:
            return None
        staging = self._buffer_for(device)
        if staging.device != device:
            return None
        with self._lock:
            if all(self._early_busy):
                return None
            region = self._early_busy.index(False)
            self._early_busy[region] = True
        base = self._plain_bytes + region * self._early_bytes
        dtype = dtype_name(first.dtype)
        try:
            self._copy_early(staging, rows, [base + o for o in offsets], base + headers_at, dtype)
        except BaseException:
            self._free_region(region)
            raise
        msgs = [drafter_pb2.FeatureRows(seq_id=r.seq_id, start=r.start, num_rows=r.data.shape[0], dtype=dtype,
                                        shared_offset=base + o, header_offset=base + headers_at + HEADER_BYTES * i)
                for i, (r, o) in enumerate(zip(rows, offsets))]
        batch = drafter_pb2.FeatureBatch(rows=msgs, feature_dim=int(first.shape[1]), shared=staging.descriptor,
                                         ready_event=self._ready_handle)
        return _EarlyPush(batch, region, sum(r.data.numel() for r in rows) * first.element_size(),
                          [(r.data, r.header) for r in rows])

    def _copy_early(self, staging: StagingBuffer, rows: list[EarlyRows], offsets: list[int], headers_at: int,
                    dtype: str) -> None:
        """The rows and headers into the buffer; on CUDA queued on the copy stream behind the rows' ready events,
        then the interprocess event recorded (the drafter's stream waits on it)."""
        def copy() -> None:
            for i, (r, offset) in enumerate(zip(rows, offsets)):
                rows_view(staging.tensor, offset, r.data.shape[0], r.data.shape[1], dtype).copy_(
                    r.data, non_blocking=True)
                header_view(staging.tensor, headers_at + HEADER_BYTES * i).copy_(r.header, non_blocking=True)

        if self._copy_stream is None:
            copy()
            return
        with torch.cuda.stream(self._copy_stream):
            for event in {id(r.ready): r.ready for r in rows if r.ready is not None}.values():
                self._copy_stream.wait_event(event)
            copy()
            if self._ready_event is None:
                self._ready_event = torch.cuda.Event(interprocess=True)
                self._ready_event.record(self._copy_stream)
                self._ready_handle = self._ready_event.ipc_handle()
            else:
                self._ready_event.record(self._copy_stream)

    def _free_region(self, region: int) -> None:
        with self._lock:
            self._early_busy[region] = False

    def send_staged(self, staged: _EarlyPush) -> None:
        if self._closed:   # closed between staging and now: the rows are lost, as a queued push's would be
            self._free_region(staged.region)
            return
        self._ensure_started()
        self._queue.put_nowait(staged)

    async def _send_early(self, push: _EarlyPush) -> None:
        """One early push: its rows stay in their region until the drafter has answered (its reads done)."""
        t0 = time.perf_counter()
        try:
            await self._push(push.batch)
        finally:
            self._free_region(push.region)
        self._delivered(push.nbytes, time.perf_counter() - t0)

    async def _send(self, submission: _Submission | _EarlyPush) -> None:
        if isinstance(submission, _EarlyPush):
            await self._send_early(submission)
            return
        rows = submission.rows
        feature_dim = int(rows[0].data.shape[1])
        if not _uniform(rows):
            raise ValueError("rows of one push must share feature_dim and dtype")
        staging = self._buffer_for(rows[0].data.device)
        dtype = dtype_name(rows[0].data.dtype)
        for i, pieces in enumerate(self._pieces(rows)):
            t0 = time.perf_counter()
            staged = submission.staged if i == 0 else None
            nbytes = await self._finish_stage(*(staged or self._enqueue_stage(staging, pieces, rows,
                                                                              submission.ready)))
            msgs = [rows[p.index].message(p.row_begin, p.row_end, dtype=dtype, shared_offset=p.offset)
                    for p in pieces]
            batch = drafter_pb2.FeatureBatch(rows=msgs, feature_dim=feature_dim, shared=staging.descriptor)
            # The drafter answers after storing the rows: only then may the next push overwrite the buffer.
            await self._push(batch)
            self._delivered(nbytes, time.perf_counter() - t0)

    def _enqueue_stage(self, staging: StagingBuffer, pieces, rows: list[FeatureRows], ready) -> tuple[int, object]:
        """Copies the pieces' rows into the buffer (on the GPU: queued on the copy stream after `ready`);
        returns (bytes, the copy's done event, None when the copy is already done)."""
        if self._copy_stream is None:
            return sum(staging.write(p, rows[p.index]) for p in pieces), None
        with torch.cuda.stream(self._copy_stream):
            if ready is not None:
                self._copy_stream.wait_event(ready)
            nbytes = sum(staging.write(p, rows[p.index]) for p in pieces)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        return nbytes, done

    async def _finish_stage(self, nbytes: int, done) -> int:
        """Waits until a staged copy is done; returns its bytes."""
        if done is None:
            return nbytes
        # A step's rows are a few hundred KB copied after the forward that made them has finished: the copy is
        # usually done within tens of microseconds. It is polled without yielding for a bounded time first (so the
        # push goes out before the Verify answer that yielded to it), then between event-loop turns, and only then
        # waited for on a thread (a hop that costs more than such a copy).
        deadline = time.perf_counter() + READY_SPIN_S
        while time.perf_counter() < deadline:
            if done.query():
                return nbytes
        for _ in range(READY_POLLS):
            if done.query():
                return nbytes
            await asyncio.sleep(0)
        await asyncio.to_thread(done.synchronize)   # off the event loop: the copy may queue behind a forward
        return nbytes

    def _release(self) -> None:
        if self._staging is not None:
            self._staging.close()
            self._staging = None


def _uniform(rows: list[FeatureRows]) -> bool:
    """All rows of a push share one feature width and dtype (a push is one buffer layout)."""
    first = rows[0].data
    return all(r.data.shape[1] == first.shape[1] and r.data.dtype == first.dtype for r in rows)
