"""Priority scheduling through the three real services (vLLM's --scheduling-policy priority): with one slot, a
request of a lower priority value that arrives later is admitted before one of a higher value, and every answer
stays transformers' greedy output."""
from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest

from ddtree_serve.decoding.config import SamplingParams
from ddtree_serve.proto import gateway_pb2_grpc
from tests.conftest import make_request, prompts_for, reference_greedy, start_stack

pytestmark = pytest.mark.slow


def test_with_one_slot_the_later_request_of_lower_priority_value_runs_first(checkpoints):
    target, drafter = checkpoints("qwen3")
    busy, later, urgent = prompts_for(target, [12, 9, 10], seed=51)
    one_slot = ["--max-batch", "1"]
    stack = start_stack(target, drafter, extra={"target": one_slot, "drafter": one_slot,
                                                "gateway": ["--scheduling-policy", "priority"]})
    finished: list[str] = []

    async def go(address):
        async with grpc.aio.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)

            async def run(name, prompt, max_tokens, priority, started=None):
                ids = []
                async for msg in stub.GenerateStream(make_request(prompt, max_tokens, "ddtree", priority=priority)):
                    ids += msg.token_ids
                    if started is not None and not started.is_set():
                        started.set()
                finished.append(name)
                return ids

            running = asyncio.Event()
            first = asyncio.ensure_future(run("busy", busy, 96, 0, running))
            await running.wait()   # it holds the only slot: the next two wait in the queue
            second = asyncio.ensure_future(run("later", later, 16, 5))
            await asyncio.sleep(0.05)
            third = asyncio.ensure_future(run("urgent", urgent, 16, -1))
            return await asyncio.gather(first, second, third)

    try:
        ids_busy, ids_later, ids_urgent = asyncio.run(go(stack.gateway))
    finally:
        stack.stop()
    assert finished == ["busy", "urgent", "later"]
    assert ids_busy == reference_greedy(target, busy, 96)
    assert ids_later == reference_greedy(target, later, 16)
    assert ids_urgent == reference_greedy(target, urgent, 16)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_an_urgent_request_preempts_the_running_one_which_resumes_and_still_gives_transformers_answer(arch,
                                                                                                      checkpoints):
    """--priority-scheduling-preemption-threshold 0, one slot: a request of priority -1 arriving while one of 5
    runs takes its slot at once and finishes first; the preempted one goes on from its prompt and outputs (a dense
    target's rows and a hybrid's whole state parked meanwhile), and its whole answer (under output-only penalties,
    which must count the tokens before the preemption) is transformers'. The gateway counts the preemption."""
    target, drafter = checkpoints(arch)
    busy, urgent = prompts_for(target, [12, 10], seed=52)
    penalties = SamplingParams(frequency_penalty=1.5, presence_penalty=0.5)
    one_slot = ["--max-batch", "1"]
    stack = start_stack(target, drafter, metrics=True, extra={
        "target": one_slot, "drafter": one_slot,
        "gateway": ["--scheduling-policy", "priority", "--priority-scheduling-preemption-threshold", "0"]})
    finished: list[str] = []
    before_urgent: list[int] = []

    async def go(address):
        async with grpc.aio.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)

            async def run(name, request, started=None):
                ids = []
                async for msg in stub.GenerateStream(request):
                    ids += msg.token_ids
                    if started is not None and len(ids) >= 8 and not started.is_set():
                        started.set()   # preempted with some outputs behind it
                finished.append(name)
                return ids

            busy_request = make_request(busy, 160, "ddtree", priority=5)
            busy_request.sampling.frequency_penalty, busy_request.sampling.presence_penalty = 1.5, 0.5
            running = asyncio.Event()
            first = asyncio.ensure_future(run("busy", busy_request, running))
            await running.wait()
            before_urgent.append(len(finished))
            second = asyncio.ensure_future(run("urgent", make_request(urgent, 16, "ddtree", priority=-1)))
            return await asyncio.gather(first, second)

    try:
        ids_busy, ids_urgent = asyncio.run(go(stack.gateway))
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_ports['gateway']}/metrics",
                                         timeout=10).read().decode()
    finally:
        stack.stop()
    assert before_urgent == [0] and finished == ["urgent", "busy"]
    assert ids_urgent == reference_greedy(target, urgent, 16)
    assert ids_busy == reference_greedy(target, busy, 160, sampling=penalties)
    preemptions = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("vllm:num_preemptions_total{")]
    assert preemptions == [1.0]
