"""gRPC server plumbing shared by the three services: health, reflection, error mapping, shutdown."""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ddtree_serve.plumbing.event_loop import running_loop_name
from ddtree_serve.plumbing.model_thread import ModelThreadStopped

log = logging.getLogger(__name__)

# gRPC messages default to 4 MiB; verify/prefill batches and feature rows can be larger.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
]


def unix_address(path: str | Path) -> str:
    """The gRPC address of a Unix domain socket (`unix:PATH`, PATH relative or absolute), for binds and channels."""
    return f"unix:{path}"


class RequestError(Exception):
    """An error with an explicit gRPC status, raised by servicers and mapped by `grpc_errors`."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Maps the runners' exceptions to gRPC status codes (documented in docs/ARCHITECTURE.md)."""
    if isinstance(exc, RequestError):
        return exc.code, exc.message
    if isinstance(exc, grpc.aio.AioRpcError):  # a downstream service failed: pass its status on
        return exc.code(), f"downstream: {exc.details()}"
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, PermissionError):   # a sequence leased to another gateway session
        return grpc.StatusCode.PERMISSION_DENIED, str(exc)
    if isinstance(exc, KeyError):
        return grpc.StatusCode.NOT_FOUND, f"unknown sequence id {exc.args[0]!r}" if exc.args else "not found"
    if isinstance(exc, ModelThreadStopped):   # a call that arrived while the service shuts down
        return grpc.StatusCode.UNAVAILABLE, "the service is shutting down"
    if isinstance(exc, RuntimeError) and str(exc).startswith("capacity"):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def grpc_errors(method: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
    """Decorates a unary servicer method: exceptions become a gRPC status and a log line, never a crash."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure must become a status
            if isinstance(exc, grpc.aio.AbortError):
                raise
            code, message = status_for(exc)
            level = logging.ERROR if code == grpc.StatusCode.INTERNAL else logging.WARNING
            log.log(level, "%s failed: %s %s", method.__name__, code.name, message,
                    exc_info=code == grpc.StatusCode.INTERNAL)
            await context.abort(code, message)

    return wrapper


def require_ready(ready: asyncio.Event | bool) -> None:
    """Raises UNAVAILABLE while the model is still loading."""
    is_set = ready.is_set() if isinstance(ready, asyncio.Event) else ready
    if not is_set:
        raise RequestError(grpc.StatusCode.UNAVAILABLE, "model is still loading")


@dataclass
class ServiceHost:
    """One grpc.aio server with health (NOT_SERVING until `mark_serving`), reflection and graceful stop."""

    service_names: Sequence[str]
    interceptors: Sequence[grpc.aio.ServerInterceptor] = ()
    reflection: bool = True   # internal services leave it off: it would list their RPCs to anyone
    max_receive_bytes: int = MAX_MESSAGE_BYTES
    server: grpc.aio.Server = field(init=False)
    health: health.aio.HealthServicer = field(init=False)

    def __post_init__(self) -> None:
        # so_reuseport off: by default a second server may bind a port already served, and requests are then
        # split between the two (seen: a gateway and a target on one port, readiness probes answered by the
        # wrong one); off, a taken port is refused at start.
        options = [*CHANNEL_OPTIONS[:1], ("grpc.max_receive_message_length", self.max_receive_bytes),
                   *CHANNEL_OPTIONS[2:], ("grpc.so_reuseport", 0)]
        self.server = grpc.aio.server(interceptors=list(self.interceptors), options=options)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)

    async def start(self, host: str, port: int, unix_socket: str | None = None) -> int:
        """Binds (TCP, and the Unix socket when given) and starts; returns the bound TCP port (0 picks a free one)."""
        from ddtree_serve.plumbing import auth

        if self.reflection:
            reflection.enable_server_reflection([*self.service_names, reflection.SERVICE_NAME, health.SERVICE_NAME],
                                                self.server)
        bound = self._bind(f"{host}:{port}", auth.server_credentials())
        if unix_socket:
            # Same server, same interceptors (the credential check included): only the path to it is shorter.
            self._bind(unix_address(unix_socket), auth.server_credentials())
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        return bound

    def _bind(self, address: str, creds: grpc.ServerCredentials | None) -> int:
        bound = (self.server.add_insecure_port(address) if creds is None
                 else self.server.add_secure_port(address, creds))
        if bound == 0:
            raise RuntimeError(f"could not bind {address}")
        return bound

    async def mark_serving(self) -> None:
        """Readiness: flips health to SERVING (overall and per named service)."""
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)

    async def mark_not_serving(self) -> None:
        """Health NOT_SERVING (a broken pair, draining): load balancers stop sending new work."""
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _set_all(self, status) -> None:
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def serve_until_signal(self, grace_s: float = 5.0, on_stop: Callable[[], Awaitable[None]] | None = None):
        """Serves until SIGTERM/SIGINT, then drains in-flight calls for `grace_s` and stops."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        waiter = asyncio.create_task(self.server.wait_for_termination())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        log.info("shutting down (grace %.1f s)", grace_s)
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        if on_stop is not None:
            await on_stop()
        await self.server.stop(grace_s)
        stopper.cancel()
        waiter.cancel()


async def wait_until_serving(address: str, timeout_s: float = 120.0, service: str = "") -> None:
    """Polls a server's gRPC health until SERVING (raises TimeoutError)."""
    from ddtree_serve.plumbing import auth

    deadline = asyncio.get_running_loop().time() + timeout_s
    async with auth.internal_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{address} not serving after {timeout_s:.0f} s")
            await asyncio.sleep(0.2)


def metrics_hooks(service: str, metrics_port: int | None):
    """(registry, server interceptors, client interceptors) of a service; (None, [], []) when metrics are off."""
    if metrics_port is None:
        return None, [], []
    from ddtree_serve.plumbing import metrics as m

    registry = m.new_registry()
    return registry, [m.ServerMetricsInterceptor(registry, service=service)], m.client_interceptors(registry, service)


async def run_service(label: str, service_name: str, servicer, add_to_server: Callable, interceptors: Sequence,
                      host: str, port: int, *, start: Callable[[], Awaitable[None]],
                      on_stop: Callable[[], Awaitable[None]], registry=None, metrics_port: int | None = None,
                      ready_file: str | None = None, public: bool = False, reflection: bool | None = None,
                      on_host: Callable[[ServiceHost], None] | None = None, grace_s: float = 5.0,
                      max_receive_bytes: int = MAX_MESSAGE_BYTES, unix_socket: str | None = None) -> None:
    """Serves one servicer: bind, metrics endpoint, `start()` (load/connect), SERVING, then until SIGTERM.

    `public` picks the credential check (API key vs internal secret) and reflection's default (on only there);
    `unix_socket` adds a Unix domain socket listener for co-located callers (the TCP port stays)."""
    from ddtree_serve.plumbing import auth
    from ddtree_serve.plumbing.gc_heap import freeze_startup_heap
    from ddtree_serve.plumbing.request_context import RequestIdServerInterceptor

    # The credential check runs first: an unauthenticated call is refused before metrics or servicer code.
    host_ = ServiceHost([service_name], [*auth.server_interceptors(public), *interceptors,
                                         RequestIdServerInterceptor()],
                        reflection=public if reflection is None else reflection, max_receive_bytes=max_receive_bytes)
    add_to_server(servicer, host_.server)
    if on_host is not None:
        on_host(host_)
    bound = await host_.start(host, port, unix_socket)
    if metrics_port is not None:
        from ddtree_serve.plumbing.metrics import start_metrics_server

        # Same interface as the gRPC port: --host 127.0.0.1 keeps /metrics on loopback too.
        log.info("%s metrics on %s:%d", label, host, start_metrics_server(metrics_port, registry, host=host))
    log.info("%s listening on %s:%d%s (pid %d, %s event loop)", label, host, bound,
             f" and {unix_address(unix_socket)}" if unix_socket else "", os.getpid(), running_loop_name())
    try:
        await start()
    except BaseException:
        await host_.server.stop(0)   # a start-up that fails stops its server here, not in a destructor at exit
        raise
    freeze_startup_heap(label)   # before SERVING: no step ever pays for a full walk of the loaded heap
    await host_.mark_serving()
    if ready_file:
        Path(ready_file).write_text(str(bound))
    await host_.serve_until_signal(grace_s=grace_s, on_stop=on_stop)
