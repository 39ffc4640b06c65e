"""The nccl transport (`--transport nccl`): target and drafter on different GPUs share a two-rank CuPy NCCL
communicator, formed at attach time; every push is a PushFeatures header plus one NCCL send -> recv.

`NcclComm` is the only code that touches cupy (imported lazily, cupy-cuda12x or cupy-cuda13x alike); the sender
(target) and receiver (drafter) drive it with the GPU-free protocol of nccl_protocol.py.
"""
from __future__ import annotations

import asyncio
import ctypes
import glob
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from ddtree_serve.proto import drafter_pb2
from ddtree_serve.transport.nccl_protocol import (DEFAULT_JOIN_TIMEOUT_S, DRAFTER_RANK, TARGET_RANK, WORLD_SIZE,
                                                  NcclHeader, NcclLinkLost, NcclSetupError, ReceiveOrder,
                                                  SendLedger, cupy_package, decode_header, encode_header, lost_header,
                                                  plan_nccl_pushes, uid_from_bytes, uid_to_bytes)
from ddtree_serve.transport.shared import DEFAULT_STAGING_BYTES, SharedBufferFeatureSender
from ddtree_serve.transport.shared_buffer import copy_piece

log = logging.getLogger(__name__)

OPENED_LINKS = 4   # communicators a drafter keeps (a restarted target forms a new one)


