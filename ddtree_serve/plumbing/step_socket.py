"""Per-step calls over a bare Unix domain socket, for services on one host (`--step-socket`, off by default).

An engine step crosses three messages in series (the feature push, the Draft answer, the Verify request) and each
costs a gRPC stream message's framing, HTTP/2 and event-loop turns on both ends: a bare asyncio Unix socket with
length-prefixed protobuf frames answers in about half the time (bench/grpc_stream_hop.py --unix). The calls keep
their gRPC meaning: the same unary handlers answer them, with the same status codes, metrics and auth.

Frames, both ways: u32 length (big-endian) | u8 kind | payload. A request's kind is its method's number (1 + its
index in STEP_METHODS), the answer's kind a gRPC status code's value (0: OK, payload = the response; else the
details in UTF-8). The first frame of a connection is the hello (kind 0, JSON {"secret", "session"}): the
internal secret when the services have one (compared in constant time) and the gateway session that owns the
sequences; it is answered OK, or UNAUTHENTICATED and the connection closed. The socket file is created 0600.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from ddtree_serve.plumbing.rpc import MAX_MESSAGE_BYTES
from ddtree_serve.plumbing.step_stream import Recorder, StepCalls, stream_error

log = logging.getLogger(__name__)

STEP_METHODS = ("TargetService/Verify", "DrafterService/Draft", "DrafterService/PushFeatures")
HELLO = 0
HELLO_TIMEOUT_S = 10.0   # a connection that says nothing is dropped, not held
_HEADER = struct.Struct(">IB")
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class FrameError(Exception):
    """A frame that breaks the protocol (too long, truncated): the connection is dropped."""


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[int, bytes] | None:
    """(kind, payload) of the next frame; None at a clean end of stream."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise FrameError("truncated frame header") from None
    length, kind = _HEADER.unpack(header)
    if length > max_bytes:
        raise FrameError(f"frame of {length} bytes exceeds {max_bytes}")
    try:
        return kind, await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise FrameError("truncated frame") from None


def frame(kind: int, payload: bytes) -> bytes:
    """One frame's bytes."""
    return _HEADER.pack(len(payload), kind) + payload


