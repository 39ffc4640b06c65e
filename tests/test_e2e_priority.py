"""Priority scheduling through the three real services (vLLM's --scheduling-policy priority): with one slot, a
request of a lower priority value that arrives later is admitted before one of a higher value, and every answer
stays transformers' greedy output."""
from __future__ import annotations

import asyncio

import grpc
import pytest

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
