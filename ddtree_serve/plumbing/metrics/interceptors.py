"""gRPC interceptors that observe ddtree_rpc_{server,client}_* for every call (and forward request ids)."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from grpc import aio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ddtree_serve.plumbing.metrics.families import RPC_BUCKETS, get_or_create
from ddtree_serve.plumbing.request_context import get_request_id, outgoing_metadata, wrap_rpc_handler


def short_method(full_method: str | bytes) -> str:
    """'/ddtree.v1.TargetService/Verify' -> 'TargetService/Verify' (package dropped to keep labels short)."""
    if isinstance(full_method, bytes):
        full_method = full_method.decode()
    service, _, method = full_method.lstrip("/").rpartition("/")
    return f"{service.rsplit('.', 1)[-1]}/{method}" if service else method


def _code_name(code: Any) -> str | None:
    if code is None:
        return None
    if isinstance(code, grpc.StatusCode):
        return code.name
    for sc in grpc.StatusCode:  # aio contexts may hand back the raw integer
        if sc.value[0] == code:
            return sc.name
    return None


@dataclass(frozen=True)
class _RpcFamilies:
    latency: Histogram
    calls: Counter
    in_flight: Gauge | None


class _Series:
    """The (latency, calls) children of one label set, looked up once: `labels()` takes a lock and validates
    its arguments on every call, a measurable part of an RPC's cost (bench/rpc_hop.py)."""

    def __init__(self, families: _RpcFamilies) -> None:
        self._f = families
        self._children: dict[tuple[str, ...], tuple[Any, Any]] = {}

    def record(self, labels: tuple[str, ...], seconds: float) -> None:
        """Observes one finished call under `labels` (label values, in the families' order)."""
        children = self._children.get(labels)
        if children is None:   # bounded: methods x status codes
            children = self._children[labels] = (self._f.latency.labels(*labels), self._f.calls.labels(*labels))
        children[0].observe(seconds)
        children[1].inc()


def _server_families(registry: CollectorRegistry) -> _RpcFamilies:
    ls = ["service", "method", "code"]
    return _RpcFamilies(
        get_or_create(registry, "ddtree_rpc_server_latency_seconds", lambda: Histogram(
            "ddtree_rpc_server_latency_seconds", "Server-side RPC latency (to the end of the stream), seconds.", ls,
            buckets=RPC_BUCKETS, registry=registry)),
        get_or_create(registry, "ddtree_rpc_server_calls", lambda: Counter(
            "ddtree_rpc_server_calls", "RPCs handled, by final status code.", ls, registry=registry)),
        get_or_create(registry, "ddtree_rpc_server_in_flight", lambda: Gauge(
            "ddtree_rpc_server_in_flight", "RPCs being handled.", ["service", "method"], registry=registry)))


def _client_families(registry: CollectorRegistry) -> _RpcFamilies:
    ls = ["service", "peer", "method", "code"]
    return _RpcFamilies(
        get_or_create(registry, "ddtree_rpc_client_latency_seconds", lambda: Histogram(
            "ddtree_rpc_client_latency_seconds", "Client-side RPC latency (to the final status), seconds.", ls,
            buckets=RPC_BUCKETS, registry=registry)),
        get_or_create(registry, "ddtree_rpc_client_calls", lambda: Counter(
            "ddtree_rpc_client_calls", "RPCs issued, by final status code.", ls, registry=registry)),
        None)


