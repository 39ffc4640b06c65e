"""Emitted tokens' log-probs: the log-softmax of the raw logits at the chosen tokens, and the top-N of each row."""
from __future__ import annotations

import pytest
import torch

from ddtree_serve.decoding.logprobs import MAX_TOP_LOGPROBS, token_logprobs


def test_each_row_gives_its_chosen_tokens_log_softmax_and_its_likeliest_tokens_in_order():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 3
    chosen = torch.tensor([3, 0, 49, 7])
    out = token_logprobs(logits, chosen, top=5)
    ref = torch.log_softmax(logits, dim=-1)
    assert [lp.logprob for lp in out] == pytest.approx(ref[torch.arange(4), chosen].tolist(), abs=1e-6)
    for row, lp in zip(ref, out):
        values, ids = row.topk(5)
        assert [i for i, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-6)


def test_without_alternatives_only_the_chosen_tokens_come_back_and_half_precision_rows_are_widened():
    logits = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.bfloat16)
    [lp] = token_logprobs(logits, torch.tensor([2]))
    assert lp.top == () and lp.logprob == pytest.approx(torch.log_softmax(logits.float(), -1)[0, 2].item(), abs=1e-6)


def test_more_alternatives_than_the_api_allows_are_refused():
    with pytest.raises(ValueError, match="top_logprobs"):
        token_logprobs(torch.zeros(1, 30), torch.tensor([0]), top=MAX_TOP_LOGPROBS + 1)


def test_each_chosen_token_carries_its_rank_in_its_row():
    logits = torch.tensor([[0.5, 3.0, 1.0, 3.0], [0.0, -1.0, 2.0, 1.0]])
    out = token_logprobs(logits, torch.tensor([2, 2]))
    # row 0: two tokens (tied) are likelier than token 2; row 1: token 2 is the likeliest
    assert [lp.rank for lp in out] == [3, 1]
    assert token_logprobs(logits, torch.tensor([1, 1]))[0].rank == 1   # a tie shares the better rank
