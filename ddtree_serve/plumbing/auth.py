"""Who may call whom: the internal shared secret, optional public API keys, TLS/mTLS credentials, session ids.

Internal RPCs (target, drafter) carry the secret in `x-ddtree-secret` metadata; the public gateway optionally
wants `authorization: Bearer <api key>`. Health checks stay open (container probes carry no secret); everything
else without the right credential gets UNAUTHENTICATED before any servicer code runs.

One process runs one service, so its security settings are configured once (`configure`) from the command line
and read by every channel and server it opens.
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

SECRET_ENV = "DDTREE_INTERNAL_SECRET"
# The gRPC front's key. The HTTP front's --api-key ($DDTREE_API_KEY) is separate so gRPC clients without a key keep
# working where only the OpenAI front is meant to be keyed.
API_KEY_ENV = "DDTREE_GRPC_API_KEY"
SECRET_HEADER = "x-ddtree-secret"
SESSION_HEADER = "x-ddtree-session"     # the gateway process that owns a sequence (see ddtree_serve/plumbing/leases.py)
# Probes (kubelet, docker healthcheck, wait_until_serving) carry no credentials and reveal nothing but a status.
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


@dataclass(frozen=True)
class Security:
    """One process's credentials: what its servers demand and what its client channels present."""

    secret: str | None = None           # internal shared secret (None: internal RPCs unauthenticated)
    api_key: str | None = None          # public gateway key (None: the public API is open)
    tls_cert: bytes | None = None       # this service's certificate chain (PEM): TLS on its port, client cert
    tls_key: bytes | None = None
    tls_client_ca: bytes | None = None  # set: clients must present a certificate signed by it (mTLS)
    tls_ca: bytes | None = None         # set: internal channels use TLS and verify servers against it
    tls_server_name: str | None = None  # name to verify internal servers' certificates against, if not the host
    session: str = field(default_factory=lambda: uuid.uuid4().hex)


_current = Security()


def configure(security: Security) -> Security:
    """Sets this process's security settings (the CLI calls it once, before serving)."""
    global _current
    _current = security
    return security


def current() -> Security:
    """This process's security settings."""
    return _current


def read_secret(secret_file: str | None = None, env: str = SECRET_ENV) -> str | None:
    """The secret from a file (first line, stripped) or else from an environment variable; None if neither."""
    if secret_file:
        value = Path(secret_file).read_text().strip()
        if not value:
            raise SystemExit(f"secret file {secret_file} is empty")
        return value
    return os.environ.get(env) or None


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def security_from_args(args, public: bool = False) -> Security:
    """Builds (and configures) the process's Security from the common CLI flags."""
    api_key = None
    if public:
        api_key = read_secret(getattr(args, "api_key_file", None), API_KEY_ENV)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    return configure(Security(
        secret=read_secret(args.secret_file), api_key=api_key, tls_cert=_read(args.tls_cert),
        tls_key=_read(args.tls_key), tls_client_ca=_read(args.tls_client_ca), tls_ca=_read(args.tls_ca),
        tls_server_name=args.tls_server_name))


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, public: bool, allow_unauthenticated: bool) -> None:
    """Refuses to expose an internal service beyond loopback without a secret (unless explicitly allowed)."""
    if public or current().secret or is_loopback(host):
        return
    if allow_unauthenticated:
        log.warning("internal service on %s WITHOUT a shared secret: anyone who reaches it can drive it", host)
        return
    raise SystemExit(f"refusing to serve internal RPCs on {host} without a shared secret: set {SECRET_ENV} or "
                     "--secret-file (or pass --allow-unauthenticated)")


