"""ddtree_serve/plumbing/auth.py and leases.py on in-process servers: credentials, TLS, bind policy, lease lapses."""
from __future__ import annotations

import asyncio
import shutil
import subprocess

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ddtree_serve.plumbing import auth
from ddtree_serve.plumbing.leases import LeaseError, LeaseTable
from ddtree_serve.proto import gateway_pb2, gateway_pb2_grpc


class _Gateway(gateway_pb2_grpc.GatewayServicer):
    async def Tokenize(self, request, context):
        return gateway_pb2.TokenizeResponse(ids=[len(request.text)])


async def _serve(interceptors, creds=None):
    server = grpc.aio.server(interceptors=interceptors)
    gateway_pb2_grpc.add_GatewayServicer_to_server(_Gateway(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = (server.add_secure_port("127.0.0.1:0", creds) if creds else server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    return server, port


async def _tokenize(channel, metadata=()):
    return await gateway_pb2_grpc.GatewayStub(channel).Tokenize(gateway_pb2.TokenizeRequest(text="abc"),
                                                                metadata=metadata, timeout=10)


def test_api_key_is_required_when_set_and_health_stays_open():
    async def scenario():
        server, port = await _serve([auth.CredentialInterceptor("authorization", "k3y", "Bearer ")])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _tokenize(ch)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError):
                    await _tokenize(ch, [("authorization", "Bearer wrong")])
                assert (await _tokenize(ch, [("authorization", "Bearer k3y")])).ids == [3]
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_internal_channel_presents_the_configured_secret():
    async def scenario():
        server, port = await _serve([auth.CredentialInterceptor(auth.SECRET_HEADER, "s3cret")])
        try:
            auth.configure(auth.Security(secret="s3cret"))
            async with auth.internal_channel(f"127.0.0.1:{port}") as ch:
                assert (await _tokenize(ch)).ids == [3]
        finally:
            auth.configure(auth.Security())
            await server.stop(0)

    asyncio.run(scenario())


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI for a test certificate")
def test_mutual_tls_with_a_self_signed_certificate(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=ddtree-internal",
                    "-addext", "subjectAltName=DNS:ddtree-internal"], check=True, capture_output=True)
    sec = auth.Security(tls_cert=cert.read_bytes(), tls_key=key.read_bytes(), tls_client_ca=cert.read_bytes(),
                        tls_ca=cert.read_bytes(), tls_server_name="ddtree-internal")

    async def scenario():
        auth.configure(sec)
        server, port = await _serve([], auth.server_credentials())
        try:
            async with auth.internal_channel(f"127.0.0.1:{port}") as ch:
                assert (await _tokenize(ch)).ids == [3]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:   # plaintext client: refused
                with pytest.raises(grpc.aio.AioRpcError):
                    await _tokenize(ch)
        finally:
            auth.configure(auth.Security())
            await server.stop(0)

    asyncio.run(scenario())


def test_internal_services_refuse_a_public_bind_without_a_secret():
    auth.configure(auth.Security())
    with pytest.raises(SystemExit):
        auth.check_bind("0.0.0.0", public=False, allow_unauthenticated=False)
    auth.check_bind("127.0.0.1", public=False, allow_unauthenticated=False)
    auth.check_bind("0.0.0.0", public=True, allow_unauthenticated=False)
    auth.configure(auth.Security(secret="x"))
    try:
        auth.check_bind("0.0.0.0", public=False, allow_unauthenticated=False)
    finally:
        auth.configure(auth.Security())


def test_a_lease_lapses_only_when_its_session_and_the_sequence_are_both_silent():
    now = [0.0]
    table = LeaseTable(lease_s=10, clock=lambda: now[0])
    table.claim("gw-a", ["s1"])
    table.touch(["pushed-only"])
    with pytest.raises(LeaseError):
        table.check("gw-b", ["s1"])
    now[0] = 8
    table.heard_from("gw-a")          # heartbeat keeps s1
    now[0] = 15
    assert table.lapsed() == ["pushed-only"]
    table.drop(["pushed-only"])
    now[0] = 30
    assert table.lapsed() == ["s1"]
