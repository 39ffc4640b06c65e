"""Co-located services call each other over Unix domain sockets: the listener, the flag, the launcher's choice."""
from __future__ import annotations

import asyncio
import os
import stat

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree_serve.plumbing import auth
from ddtree_serve.plumbing.rpc import ServiceHost, unix_address
from ddtree_serve.proto import target_pb2, target_pb2_grpc
from launch import cli
from launch.local_stack import LocalStack


def _stack(tmp_path, **kw) -> LocalStack:
    return LocalStack(model=str(tmp_path / "model"), drafter=str(tmp_path / "drafter"), log_dir=str(tmp_path / "logs"),
                      **kw)


def _flag(cmd: list[str], name: str) -> list[str]:
    return [cmd[i + 1] for i, arg in enumerate(cmd) if arg == name]


def test_unix_address_is_the_grpc_form_of_a_path():
    assert unix_address("/tmp/x/target.sock") == "unix:/tmp/x/target.sock"
    assert unix_address("rel/drafter.sock") == "unix:rel/drafter.sock"


def test_the_launcher_links_the_services_over_unix_sockets_by_default(tmp_path):
    s = _stack(tmp_path)
    cmds = s.commands()
    assert s.unix_sockets
    assert stat.S_IMODE(os.stat(s.socket_dir).st_mode) == 0o700   # only this user may connect
    assert _flag(cmds["target"], "--unix-socket") == [s.socket_path("target")]
    assert _flag(cmds["drafter"], "--unix-socket") == [s.socket_path("drafter")]
    assert _flag(cmds["gateway"], "--unix-socket") == []            # its callers are outside clients
    assert _flag(cmds["gateway"], "--target") == [f"unix:{s.socket_path('target')}"]
    assert _flag(cmds["gateway"], "--drafter") == [f"unix:{s.socket_path('drafter')}"]
    # The target pushes to the drafter's socket; tools that name its TCP address are still allowed.
    assert _flag(cmds["target"], "--allow-drafter") == [s.link_address("drafter"), s.address("drafter")]
    # Outside clients keep TCP.
    assert s.address("target") == f"127.0.0.1:{s.ports['target']}"
    assert s.gateway == f"127.0.0.1:{s.ports['gateway']}"
    s.stop()
    assert not os.path.exists(s.socket_dir)   # the stack made it, the stack removes it


def test_without_unix_sockets_the_services_link_over_tcp_as_before(tmp_path):
    s = _stack(tmp_path, unix_sockets=False)
    cmds = s.commands()
    assert all(_flag(cmd, "--unix-socket") == [] for cmd in cmds.values())
    assert _flag(cmds["gateway"], "--target") == [s.address("target")]
    assert _flag(cmds["gateway"], "--drafter") == [s.address("drafter")]
    assert _flag(cmds["target"], "--allow-drafter") == [s.address("drafter")]


def test_a_socket_directory_too_deep_for_a_socket_path_falls_back_to_tcp(tmp_path):
    deep = tmp_path / ("d" * 120)
    s = _stack(tmp_path, socket_dir=str(deep))
    assert not s.unix_sockets
    assert s.link_address("drafter") == s.address("drafter")


@pytest.mark.parametrize("service", ["target", "drafter", "gateway"])
def test_every_service_takes_a_unix_socket(service):
    required = {"target": ["--model", "m"], "drafter": ["--drafter", "d", "--target-model", "m"], "gateway": []}
    args = cli.build_parser().parse_args([service, *required[service], "--unix-socket", "/tmp/s.sock"])
    assert args.unix_socket == "/tmp/s.sock"
    assert cli.build_parser().parse_args([service, *required[service]]).unix_socket is None


def test_a_service_answers_on_its_unix_socket_and_tcp_with_the_same_credential_check(tmp_path):
    path = str(tmp_path / "svc.sock")
    previous = auth.current()
    auth.configure(auth.Security(secret="s3cret"))

    async def main():
        host = ServiceHost(["ddtree.v1.TargetService"], auth.server_interceptors(public=False), reflection=False)
        target_pb2_grpc.add_TargetServiceServicer_to_server(target_pb2_grpc.TargetServiceServicer(), host.server)
        port = await host.start("127.0.0.1", 0, unix_socket=path)
        await host.mark_serving()
        try:
            statuses = []
            for address in (unix_address(path), f"127.0.0.1:{port}"):
                async with grpc.aio.insecure_channel(address) as ch:
                    reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
                    statuses.append(reply.status)
                    # Without the secret: refused before the servicer (which would say UNIMPLEMENTED).
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await target_pb2_grpc.TargetServiceStub(ch).Info(target_pb2.InfoRequest(), timeout=10)
                    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                async with auth.internal_channel(address) as ch:   # with it: through to the servicer
                    with pytest.raises(grpc.aio.AioRpcError) as passed:
                        await target_pb2_grpc.TargetServiceStub(ch).Info(target_pb2.InfoRequest(), timeout=10)
                    assert passed.value.code() == grpc.StatusCode.UNIMPLEMENTED
            return statuses
        finally:
            await host.server.stop(None)

    try:
        assert asyncio.run(main()) == [health_pb2.HealthCheckResponse.SERVING] * 2
    finally:
        auth.configure(previous)


def test_a_second_service_on_a_port_already_served_is_refused_at_start():
    """Without SO_REUSEPORT: two servers on one port would silently split its requests between them."""

    async def scenario():
        first = ServiceHost(["a"], reflection=False)
        port = await first.start("127.0.0.1", 0)
        try:
            with pytest.raises(RuntimeError):
                await ServiceHost(["b"], reflection=False).start("127.0.0.1", port)
        finally:
            await first.server.stop(None)

    asyncio.run(scenario())
