"""Metric names/labels, the ITL trick, gRPC metric interceptors and request-id propagation (tiny in-test server)."""
from __future__ import annotations

import asyncio
import io
import json
import logging
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc import aio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ddtree_serve.plumbing import metrics as M
from ddtree_serve.plumbing.metrics import names
from ddtree_serve.plumbing import request_context as rc

VLLM_COUNTERS = ["vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:spec_decode_num_drafts",
                 "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
                 "vllm:spec_decode_num_accepted_tokens_per_pos"]
VLLM_HISTOGRAMS = ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                   "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"]
VLLM_GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting"]


def scrape(registry: CollectorRegistry) -> dict[str, list]:
    """{sample name: [(labels, value), ...]} from the text exposition, as Prometheus would read it."""
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples: dict[str, list], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def types(registry: CollectorRegistry) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(generate_latest(registry).decode())}


def test_gateway_vllm_names_types_and_labels() -> None:
    reg = CollectorRegistry()
    g = M.GatewayMetrics(reg, "tiny-qwen3")
    g.set_queue(running=3, waiting=2)
    g.observe_prompt(7)
    g.observe_first_token(0.05)
    g.observe_tokens(0.02, 2)
    g.observe_step(1, [8], [2], 0.001, 0.0005, 0.002, 0.004)
    g.observe_finished("stop", prompt_tokens=7, generation_tokens=3, e2e_s=0.2, queue_s=0.01)
    t = types(reg)
    for name in VLLM_COUNTERS:
        assert t[name] == "counter", name
    for name in VLLM_HISTOGRAMS:
        assert t[name] == "histogram", name
    for name in VLLM_GAUGES:
        assert t[name] == "gauge", name
    s = scrape(reg)
    base = {"model_name": "tiny-qwen3", "engine": "ddtree-serve"}
    # Counters are declared without _total; the exposition adds it (as vLLM relies on).
    assert value(s, "vllm:prompt_tokens_total", **base) == 7
    assert value(s, "vllm:generation_tokens_total", **base) == 3
    assert value(s, "vllm:request_success_total", finished_reason="stop", **base) == 1
    assert value(s, "vllm:num_requests_running", **base) == 3
    assert value(s, "vllm:num_requests_waiting", **base) == 2
    assert value(s, "vllm:time_to_first_token_seconds_count", **base) == 1
    assert value(s, "vllm:e2e_request_latency_seconds_sum", **base) == pytest.approx(0.2)
    assert value(s, "vllm:request_queue_time_seconds_sum", **base) == pytest.approx(0.01)
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total"):
        assert all(set(lab) >= {"model_name", "engine"} for lab, _ in s[name])
    assert {lab["position"] for lab, _ in s["vllm:spec_decode_num_accepted_tokens_per_pos_total"]} == {"0", "1"}
    assert value(s, "ddtree_step_seconds_count", model_name="tiny-qwen3", mode="ddtree") == 1


def test_inter_token_latency_observes_interval_over_n_n_times() -> None:
    reg = CollectorRegistry()
    g = M.GatewayMetrics(reg, "m")
    g.observe_tokens(0.03, 3)   # one step, 3 tokens, 30 ms after the previous emission
    g.observe_tokens(0.5, 0)    # nothing emitted: nothing observed
    s = scrape(reg)
    assert value(s, "vllm:inter_token_latency_seconds_count") == 3
    assert value(s, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.03)
    # All three observations are 10 ms, none is 30 ms.
    assert value(s, "vllm:inter_token_latency_seconds_bucket", le="0.0075") == 0
    assert value(s, "vllm:inter_token_latency_seconds_bucket", le="0.01") == 3
    assert value(s, "vllm:generation_tokens_total") == 3


