"""The metric names each service exports, built on demand from fresh registries (dashboards and tests check them)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry

from ddtree_serve.plumbing.metrics.families import DrafterMetrics, GatewayMetrics, TargetMetrics
from ddtree_serve.plumbing.metrics.interceptors import ClientMetricsInterceptor, ServerMetricsInterceptor

SERVICES = ("gateway", "target", "drafter")
_FAMILIES = {"gateway": GatewayMetrics, "target": TargetMetrics, "drafter": DrafterMetrics}


def metric_families(service: str) -> dict[str, str]:
    """{family name: type} that a service exports ("gateway" | "target" | "drafter"), as collected."""
    if service not in _FAMILIES:
        raise ValueError(f"unknown service {service!r}")
    registry = CollectorRegistry()
    _FAMILIES[service](registry, "m")
    # Every service is a gRPC server, and gateway/target are clients of the next hop.
    ServerMetricsInterceptor(registry, service)
    ClientMetricsInterceptor(registry, service)
    return {m.name: m.type for m in registry.collect()}


def exposed_series_names(service: str) -> frozenset[str]:
    """Every series name a scrape of the service can show (counter _total, histogram _bucket/_sum/_count, ...)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("", "_sum", "_count"), "gauge": ("",), "info": ("_info",)}
    out: set[str] = set()
    for name, kind in metric_families(service).items():
        out.update(name + s for s in suffixes.get(kind, ("",)))
    return frozenset(out)
