"""Step calls over a bare Unix socket (ddtree_serve/plumbing/step_socket.py): the unary handlers' answers and
statuses, the secret, the caller's session, and what hostile or vanished peers get."""
from __future__ import annotations

import asyncio
import os
import stat
import struct

import grpc
import pytest

from ddtree_serve.plumbing import auth
from ddtree_serve.plumbing.rpc import grpc_errors
from ddtree_serve.plumbing.step_socket import SocketCalls, StepMethod, StepSocketServer, frame
from ddtree_serve.proto import target_pb2

VERIFY = "TargetService/Verify"


class Handler:
    """A Verify-shaped unary handler: answers one result per item, named after the caller's session."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.calls = 0

    @grpc_errors
    async def Verify(self, request, context):
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        if any(it.seq_id == "bad" for it in request.items):
            raise ValueError("bad sequence")
        return target_pb2.VerifyResponse(results=[
            target_pb2.VerifyResult(seq_id=f"{auth.session_of(context)}/{it.seq_id}", next_token=len(it.tokens))
            for it in request.items])


def request(*seq_ids: str) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(items=[target_pb2.TreeItem(seq_id=s, tokens=[1, 2, 3], parents=[-1, 0, 1])
                                           for s in seq_ids])


async def serve(path, handler: Handler, secret: str | None = None) -> StepSocketServer:
    server = StepSocketServer(path, [StepMethod(VERIFY, target_pb2.VerifyRequest, handler.Verify)], secret,
                              auth.SESSION_HEADER)
    await server.start()
    return server


def calls(path, secret: str | None = None) -> SocketCalls:
    return SocketCalls(str(path), VERIFY, target_pb2.VerifyResponse, secret, session="gw1")


def run(coro):
    return asyncio.run(coro)


def test_a_call_is_answered_by_the_unary_handler_with_the_callers_session(tmp_path):
    async def go():
        server = await serve(tmp_path / "s", Handler())
        try:
            client = calls(tmp_path / "s")
            first = await client(request("a", "b"), timeout=5)
            second = await client(request("c"), timeout=5)   # the same connection, in order
            client.close()
            return first, second
        finally:
            await server.close()

    first, second = run(go())
    assert [(r.seq_id, r.next_token) for r in first.results] == [("gw1/a", 3), ("gw1/b", 3)]
    assert [r.seq_id for r in second.results] == ["gw1/c"]


def test_the_socket_file_is_private_to_the_user_and_removed_on_close(tmp_path):
    async def go():
        server = await serve(tmp_path / "s", Handler())
        mode = stat.S_IMODE(os.stat(tmp_path / "s").st_mode)
        await server.close()
        return mode

    assert run(go()) == 0o600
    assert not (tmp_path / "s").exists()


def test_a_handler_error_comes_back_as_its_grpc_status_and_the_connection_serves_on(tmp_path):
    async def go():
        server = await serve(tmp_path / "s", Handler())
        try:
            client = calls(tmp_path / "s")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client(request("bad"), timeout=5)
            after = await client(request("ok"), timeout=5)
            return err.value, after
        finally:
            await server.close()

    err, after = run(go())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "bad sequence" in err.details()
    assert [r.seq_id for r in after.results] == ["gw1/ok"]


def test_a_caller_without_the_secret_is_refused_and_never_reaches_the_handler(tmp_path):
    handler = Handler()

    async def go():
        server = await serve(tmp_path / "s", handler, secret="s3cret")
        try:
            with pytest.raises(grpc.aio.AioRpcError) as wrong:
                await calls(tmp_path / "s", secret="guess")(request("a"), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await calls(tmp_path / "s")(request("a"), timeout=5)
            right = await calls(tmp_path / "s", secret="s3cret")(request("a"), timeout=5)
            return wrong.value, missing.value, right
        finally:
            await server.close()

    wrong, missing, right = run(go())
    assert wrong.code() == missing.code() == grpc.StatusCode.UNAUTHENTICATED
    assert [r.seq_id for r in right.results] == ["gw1/a"] and handler.calls == 1


def test_a_malformed_request_is_invalid_argument_and_an_oversized_frame_drops_only_its_connection(tmp_path):
    async def raw(payload: bytes) -> bytes:
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "s"))
        writer.write(frame(0, b'{"secret": "", "session": "x"}') + payload)
        writer.write_eof()   # the server answers what it got, then sees the end and closes
        data = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        return data

    async def go():
        server = await serve(tmp_path / "s", Handler())
        try:
            garbage = await raw(frame(1, b"\xff\xff\xff"))
            huge = await raw(struct.pack(">IB", 1 << 31, 1))   # 2 GiB announced
            unknown = await raw(frame(9, b""))
            fine = await calls(tmp_path / "s")(request("a"), timeout=5)
            return garbage, huge, unknown, fine
        finally:
            await server.close()

    garbage, huge, unknown, fine = run(go())
    hello_ok = frame(0, b"")
    assert garbage.startswith(hello_ok) and garbage[len(hello_ok) + 4] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert huge == hello_ok   # answered the hello, then closed: no reply to the oversized frame
    assert unknown[len(hello_ok) + 4] == grpc.StatusCode.UNIMPLEMENTED.value[0]
    assert [r.seq_id for r in fine.results] == ["gw1/a"]


def test_a_slow_answer_is_deadline_exceeded_and_a_vanished_server_unavailable_until_it_is_back(tmp_path):
    async def go():
        server = await serve(tmp_path / "s", Handler(delay_s=1.0))
        client = calls(tmp_path / "s")
        with pytest.raises(grpc.aio.AioRpcError) as slow:
            await client(request("a"), timeout=0.1)
        await server.close()
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await client(request("a"), timeout=5)
        server = await serve(tmp_path / "s", Handler())   # a restarted peer: the next call reconnects
        try:
            back = await client(request("a"), timeout=5)
        finally:
            await server.close()
        return slow.value, gone.value, back

    slow, gone, back = run(go())
    assert slow.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert gone.code() == grpc.StatusCode.UNAVAILABLE
    assert [r.seq_id for r in back.results] == ["gw1/a"]


def test_an_idle_connection_broken_by_a_restart_is_replaced_without_failing_the_call(tmp_path):
    async def go():
        server = await serve(tmp_path / "s", Handler())
        client = calls(tmp_path / "s")
        await client(request("a"), timeout=5)
        await server.close()
        server = await serve(tmp_path / "s", Handler())
        try:
            return await client(request("b"), timeout=5)
        finally:
            await server.close()

    assert [r.seq_id for r in run(go()).results] == ["gw1/b"]


def test_closing_the_server_ends_an_open_client_connection_and_a_silent_one_is_dropped(tmp_path, monkeypatch):
    """A gateway holds its connection open for good: closing the server must not wait for it (Python 3.12's
    wait_closed waits for every connection), and a peer that never says hello is not held."""
    from ddtree_serve.plumbing import step_socket

    monkeypatch.setattr(step_socket, "HELLO_TIMEOUT_S", 0.2)

    async def go():
        server = await serve(tmp_path / "s", Handler())
        client = calls(tmp_path / "s")
        await client(request("a"), timeout=5)
        silent_reader, silent_writer = await asyncio.open_unix_connection(str(tmp_path / "s"))
        dropped = await asyncio.wait_for(silent_reader.read(), 5)   # EOF once the hello times out
        await asyncio.wait_for(server.close(), 3)
        with pytest.raises(grpc.aio.AioRpcError) as after:
            await client(request("b"), timeout=5)
        silent_writer.close()
        return dropped, after.value

    dropped, after = run(go())
    assert dropped == b""
    assert after.code() == grpc.StatusCode.UNAVAILABLE
