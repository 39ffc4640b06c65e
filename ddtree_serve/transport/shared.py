"""Shared-buffer transports (`shm`, `cuda-ipc`): rows are copied once into a staging buffer the drafter has
mapped, and the PushFeatures message carries only their offsets."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from ddtree_serve.proto import drafter_pb2
from ddtree_serve.transport.base import FeatureRows, dtype_name
from ddtree_serve.transport.push import PushSender
from ddtree_serve.transport.shared_buffer import StagingBuffer, plan_pieces

DEFAULT_STAGING_BYTES = 64 << 20   # a bigger push (a long prompt's rows) goes out in several
READY_POLLS = 32                     # event-loop turns spent polling a staging copy before waiting on a thread


@dataclass
class _Submission:
    rows: list[FeatureRows]
    ready: torch.cuda.Event | None   # recorded after the work that produced the rows (CUDA only)


@dataclass
class SharedBufferFeatureSender(PushSender):
    """Stages rows in a buffer of `staging_bytes` (allocated on first push, on the rows' device for cuda-ipc)."""

    name: str = "shm"
    staging_bytes: int = DEFAULT_STAGING_BYTES

    def __post_init__(self) -> None:
        super().__post_init__()
        self._staging: StagingBuffer | None = None
        self._copy_stream = None

    def _prepare(self, rows: list[FeatureRows]) -> _Submission:
        device = rows[0].data.device
        if device.type != "cuda":
            return _Submission(rows, None)
        # The rows come from the model thread's stream: an event recorded there now (the forward that made them
        # was queued before this call) lets the copy wait for exactly that work, on the GPU.
        ready = torch.cuda.Event()
        ready.record(torch.cuda.default_stream(device))
        return _Submission(rows, ready)

    def _buffer_for(self, device: torch.device) -> StagingBuffer:
        if self._staging is None:
            self._staging = StagingBuffer(self.name, self.staging_bytes,
                                          device if self.name == "cuda-ipc" else torch.device("cpu"))
            if self._staging.device.type == "cuda":
                self._copy_stream = torch.cuda.Stream(self._staging.device)
        return self._staging

    async def _send(self, submission: _Submission) -> None:
        rows = submission.rows
        feature_dim = int(rows[0].data.shape[1])
        if any(r.data.shape[1] != feature_dim or r.data.dtype != rows[0].data.dtype for r in rows):
            raise ValueError("rows of one push must share feature_dim and dtype")
        staging = self._buffer_for(rows[0].data.device)
        dtype = dtype_name(rows[0].data.dtype)
        row_bytes = feature_dim * rows[0].data.element_size()
        for pieces in plan_pieces([r.num_rows for r in rows], row_bytes, staging.size_bytes):
            t0 = time.perf_counter()
            nbytes = await self._stage(staging, pieces, rows, submission.ready)
            msgs = [rows[p.index].message(p.row_begin, p.row_end, dtype=dtype, shared_offset=p.offset)
                    for p in pieces]
            batch = drafter_pb2.FeatureBatch(rows=msgs, feature_dim=feature_dim, shared=staging.descriptor)
            # The drafter answers after storing the rows: only then may the next push overwrite the buffer.
            await self._push(batch)
            self._delivered(nbytes, time.perf_counter() - t0)

    async def _stage(self, staging: StagingBuffer, pieces, rows: list[FeatureRows], ready) -> int:
        if self._copy_stream is None:
            return sum(staging.write(p, rows[p.index]) for p in pieces)
        with torch.cuda.stream(self._copy_stream):
            if ready is not None:
                self._copy_stream.wait_event(ready)
            nbytes = sum(staging.write(p, rows[p.index]) for p in pieces)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        # A step's rows are a few hundred KB copied after the forward that made them has finished: the copy is
        # usually done within a few event-loop turns, and polling then spares the thread hop of a blocking wait.
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