def _preload_torch_nccl() -> None:
    # torch's CUDA wheels ship libnccl.so.2 in the nvidia-nccl package; loading it globally first lets cupy's NCCL
    # bindings resolve against the same library when the CUDA toolkit's own copy is not on the loader path.
    try:
        import nvidia.nccl

        for path in glob.glob(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so*")):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return
    except (ImportError, OSError, IndexError):
        pass


def load_nccl() -> Any:
    """cupy.cuda.nccl, imported on first use with NVLink multicast off; NcclSetupError names what to install."""
    # Never NVLink SHARP / multicast (NVLS): the lent machines forbid it, and two ranks gain nothing from it.
    # NCCL reads the variable when it initialises, which is after this point.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    _preload_torch_nccl()
    hint = f"install {cupy_package()} (pip install 'ddtree-serve[gpu]'; cupy-cuda12x or cupy-cuda13x both work)"
    try:
        import cupy  # noqa: F401 - either wheel provides the `cupy` package
        import cupy.cuda
        from cupy.cuda import nccl
    except ImportError as exc:
        raise NcclSetupError(f"transport nccl needs CuPy with NCCL: {hint} ({exc})") from None
    if not getattr(cupy.cuda, "nccl_enabled", True):
        raise NcclSetupError(f"CuPy is installed but finds no NCCL library: {hint}, and NCCL (pip install "
                             f"nvidia-nccl-cu{cupy_package()[9:11]})")
    return nccl


def new_unique_id() -> bytes:
    """A fresh ncclUniqueId (rank 0 makes it; its bootstrap listener runs in this process)."""
    return uid_to_bytes(load_nccl().get_unique_id())


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class NcclComm:
    """One rank of a two-rank communicator on one GPU, with a dedicated CUDA stream for its sends and receives."""

    def __init__(self, unique_id: bytes, rank: int, device: torch.device, world_size: int = WORLD_SIZE):
        """Joins the communicator; blocks until every rank has joined (call it off the event loop)."""
        import cupy

        self._nccl = load_nccl()
        self.rank, self.device = rank, torch.device("cuda", _device_index(torch.device(device)))
        with cupy.cuda.Device(self.device.index):
            try:
                self._comm = self._nccl.NcclCommunicator(world_size, uid_from_bytes(unique_id, True), rank)
            except OverflowError:   # a platform whose C char is unsigned (Arm)
                self._comm = self._nccl.NcclCommunicator(world_size, uid_from_bytes(unique_id, False), rank)
        self.stream = torch.cuda.Stream(self.device)
        self._aborted = False

    def _nccl_dtype(self, dtype: str) -> int:
        n = self._nccl
        # Point-to-point copies move bits: a 16-bit type NCCL lacks (bf16 before NCCL 2.10) travels as float16.
        return {"float32": n.NCCL_FLOAT32, "float16": n.NCCL_FLOAT16,
                "bfloat16": getattr(n, "NCCL_BFLOAT16", n.NCCL_FLOAT16)}[dtype]

    def send(self, buffer: torch.Tensor, count: int, dtype: str, peer: int,
             after: torch.cuda.Event | None = None) -> torch.cuda.Event:
        """Queues a send of `count` elements from the start of `buffer`; returns the event of its completion."""
        return self._p2p(self._comm.send, buffer, count, dtype, peer, after)

    def recv(self, buffer: torch.Tensor, count: int, dtype: str, peer: int) -> torch.cuda.Event:
        """Queues a receive of `count` elements into the start of `buffer`; returns the event of its completion."""
        return self._p2p(self._comm.recv, buffer, count, dtype, peer, None)

    def _p2p(self, op: Callable, buffer: torch.Tensor, count: int, dtype: str, peer: int,
             after: torch.cuda.Event | None) -> torch.cuda.Event:
        import cupy

        if self._aborted:
            raise NcclLinkLost("the NCCL communicator was aborted")
        with cupy.cuda.Device(self.device.index):
            if after is not None:
                self.stream.wait_event(after)
            op(buffer.data_ptr(), count, self._nccl_dtype(dtype), peer, self.stream.cuda_stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def abort(self) -> None:
        """Ends the communicator now, terminating any send or receive still pending (a dead peer's)."""
        if not self._aborted:
            self._aborted = True
            try:
                self._comm.abort()
            except Exception as exc:  # noqa: BLE001 - the peer may have torn it down already
                log.debug("NCCL abort: %s", exc)


def in_daemon_thread(fn: Callable[..., Any], *args: Any, on_late: Callable[[Any], None] | None = None) -> asyncio.Future:
    """Runs a blocking call on a daemon thread (a communicator that never forms must not keep the process alive).

    When the awaiting side has given up (timeout, cancel) by the time it returns, `on_late` gets the result."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():
            if ok and on_late is not None:
                on_late(value)
        elif ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def run() -> None:
        try:
            value, ok = fn(*args), True
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting side
            value, ok = exc, False
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:   # the loop is closed: nobody waits any more
            if ok and on_late is not None:
                on_late(value)

    threading.Thread(target=run, name="nccl-init", daemon=True).start()
    return future


async def wait_event(event: torch.cuda.Event, timeout_s: float) -> None:
    """Waits for a CUDA event without blocking the event loop; TimeoutError when a peer never matched the op."""
    deadline = time.monotonic() + timeout_s
    pause = 0.00005
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"an NCCL transfer did not complete within {timeout_s:.0f} s")
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.001)   # sub-millisecond for transfers, bounded polling when the peer is slow


@dataclass
class NcclFeatureSender(SharedBufferFeatureSender):
    """The target's side: rows staged into a send buffer on its GPU, sent over NCCL after a header RPC."""

    name: str = "nccl"
    staging_bytes: int = DEFAULT_STAGING_BYTES
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S

    def __post_init__(self) -> None:
        super().__post_init__()
        self._comm: NcclComm | None = None
        self.comm_id = ""
        self.ledger = SendLedger()
        self._send_buffer: torch.Tensor | None = None

    async def establish(self, device: str | torch.device) -> str:
        """Forms the communicator with the drafter (rank 0 here, rank 1 there); returns the drafter's GPU UUID."""
        self._ensure_started()
        device = torch.device("cuda", _device_index(torch.device(device)))
        unique_id = new_unique_id()
        self.comm_id = uuid.uuid4().hex
        own = in_daemon_thread(NcclComm, unique_id, TARGET_RANK, device, on_late=NcclComm.abort)
        join = self._stub.JoinNccl(drafter_pb2.NcclJoinRequest(
            unique_id=unique_id, comm_id=self.comm_id, world_size=WORLD_SIZE, rank=DRAFTER_RANK,
            buffer_bytes=self.staging_bytes, timeout_s=self.join_timeout_s), timeout=self.join_timeout_s + 5)
        try:
            self._comm, reply = await asyncio.wait_for(asyncio.gather(own, join), self.join_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise NcclSetupError(f"the drafter did not join the NCCL communicator: {exc.code().name} "
                                 f"{exc.details()}") from None
        except asyncio.TimeoutError:
            raise NcclSetupError(f"the NCCL communicator did not form within {self.join_timeout_s:.0f} s") from None
        except Exception as exc:  # noqa: BLE001 - NCCL's own error (e.g. a duplicate GPU)
            raise NcclSetupError(f"NCCL communicator init failed: {exc}") from None
        self._send_buffer = torch.empty(self.staging_bytes, dtype=torch.uint8, device=device)
        self._copy_stream = torch.cuda.Stream(device)
        log.info("NCCL communicator %s formed: target %s (rank 0) -> drafter GPU %s (rank 1)", self.comm_id, device,
                 reply.device_uuid or "?")
        return reply.device_uuid

    def _prepare(self, rows):
        # The send buffer is staged in _send, right before its NCCL send: no staging at submit here.
        return self._submission(rows)

    async def _send(self, submission) -> None:
        rows = submission.rows
        if self._comm is None or self.ledger.aborted:
            # The drafter learns now that these rows will never come, so their sequences go `ar` at once
            # instead of waiting out the feature timeout.
            reason = self.ledger.aborted or "no NCCL communicator"
            await self._push(lost_header(rows, self.comm_id, reason))
            raise NcclLinkLost(f"rows of {len(rows)} sequences not sent: {reason}")
        for push in plan_nccl_pushes(rows, self.staging_bytes):
            t0 = time.perf_counter()
            push_id = self.ledger.begin()
            try:
                staged = self._stage_async(push, rows, submission.ready)
                sent = self._comm.send(self._send_buffer, push.count, push.dtype, DRAFTER_RANK, after=staged)
                # The answer comes once the drafter holds the rows: the acknowledgement that frees the buffer.
                await self._push(encode_header(push, rows, self.comm_id, push_id))
                await wait_event(sent, self.timeout_s)
            except BaseException as exc:
                # An unmatched send would block the stream for good, and the pairing of later pushes is lost.
                self._abort(f"push {push_id} failed: {exc}")
                raise
            self.ledger.acknowledged(push_id)
            self._delivered(push.nbytes, time.perf_counter() - t0)

    def _stage_async(self, push, rows, ready: torch.cuda.Event | None) -> torch.cuda.Event:
        with torch.cuda.stream(self._copy_stream):
            if ready is not None:
                self._copy_stream.wait_event(ready)   # behind the forward that made the rows
            for p in push.pieces:
                copy_piece(self._send_buffer, p, rows[p.index])
            staged = torch.cuda.Event()
            staged.record(self._copy_stream)
        return staged

    def _abort(self, reason: str) -> None:
        if not self.ledger.aborted:
            log.error("NCCL communicator %s aborted: %s (its sequences continue autoregressively)", self.comm_id,
                      reason)
        self.ledger.abort(reason)
        if self._comm is not None:
            self._comm.abort()

    def _release(self) -> None:
        if self._comm is not None:
            self._comm.abort()
            self._comm = None
        self._send_buffer = None


@dataclass
class _Link:
    comm: NcclComm
    buffer: torch.Tensor
    order: ReceiveOrder


class NcclReceiver:
    """The drafter's side: communicators joined by id, each with a receive buffer, pushes received in order."""

    def __init__(self, capacity: int = OPENED_LINKS):
        self.capacity = capacity
        self._links: OrderedDict[str, _Link] = OrderedDict()

    async def join(self, request: drafter_pb2.NcclJoinRequest, device: str | torch.device) -> None:
        """Joins the target's communicator as rank 1 (off the event loop, bounded by the request's timeout)."""
        if request.world_size != WORLD_SIZE or request.rank != DRAFTER_RANK:
            raise NcclSetupError(f"a feature link is {WORLD_SIZE} ranks with the drafter as rank {DRAFTER_RANK}, "
                                 f"not rank {request.rank} of {request.world_size}")
        if request.buffer_bytes <= 0 or not request.comm_id:
            raise NcclSetupError("buffer_bytes and comm_id are required")
        load_nccl()
        device = torch.device("cuda", _device_index(torch.device(device)))
        timeout_s = request.timeout_s or DEFAULT_JOIN_TIMEOUT_S
        try:
            comm = await asyncio.wait_for(in_daemon_thread(NcclComm, bytes(request.unique_id), DRAFTER_RANK, device,
                                                           on_late=NcclComm.abort), timeout_s)
        except asyncio.TimeoutError:
            raise NcclSetupError(f"the NCCL communicator did not form within {timeout_s:.0f} s") from None
        except NcclSetupError:
            raise
        except Exception as exc:  # noqa: BLE001 - NCCL's own error
            raise NcclSetupError(f"NCCL communicator init failed: {exc}") from None
        self._links[request.comm_id] = _Link(comm, torch.empty(request.buffer_bytes, dtype=torch.uint8, device=device),
                                             ReceiveOrder())
        while len(self._links) > self.capacity:
            _, old = self._links.popitem(last=False)
            old.comm.abort()
        log.info("joined NCCL communicator %s as rank 1 on %s", request.comm_id, device)

    async def receive(self, batch: drafter_pb2.FeatureBatch, timeout_s: float) -> torch.Tensor:
        """The payload announced by a header, received into the link's buffer (uint8, valid until the next push).

        Any failure aborts the link (the pairing of sends and receives is lost) and raises NcclLinkLost."""
        link = self._links.get(batch.nccl.comm_id)
        if link is None:
            raise NcclLinkLost(f"no NCCL communicator {batch.nccl.comm_id!r} here (aborted, or never joined)")
        try:
            header: NcclHeader = decode_header(batch, link.buffer.numel())
            link.order.accept(header.push_id)
            done = link.comm.recv(link.buffer, header.count, header.dtype, TARGET_RANK)
            await wait_event(done, timeout_s)
        except BaseException as exc:
            self.abort(batch.nccl.comm_id)
            if isinstance(exc, NcclLinkLost):
                raise
            raise NcclLinkLost(f"NCCL push {batch.nccl.push_id} lost, communicator aborted: {exc}") from None
        return link.buffer[:header.nbytes]

    def abort(self, comm_id: str) -> None:
        """Aborts and forgets one communicator."""
        link = self._links.pop(comm_id, None)
        if link is not None:
            link.comm.abort()

    def close(self) -> None:
        """Aborts every communicator."""
        for comm_id in list(self._links):
            self.abort(comm_id)
