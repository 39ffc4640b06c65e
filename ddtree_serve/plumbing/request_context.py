"""Request ids carried through gRPC metadata into a contextvar, and structured JSON logging that shows them."""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import json as _json
import logging
import re
import secrets
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import grpc
from grpc import aio

REQUEST_ID_KEY = "x-request-id"
TRACEPARENT_KEY = "traceparent"

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("ddtree_request_id", default=None)
_traceparent: contextvars.ContextVar[str | None] = contextvars.ContextVar("ddtree_traceparent", default=None)

# W3C trace context: version-traceid-parentid-flags, lowercase hex; all-zero ids are invalid.
_TRACEPARENT_RE = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_HEX32_RE = re.compile(r"^[0-9a-f]{32}$")

Metadata = Sequence[tuple[str, str | bytes]]


def new_request_id() -> str:
    """A fresh id shaped like a W3C trace id (32 lowercase hex digits), so it can seed a traceparent."""
    return secrets.token_hex(16)


def get_request_id() -> str | None:
    """The request id of the current context, or None."""
    return _request_id.get()


def set_request_id(request_id: str | None, traceparent: str | None = None) -> contextvars.Token:
    """Sets the current request id (and traceparent); returns the token for reset_request_id."""
    _traceparent.set(traceparent)
    return _request_id.set(request_id)


def reset_request_id(token: contextvars.Token) -> None:
    """Restores the request id that was current before set_request_id."""
    _request_id.reset(token)


@contextlib.contextmanager
def request_scope(request_id: str | None, traceparent: str | None = None) -> Iterator[str | None]:
    """Context manager: the given request id is current inside the block."""
    rid_token = _request_id.set(request_id)
    tp_token = _traceparent.set(traceparent)
    try:
        yield request_id
    finally:
        _traceparent.reset(tp_token)
        _request_id.reset(rid_token)


def parse_traceparent(value: str) -> str | None:
    """The trace id of a valid W3C traceparent header, else None."""
    m = _TRACEPARENT_RE.match(value.strip().lower())
    if m is None or m.group(1) == "ff" or set(m.group(2)) == {"0"} or set(m.group(3)) == {"0"}:
        return None
    return m.group(2)


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def extract_request_id(metadata: Metadata | None) -> tuple[str | None, str | None]:
    """(request id, traceparent) from invocation metadata; x-request-id wins, else the traceparent's trace id."""
    rid: str | None = None
    tp: str | None = None
    for key, value in metadata or ():
        k = key.lower()
        if k == REQUEST_ID_KEY and rid is None:
            rid = _text(value).strip() or None
        elif k == TRACEPARENT_KEY and tp is None and parse_traceparent(_text(value)) is not None:
            tp = _text(value).strip().lower()
    if rid is None and tp is not None:
        rid = parse_traceparent(tp)
    return rid, tp


def outgoing_metadata(metadata: Metadata | None) -> list[tuple[str, str | bytes]]:
    """Metadata plus the current request id and a traceparent, unless the caller already set them."""
    out = list(metadata or ())
    keys = {k.lower() for k, _ in out}
    rid = _request_id.get()
    if rid is None:
        return out
    if REQUEST_ID_KEY not in keys:
        out.append((REQUEST_ID_KEY, rid))
    if TRACEPARENT_KEY not in keys:
        tp = _traceparent.get()
        trace_id = parse_traceparent(tp) if tp else (rid if _HEX32_RE.match(rid) else None)
        if trace_id is not None:
            # Each hop is a new span of the same trace (W3C: fresh parent-id, same trace-id).
            out.append((TRACEPARENT_KEY, f"00-{trace_id}-{secrets.token_hex(8)}-01"))
    return out


# -- wrapping gRPC method handlers (shared with metrics.ServerMetricsInterceptor) ------------------------------

def wrap_rpc_handler(handler: grpc.RpcMethodHandler | None, method: str,
                     around: Callable[[str, Any], contextlib.AbstractContextManager[Any]]) -> grpc.RpcMethodHandler | None:
    """A copy of handler whose behaviour runs inside `around(method, context)`, for every RPC shape.

    The context manager is entered when the handler starts and left when it finishes: for server-streaming
    handlers that is the end of the stream, and an exception (abort, error, cancellation) passes through it.
    """
    if handler is None:
        return None
    if handler.unary_unary is not None:
        behavior, factory = handler.unary_unary, grpc.unary_unary_rpc_method_handler
    elif handler.unary_stream is not None:
        behavior, factory = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    elif handler.stream_unary is not None:
        behavior, factory = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    else:
        behavior, factory = handler.stream_stream, grpc.stream_stream_rpc_method_handler
    return factory(_wrap_behavior(behavior, method, around),
                   request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)


def _wrap_behavior(behavior: Callable[..., Any], method: str,
                   around: Callable[[str, Any], contextlib.AbstractContextManager[Any]]) -> Callable[..., Any]:
    # grpc.aio dispatches on the behaviour's kind (async generator, coroutine, sync), so the wrapper keeps it.
    if inspect.isasyncgenfunction(behavior):
        async def agen_wrapper(request: Any, context: Any) -> Any:
            with around(method, context):
                async for item in behavior(request, context):
                    yield item
        return agen_wrapper
    if inspect.iscoroutinefunction(behavior):
        async def coro_wrapper(request: Any, context: Any) -> Any:
            with around(method, context):
                return await behavior(request, context)
        return coro_wrapper
    if inspect.isgeneratorfunction(behavior):
        def gen_wrapper(request: Any, context: Any) -> Any:
            with around(method, context):
                yield from behavior(request, context)
        return gen_wrapper

    def sync_wrapper(request: Any, context: Any) -> Any:
        with around(method, context):
            return behavior(request, context)
    return sync_wrapper


class RequestIdServerInterceptor(aio.ServerInterceptor):
    """Makes the caller's x-request-id (or traceparent trace id) the current request id while a handler runs."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        rid, tp = extract_request_id(handler_call_details.invocation_metadata)
        if rid is None:
            return handler

        @contextlib.contextmanager
        def scope(_method: str, _context: Any) -> Iterator[None]:
            with request_scope(rid, tp):
                yield

        return wrap_rpc_handler(handler, handler_call_details.method, scope)


# -- logging ------------------------------------------------------------------------------------------------

# Attributes every LogRecord has; anything else came in through `extra=` and goes into the JSON line.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime",
                                                                                     "service", "request_id"}


class RequestContextFilter(logging.Filter):
    """Stamps each record with the service name and the current request id."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        if not hasattr(record, "request_id") or record.request_id is None:
            record.request_id = _request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, service, request_id, logger, msg, extras, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": getattr(record, "service", None),
            "request_id": getattr(record, "request_id", None),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return _json.dumps(out, default=str, ensure_ascii=False)


_HANDLER_MARK = "_ddtree_handler"


def configure_logging(service_name: str, level: int | str = logging.INFO, json: bool = True,
                      stream: Any = None) -> logging.Handler:
    """Installs one root handler (replacing a previous one of ours) that writes structured lines for the service."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, _HANDLER_MARK, False):
            root.removeHandler(h)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    setattr(handler, _HANDLER_MARK, True)
    handler.addFilter(RequestContextFilter(service_name))
    handler.setFormatter(JsonFormatter() if json else logging.Formatter(
        "%(asctime)s %(levelname)s %(service)s [%(request_id)s] %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    return handler
