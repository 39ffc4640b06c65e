"""Through the three real services: greedy output equals transformers' generate(), for every mode, batched."""
from __future__ import annotations

import pytest

from tests.conftest import make_request, prompts_for, reference_greedy, run_streams, start_stack

pytestmark = pytest.mark.slow

# (prompt length, max_tokens, mode, budget): different lengths, limits and modes share the running batch.
MIXED_BATCH = [
    (5, 64, "ddtree", 0),       # the gateway's default budget
    (17, 72, "ddtree", 4),
    (9, 64, "ddtree", 16),
    (30, 65, "ddtree", 64),
    (3, 64, "dflash", 0),
    (12, 40, "dflash", 0),
    (7, 64, "ar", 0),
    (21, 33, "ar", 0),
    (11, 64, None, 0),          # default mode (ddtree)
    (2, 9, "ddtree", 8),
]


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen3_5"])
def test_concurrent_mixed_requests_equal_transformers_greedy(checkpoints, kind):
    target, drafter = checkpoints(kind)
    prompts = prompts_for(target, [n for n, *_ in MIXED_BATCH], seed=11)
    requests = [make_request(p, max_tokens, mode, budget) for p, (_, max_tokens, mode, budget) in zip(prompts, MIXED_BATCH)]
    stack = start_stack(target, drafter)
    try:
        results = run_streams(stack.gateway, requests)
    finally:
        stack.stop()
    for prompt, (_, max_tokens, mode, budget), result in zip(prompts, MIXED_BATCH, results):
        expected = reference_greedy(target, prompt, max_tokens)
        assert result["token_ids"] == expected, f"{kind} mode={mode} budget={budget} prompt_len={len(prompt)}"
        assert result["finish_reason"] == "length"
        stats = result["stats"]
        assert stats.generated_tokens == max_tokens
        # the prefill gives the first token; each verify step commits its accepted drafts + one target token,
        # and the gateway never drafts past max_tokens
        assert stats.accepted_tokens + stats.steps == max_tokens - 1
        if mode == "ar":
            assert stats.accepted_tokens == 0 and stats.draft_tokens == 0
        else:  # every step verified a real draft (no silent fall-back to autoregressive decoding)
            assert stats.draft_tokens >= stats.steps