def test_observe_step_spec_decode_counters_and_acceptance() -> None:
    reg = CollectorRegistry()
    g = M.GatewayMetrics(reg, "m")
    # Three sequences: a tree of 8 nodes accepting 3, a tree of 4 accepting 0, and an AR step (empty tree).
    g.observe_step(3, [8, 4, 0], [3, 0, 0], draft_s=0.002, tree_s=0.001, verify_s=0.01, step_s=0.015)
    g.observe_step(1, [16], [5], draft_s=0.002, tree_s=0.001, verify_s=0.01, step_s=0.015)
    s = scrape(reg)
    drafts = value(s, "vllm:spec_decode_num_drafts_total")
    accepted = value(s, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts == 3                      # the AR sequence counts no draft
    assert value(s, "vllm:spec_decode_num_draft_tokens_total") == 8 + 4 + 16
    assert accepted == 3 + 5
    per_pos = {lab["position"]: v for lab, v in s["vllm:spec_decode_num_accepted_tokens_per_pos_total"]}
    assert per_pos == {"0": 2, "1": 2, "2": 2, "3": 1, "4": 1}
    assert sum(per_pos.values()) == accepted
    assert 1 + accepted / drafts == pytest.approx((4 + 1 + 6) / 3)
    # Acceptance-length histogram counts every sequence, bonus included (AR = 1).
    assert value(s, "ddtree_acceptance_length_count") == 4
    assert value(s, "ddtree_acceptance_length_sum") == 4 + 1 + 1 + 6
    assert value(s, "ddtree_tree_size_nodes_sum") == 28
    assert value(s, "ddtree_step_batch_size_sum") == 4
    assert value(s, "ddtree_verify_seconds_sum") == pytest.approx(0.02)
    with pytest.raises(ValueError):
        g.observe_step(2, [1, 2], [0], 0, 0, 0, 0)


def test_target_and_drafter_metrics() -> None:
    reg = M.new_registry()
    t = M.TargetMetrics(reg, "tgt")
    t.observe_forward("verify", batch_size=4, seconds=0.016, num_tokens=260)
    t.observe_forward("prefill", batch_size=1, seconds=0.05)
    t.set_cache(running=4, max_sequences=8, used_tokens=1000, capacity_tokens=16384)
    t.observe_transport("inline", 4096, 0.001)
    t.observe_transport("inline", 1024)   # untimed transfer: bytes only
    assert t.track_gpu_memory("cpu") is False
    s = scrape(reg)
    assert value(s, "ddtree_target_forward_seconds_count", model_name="tgt", op="verify") == 1
    assert value(s, "ddtree_target_forward_tokens_sum", op="verify") == 260
    assert value(s, "ddtree_kv_cache_used_tokens", model_name="tgt") == 1000
    assert value(s, "ddtree_kv_cache_capacity_tokens") == 16384
    assert value(s, "ddtree_target_running_sequences") == 4
    assert value(s, "ddtree_target_forward_seconds_count", op="prefill") == 1
    assert value(s, "ddtree_transport_bytes_total", transport="inline", direction="send") == 5120
    assert value(s, "ddtree_transport_seconds_count", transport="inline") == 1
    assert "process_resident_memory_bytes" in s
    assert "ddtree_gpu_memory_allocated_bytes" not in s   # CPU: family declared, no sample

    reg2 = CollectorRegistry()
    d = M.DrafterMetrics(reg2, "drf")
    d.observe_draft(batch_size=2, seconds=0.003)
    d.set_cache(running=2, max_sequences=8, used_tokens=300, capacity_tokens=4096)
    d.observe_transport_received("inline", 2048, 0.0005)
    s2 = scrape(reg2)
    assert value(s2, "ddtree_drafter_forward_seconds_count", model_name="drf") == 1
    assert value(s2, "ddtree_drafter_batch_size_sum") == 2
    assert value(s2, "ddtree_drafter_context_cache_used_tokens") == 300
    assert value(s2, "ddtree_drafter_max_sequences") == 8
    assert value(s2, "ddtree_transport_bytes_total", direction="recv") == 2048


def test_metric_names_helper_and_colons_are_valid() -> None:
    families = {svc: set(names.metric_families(svc)) for svc in names.SERVICES}
    assert set(families) == {"gateway", "target", "drafter"}
    for name in VLLM_COUNTERS + VLLM_HISTOGRAMS + VLLM_GAUGES:
        assert name in families["gateway"]
    for svc in ("gateway", "target", "drafter"):
        assert {"ddtree_rpc_server_latency_seconds", "ddtree_rpc_client_latency_seconds"} <= families[svc]
    assert "ddtree_kv_cache_used_tokens" in families["target"]
    assert "vllm:generation_tokens_total" in names.exposed_series_names("gateway")
    assert "ddtree_rpc_server_latency_seconds_bucket" in names.exposed_series_names("drafter")
    # Two registries are independent: no global state.
    M.GatewayMetrics(CollectorRegistry(), "a")
    M.GatewayMetrics(CollectorRegistry(), "a")


def test_metrics_http_server_ephemeral_port() -> None:
    reg = CollectorRegistry()
    M.GatewayMetrics(reg, "m").set_queue(1, 0)
    server = M.serve_metrics(0, reg, host="127.0.0.1")
    try:
        assert server.port > 0
        # The Accept header Prometheus 2.x/3.x sends: OpenMetrics first. prometheus_client would answer it with
        # escaped names (vllm_...); our endpoint keeps the declared names.
        req = urllib.request.Request(f"http://127.0.0.1:{server.port}/metrics", headers={"Accept": (
            "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
            "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")})
        with urllib.request.urlopen(req, timeout=5) as resp:
            body = resp.read().decode()
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert 'vllm:num_requests_running{engine="ddtree-serve",model_name="m"} 1.0' in body
        assert "vllm_" not in body
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/nope", timeout=5)
    finally:
        server.close()
    assert M.start_metrics_server(0, CollectorRegistry(), host="127.0.0.1") > 0


# -- interceptors on a tiny grpc.aio server (generic handlers, raw bytes) ----------------------------------

LOG = logging.getLogger("test.handler")


async def _unary(request: bytes, context: aio.ServicerContext) -> bytes:
    LOG.info("handled", extra={"payload": request.decode()})
    if request == b"bad":
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad request")
    if request == b"boom":
        raise RuntimeError("boom")
    return (rc.get_request_id() or "").encode()


async def _stream(request: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
    for i in range(3):
        if request == b"bad" and i == 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad midway")
        await asyncio.sleep(0.01)
        yield f"{i}:{rc.get_request_id()}".encode()


def _handlers() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler("test.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream),
    })


async def _serve(registry: CollectorRegistry) -> tuple[aio.Server, int]:
    server = aio.server(interceptors=[M.ServerMetricsInterceptor(registry, "echo"), rc.RequestIdServerInterceptor()])
    server.add_generic_rpc_handlers((_handlers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _settle(registry: CollectorRegistry, name: str, want: float, **labels: str) -> None:
    # Stream statuses are recorded by a task that wakes after the caller's await; give it a few loop turns.
    for _ in range(100):
        if value(scrape(registry), name, **labels) >= want:
            return
        await asyncio.sleep(0.01)


def test_interceptors_record_codes_for_unary_and_streaming() -> None:
    async def main() -> tuple[dict, dict]:
        sreg, creg = CollectorRegistry(), CollectorRegistry()
        server, port = await _serve(sreg)
        client = M.ClientMetricsInterceptor(creg, "echo", peer=f"127.0.0.1:{port}")
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}", interceptors=client.all()) as ch:
                unary, stream = ch.unary_unary("/test.Echo/Unary"), ch.unary_stream("/test.Echo/Stream")
                assert await unary(b"ok") == b""
                with pytest.raises(aio.AioRpcError) as err:
                    await unary(b"bad")
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                with pytest.raises(aio.AioRpcError) as err:
                    await unary(b"boom")
                assert err.value.code() == grpc.StatusCode.UNKNOWN
                assert [m async for m in stream(b"ok")] == [b"0:None", b"1:None", b"2:None"]
                with pytest.raises(aio.AioRpcError) as err:
                    _ = [m async for m in stream(b"bad")]
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                await _settle(creg, "ddtree_rpc_client_calls_total", 2, method="Echo/Stream")
        finally:
            await server.stop(None)
        return scrape(sreg), scrape(creg)

    s, c = asyncio.run(main())
    for code, n in (("OK", 1), ("INVALID_ARGUMENT", 1), ("UNKNOWN", 1)):
        assert value(s, "ddtree_rpc_server_calls_total", service="echo", method="Echo/Unary", code=code) == n, code
        assert value(s, "ddtree_rpc_server_latency_seconds_count", method="Echo/Unary", code=code) == n, code
        assert value(c, "ddtree_rpc_client_latency_seconds_count", service="echo", method="Echo/Unary", code=code) == n
    for code in ("OK", "INVALID_ARGUMENT"):
        assert value(s, "ddtree_rpc_server_calls_total", method="Echo/Stream", code=code) == 1, code
        assert value(c, "ddtree_rpc_client_calls_total", method="Echo/Stream", code=code) == 1, code
    # Server-streaming latency runs to the end of the stream: 3 sleeps of 10 ms.
    assert value(s, "ddtree_rpc_server_latency_seconds_sum", method="Echo/Stream", code="OK") >= 0.03
    assert value(s, "ddtree_rpc_server_in_flight", method="Echo/Stream") == 0
    assert all(lab["peer"].startswith("127.0.0.1:") for lab, _ in c["ddtree_rpc_client_calls_total"])


def test_request_id_propagates_client_to_server_context_and_logs() -> None:
    buf = io.StringIO()
    handler = rc.configure_logging("echo-svc", logging.INFO, json=True, stream=buf)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"

    async def main() -> tuple[bytes, list[bytes], bytes]:
        server, port = await _serve(CollectorRegistry())
        client = M.ClientMetricsInterceptor(CollectorRegistry(), "echo")
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}", interceptors=client.all()) as ch:
                unary, stream = ch.unary_unary("/test.Echo/Unary"), ch.unary_stream("/test.Echo/Stream")
                with rc.request_scope("req-42"):
                    got = await unary(b"hello")
                    streamed = [m async for m in stream(b"ok")]
                assert rc.get_request_id() is None   # the scope is gone
                # Only a W3C traceparent (e.g. from an OpenTelemetry client): its trace id becomes the request id.
                via_tp = await unary(b"tp", metadata=(("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01"),))
        finally:
            await server.stop(None)
        return got, streamed, via_tp

    try:
        got, streamed, via_tp = asyncio.run(main())
    finally:
        logging.getLogger().removeHandler(handler)
    assert got == b"req-42"
    assert streamed == [b"0:req-42", b"1:req-42", b"2:req-42"]
    assert via_tp == trace_id.encode()
    lines = [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]
    handled = [r for r in lines if r["msg"] == "handled"]
    assert [(r["service"], r["request_id"], r["payload"]) for r in handled] == [
        ("echo-svc", "req-42", "hello"), ("echo-svc", trace_id, "tp")]
    assert handled[0]["level"] == "INFO" and handled[0]["logger"] == "test.handler"


def test_outgoing_metadata_and_traceparent_parsing() -> None:
    assert rc.outgoing_metadata([("a", "1")]) == [("a", "1")]   # no current id: untouched
    rid = rc.new_request_id()
    with rc.request_scope(rid):
        md = dict(rc.outgoing_metadata(()))
    assert md["x-request-id"] == rid
    assert rc.parse_traceparent(md["traceparent"]) == rid
    with rc.request_scope("abc"):
        assert rc.outgoing_metadata([("x-request-id", "keep")]) == [("x-request-id", "keep")]
    assert rc.parse_traceparent("00-" + "0" * 32 + "-00f067aa0ba902b7-01") is None
    assert rc.parse_traceparent("garbage") is None
    assert rc.extract_request_id([("X-Request-Id", "r1"), ("traceparent", "bad")]) == ("r1", None)


def test_text_log_format_carries_request_id() -> None:
    buf = io.StringIO()
    handler = rc.configure_logging("gw", "DEBUG", json=False, stream=buf)
    try:
        with rc.request_scope("rid-7"):
            logging.getLogger("x").debug("hi")
    finally:
        logging.getLogger().removeHandler(handler)
    assert "gw [rid-7] x: hi" in buf.getvalue()
