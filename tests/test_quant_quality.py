"""bench.quant_quality: the perplexity arithmetic, teacher-forced log-probs through the target's own forward equal to
transformers' on the same tokens (unquantized, and int8 as the dequantized weights), and a small end-to-end run."""
from __future__ import annotations

import json
import math

import pytest
import torch

from bench.offline_decode import decode, next_token_gap, teacher_forced_logprobs
from bench.quant_quality import compare, main, perplexity, shared_prefix
from target_svc.runner import TargetConfig, TargetRunner
from tests.conftest import prompts_for, reference_model


def _runner(target_dir, quantize: str = "none", prefill_chunk: int = 4) -> TargetRunner:
    # A chunk of 4 splits the 10-token prompt mid-chunk: prompt-only chunks, a mixed one, and answer-only ones.
    return TargetRunner(TargetConfig(model_dir=str(target_dir), max_batch=1, max_seq_len=128, max_tree_nodes=17,
                                     prefill_chunk=prefill_chunk, quantize=quantize))


def _transformers_logprobs(target_dir, prompt: list[int], answer: list[int], quantize: str = "none"):
    """log p(answer[i] | prefix) from transformers' forward of the whole sequence, and its mean-NLL loss."""
    model = reference_model(str(target_dir), quantize)
    ids = torch.tensor([prompt + answer])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100  # transformers shifts the labels itself; the prompt is context only
    with torch.no_grad():
        out = model(ids, labels=labels)
    lp = out.logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
    return lp.gather(1, torch.tensor(answer)[:, None])[:, 0], float(out.loss)


def test_perplexity_is_exp_of_the_mean_nll_over_all_tokens():
    # NLLs ln 2, 2 ln 2 | 3 ln 2: mean 2 ln 2 over the three tokens, perplexity exactly 4 (pooled, not per sequence:
    # the per-sequence mean would be (2 ** 1.5 + 8) / 2).
    lps = [torch.tensor([math.log(0.5), math.log(0.25)], dtype=torch.float64),
           torch.tensor([math.log(0.125)], dtype=torch.float64)]
    assert perplexity(lps) == pytest.approx(4.0, rel=1e-12)
    assert perplexity([torch.zeros(5)]) == 1.0
    with pytest.raises(ValueError):
        perplexity([torch.zeros(0)])


def test_comparison_applies_the_issues_thresholds():
    results = {"bfloat16": {"perplexity": 2.0, "ddtree": {"tau": 4.0}},
               "int8": {"perplexity": 2.039, "ddtree": {"tau": 3.81}},
               "int4": {"perplexity": 2.05, "ddtree": {"tau": 3.79}}}
    c = compare(results, "bfloat16")
    assert set(c) == {"int8", "int4"}
    assert c["int8"]["perplexity_within_2pct"] and c["int8"]["tau_within_5pct"]
    assert not c["int4"]["perplexity_within_2pct"] and not c["int4"]["tau_within_5pct"]
    assert c["int8"]["perplexity_relative"] == pytest.approx(0.0195)
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and shared_prefix([], [1]) == 0


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_teacher_forced_logprobs_equal_transformers_on_the_same_tokens(kind, checkpoints):
    target_dir, _ = checkpoints(kind)
    prompt, answer = prompts_for(target_dir, [10, 13], seed=21)
    lp = teacher_forced_logprobs(_runner(target_dir), "s", prompt, answer)
    expected, loss = _transformers_logprobs(target_dir, prompt, answer)
    assert lp.shape == (len(answer),)
    torch.testing.assert_close(lp, expected, atol=2e-4, rtol=1e-4)
    assert perplexity([lp]) == pytest.approx(math.exp(loss), rel=1e-4)  # transformers' loss is the mean NLL


