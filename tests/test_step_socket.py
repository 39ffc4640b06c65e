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


class ThreadServer:
    """A step socket served from its own thread and event loop: a polling client holds its own loop, so the
    answer must come from elsewhere (as from the target's process)."""

    def __init__(self, path, handler: Handler) -> None:
        import threading

        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def main():
            self.server = await serve(path, handler)
            self.stop = asyncio.Event()
            started.set()
            await self.stop.wait()
            await self.server.close()

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(main(),), daemon=True)
        self.thread.start()
        assert started.wait(5)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(5)


def test_a_polling_client_gets_each_answer_whether_it_comes_within_the_poll_or_after_it(tmp_path):
    handler = Handler()
    server = ThreadServer(tmp_path / "s", handler)

    async def go():
        client = SocketCalls(str(tmp_path / "s"), VERIFY, target_pb2.VerifyResponse, None, "gw1", spin_s=0.5)
        fast = [await client(request(f"f{i}"), timeout=5) for i in range(3)]
        handler.delay_s, client.spin_s = 0.2, 0.02   # answers now come after the poll gave up: the loop reads them
        slow = [await client(request(f"s{i}"), timeout=5) for i in range(2)]
        handler.delay_s, client.spin_s = 0.0, 0.5
        again = await client(request("g"), timeout=5)
        client.close()
        return fast, slow, again

    try:
        fast, slow, again = run(go())
    finally:
        server.close()
    assert [r.results[0].seq_id for r in fast + slow + [again]] == ["gw1/f0", "gw1/f1", "gw1/f2", "gw1/s0", "gw1/s1",
                                                                    "gw1/g"]


def test_an_answer_split_across_the_end_of_the_poll_is_put_together(tmp_path):
    """The poll may take the first bytes of an answer and give up before the rest: the loop reads on from there."""
    import socket
    import threading
    import time

    answer = target_pb2.VerifyResponse(results=[target_pb2.VerifyResult(seq_id="x" * 3000, next_token=7)])
    data = frame(0, answer.SerializeToString())
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "s"))
    listener.listen(1)

    def peer():
        conn, _ = listener.accept()
        conn.recv(1 << 16)                  # the hello
        conn.sendall(frame(0, b""))
        conn.recv(1 << 16)                  # the request
        conn.sendall(data[:1000])           # within the poll
        time.sleep(0.2)
        conn.sendall(data[1000:])           # after it
        conn.recv(1 << 16)                  # until the client closes
        conn.close()

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()

    async def go():
        client = SocketCalls(str(tmp_path / "s"), VERIFY, target_pb2.VerifyResponse, None, "gw1", spin_s=0.05)
        got = await client(request("a"), timeout=5)
        client.close()
        return got

    got = run(go())
    thread.join(5)
    listener.close()
    assert got == answer
