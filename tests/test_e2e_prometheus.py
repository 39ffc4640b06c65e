"""A real Prometheus scrapes the real services: its PromQL figures equal what the gateway tells the client.

Needs the `prometheus` binary (Debian package `prometheus`; scripts/test.sh installs it in CI). The test fails,
rather than skips, without it, so CI cannot pass while silently not running it.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import yaml

from bench import common
from launch.local_stack import LocalStack, free_port, free_ports
from ddtree_serve.proto import gateway_pb2, gateway_pb2_grpc
from tests.conftest import make_request, prompts_for, reference_greedy, run_streams

pytestmark = pytest.mark.slow

SCRAPE_INTERVAL_S = 1
INSTALL = "apt-get update && apt-get install -y --no-install-recommends prometheus"


class Prometheus:
    """A throwaway Prometheus on loopback scraping the given {job: metrics port} every second."""

    def __init__(self, jobs: dict[str, int]) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail(f"the prometheus binary is not installed (CI installs it: {INSTALL})")
        self.dir = Path(tempfile.mkdtemp(prefix="ddtree-prom-"))
        self.port = free_port()
        config = {
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "scrape_timeout": f"{SCRAPE_INTERVAL_S}s"},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                               for job, port in jobs.items()],
        }
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(self.dir / "prometheus.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [binary, f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=info"],
            stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
            # Target discovery and the first scrape take a few seconds: start measuring once every job is up.
            self.wait_for("count(up == 1)", lambda v: v == len(jobs), timeout_s=60)
        except BaseException:
            self.stop()
            raise

    def _get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
            return r.read()

    def _wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{(self.dir / 'prometheus.log').read_text()}")
            try:
                self._get("/-/ready")
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        raise TimeoutError("prometheus not ready")

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """Instant query: [(labels, value)]."""
        body = json.loads(self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
        assert body["status"] == "success", body
        return [(r["metric"], float(r["value"][1])) for r in body["data"]["result"]]

    def scalar(self, expr: str) -> float | None:
        """The single value of an expression, or None while it has no result."""
        result = self.query(expr)
        assert len(result) <= 1, result
        return result[0][1] if result else None

    def wait_for(self, expr: str, accept: Callable[[float], bool], timeout_s: float = 30) -> float:
        """Polls until the expression's value passes `accept` (i.e. the final counters have been scraped)."""
        deadline = time.time() + timeout_s
        value = None
        while time.time() < deadline:
            value = self.scalar(expr)
            if value is not None and accept(value):
                return value
            time.sleep(0.25)
        raise AssertionError(f"{expr} = {value} after {timeout_s} s")

    def settle(self, expr: str, expected: float, timeout_s: float = 30) -> None:
        """Waits for the scrape that shows a counter's final value; fails if it overshoots or never gets there."""
        assert self.wait_for(expr, lambda v: v >= expected, timeout_s) == expected, expr

    def targets_up(self) -> dict[str, bool]:
        """job -> whether its target was scraped successfully within the last minute."""
        return {labels["job"]: value == 1 for labels, value in self.query("max by (job) (max_over_time(up[1m]))")}

    def scrape_errors(self) -> dict[str, str]:
        """job -> last scrape error (for failure messages)."""
        body = json.loads(self._get("/api/v1/targets"))
        return {t["labels"]["job"]: t["lastError"] for t in body["data"]["activeTargets"] if t["lastError"]}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def prometheus(jobs: dict[str, int]) -> Iterator[Prometheus]:
    prom = Prometheus(jobs)
    try:
        yield prom
    finally:
        prom.stop()


def first_stop_token(reference: list[int], min_index: int) -> tuple[int, int]:
    """A token whose first occurrence in the greedy output is at index >= min_index: (token, index)."""
    for i, tok in enumerate(reference):
        if i >= min_index and tok not in reference[:i]:
            return tok, i
    raise AssertionError(f"no fresh token after index {min_index} in {reference}")


