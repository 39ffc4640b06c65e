"""Prometheus metrics: per-service families, gRPC interceptors, the /metrics endpoint (names.py: the name lists)."""
from ddtree_serve.plumbing.metrics.exposition import MetricsHTTPServer, metrics_wsgi_app, serve_metrics, start_metrics_server
from ddtree_serve.plumbing.metrics.families import (ENGINE, DrafterMetrics, GatewayMetrics, TargetMetrics,
                                                    new_registry)
from ddtree_serve.plumbing.metrics.interceptors import (ClientMetricsInterceptor, ServerMessageSeries,
                                                        ServerMetricsInterceptor, client_interceptors,
                                                        message_recorder, short_method)

__all__ = ["ENGINE", "ClientMetricsInterceptor", "DrafterMetrics", "GatewayMetrics", "MetricsHTTPServer",
           "ServerMessageSeries", "ServerMetricsInterceptor", "TargetMetrics", "client_interceptors", "message_recorder",
           "metrics_wsgi_app", "new_registry",
           "serve_metrics", "short_method", "start_metrics_server"]