class ServerMetricsInterceptor(aio.ServerInterceptor):
    """Observes ddtree_rpc_server_latency_seconds / _calls{service, method, code} for every handler shape."""

    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        self.service = service
        self._f = _server_families(registry)
        self._series = _Series(self._f)
        self._gauges: dict[str, Gauge] = {}
        # method -> (handler, its wrapper): a method's handler is one object for the server's life, so it is
        # wrapped once, not on every call.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:   # unknown method: nothing to observe, nothing to remember
            return None
        cached = self._wrapped.get(handler_call_details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = wrap_rpc_handler(handler, short_method(handler_call_details.method), self._observe)
        self._wrapped[handler_call_details.method] = (handler, wrapped)
        return wrapped

    @contextlib.contextmanager
    def _observe(self, method: str, context: Any) -> Iterator[None]:
        start = time.perf_counter()
        gauge = self._gauges.get(method)
        if gauge is None:
            gauge = self._gauges[method] = self._f.in_flight.labels(self.service, method)  # type: ignore[union-attr]
        gauge.inc()
        code: str | None = None
        try:
            yield
            code = _context_code(context) or "OK"
        except (asyncio.CancelledError, GeneratorExit):
            code = "DEADLINE_EXCEEDED" if _deadline_passed(context) else "CANCELLED"
            raise
        except aio.AbortError:
            code = _context_code(context) or "UNKNOWN"
            raise
        except BaseException as exc:
            # grpc turns a raised exception into UNKNOWN unless the handler aborted (sync servers raise Exception).
            code = _context_code(context) if _is_sync_abort(exc) else "UNKNOWN"
            code = code or "UNKNOWN"
            raise
        finally:
            gauge.dec()
            self._series.record((self.service, method, code), time.perf_counter() - start)


def _context_code(context: Any) -> str | None:
    try:
        return _code_name(context.code())
    except Exception:  # noqa: BLE001 - older contexts lack code(); the status then is the default
        return None


def _deadline_passed(context: Any) -> bool:
    try:
        remaining = context.time_remaining()
    except Exception:  # noqa: BLE001
        return False
    return remaining is not None and remaining <= 0


def _is_sync_abort(exc: BaseException) -> bool:
    # grpc's sync ServicerContext.abort raises a bare Exception after setting the code.
    return type(exc) is Exception


class ServerMessageSeries:
    """ddtree_rpc_server_latency_seconds / _calls of the messages of a long-lived stream, each filed under the unary
    method it stands for (a VerifyStream message as TargetService/Verify): dashboards and benches see one series
    whichever way the calls came."""

    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        self.service = service
        self._series = _Series(_server_families(registry))

    def record(self, method: str, code: str, seconds: float) -> None:
        """Observes one answered message."""
        self._series.record((self.service, method, code), seconds)


class _ClientBase:
    def __init__(self, registry: CollectorRegistry, service: str, peer: str = "") -> None:
        self.service = service
        self.peer = peer
        self._f = _client_families(registry)
        self._series = _Series(self._f)
        self._pending: set[asyncio.Task[None]] = set()

    def _details(self, details: aio.ClientCallDetails) -> aio.ClientCallDetails:
        if get_request_id() is None:   # nothing to forward (the engine's batched steps): the details as they are
            return details
        return aio.ClientCallDetails(details.method, details.timeout,
                                     aio.Metadata(*outgoing_metadata(details.metadata)),
                                     details.credentials, details.wait_for_ready)

    def _record(self, method: str, code: str, start: float) -> None:
        self._series.record((self.service, self.peer, method, code), time.perf_counter() - start)

    def record_message(self, method: str, code: str, seconds: float) -> None:
        """Observes one round trip on a long-lived stream under the unary method it stands for (ServerMessageSeries)."""
        self._series.record((self.service, self.peer, method, code), seconds)

    async def _finish(self, call: Any, method: str, start: float) -> None:
        try:
            code = _code_name(await call.code()) or "UNKNOWN"
        except asyncio.CancelledError:
            code = "CANCELLED"
        self._record(method, code, start)

    def _watch(self, call: Any, method: str, start: float) -> None:
        # Streams finish later than the interceptor returns; a task waits for the status (kept alive in _pending).
        task = asyncio.ensure_future(self._finish(call, method, start))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)


class ClientMetricsInterceptor(_ClientBase, aio.UnaryUnaryClientInterceptor):
    """Observes ddtree_rpc_client_latency_seconds / _calls{service, peer, method, code} of unary calls and adds
    x-request-id/traceparent. `service` is the calling service (the method label names the callee); `peer` is
    optional (empty when one interceptor serves several channels). grpc.aio files an interceptor under one RPC kind only, so pass `all()` to the
    channel to cover the streaming kinds too."""

    def __init__(self, registry: CollectorRegistry, service: str, peer: str = "") -> None:
        super().__init__(registry, service, peer)
        self._companions = [_UnaryStreamMetrics(self), _StreamUnaryMetrics(self), _StreamStreamMetrics(self)]

    def all(self) -> list[aio.ClientInterceptor]:
        """This interceptor and its unary-stream, stream-unary and stream-stream companions (shared families)."""
        return [self, *self._companions]

    async def intercept_unary_unary(self, continuation: Any, client_call_details: aio.ClientCallDetails,
                                    request: Any) -> Any:
        start, method = time.perf_counter(), short_method(client_call_details.method)
        try:
            call = await continuation(self._details(client_call_details), request)
            # Waiting here costs nothing extra: the caller awaits the same response right after.
            code = _code_name(await call.code()) or "UNKNOWN"
        except asyncio.CancelledError:
            self._record(method, "CANCELLED", start)
            raise
        self._record(method, code, start)
        return call


class _Companion:
    def __init__(self, owner: ClientMetricsInterceptor) -> None:
        self._owner = owner

    async def _intercept(self, continuation: Any, details: aio.ClientCallDetails, request: Any) -> Any:
        start, method = time.perf_counter(), short_method(details.method)
        call = await continuation(self._owner._details(details), request)  # noqa: SLF001
        self._owner._watch(call, method, start)  # noqa: SLF001
        return call


class _UnaryStreamMetrics(_Companion, aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: aio.ClientCallDetails,
                                     request: Any) -> Any:
        return await self._intercept(continuation, client_call_details, request)


class _StreamUnaryMetrics(_Companion, aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, client_call_details: aio.ClientCallDetails,
                                     request_iterator: Any) -> Any:
        return await self._intercept(continuation, client_call_details, request_iterator)


class _StreamStreamMetrics(_Companion, aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, client_call_details: aio.ClientCallDetails,
                                      request_iterator: Any) -> Any:
        return await self._intercept(continuation, client_call_details, request_iterator)


def client_interceptors(registry: CollectorRegistry, service: str, peer: str = "") -> list[aio.ClientInterceptor]:
    """Client interceptors for every RPC kind (service = the caller, e.g. "gateway"); reusable across channels."""
    return ClientMetricsInterceptor(registry, service, peer).all()


def message_recorder(interceptors) -> Callable[[str, str, float], None] | None:
    """The `record_message` of the metrics interceptor among `interceptors` (None when metrics are off)."""
    return next((i.record_message for i in interceptors if isinstance(i, ClientMetricsInterceptor)), None)
