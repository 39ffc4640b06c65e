"""Writes deploy/grafana/dashboards/ddtree-serve.json (run after editing; tests check the file is up to date)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards" / "ddtree-serve.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"
M = '{model_name=~"$model_name"}'   # the vllm:* families carry model_name; the per-service ones are per job


def rate(series: str, by: str = "", sel: str = "") -> str:
    """sum [by (...)] (rate(series{sel}[$__rate_interval]))."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({series}{sel}[{RI}]))"


def mean(hist: str, by: str = "", sel: str = "") -> str:
    """Mean of a histogram over the rate window: rate(_sum) / rate(_count)."""
    return f"{rate(hist + '_sum', by, sel)} / {rate(hist + '_count', by, sel)}"


def quantile(q: float, hist: str, by: str = "", sel: str = "") -> str:
    """histogram_quantile over the rate of the _bucket series."""
    labels = ", ".join(["le", *[b.strip() for b in by.split(",") if b.strip()]])
    return f"histogram_quantile({q}, {rate(hist + '_bucket', labels, sel)})"


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}


class Layout:
    """Places panels on Grafana's 24-column grid, two or three to a row."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.y = 0
        self.x = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        if self.x:
            self.y += 8
            self.x = 0
        self.panels.append({"type": "row", "title": title, "id": self._id(), "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def panel(self, title: str, exprs: list[tuple[str, str]], unit: str, w: int = 8, description: str = "",
              kind: str = "timeseries", decimals: int | None = None) -> None:
        if self.x + w > 24:
            self.y += 8
            self.x = 0
        defaults: dict[str, Any] = {"unit": unit, "custom": {"lineWidth": 1, "fillOpacity": 10,
                                                              "showPoints": "never", "spanNulls": True}}
        if kind == "stat":
            defaults = {"unit": unit}
        if decimals is not None:
            defaults["decimals"] = decimals
        self.panels.append({
            "type": kind, "title": title, "id": self._id(), "description": description, "datasource": DS,
            "gridPos": {"h": 8, "w": w, "x": self.x, "y": self.y},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": ({"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                         "colorMode": "value", "graphMode": "area"} if kind == "stat" else
                        {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                         "tooltip": {"mode": "multi", "sort": "desc"}}),
            "targets": [target(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(exprs)],
        })
        self.x += w

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def build() -> dict[str, Any]:
    """The dashboard as a dict (Grafana schema 39)."""
    L = Layout()
    acceptance = (f"1 + {rate('vllm:spec_decode_num_accepted_tokens_total', sel=M)}"
                  f" / {rate('vllm:spec_decode_num_drafts_total', sel=M)}")

    L.row("Requests")
    L.panel("Token throughput", [(rate("vllm:generation_tokens_total", sel=M), "generated tokens/s"),
                                 (rate("vllm:prompt_tokens_total", sel=M), "prompt tokens/s")], "short",
            description="Generated (emitted) and prefilled tokens per second, all gateways.")
    L.panel("Scheduler queue", [(f"sum(vllm:num_requests_running{M})", "running"),
                                (f"sum(vllm:num_requests_waiting{M})", "waiting"),
                                (rate("vllm:num_preemptions_total", sel=M), "preempted/s")], "short",
            description="Requests running and waiting, and running ones preempted per second for a waiting one of "
                        "higher priority (--priority-scheduling-preemption-threshold).")
    L.panel("Finished requests", [(rate("vllm:request_success_total", "finished_reason", M), "{{finished_reason}}")],
            "reqps")
    L.panel("Prefix cache", [(f"{rate('vllm:prefix_cache_hits_total', sel=M)}"
                              f" / {rate('vllm:prefix_cache_queries_total', sel=M)}", "hit rate (tokens)"),
                             (rate("ddtree_target_prefix_reused_tokens_total"), "target reused tokens/s"),
                             (rate("ddtree_prefix_held_back_total", sel=M), "prompts held back/s")],
            "short", description="Share of prompt tokens served from parked sequences' cache rows (prefix caching; "
                                 "vLLM's counters), the tokens per second the targets did not run for it, and the "
                                 "prompts per second that waited a step to copy an in-flight prompt's rows.")
    L.panel("Time to first token", [(quantile(q, "vllm:time_to_first_token_seconds", sel=M), f"p{int(q * 100)}")
                                    for q in (0.5, 0.9, 0.99)], "s")
    L.panel("Inter-token latency", [(quantile(q, "vllm:inter_token_latency_seconds", sel=M), f"p{int(q * 100)}")
                                    for q in (0.5, 0.9, 0.99)], "s",
            description="A step that emits n tokens counts interval/n, n times.")
    L.panel("End-to-end request latency", [(quantile(q, "vllm:e2e_request_latency_seconds", sel=M),
                                            f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)]
            + [(quantile(0.9, "vllm:request_queue_time_seconds", sel=M), "queue p90")], "s")

    L.row("Speculative decoding")
    L.panel("Mean acceptance length", [(acceptance, "tokens / step")], "short", w=4, kind="stat", decimals=2,
            description="1 + accepted / drafts: tokens committed per verify step, bonus included.")
    L.panel("Acceptance length", [(acceptance, "all (vllm counters)"),
                                  (mean("ddtree_acceptance_length", "mode"), "{{mode}}")], "short", w=10)
    L.panel("Per-position acceptance rate",
            [(f"{rate('vllm:spec_decode_num_accepted_tokens_per_pos_total', 'position', M)}"
              f" / scalar({rate('vllm:spec_decode_num_drafts_total', sel=M)})", "depth {{position}}")],
            "percentunit", w=10, description="Share of drafts whose token at this depth (0 = first) was accepted.")
    L.panel("Draft tree size", [(f"{rate('vllm:spec_decode_num_draft_tokens_total', sel=M)}"
                                 f" / {rate('vllm:spec_decode_num_drafts_total', sel=M)}", "mean nodes / draft"),
                                (quantile(0.9, "ddtree_tree_size_nodes", "mode"), "p90 {{mode}}"),
                                (f"{rate('vllm:spec_decode_num_accepted_tokens_total', sel=M)}"
                                 f" / {rate('vllm:spec_decode_num_draft_tokens_total', sel=M)} * 100",
                                 "accepted per 100 nodes")], "short")
    L.panel("Step time (mean)", [(mean("ddtree_draft_seconds"), "draft"),
                                 (mean("ddtree_tree_build_seconds"), "tree build"),
                                 (mean("ddtree_verify_seconds"), "verify"),
                                 (mean("ddtree_step_seconds"), "whole step")], "s")
    L.panel("Step segments (mean)", [(mean("ddtree_step_segment_seconds", "segment"), "{{segment}}")], "s",
            description="A step's path between the processes (gateway/step_timeline.py): one-way trips, handlers, "
                        "the feature push and the drafter's store and draft, from the services' wall-clock stamps "
                        "(one host's clock).")
    L.panel("Batch size and steps", [(mean("ddtree_step_batch_size", "mode"), "gateway step {{mode}}"),
                                     (mean("ddtree_target_batch_size", "op"), "target {{op}}"),
                                     (mean("ddtree_drafter_batch_size"), "drafter draft"),
                                     (rate("ddtree_steps_total", "mode"), "steps/s {{mode}}")], "short")

    L.row("RPC hops")
    L.panel("Server RPC latency", [(quantile(q, "ddtree_rpc_server_latency_seconds", "job, method"),
                                    f"p{int(q * 100)} {{{{job}}}} {{{{method}}}}") for q in (0.5, 0.99)], "s",
            description="Handler time per hop, to the end of the stream for streaming calls.")
    L.panel("Client RPC latency", [(quantile(q, "ddtree_rpc_client_latency_seconds", "job, method"),
                                    f"p{int(q * 100)} {{{{job}}}} {{{{method}}}}") for q in (0.5, 0.99)], "s",
            description="Caller's view; minus the server latency of the same method = network + serialization.")
    L.panel("RPC errors and in-flight", [
        (rate("ddtree_rpc_server_calls_total", "job, method, code", '{code!="OK"}'), "{{job}} {{method}} {{code}}"),
        (rate("ddtree_rpc_client_calls_total", "job, method, code", '{code!="OK"}'),
         "client {{job}} {{method}} {{code}}"),
        ("sum by (job, method) (ddtree_rpc_server_in_flight)", "in flight {{job}} {{method}}")], "short")
    L.panel("Feature transport bandwidth", [(rate("ddtree_transport_bytes_total", "job, transport, direction"),
                                             "{{job}} {{transport}} {{direction}}")], "Bps", w=12)
    L.panel("Feature transport time (mean)", [(mean("ddtree_transport_seconds", "job, transport, direction"),
                                               "{{job}} {{transport}} {{direction}}")], "s", w=12)

    L.row("Target and drafter")
    L.panel("Target forward", [(mean("ddtree_target_forward_seconds", "op"), "mean {{op}}"),
                               (quantile(0.99, "ddtree_target_forward_seconds", "op"), "p99 {{op}}")], "s")
    L.panel("Drafter forward", [(mean("ddtree_drafter_forward_seconds"), "mean"),
                                (quantile(0.99, "ddtree_drafter_forward_seconds"), "p99")], "s")
    L.panel("Cache use", [
        ("sum by (instance) (ddtree_kv_cache_used_tokens) / sum by (instance) (ddtree_kv_cache_capacity_tokens)",
         "target KV {{instance}}"),
        ("sum by (instance) (ddtree_drafter_context_cache_used_tokens)"
         " / sum by (instance) (ddtree_drafter_context_cache_capacity_tokens)", "drafter context {{instance}}")],
        "percentunit")
    L.panel("Running sequences", [("sum by (instance) (ddtree_target_running_sequences)", "target {{instance}}"),
                                  ("sum by (instance) (ddtree_drafter_running_sequences)", "drafter {{instance}}")],
            "short")
    L.panel("GPU memory", [("sum by (job, instance, device) (ddtree_gpu_memory_allocated_bytes)",
                            "allocated {{job}} {{device}}"),
                           ("sum by (job, instance, device) (ddtree_gpu_memory_reserved_bytes)",
                            "reserved {{job}} {{device}}")], "bytes")
    L.panel("Structured outputs", [(rate("ddtree_target_grammars_prepared_total", "result"), "grammars {{result}}"),
                                   (mean("ddtree_target_grammar_compile_seconds"), "compile s (mean)"),
                                   (rate("ddtree_target_verify_nodes_pruned_total"), "draft nodes pruned")], "short",
            description="Grammars asked for by result, their compile time, and the draft-tree nodes the target "
                        "dropped before its forwards (refused by a grammar, or past keep_nodes).")
    L.panel("Process CPU and memory", [("sum by (job, instance) (rate(process_cpu_seconds_total[$__rate_interval]))",
                                        "cpu {{job}}"),
                                       ("sum by (job, instance) (process_resident_memory_bytes) / 2^30",
                                        "RSS GiB {{job}}")], "short")

    return {
        "uid": "ddtree-serve",
        "title": "ddtree-serve",
        "description": "Speculative decoding (DFlash + DDTree) across gateway, target and drafter services.",
        "tags": ["ddtree-serve", "vllm", "speculative-decoding"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "annotations": {"list": []},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {"text": "Prometheus", "value": "prometheus"}, "hide": 0, "refresh": 1},
            {"name": "model_name", "label": "Model", "type": "query", "datasource": DS,
             "query": {"query": "label_values(vllm:num_requests_running, model_name)", "refId": "model_name"},
             "definition": "label_values(vllm:num_requests_running, model_name)",
             "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "sort": 1,
             "current": {"text": "All", "value": "$__all"}, "hide": 0},
        ]},
        "panels": L.panels,
    }


def render() -> str:
    """The dashboard file's exact text."""
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    sys.stdout.write(f"wrote {OUT}\n")
