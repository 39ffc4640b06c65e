"""The target's per-node choice: greedy, seeded sampling, top-k/top-p support, goodness of fit."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from ddtree_serve.decoding.config import SamplingParams
from ddtree_serve.decoding.sampling import choose_tokens, filter_logits, make_generator, target_probs

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_greedy_is_argmax():
    logits = torch.randn(9, 50, generator=torch.Generator().manual_seed(0))
    out = choose_tokens(logits, SamplingParams(temperature=0.0), None)
    assert out.dtype == torch.long and torch.equal(out, logits.argmax(-1))


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(16, 30, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=123)
    a = choose_tokens(logits, params, make_generator(123, "cpu"))
    b = choose_tokens(logits, params, make_generator(123, "cpu"))
    c = choose_tokens(logits, params, make_generator(124, "cpu"))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_each_node_draws_independently():
    # identical rows must not all get the same token (one draw per row, not one per call)
    logits = torch.zeros(64, 8)
    out = choose_tokens(logits, SamplingParams(temperature=1.0), make_generator(0, "cpu"))
    assert out.unique().numel() > 4


def test_top_k_restricts_support():
    logits = LOGITS.expand(4000, -1)
    out = choose_tokens(logits, SamplingParams(temperature=5.0, top_k=2), make_generator(2, "cpu"))
    assert set(out.tolist()) == {0, 1}


def test_top_k_keeps_ties_at_the_kth_value():
    kept = filter_logits(torch.tensor([[3.0, 1.0, 1.0, 0.0]]), top_k=2)
    assert torch.isfinite(kept).tolist() == [[True, True, True, False]]


def test_top_p_restricts_support_to_the_nucleus():
    probs = LOGITS.softmax(-1)  # ~[.57, .21, .13, .08, .03, .004]
    out = choose_tokens(LOGITS.expand(4000, -1), SamplingParams(temperature=1.0, top_p=0.8),
                        make_generator(3, "cpu"))
    assert probs[:2].sum() < 0.8 < probs[:3].sum()
    assert set(out.tolist()) == {0, 1, 2}


def test_tiny_top_p_keeps_the_most_likely_token():
    out = choose_tokens(LOGITS.expand(100, -1), SamplingParams(temperature=1.0, top_p=1e-6),
                        make_generator(4, "cpu"))
    assert set(out.tolist()) == {0}


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_samples_follow_tempered_softmax(temperature):
    n = 20_000
    out = choose_tokens(LOGITS.expand(n, -1), SamplingParams(temperature=temperature), make_generator(5, "cpu"))
    counts = torch.bincount(out, minlength=6).double()
    expected = (LOGITS.double() / temperature).softmax(-1) * n
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3
    # the same test rejects the untempered distribution, so it has power
    wrong = LOGITS.double().softmax(-1) * n
    assert chisquare(counts.numpy(), wrong.numpy()).pvalue < 1e-6


def test_filtered_samples_follow_renormalised_distribution():
    n = 20_000
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.9)
    out = choose_tokens(LOGITS.expand(n, -1), params, make_generator(6, "cpu"))
    probs = target_probs(LOGITS, params).double()
    probs = probs / probs.sum()  # float32 softmax sums to 1 only within ~1e-7; scipy wants 1e-8
    support = probs > 0
    counts = torch.bincount(out, minlength=6).double()
    assert counts[~support].sum() == 0
    assert chisquare(counts[support].numpy(), (probs[support] * n).numpy()).pvalue > 1e-3


def test_invalid_params_raise():
    with pytest.raises(ValueError):
        choose_tokens(LOGITS[None], SamplingParams(temperature=float("nan")), None)
    with pytest.raises(ValueError):
        choose_tokens(LOGITS, SamplingParams(temperature=1.0), None)