class SocketAbort(grpc.aio.AbortError):
    """What `SocketContext.abort` raises: the call ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class SocketContext:
    """The part of a gRPC servicer context the unary handlers use: abort and the caller's metadata."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        """The hello's metadata (the caller's session)."""
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        """Ends the call with code (raises SocketAbort)."""
        raise SocketAbort(code, details)


@dataclass(frozen=True)
class StepMethod:
    """A unary handler served on the step socket: handler(request, context) -> response."""

    name: str   # one of STEP_METHODS
    request_type: type
    handler: Callable[[Any, Any], Awaitable[Any]]


class StepSocketServer:
    """Serves StepMethods on a Unix socket, one call at a time per connection, in order."""

    def __init__(self, path: str | Path, methods: list[StepMethod], secret: str | None, session_header: str,
                 record: Recorder | None = None) -> None:
        self.path = str(path)
        self.methods = {STEP_METHODS.index(m.name) + 1: m for m in methods}
        self.secret = secret
        self.session_header = session_header
        self.record = record
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        """Listens (a stale socket file from a killed process is replaced); the file is made 0600."""
        if os.path.exists(self.path):
            os.unlink(self.path)
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        os.chmod(self.path, 0o600)
        log.info("step socket listening on %s (%s)", self.path, ", ".join(m.name for m in self.methods.values()))

    async def close(self) -> None:
        """Stops listening, ends the open connections (a gateway keeps one open for good; since Python 3.12
        wait_closed waits for them) and removes the socket file."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
            except asyncio.TimeoutError:
                log.warning("step socket %s: connections still open after 5 s at shutdown", self.path)
            self._server = None
        if os.path.exists(self.path):
            os.unlink(self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            context = await asyncio.wait_for(self._hello(reader, writer), HELLO_TIMEOUT_S)
            if context is not None:
                await self._answer_each(reader, writer, context)
        except (FrameError, ConnectionError, asyncio.TimeoutError) as exc:
            log.warning("step socket %s: dropping a connection: %s", self.path, exc or type(exc).__name__)
        except asyncio.CancelledError:
            pass   # the server is stopping
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> SocketContext | None:
        first = await read_frame(reader, 64 << 10)
        if first is None:
            return None
        kind, payload = first
        try:
            hello = json.loads(payload) if kind == HELLO else None
            secret, session = str(hello.get("secret") or ""), str(hello.get("session") or "")
        except (ValueError, AttributeError):
            hello = None
        if hello is None:
            await self._send(writer, grpc.StatusCode.INVALID_ARGUMENT, b"the first frame must be a hello")
            return None
        if self.secret and not hmac.compare_digest(secret.encode(), self.secret.encode()):
            log.warning("step socket %s: refused a connection without the shared secret", self.path)
            await self._send(writer, grpc.StatusCode.UNAUTHENTICATED, b"missing or wrong internal secret")
            return None
        await self._send(writer, grpc.StatusCode.OK, b"")
        return SocketContext(((self.session_header, session),) if session else ())

    async def _answer_each(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           context: SocketContext) -> None:
        while (request := await read_frame(reader)) is not None:
            kind, payload = request
            method = self.methods.get(kind)
            if method is None:
                await self._send(writer, grpc.StatusCode.UNIMPLEMENTED, f"no step method {kind} here".encode())
                continue
            start, code, answer = time.perf_counter(), grpc.StatusCode.OK, b""
            try:
                answer = (await method.handler(method.request_type.FromString(payload), context)).SerializeToString()
            except DecodeError:
                code, answer = grpc.StatusCode.INVALID_ARGUMENT, f"{method.name}: malformed request".encode()
            except SocketAbort as exc:
                code, answer = exc.code, exc.details.encode()
            except Exception as exc:  # noqa: BLE001 - the unary handlers map their own errors; this is a bug
                log.exception("step socket %s: %s failed", self.path, method.name)
                code, answer = grpc.StatusCode.INTERNAL, f"{method.name}: {type(exc).__name__}".encode()
            finally:
                if self.record is not None:
                    self.record(method.name, code.name, time.perf_counter() - start)
            await self._send(writer, code, answer)

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, code: grpc.StatusCode, payload: bytes) -> None:
        writer.write(frame(code.value[0], payload))
        await writer.drain()


class SocketCalls(StepCalls):
    """StreamedCalls' interface over a step socket: `await calls(request, timeout)` -> the response, or the
    AioRpcError a unary call would raise. One connection, opened on first use; a handler's error status leaves it
    open, a broken or refused one is dropped.

    spin_s > 0: after sending, wait for the answer by polling the socket for up to spin_s (then in the event loop as
    usual), while the recent answers came within it. A process asleep in epoll is woken by the kernel when the
    answer lands, which costs ~70 us on a virtual machine's idle vCPU (bench/socket_wakeup.py) and leaves its
    caches cold; an engine step waits on its Draft answer on the step's critical path. The poll holds the event
    loop, so it is for a gateway that drives one pair (the other coroutines run once the answer is in)."""

    def __init__(self, path: str, method: str, response_type: type, secret: str | None, session: str,
                 record: Recorder | None = None, spin_s: float = 0.0) -> None:
        super().__init__(method, record)
        self.path, self.response_type = path, response_type
        self.kind = STEP_METHODS.index(method) + 1
        self.spin_s = spin_s
        self.last_answer_s = 0.0   # the last round trip: polling is only worth it while answers come within spin_s
        self._hello = json.dumps({"secret": secret or "", "session": session}).encode()
        self._sock: socket.socket | None = None
        self._buffer = bytearray()   # bytes received past the last whole frame

    def _drops_after(self, code: grpc.StatusCode) -> bool:
        return code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)

    async def _round_trip(self, request: Any) -> Any:
        payload = frame(self.kind, request.SerializeToString())
        reused = self._sock is not None
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        try:
            sock = self._sock or await self._connect()
            await loop.sock_sendall(sock, payload)
        except (ConnectionError, OSError) as exc:
            self.close()
            if not reused:
                raise stream_error(grpc.StatusCode.UNAVAILABLE, f"{self.method}: {self.path}: {exc}") from None
            # The idle connection broke since the last call (a peer restarted): the request never left.
            sock = await self._connect()
            await loop.sock_sendall(sock, payload)
        answer = None
        if self.spin_s > 0 and self.last_answer_s <= self.spin_s:
            answer = self._poll_frame(sock, start + self.spin_s)
        if answer is None:
            answer = await self._read(sock)
        self.last_answer_s = time.perf_counter() - start
        return self._answer(answer)

    async def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, self.path)
        except (ConnectionError, OSError) as exc:
            sock.close()
            raise stream_error(grpc.StatusCode.UNAVAILABLE, f"{self.method}: {self.path}: {exc}") from None
        self._sock, self._buffer = sock, bytearray()
        try:
            await asyncio.get_running_loop().sock_sendall(sock, frame(HELLO, self._hello))
        except (ConnectionError, OSError) as exc:
            self.close()
            raise stream_error(grpc.StatusCode.UNAVAILABLE, f"{self.method}: {self.path}: {exc}") from None
        self._answer(await self._read(sock))   # OK, or the refusal raised
        return sock

    def _take_frame(self) -> tuple[int, bytes] | None:
        """The next whole frame in the buffer, if there is one (FrameError past the size limit)."""
        if len(self._buffer) < _HEADER.size:
            return None
        length, kind = _HEADER.unpack_from(self._buffer)
        if length > MAX_MESSAGE_BYTES:
            raise FrameError(f"frame of {length} bytes exceeds {MAX_MESSAGE_BYTES}")
        end = _HEADER.size + length
        if len(self._buffer) < end:
            return None
        with memoryview(self._buffer) as view:   # one copy (a bytearray slice would copy twice)
            payload = bytes(view[_HEADER.size:end])
        del self._buffer[:end]
        return kind, payload

    def _poll_frame(self, sock: socket.socket, deadline: float) -> tuple[int, bytes] | None:
        """The answer if it comes before `deadline` (perf_counter), polling the socket; None otherwise (what came
        stays buffered for _read). Errors as _read raises them."""
        try:
            while True:
                answer = self._take_frame()
                if answer is not None:
                    return answer
                try:
                    chunk = sock.recv(1 << 20)
                except BlockingIOError:
                    if time.perf_counter() >= deadline:
                        return None
                    continue
                if not chunk:
                    raise ConnectionError("the step socket closed without an answer")
                self._buffer += chunk
        except (FrameError, ConnectionError, OSError) as exc:
            raise stream_error(grpc.StatusCode.UNAVAILABLE, f"{self.method}: {exc}") from None

    async def _read(self, sock: socket.socket) -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        try:
            while (answer := self._take_frame()) is None:
                chunk = await loop.sock_recv(sock, 1 << 20)
                if not chunk:
                    raise ConnectionError("the step socket closed without an answer")
                self._buffer += chunk
        except (FrameError, ConnectionError, OSError) as exc:
            raise stream_error(grpc.StatusCode.UNAVAILABLE, f"{self.method}: {exc}") from None
        return answer

    def _answer(self, answer: tuple[int, bytes]) -> Any:
        kind, payload = answer
        if kind != 0:
            code = _CODES.get(kind, grpc.StatusCode.UNKNOWN)
            raise stream_error(code, payload.decode(errors="replace"))
        return self.response_type.FromString(payload)

    def close(self) -> None:
        """Drops the connection, if any."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buffer = bytearray()