def test_promql_mean_acceptance_length_equals_client_stats(checkpoints) -> None:
    target, drafter = checkpoints("qwen3")
    # A prompt on which the tiny random drafter gets some drafts accepted (budget 64), so the figure is not just 1.
    prompt = prompts_for(target, [9], seed=3)[0]
    reference = reference_greedy(target, prompt, 96)
    # Ending on a stop token (not max_tokens) keeps every verify step a drafted one: near max_tokens the gateway
    # verifies an empty tree, which the per-request figure counts as a step and vLLM's counters do not.
    stop, index = first_stop_token(reference, 40)
    stack = LocalStack(model=str(target), drafter=str(drafter), threads=1, metrics=True).start(timeout_s=180)
    try:
        with prometheus({f"ddtree-{n}": p for n, p in stack.metrics_ports.items()}) as prom:
            [result] = run_streams(stack.gateway, [make_request(prompt, 96, mode="ddtree", budget=64,
                                                                stop_token_ids=[stop])])
            stats = result["stats"]
            assert result["token_ids"] == reference[:index + 1] and result["finish_reason"] == "stop"
            assert stats.steps > 0
            assert stats.accepted_tokens > 0, "no draft accepted: the acceptance-length check would be trivial"
            # Each job is scraped on its own clock: wait until every counter shows its final value, then compare.
            # The request's success is counted after its last step, so once it shows, so do all step counters.
            settle = prom.settle
            settle('sum(vllm:request_success_total{finished_reason="stop"})', 1)
            settle("sum(vllm:spec_decode_num_drafts_total)", stats.steps)
            mean_acceptance = prom.scalar("1 + sum(vllm:spec_decode_num_accepted_tokens_total)"
                                          " / sum(vllm:spec_decode_num_drafts_total)")
            assert mean_acceptance == pytest.approx(stats.mean_acceptance_length, rel=1e-9)
            settle("sum(vllm:spec_decode_num_accepted_tokens_total)", stats.accepted_tokens)
            settle("sum(vllm:spec_decode_num_draft_tokens_total)", stats.draft_tokens)
            settle("sum(vllm:generation_tokens_total)", stats.generated_tokens)
            settle("sum(vllm:spec_decode_num_accepted_tokens_per_pos_total)", stats.accepted_tokens)
            settle("sum(vllm:e2e_request_latency_seconds_count)", 1)
            assert prom.scalar("sum(ddtree_acceptance_length_sum) / sum(ddtree_acceptance_length_count)") == \
                pytest.approx(stats.mean_acceptance_length, rel=1e-9)
            # Every hop was scraped and recorded its RPCs: one Verify and one Draft per step for one request.
            assert prom.targets_up() == {"ddtree-target": True, "ddtree-drafter": True, "ddtree-gateway": True}, \
                prom.scrape_errors()
            settle('sum(ddtree_rpc_server_calls_total{job="ddtree-target",method="TargetService/Verify",code="OK"})',
                   stats.steps)
            settle('sum(ddtree_rpc_client_calls_total{job="ddtree-gateway",method="TargetService/Verify",code="OK"})',
                   stats.steps)
            settle('sum(ddtree_rpc_server_calls_total{job="ddtree-drafter",method="DrafterService/Draft",code="OK"})',
                   stats.steps)
            settle('sum(ddtree_rpc_server_calls_total{job="ddtree-gateway",method="Gateway/GenerateStream",code="OK"})',
                   1)
            settle('sum(ddtree_target_forward_seconds_count{op="verify"})', stats.steps)
            # Every step's draft was answered once, from the draft made when its features arrived (a hit): the
            # first step's too, made on the prompt's push with the top-k the gateway named in its Prefill. The last
            # push's draft may run for nothing when the request ends (one forward more), or be dropped after the
            # release.
            settle("sum(ddtree_drafter_prefetched_drafts_total)", stats.steps)
            assert prom.scalar('sum(ddtree_drafter_prefetched_drafts_total{outcome="hit"})') == stats.steps
            forwards = prom.wait_for("sum(ddtree_drafter_forward_seconds_count)", lambda v: v >= stats.steps)
            assert stats.steps <= forwards <= stats.steps + 1
            # Context features: what the target sent is what the drafter received. The target counts a push when
            # it is acknowledged, after its Verify has answered, so wait for the two counters to meet.
            gap = ('sum(ddtree_transport_bytes_total{direction="send"})'
                   ' - sum(ddtree_transport_bytes_total{direction="recv"})')
            assert prom.wait_for(gap, lambda v: v == 0) == 0, gap
            assert prom.scalar('sum(ddtree_transport_bytes_total{direction="send"})') > 0
            # An eager (CPU) target has no verify graphs to capture: nothing pending, so a benchmark starts at once.
            assert prom.scalar('sum(ddtree_target_graph_buckets{state="pending"})') == 0
            assert common.wait_for_graphs(stack, timeout_s=5) < 1
    finally:
        stack.stop()


# -- one gateway fronting two target/drafter pairs -----------------------------------------------------------

