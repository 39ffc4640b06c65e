"""Step calls over long-lived streams (ddtree_serve/plumbing/step_stream.py), against a real grpc.aio server."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from ddtree_serve.plumbing.step_stream import StreamedCalls, answer_each, within

METHOD = "/echo.Echo/Call"


class EchoServer:
    """A stream-stream method answering each message with answer_each: upper-cases it, aborts on b"bad", sleeps
    on b"slow"; counts the streams opened and records each message's status."""

    def __init__(self) -> None:
        self.streams = 0
        self.recorded: list[tuple[str, str]] = []
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def _answer(self, request: bytes, context) -> bytes:
        if request == b"bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad request")
        if request == b"slow":
            await asyncio.sleep(2)
        return request.upper()

    async def _handler(self, requests, context):
        self.streams += 1
        async for response in answer_each(requests, context, self._answer, "Echo/Call",
                                          lambda m, code, s: self.recorded.append((m, code))):
            yield response

    async def start(self, port: int = 0) -> None:
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "echo.Echo", {"Call": grpc.stream_stream_rpc_method_handler(self._handler)})])
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(None)


def run(coro_fn):
    """Runs coro_fn(server, channel, calls) against a fresh echo server; returns its result."""
    async def go():
        server = EchoServer()
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        recorded: list[tuple[str, str]] = []
        calls = StreamedCalls(lambda: channel.stream_stream(METHOD)(), "Echo/Call",
                              lambda m, code, s: recorded.append((m, code)))
        try:
            return await coro_fn(server, channel, calls, recorded)
        finally:
            calls.close()
            await channel.close()
            await server.stop()

    return asyncio.run(go())


def test_successive_calls_are_answered_in_order_on_one_stream():
    async def body(server, channel, calls, recorded):
        answers = [await calls(m, timeout=5) for m in (b"a", b"bb", b"ccc")]
        return answers, server.streams, recorded, server.recorded

    answers, streams, client_recorded, server_recorded = run(body)
    assert answers == [b"A", b"BB", b"CCC"]
    assert streams == 1
    assert client_recorded == server_recorded == [("Echo/Call", "OK")] * 3


def test_an_aborted_message_fails_that_call_with_its_status_and_the_next_call_opens_a_fresh_stream():
    async def body(server, channel, calls, recorded):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await calls(b"bad", timeout=5)
        after = await calls(b"ok", timeout=5)
        return failed.value, after, server.streams, recorded, server.recorded

    error, after, streams, client_recorded, server_recorded = run(body)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details() == "bad request"
    assert after == b"OK" and streams == 2
    assert client_recorded == server_recorded == [("Echo/Call", "INVALID_ARGUMENT"), ("Echo/Call", "OK")]


def test_a_call_past_its_timeout_fails_with_deadline_exceeded_and_the_next_one_is_answered():
    async def body(server, channel, calls, recorded):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await calls(b"slow", timeout=0.2)
        after = await calls(b"ok", timeout=5)
        return failed.value, after, recorded

    error, after, recorded = run(body)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "within 0.2 s" in error.details()
    assert after == b"OK"
    assert recorded == [("Echo/Call", "DEADLINE_EXCEEDED"), ("Echo/Call", "OK")]


def test_a_call_after_the_server_restarted_is_answered_by_the_new_server():
    async def body(server, channel, calls, recorded):
        first = await calls(b"a", timeout=5)
        port = server.port
        await server.stop()
        await server.start(port)   # same address, a new process would look the same to the channel
        try:
            second = await calls(b"b", timeout=10)
        except grpc.aio.AioRpcError as exc:
            # The old stream's end can reach the client after its write went out: the call then fails as
            # UNAVAILABLE (never retried, since the old server might have acted on it) and the next one is new.
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            second = await calls(b"b", timeout=10)
        return first, second

    assert run(body) == (b"A", b"B")


def test_concurrent_callers_are_serialised_and_each_gets_its_own_answer():
    async def body(server, channel, calls, recorded):
        return await asyncio.gather(*(calls(bytes([97 + i]), timeout=5) for i in range(8))), server.streams

    answers, streams = run(body)
    assert answers == [bytes([65 + i]) for i in range(8)] and streams == 1


def test_a_step_call_runs_in_the_callers_task_and_times_out_there():
    async def main():
        outer = asyncio.current_task()

        async def which_task():
            return asyncio.current_task()

        inner = await within(which_task(), 1.0)
        with pytest.raises(asyncio.TimeoutError):
            await within(asyncio.sleep(5), 0.05)
        return outer, inner

    outer, inner = asyncio.run(main())
    assert inner is outer or not hasattr(asyncio, "timeout")   # Python 3.10's wait_for makes a task of its own


def test_a_call_to_a_server_that_is_gone_fails_as_unavailable_not_with_a_stream_state_error():
    async def body(server, channel, calls, recorded):
        await calls(b"a", timeout=5)
        await server.stop()   # gone for good: the retry on a fresh stream cannot connect either
        codes = []
        for _ in range(2):   # the broken idle stream, then a fresh one
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await calls(b"b", timeout=5)
            codes.append(info.value.code())
        return codes

    assert run(body) == [grpc.StatusCode.UNAVAILABLE] * 2


def test_a_write_to_a_stream_that_already_ended_fails_with_the_streams_status():
    async def go():
        channel = grpc.aio.insecure_channel("127.0.0.1:1")   # nothing listens there
        ended = channel.stream_stream(METHOD)()
        await ended.code()   # the connection was refused: the stream is over before anything was written
        calls = StreamedCalls(lambda: ended, "Echo/Call")
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await calls(b"x", timeout=5)
        finally:
            await channel.close()
        return info.value.code()

    assert asyncio.run(go()) == grpc.StatusCode.UNAVAILABLE
