"""Prefix caching through the three real services: a follow-up turn starts from the parked rows of the turn before,
and its output still equals transformers' generate() on the whole prompt."""
from __future__ import annotations

import urllib.request

import pytest

from tests.conftest import make_request, prompts_for, reference_greedy, run_streams, start_stack

pytestmark = pytest.mark.slow


def _metric(port: int, name: str) -> float:
    """The sum of a Prometheus counter's samples on one service's /metrics page."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_follow_up_turns_reuse_the_parked_turn_and_equal_transformers_greedy(checkpoints, kind):
    target, drafter = checkpoints(kind)
    first, extra = prompts_for(target, [24, 7], seed=41)
    stack = start_stack(target, drafter, metrics=True)
    try:
        for mode in ("ddtree", "dflash", "ar"):
            (turn1,) = run_streams(stack.gateway, [make_request(first, 20, mode)])
            assert turn1["stats"].cached_prompt_tokens in (0, len(first) - 1)   # an earlier mode's turn may match
            follow_up = first + turn1["token_ids"] + extra
            (turn2,) = run_streams(stack.gateway, [make_request(follow_up, 24, mode)])
            assert turn2["token_ids"] == reference_greedy(target, follow_up, 24), f"{kind} {mode}"
            # The first turn's rows: its prompt and every token but the last (pending, never written); the
            # drafter may hold its last step's rows or not, and the target reuses no more than the drafter holds.
            cached = turn2["stats"].cached_prompt_tokens
            held = len(first) + len(turn1["token_ids"]) - 1
            assert cached == held if mode == "ar" else held - 16 <= cached <= held, f"{kind} {mode}: {cached}"
        hits = _metric(stack.metrics_ports["gateway"], "vllm:prefix_cache_hits_total")
        reused = _metric(stack.metrics_ports["target"], "ddtree_target_prefix_reused_tokens_total")
        assert hits == reused > 0
    finally:
        stack.stop()


def test_a_different_cache_salt_shares_nothing(checkpoints):
    target, drafter = checkpoints("qwen3")
    (prompt,) = prompts_for(target, [30], seed=42)
    stack = start_stack(target, drafter)
    try:
        run_streams(stack.gateway, [make_request(prompt, 8, "ddtree", cache_salt="tenant-a")])
        (other,) = run_streams(stack.gateway, [make_request(prompt + [7], 8, "ddtree", cache_salt="tenant-b")])
        (same,) = run_streams(stack.gateway, [make_request(prompt + [7], 8, "ddtree", cache_salt="tenant-a")])
    finally:
        stack.stop()
    assert other["stats"].cached_prompt_tokens == 0
    assert same["stats"].cached_prompt_tokens >= len(prompt) - 1 - 16
    assert other["token_ids"] == same["token_ids"] == reference_greedy(target, prompt + [7], 8)


def test_a_prompt_sharing_a_running_requests_prefix_copies_its_rows(checkpoints):
    """A dense target: the second request arrives while the first still decodes; both answers stay transformers'."""
    import asyncio

    import grpc

    from ddtree_serve.proto import gateway_pb2_grpc

    target, drafter = checkpoints("qwen3")
    shared, tail_a, tail_b = prompts_for(target, [30, 5, 6], seed=43)

    async def go(address):
        async with grpc.aio.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            first = stub.GenerateStream(make_request(shared + tail_a, 160, "ddtree")).__aiter__()
            head = [await first.__anext__(), await first.__anext__()]   # prefilled, drafted for and verified
            ids_b, stats_b = [], None
            async for msg in stub.GenerateStream(make_request(shared + tail_b, 24, "ddtree")):
                ids_b += msg.token_ids
                stats_b = msg.stats
            rest = [msg async for msg in first]
            ids_a = [t for msg in head + rest for t in msg.token_ids]
            return ids_a, rest[-1].stats, ids_b, stats_b

    stack = start_stack(target, drafter)
    try:
        ids_a, stats_a, ids_b, stats_b = asyncio.run(go(stack.gateway))
    finally:
        stack.stop()
    assert stats_b.e2e_seconds < stats_a.e2e_seconds   # it ran while the first one did
    assert stats_b.cached_prompt_tokens == len(shared)
    assert ids_a == reference_greedy(target, shared + tail_a, 160)
    assert ids_b == reference_greedy(target, shared + tail_b, 24)