class Procs:
    """Service processes started by this test (stopped by their own Popen handles)."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.log_dir = Path(tempfile.mkdtemp(prefix="ddtree-pairs-"))

    def start(self, name: str, args: list[str]) -> None:
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - lives with the process
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "launch.cli", *args], stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n" + "\n".join(p.read_text().splitlines()[-20:])
                         for p in sorted(self.log_dir.glob("*.log")))

    def wait_serving(self, address: str, timeout_s: float = 180) -> None:
        from ddtree_serve.plumbing.rpc import wait_until_serving

        async def wait() -> None:
            task = asyncio.create_task(wait_until_serving(address, timeout_s=timeout_s))
            while not task.done():
                dead = [n for n, p in self.procs.items() if p.poll() is not None]
                if dead:
                    task.cancel()
                    raise RuntimeError(f"{dead} exited during start-up:\n{self.logs()}")
                await asyncio.sleep(0.2)
            await task

        asyncio.run(wait())

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _model_info(address: str) -> gateway_pb2.ModelInfoResponse:
    async def call() -> gateway_pb2.ModelInfoResponse:
        async with grpc.aio.insecure_channel(address) as channel:
            return await gateway_pb2_grpc.GatewayStub(channel).ModelInfo(gateway_pb2.ModelInfoRequest(), timeout=30)

    return asyncio.run(call())


def test_gateway_spreads_requests_over_two_pairs(checkpoints, tmp_path) -> None:
    target, drafter = checkpoints("qwen3")
    names = ("target0", "drafter0", "target1", "drafter1", "gateway")
    ports = free_ports(2 * len(names))
    grpc_ports, metrics_ports = dict(zip(names, ports)), dict(zip(names, ports[len(names):]))
    pairs = [{"target": f"127.0.0.1:{grpc_ports[f'target{i}']}", "drafter": f"127.0.0.1:{grpc_ports[f'drafter{i}']}"}
             for i in (0, 1)]
    (tmp_path / "pairs.yaml").write_text(yaml.safe_dump(pairs))
    procs = Procs()

    def common(name: str) -> list[str]:
        return ["--host", "127.0.0.1", "--port", str(grpc_ports[name]), "--metrics-port", str(metrics_ports[name])]

    try:
        for i in (0, 1):
            procs.start(f"target{i}", ["target", "--model", str(target), "--threads", "1", *common(f"target{i}")])
            procs.start(f"drafter{i}", ["drafter", "--drafter", str(drafter), "--target-model", str(target),
                                        "--threads", "1", *common(f"drafter{i}")])
        procs.start("gateway", ["gateway", "--pairs", str(tmp_path / "pairs.yaml"), "--mode", "ddtree",
                                "--budget", "16", *common("gateway")])
        gateway = f"127.0.0.1:{grpc_ports['gateway']}"
        procs.wait_serving(gateway)
        info = _model_info(gateway)
        assert [(p.target, p.drafter) for p in info.pairs] == [(p["target"], p["drafter"]) for p in pairs]

        with prometheus(metrics_ports) as prom:
            lengths = [5, 11, 7, 16, 3, 9]
            prompts = prompts_for(target, lengths, seed=23)
            modes = ["ddtree", "ddtree", "dflash", "ddtree", "ar", "ddtree"]
            results = run_streams(gateway, [make_request(p, 24, mode=m) for p, m in zip(prompts, modes)])
            for prompt, mode, result in zip(prompts, modes, results):
                assert result["token_ids"] == reference_greedy(target, prompt, 24), f"mode={mode}"
            n = len(prompts)
            prom.settle('sum(vllm:request_success_total{job="gateway"})', n)
            # Between them the pairs prefilled every request exactly once, and both pairs did work.
            prom.settle('sum(ddtree_target_batch_size_sum{op="prefill"})', n)
            prefilled = {}
            for i in (0, 1):
                job = f"target{i}"
                prefilled[job] = prom.scalar(f'sum(ddtree_target_batch_size_sum{{job="{job}",op="prefill"}})')
                assert prefilled[job] > 0, f"pair {i} got no request"
                assert prom.wait_for(f'sum(ddtree_target_forward_seconds_count{{job="{job}",op="verify"}})',
                                     lambda v: v > 0) > 0
                assert prom.wait_for(f'sum(ddtree_drafter_forward_seconds_count{{job="drafter{i}"}})',
                                     lambda v: v > 0) > 0
                assert prom.wait_for(f'sum(ddtree_rpc_server_calls_total{{job="drafter{i}",'
                                     f'method="DrafterService/Draft",code="OK"}})', lambda v: v > 0) > 0
            assert sum(prefilled.values()) == n
            total_steps = sum(r["stats"].steps for r in results)
            prom.settle('sum(ddtree_target_batch_size_sum{op="verify"})', total_steps)
            assert prom.targets_up() == dict.fromkeys(metrics_ports, True), prom.scrape_errors()
    finally:
        procs.stop()
