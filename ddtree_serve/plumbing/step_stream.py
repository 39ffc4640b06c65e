"""Per-step calls between the services as messages on one long-lived bidirectional stream.

A unary gRPC call pays for a new HTTP/2 stream, its headers and the interceptors every time; a message on an open
stream pays for the message alone (bench/grpc_stream_hop.py: about half the round trip). The services make three
such calls per engine step (Draft, Verify, and the target's feature push), so each is also served as a stream:
one answer per request, in order. The client side (`StreamedCalls`) looks like a unary stub method, with a timeout
per call; the server side (`answer_each`) reuses the unary handler, so both paths share one implementation,
one error mapping and one metric series.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

Recorder = Callable[[str, str, float], None]   # (method, status code name, seconds)


async def within(awaitable: Awaitable[Any], timeout: float) -> Any:
    """awaitable's result, or asyncio.TimeoutError after `timeout` s. Run in the caller's task: before Python 3.12
    asyncio.wait_for wrapped it in a new one, a turn of the event loop more on every step call (3.11)."""
    if hasattr(asyncio, "timeout"):   # Python >= 3.11
        async with asyncio.timeout(timeout):
            return await awaitable
    return await asyncio.wait_for(awaitable, timeout)


def stream_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """An AioRpcError as a unary call would raise it, for failures the stream itself detects."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class StepCalls:
    """A per-step call kind used like a unary stub method: serialised, timed into `record`, a timeout per call, and
    failures raised as the AioRpcError a unary call would raise. Subclasses carry the messages (`_round_trip`)."""

    def __init__(self, method: str, record: Recorder | None = None) -> None:
        self.method = method   # the unary method a message stands for: metrics labels, error text
        self.record = record
        self._lock = asyncio.Lock()

    async def __call__(self, request: Any, timeout: float) -> Any:
        """The answer to `request`; AioRpcError (DEADLINE_EXCEEDED after `timeout` s) as a unary call would raise."""
        async with self._lock:
            start, code = time.perf_counter(), "OK"
            try:
                return await within(self._round_trip(request), timeout)
            except asyncio.TimeoutError:
                code = grpc.StatusCode.DEADLINE_EXCEEDED.name
                self.close()
                raise stream_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"{self.method}: no answer within {timeout:.1f} s") from None
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
                if self._drops_after(exc.code()):
                    self.close()
                raise
            except BaseException:   # cancelled by the caller, or the channel broke in another way
                code = "CANCELLED"
                self.close()
                raise
            finally:
                if self.record is not None:
                    self.record(self.method, code, time.perf_counter() - start)

    def _drops_after(self, code: grpc.StatusCode) -> bool:
        """Whether a call that failed with `code` leaves the channel unusable (the next call opens a fresh one)."""
        return True

    async def _round_trip(self, request: Any) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        """Drops the open stream or connection, if any."""
        raise NotImplementedError


class StreamedCalls(StepCalls):
    """Calls a stream-stream method like a unary one: one write, one read, in order; the stream opens on first
    use and is dropped after any failure (a failed message ends a gRPC stream; the next call opens a fresh one)."""

    def __init__(self, open_stream: Callable[[], Any], method: str, record: Recorder | None = None) -> None:
        super().__init__(method, record)
        self.open_stream = open_stream   # e.g. stub.VerifyStream (called with no arguments)
        self._call = None

    async def _round_trip(self, request: Any) -> Any:
        reused = self._call is not None
        if not reused:
            self._call = self.open_stream()
        try:
            await self._call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            if not reused:
                raise await self._write_error(exc) from None
            # The idle stream broke since the last call (a peer restarted): the request never left, so one
            # retry on a fresh stream is safe.
            self.close()
            self._call = self.open_stream()
            try:
                await self._call.write(request)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as retry_exc:
                raise await self._write_error(retry_exc) from None
        response = await self._call.read()
        if response is grpc.aio.EOF:   # the server closed the stream without answering (it is stopping)
            raise stream_error(grpc.StatusCode.UNAVAILABLE, f"{self.method}: the stream ended without an answer")
        return response

    async def _write_error(self, exc: BaseException) -> grpc.aio.AioRpcError:
        """What a failed write raises: the stream's own status when it already ended (grpc.aio then raises
        InvalidStateError, e.g. a peer that is down refused the connection), as a unary call would raise it."""
        if isinstance(exc, grpc.aio.AioRpcError):
            return exc
        code, details = await self._call.code(), await self._call.details()
        if code == grpc.StatusCode.OK:
            code, details = grpc.StatusCode.UNAVAILABLE, "the stream ended"
        return stream_error(code, f"{self.method}: {details}")

    def close(self) -> None:
        """Cancels the open stream, if any."""
        if self._call is not None:
            self._call.cancel()
            self._call = None


async def answer_each(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext,
                      answer: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]], method: str,
                      record: Recorder | None = None) -> AsyncIterator[Any]:
    """Yields `answer(request, context)` for each request of a stream, in order. `answer` is the unary handler:
    when it aborts (a bad request, a failed forward), the stream ends with that status, as the unary call would."""
    async for request in requests:
        start, code = time.perf_counter(), "OK"
        try:
            response = await answer(request, context)
        except grpc.aio.AbortError:
            code = _status_name(context)
            raise
        except BaseException:
            code = "CANCELLED"
            raise
        finally:
            if record is not None:
                record(method, code, time.perf_counter() - start)
        yield response


def _status_name(context: grpc.aio.ServicerContext) -> str:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return next((c.name for c in grpc.StatusCode if c.value[0] == code), "UNKNOWN")
