"""The distillation generator: the same greedy continuations as transformers' generate, faster."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from drafter_svc.train.samples import generate_greedy
from drafter_svc.train.fast_generate import generate_greedy_batch, generate_greedy_fast, supports_fast_greedy


def _load(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_fast_greedy_equals_transformers_generate(checkpoints, kind: str) -> None:
    model = _load(checkpoints(kind)[0])
    assert supports_fast_greedy(model)
    prompts = _prompts(model.config.vocab_size, [1, 3, 7, 12, 12, 20])
    # No EOS stop (an id outside the vocabulary): full-length continuations compare every position.
    ref = generate_greedy(model, prompts, 24, [10**6], 0, batch_size=1)
    fast = generate_greedy_batch(model, prompts, 24, [10**6], 0)
    assert fast == ref
    assert all(len(t) == 24 for t in fast)


def test_fast_greedy_stops_each_row_at_its_eos_and_drops_finished_rows(checkpoints) -> None:
    model = _load(checkpoints("llama")[0])
    prompts = _prompts(model.config.vocab_size, [2, 5, 9, 4, 11, 6, 8, 3], seed=1)
    full = generate_greedy_batch(model, prompts, 40, [10**6], 0)
    # Pick as EOS a token that ends some rows early and not others.
    eos = full[0][3]
    ref = generate_greedy(model, prompts, 40, [eos], 0, batch_size=1)
    fast = generate_greedy_batch(model, prompts, 40, [eos], 0, compact_every=2)
    assert fast == ref
    assert any(len(t) < 40 for t in fast) and any(len(t) == 40 for t in fast)
    assert all(t[-1] == eos for t in fast if len(t) < 40)


def test_fast_greedy_batches_respect_the_token_cap_and_the_time_budget(checkpoints) -> None:
    model = _load(checkpoints("qwen3")[0])
    prompts = _prompts(model.config.vocab_size, [4, 9, 2, 6, 13, 5], seed=2)
    ref = generate_greedy(model, prompts, 8, [10**6], 0, batch_size=1)
    seen: list[int] = []
    out = generate_greedy_fast(model, prompts, 8, [10**6], 0, max_batch_tokens=40,
                               progress=lambda done, total: seen.append(done))
    assert out == ref
    assert len(seen) > 1 and seen[-1] == len(prompts)  # the cap split the prompts into several batches
    assert generate_greedy_fast(model, prompts, 8, [10**6], 0, time_budget_s=0.0) == [None] * len(prompts)


def test_hybrid_models_are_left_to_transformers(checkpoints) -> None:
    model = _load(checkpoints("qwen3_5")[0])
    assert not supports_fast_greedy(model)