# ---- server side -----------------------------------------------------------------------------------------------
def _abort_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that only aborts (gRPC needs the kind to match the method)."""

    async def unary(request, context):
        await context.abort(code, message)

    async def streaming(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    if handler is None or (not handler.request_streaming and not handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(unary)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.stream_unary_rpc_method_handler(unary)


class CredentialInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only when its metadata carries `expected` under `header` (constant-time compare)."""

    def __init__(self, header: str, expected: str, scheme: str = ""):
        self.header = header
        self.expected = (scheme + expected).encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler_call_details.method.startswith(OPEN_PREFIXES):
            return handler
        given = next((v for k, v in (handler_call_details.invocation_metadata or ()) if k == self.header), "")
        given = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given, self.expected):
            return handler
        return _abort_handler(handler, grpc.StatusCode.UNAUTHENTICATED,
                              f"missing or wrong credentials ({self.header} metadata)")


def server_interceptors(public: bool) -> list[grpc.aio.ServerInterceptor]:
    """The credential check a server needs: the API key on the public gateway, the secret on internal services."""
    sec = current()
    if public:
        return [CredentialInterceptor("authorization", sec.api_key, "Bearer ")] if sec.api_key else []
    return [CredentialInterceptor(SECRET_HEADER, sec.secret)] if sec.secret else []


def server_credentials() -> grpc.ServerCredentials | None:
    """TLS (mTLS when a client CA is set) for this process's server port; None: plaintext."""
    sec = current()
    if not sec.tls_cert:
        return None
    return grpc.ssl_server_credentials([(sec.tls_key, sec.tls_cert)], root_certificates=sec.tls_client_ca,
                                       require_client_auth=sec.tls_client_ca is not None)


# ---- client side -----------------------------------------------------------------------------------------------
class _Metadata:
    def __init__(self, pairs: Sequence[tuple[str, str]]):
        self.pairs = tuple(pairs)

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(tuple(d.metadata) if d.metadata else ()), *self.pairs)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)


class _UnaryUnaryMetadata(_Metadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, d, request):
        return await continuation(self._details(d), request)


class _UnaryStreamMetadata(_Metadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, d, request):
        return await continuation(self._details(d), request)


class _StreamUnaryMetadata(_Metadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, d, request_iterator):
        return await continuation(self._details(d), request_iterator)


class _StreamStreamMetadata(_Metadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, d, request_iterator):
        return await continuation(self._details(d), request_iterator)


def metadata_interceptors(pairs: Sequence[tuple[str, str]]) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors adding fixed metadata (secret, session id) to every call of a channel, one per RPC kind:
    grpc.aio files an interceptor under the first kind it implements only, so one object covering all four
    would leave streaming calls without the metadata."""
    return [kind(pairs) for kind in (_UnaryUnaryMetadata, _UnaryStreamMetadata, _StreamUnaryMetadata,
                                     _StreamStreamMetadata)]


def secret_metadata(secret: str | None) -> list[tuple[str, str]]:
    """Metadata that authenticates an internal call (empty without a secret)."""
    return [(SECRET_HEADER, secret)] if secret else []


def internal_channel(address: str, options: Sequence = (), interceptors: Sequence = ()) -> grpc.aio.Channel:
    """A channel to an internal service carrying this process's secret and session id, over TLS if configured."""
    sec = current()
    pairs = [*secret_metadata(sec.secret), (SESSION_HEADER, sec.session)]
    all_interceptors = [*metadata_interceptors(pairs), *interceptors]
    options = list(options)
    if sec.tls_ca is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=all_interceptors)
    if sec.tls_server_name:
        options.append(("grpc.ssl_target_name_override", sec.tls_server_name))
    creds = grpc.ssl_channel_credentials(root_certificates=sec.tls_ca, private_key=sec.tls_key,
                                         certificate_chain=sec.tls_cert)
    return grpc.aio.secure_channel(address, creds, options=options, interceptors=all_interceptors)


def session_of(context: grpc.aio.ServicerContext) -> str:
    """The caller's session id (the gateway process), '' when it sent none."""
    for key, value in context.invocation_metadata() or ():
        if key == SESSION_HEADER:
            return value
    return ""