def test_the_chunking_does_not_change_the_log_probs(checkpoints):
    target_dir, _ = checkpoints("qwen3_5")  # Gated DeltaNet states carried across chunks as well as K/V
    prompt, answer = prompts_for(target_dir, [10, 13], seed=22)
    chunked = teacher_forced_logprobs(_runner(target_dir, prefill_chunk=4), "s", prompt, answer)
    whole = teacher_forced_logprobs(_runner(target_dir, prefill_chunk=0), "s", prompt, answer)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_the_quantized_run_differs_from_the_unquantized_one_only_through_the_weights(quantize, checkpoints):
    """The quantized target's log-probs are transformers' with every decoder Linear weight replaced by q * s (and
    nothing else changed), and they are not the float model's."""
    target_dir, _ = checkpoints("llama")
    prompt, answer = prompts_for(target_dir, [10, 13], seed=23)
    lp = teacher_forced_logprobs(_runner(target_dir, quantize), "s", prompt, answer)
    expected, loss = _transformers_logprobs(target_dir, prompt, answer, quantize)
    torch.testing.assert_close(lp, expected, atol=2e-4, rtol=1e-4)
    assert perplexity([lp]) == pytest.approx(math.exp(loss), rel=1e-4)
    unquantized, _ = _transformers_logprobs(target_dir, prompt, answer)
    assert (lp - unquantized).abs().max() > 1e-3  # a different model: the equality above is not a float forward's


def test_ddtree_decoding_is_the_greedy_answer_and_counts_its_steps(checkpoints):
    target_dir, drafter_dir = checkpoints("qwen3")
    from drafter_svc.runner import DrafterConfig, DrafterRunner

    runner = _runner(target_dir, prefill_chunk=512)
    drafter = DrafterRunner(DrafterConfig(drafter_dir=str(drafter_dir), target_model_dir=str(target_dir),
                                          max_batch=1, max_seq_len=128))
    runner.set_feature_layers(drafter.target_layer_ids)
    prompt = prompts_for(target_dir, [9], seed=24)[0]
    greedy = decode(runner, None, "a", prompt, 20)
    tree = decode(runner, drafter, "t", prompt, 20, budget=16)
    assert tree.tokens == greedy.tokens and greedy.drafted_steps == greedy.accepted == 0
    assert greedy.steps == len(greedy.tokens) - 1
    assert 0 < tree.drafted_steps <= tree.steps
    assert tree.steps + tree.accepted == len(tree.tokens) - 1  # each step commits its accepted tokens and a bonus
    assert not runner.seqs and not runner.model.cache.slot_of and drafter.cache_usage()[0] == 0  # all released


def test_the_bench_runs_end_to_end_on_a_tiny_pair(checkpoints, tmp_path):
    target_dir, drafter_dir = checkpoints("qwen3")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": [{"id": "a", "kind": "k", "text": "hello there"},
                                               {"id": "b", "kind": "k", "text": "one two three"}]}))
    main(["--model", str(target_dir), "--drafter", str(drafter_dir), "--prompts", str(prompts), "--max-tokens", "8",
          "--budget", "16", "--quantize", "int8", "--out-dir", str(tmp_path / "out")])
    (json_path,) = (tmp_path / "out").glob("quant-quality-*.json")
    data = json.loads(json_path.read_text())
    ref, q = data["targets"]["float32"], data["targets"]["int8"]
    # Both targets score the same tokens: the float32 target's greedy answers.
    assert ref["answer_tokens"] == q["answer_tokens"] > 0
    assert [pp["answer_tokens"] for pp in data["per_prompt"]["float32"]] == \
        [pp["answer_tokens"] for pp in data["per_prompt"]["int8"]]
    assert ref["ddtree_equals_greedy"] == q["ddtree_equals_greedy"] == 2 and ref["greedy_equals_reference"] == 2
    assert set(data["comparison"]["int8"]) >= {"perplexity_within_2pct", "tau_within_5pct"}
    assert "not the issue's bf16 vs int8 on the GPU" in json_path.with_suffix(".md").read_text()


def test_next_token_gap_names_the_greedy_token_and_a_nonnegative_margin(checkpoints):
    target_dir, _ = checkpoints("llama")
    runner = _runner(target_dir)
    prompt = prompts_for(target_dir, [10], seed=3)[0]
    greedy = decode(runner, None, "g", prompt, 3).tokens
    gap, top1, top2 = next_token_gap(runner, "gap", prompt + greedy[:2])
    assert top1 == greedy[2] and top2 != top1 and gap >= 0.0
