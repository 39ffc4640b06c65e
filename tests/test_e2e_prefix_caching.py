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


def test_a_hybrid_target_starts_prompts_sharing_a_system_prompt_from_its_state_snapshot(checkpoints):
    """Gated DeltaNet state snapshots (target --gdn-state-snapshots): a chat's system messages are the prefix where
    the target keeps its states; a later chat under the same system prompt copies those rows and starts there (its
    cached tokens are the system prompt's), as does a token-id prompt that names its breakpoint itself. Every answer
    is transformers' greedy output on the whole prompt."""
    from transformers import AutoTokenizer

    from ddtree_serve.proto import gateway_pb2

    target, drafter = checkpoints("qwen3_5")
    tok = AutoTokenizer.from_pretrained(target)
    system = {"role": "system", "content": "You are a careful assistant. Answer in one short sentence, and "
                                           "always name the city you are asked about first."}
    chats = [[system, {"role": "user", "content": question}]
             for question in ("What is the capital of France?", "Which river runs through Paris?")]

    def ids(messages, generation_prompt):
        text = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        return tok(text, add_special_tokens=False).input_ids

    rendered = [ids(c, True) for c in chats]
    system_len = len(ids([system], False))
    assert system_len >= 16 and all(r[:system_len] == rendered[0][:system_len] for r in rendered)

    def chat_request(messages):
        return gateway_pb2.GenerateRequest(
            chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in messages]),
            max_tokens=12, ignore_eos=True, mode=gateway_pb2.DECODE_MODE_DDTREE)

    shared, tail_a, tail_b = prompts_for(target, [24, 6, 5], seed=44)
    together = [[dict(system, content=system["content"] + " Be kind."), c[1]] for c in chats]
    stack = start_stack(target, drafter, extra={"target": ["--gdn-state-snapshots", "4"]})
    try:
        answers = [run_streams(stack.gateway, [chat_request(c)])[0] for c in chats]
        by_ids = [run_streams(stack.gateway, [make_request(shared + tail, 12, "ddtree", cache_breakpoint=24)])[0]
                  for tail in (tail_a, tail_b)]
        at_once = run_streams(stack.gateway, [chat_request(c) for c in together])   # admitted in one step
    finally:
        stack.stop()
    # the second of two chats arriving together waits a step for the first's snapshot instead of running it too
    assert sorted(a["stats"].cached_prompt_tokens for a in at_once) == [0, len(ids([together[0][0]], False))]
    assert [a["token_ids"] for a in at_once] == [reference_greedy(target, ids(c, True), 12) for c in together]
    assert [a["stats"].cached_prompt_tokens for a in answers] == [0, system_len]
    assert [a["token_ids"] for a in answers] == [reference_greedy(target, r, 12) for r in rendered]
    assert [a["stats"].cached_prompt_tokens for a in by_ids] == [0, 24]
    assert [a["token_ids"] for a in by_ids] == [reference_greedy(target, shared + t, 12) for t in (tail_a, tail_b)]
