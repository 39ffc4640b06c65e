"""Logit bias, penalties and min-p: transformers' own processors agree, and each tree node is judged under its
own context."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor)

from ddtree_serve.decoding.config import SamplingParams
from ddtree_serve.decoding.logits_processing import TokenHistory, adjust_logits, node_path_mask, path_output_counts
from ddtree_serve.decoding.sampling import filter_logits

V = 40


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _history(prompt: list[int], output: list[int]) -> TokenHistory:
    h = TokenHistory.empty(V, "cpu")
    h.add_prompt(prompt)
    h.add_output(output)
    return h


def test_the_repetition_penalty_equals_transformers_over_prompt_and_output_tokens():
    prompt, output = [3, 7, 7, 11], [7, 20, 25, 20]
    x = _logits(1)
    ours = adjust_logits(x, SamplingParams(repetition_penalty=1.7), _history(prompt, output))
    theirs = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), x.clone())
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_logit_bias_equals_transformers_sequence_bias_of_single_tokens():
    x = _logits(3, seed=1)
    bias = {4: 2.5, 9: -100.0, 30: 0.25}
    ours = adjust_logits(x, SamplingParams.from_wire(0.0, 1.0, 0, None, logit_bias=bias))
    theirs = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(torch.tensor([[1]] * 3), x.clone())
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_min_p_equals_transformers_after_temperature():
    x = _logits(6, seed=2) / 0.7
    ours = filter_logits(x.clone(), min_p=0.15)
    theirs = MinPLogitsWarper(0.15)(torch.tensor([[1]] * 6), x.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.isfinite(ours).sum(-1).min() >= 1 and torch.isinf(ours).any()


def test_frequency_and_presence_penalties_count_output_tokens_only():
    x = torch.zeros(1, V)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = adjust_logits(x, params, _history(prompt=[1, 2], output=[5, 5, 5, 6]))[0]
    assert out[5].item() == pytest.approx(-(3 * 0.5 + 0.25))
    assert out[6].item() == pytest.approx(-(0.5 + 0.25))
    assert out[1].item() == 0 and out[2].item() == 0 and out[7].item() == 0


def test_a_negative_penalty_rewards_repeats():
    out = adjust_logits(torch.zeros(1, V), SamplingParams(presence_penalty=-1.0), _history([], [8]))[0]
    assert out[8].item() == 1.0 and out.argmax().item() == 8


def test_each_tree_node_counts_the_tokens_on_its_own_root_path():
    #        0(root: 12)
    #       /        \
    #    1(5)        2(6)
    #     |            \
    #    3(5)          4(7)
    tokens = torch.tensor([12, 5, 6, 5, 7])
    parents = torch.tensor([-1, 0, 0, 1, 2])
    history = _history(prompt=[], output=[12, 6])
    counts = path_output_counts(history, tokens, node_path_mask(parents))
    expected_paths = {0: [], 1: [5], 2: [6], 3: [5, 5], 4: [6, 7]}
    for node, path in expected_paths.items():
        want = history.output_counts.clone()
        for t in path:
            want[t] += 1
        assert torch.equal(counts[node], want), node


def test_adjusting_a_tree_equals_adjusting_each_node_under_its_path_as_a_plain_sequence():
    tokens = torch.tensor([12, 5, 6, 5, 7, 9])
    parents = torch.tensor([-1, 0, 0, 1, 2, 3])
    prompt, output = [3, 5, 9], [12]
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                            logit_bias=((6, 1.0), (9, -2.0)))
    x = _logits(len(tokens), seed=3)
    tree = adjust_logits(x, params, _history(prompt, output), tokens, parents)
    paths = {0: [], 1: [5], 2: [6], 3: [5, 5], 4: [6, 7], 5: [5, 5, 9]}
    for node, path in paths.items():
        alone = adjust_logits(x[node : node + 1], params, _history(prompt, output + path))
        torch.testing.assert_close(tree[node : node + 1], alone, rtol=0, atol=0)


def test_bias_alone_needs_no_history_but_penalties_do():
    adjust_logits(_logits(1), SamplingParams(logit_bias=((1, 1.0),)))
    with pytest.raises(ValueError, match="history"):
        adjust_logits(_logits(1), SamplingParams(presence_penalty=1.0))


def test_only_biases_and_penalties_count_as_adjusting_logits():
    assert not SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1).adjusts_logits
    assert SamplingParams(logit_bias=((1, 0.5),)).adjusts_logits
    assert SamplingParams(repetition_penalty=1.1).adjusts_logits
    assert SamplingParams(frequency_penalty=-0.1).adjusts_logits
    assert not SamplingParams(repetition_penalty=1.1).plain_greedy and SamplingParams().plain_greedy


@pytest.mark.parametrize("fields, fragment", [
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": float("nan")}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"logit_bias": {1: 101.0}}, "logit_bias values"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias values"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias token ids"),
    ({"logit_bias": {i: 1.0 for i in range(301)}}, "at most 300"),
])
def test_out_of_range_fields_are_refused_with_their_name(fields, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams.from_wire(0.0, 1.0, 0, None, **fields)


def test_wire_zero_turns_the_repetition_penalty_off():
    assert SamplingParams.from_wire(0.0, 1.0, 0, None, repetition_penalty=0.0).repetition_penalty == 1.0


def test_a_bias_outside_the_vocabulary_is_refused():
    params = SamplingParams.from_wire(0.0, 1.0, 0, None, logit_bias={V: 1.0})
    with pytest.raises(ValueError, match=r"\[0, 40\)"):
        params.check_vocab(V)
    params.check_vocab(V + 1)


def test_min_tokens_holds_stop_tokens_back_at_every_node_whose_choice_comes_too_early():
    #   0 - 1 - 2 - 3        depths 0..3; two tokens emitted so far (the root is the second)
    #        \- 4            depth 2
    tokens = torch.tensor([12, 5, 6, 7, 8])
    parents = torch.tensor([-1, 0, 1, 2, 1])
    history = _history(prompt=[], output=[30, 12])
    params = SamplingParams(min_tokens=4, min_tokens_blocked=(0, 3))
    out = adjust_logits(torch.zeros(5, V), params, history, tokens, parents)
    held = torch.isinf(out[:, [0, 3]]).all(1).tolist()
    # node i chooses output token number 2 + depth(i): held back while that is below 4
    assert held == [True, True, False, False, False]
    assert torch.isfinite(out[:, 1:3]).all() and torch.isfinite(out[:, 4:]).all()


def test_min_tokens_without_stop_tokens_to_hold_adjusts_nothing():
    assert not SamplingParams(min_tokens=8).adjusts_logits
    assert SamplingParams(min_tokens=8, min_tokens_blocked=(2,)).adjusts_logits
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams.from_wire(0.0, 1.0, 0, None, min_tokens=-1)


def test_allowed_token_ids_leave_only_those_tokens_finite_and_unchanged():
    x = _logits(3, seed=4)
    out = adjust_logits(x, SamplingParams.from_wire(0.0, 1.0, 0, None, allowed_token_ids=[9, 2, 9]))
    assert torch.isfinite(out).sum(1).tolist() == [2, 2, 2]
    assert torch.equal(out[:, [2, 9]], x[:, [2, 9]])
    with pytest.raises(ValueError, match=r"allowed_token_ids must lie in \[0, 40\)"):
        SamplingParams(allowed_token_ids=(3, V)).check_vocab(V)


def test_allowed_tokens_that_min_tokens_all_holds_back_are_refused():
    with pytest.raises(ValueError, match="allowed_token_ids are all stop tokens"):
        SamplingParams(min_tokens=3, min_tokens_blocked=(2, 7), allowed_token_ids=(2,)).validate()
    SamplingParams(min_tokens=3, min_tokens_blocked=(2, 7), allowed_token_ids=(2, 5)).validate()


def _vllm_bans(bad_words, output: list[int]) -> set[int]:
    """vLLM's rule for one sequence, written plainly: a word's last token is banned when the output (generated
    tokens only) ends with the rest of it."""
    return {w[-1] for w in bad_words if len(w) - 1 <= len(output) and list(w[:-1]) == output[len(output) - len(w) + 1:]}


def test_a_one_token_bad_word_is_never_chosen_and_needs_no_history():
    out = adjust_logits(_logits(3, seed=6), SamplingParams.from_wire(0.0, 1.0, 0, None, bad_words=[[4], [9]]))
    assert torch.isneginf(out[:, [4, 9]]).all() and torch.isfinite(out[:, [0, 1, 2, 3, 5]]).all()


def test_each_tree_node_bans_a_bad_words_last_token_iff_its_own_output_ends_with_the_rest():
    #        0(root: 12)
    #       /        \
    #    1(5)        2(6)
    #     |            \
    #    3(7)          4(5)
    #     |
    #    5(5)
    tokens = torch.tensor([12, 5, 6, 7, 5, 5])
    parents = torch.tensor([-1, 0, 0, 1, 2, 3])
    bad = ((12, 5, 9), (5, 8), (6, 5, 3), (30, 12, 6, 11), (7, 5, 7, 2))
    params = SamplingParams.from_wire(0.0, 1.0, 0, None, bad_words=[list(w) for w in bad])
    history = _history(prompt=[5], output=[30, 12])
    x = _logits(len(tokens), seed=7)
    out = adjust_logits(x, params, history, tokens, parents)
    paths = {0: [], 1: [5], 2: [6], 3: [5, 7], 4: [6, 5], 5: [5, 7, 5]}
    for node, path in paths.items():
        want = _vllm_bans(bad, [30, 12] + path)
        assert set(torch.isneginf(out[node]).nonzero().flatten().tolist()) == want, node
        alone = adjust_logits(x[node: node + 1], params, _history([5], [30, 12] + path))
        assert torch.equal(out[node: node + 1], alone)
    assert _vllm_bans(bad, [30, 12, 5]) == {9, 8} and _vllm_bans(bad, [30, 12, 6]) == {11}


def test_a_bad_words_prefix_in_the_prompt_bans_nothing():
    params = SamplingParams.from_wire(0.0, 1.0, 0, None, bad_words=[[3, 4]])
    out = adjust_logits(_logits(1), params, _history(prompt=[1, 3], output=[]))
    assert torch.isfinite(out).all()
    assert torch.isneginf(adjust_logits(_logits(1), params, _history(prompt=[1], output=[3])))[0, 4]


def test_the_history_keeps_as_many_output_tokens_as_the_longest_prefix_can_use():
    from ddtree_serve.decoding.config import MAX_BAD_WORD_TOKENS

    output = [i % V for i in range(100)]
    h = _history([], output)
    assert h.tail == output[-(MAX_BAD_WORD_TOKENS - 1):] and h.emitted == 100


def test_a_row_of_allowed_tokens_that_bad_words_would_empty_keeps_them():
    params = SamplingParams.from_wire(0.0, 1.0, 0, None, allowed_token_ids=[2, 3], bad_words=[[1, 2], [1, 3], [3]])
    x = _logits(1, seed=8)
    out = adjust_logits(x, params, _history([], [1]))   # 2 and 3 both banned after 1: nothing left
    assert torch.equal(torch.isfinite(out[0]).nonzero().flatten(), torch.tensor([2, 3]))
    out = adjust_logits(x, params, _history([], [0]))   # only the one-token word holds
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [2]


@pytest.mark.parametrize("words, fragment", [
    ([[i] for i in range(257)], "at most 256"),
    ([list(range(33))], "1 to 32 token ids"),
    ([[]], "1 to 32 token ids"),
    ([[2, -1]], "1 to 32 token ids"),
])
def test_bad_words_out_of_bounds_are_refused(words, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams.from_wire(0.0, 1.0, 0, None, bad_words=words)


def test_bad_words_outside_the_vocabulary_or_banning_every_allowed_token_are_refused():
    with pytest.raises(ValueError, match=r"bad_words token ids must lie in \[0, 40\)"):
        SamplingParams.from_wire(0.0, 1.0, 0, None, bad_words=[[1, V]]).check_vocab(V)
    with pytest.raises(ValueError, match="allowed_token_ids are all bad words"):
        SamplingParams.from_wire(0.0, 1.0, 0, None, allowed_token_ids=[4], bad_words=[[4]])
