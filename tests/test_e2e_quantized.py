"""Through the three services with `--quantize int8`: greedy output equals the quantized model's own greedy decoding
(transformers with the dequantized weights); the memory plan is served and exported; a plan that cannot hold one
sequence refuses to start in one line."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddtree_serve.proto import gateway_pb2, gateway_pb2_grpc
from launch.local_stack import free_port
from tests.conftest import make_request, prompts_for, reference_greedy, run_streams, start_stack

pytestmark = pytest.mark.slow

BATCH = [(5, 40, "ddtree", 8), (14, 33, "dflash", 0), (9, 40, "ar", 0)]


def _model_info(address: str) -> gateway_pb2.ModelInfoResponse:
    async def call():
        async with grpc.aio.insecure_channel(address) as channel:
            return await gateway_pb2_grpc.GatewayStub(channel).ModelInfo(gateway_pb2.ModelInfoRequest(), timeout=30)

    return asyncio.run(call())


def _gauges(port: int, family: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            return {next(v for k, v in s.labels.items() if k != "model_name"): s.value for s in fam.samples}
    return {}


def test_int8_target_through_the_services_equals_the_quantized_reference(checkpoints):
    target, drafter = checkpoints("qwen3_5")
    prompts = prompts_for(target, [n for n, *_ in BATCH], seed=3)
    # 0.01 GiB of cache: the tiny model's 64-token slots fit many times over, so the batch stays the requested 8.
    stack = start_stack(target, drafter, metrics=True,
                        extra={"target": ["--quantize", "int8", "--max-seq-len", "256", "--kv-cache-memory", "0.01"]})
    try:
        results = run_streams(stack.gateway, [make_request(p, t, m, b) for p, (_, t, m, b) in zip(prompts, BATCH)])
        info = _model_info(stack.gateway)
        plan_bytes = _gauges(stack.metrics_ports["target"], "ddtree_target_memory_plan_bytes")
        plan_seqs = _gauges(stack.metrics_ports["target"], "ddtree_target_memory_plan_sequences")
    finally:
        stack.stop()
    for prompt, (_, max_tokens, mode, _), result in zip(prompts, BATCH, results):
        assert result["token_ids"] == reference_greedy(target, prompt, max_tokens, quantize="int8"), f"mode={mode}"
        if mode != "ar":
            assert result["stats"].draft_tokens >= result["stats"].steps > 0
    pair = info.pairs[0]
    assert pair.target_quantize == "int8"
    memory = pair.target_memory
    assert memory.enforced and memory.source == "--kv-cache-memory" and memory.max_batch == 8
    assert memory.cache_bytes == 9 * memory.slot_bytes and memory.weight_bytes > 0
    assert plan_bytes["cache"] == memory.cache_bytes and plan_bytes["weights"] == memory.weight_bytes
    assert plan_seqs == {"held": 8.0, "fit": float(memory.fit_batch), "requested": 8.0}


def test_a_target_whose_cache_cannot_hold_one_sequence_refuses_to_start_in_one_line(checkpoints):
    target, _ = checkpoints("qwen3")
    cmd = [sys.executable, "-m", "launch.cli", "target", "--model", str(target), "--port", str(free_port()),
           "--max-seq-len", "512", "--kv-cache-memory", "0.000001", "--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ddtree-serve target: error: not enough memory for one sequence of --max-seq-len 512")
    assert "Traceback" not in proc.stderr
