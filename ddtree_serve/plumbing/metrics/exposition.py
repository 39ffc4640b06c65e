"""The /metrics HTTP endpoint: a registry served in the Prometheus text format from a daemon thread."""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - scrapes every second would flood logs
        pass


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _ThreadingWSGIServerV6(_ThreadingWSGIServer):
    address_family = socket.AF_INET6


def metrics_wsgi_app(registry: CollectorRegistry) -> Callable[..., list[bytes]]:
    """WSGI app serving the classic Prometheus text format whatever the scraper's Accept header says.

    prometheus_client (0.2x) answers an OpenMetrics Accept header, which Prometheus sends by default, with
    "underscores" escaping that rewrites `vllm:x` to `vllm_x` in sample lines (client_python issue #1177), breaking
    vLLM-named queries and dashboards. The 0.0.4 text format keeps the names exactly as declared.
    """
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found; try /metrics\n"]
        body = generate_latest(registry)
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_PLAIN_0_0_4), ("Content-Length", str(len(body)))])
        return [body]
    return app


@dataclass
class MetricsHTTPServer:
    """A running /metrics endpoint; close() stops it."""

    port: int
    _server: WSGIServer
    _thread: threading.Thread

    def close(self) -> None:
        """Stops serving and frees the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> MetricsHTTPServer:
    """Serves registry on http://host:port/metrics in a daemon thread (port 0 = ephemeral)."""
    server_cls = _ThreadingWSGIServerV6 if ":" in host else _ThreadingWSGIServer
    server = make_server(host, port, metrics_wsgi_app(registry), server_class=server_cls, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name=f"metrics-http-{server.server_port}", daemon=True)
    thread.start()
    return MetricsHTTPServer(int(server.server_port), server, thread)


def start_metrics_server(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> int:
    """Serves registry on host:port in a daemon thread for the life of the process; returns the bound port."""
    return serve_metrics(port, registry, host).port
