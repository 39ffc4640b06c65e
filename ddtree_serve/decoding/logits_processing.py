"""Logit adjustments that depend on the sequence's tokens: logit_bias, min_tokens and the repetition, frequency
and presence penalties, applied to every node of a draft tree under that node's own context.

Semantics follow vLLM (and transformers for what it has): tokens outside allowed_token_ids are set to -inf,
the bias is added (transformers' `sequence_bias` for one-token sequences); min_tokens sets the stop tokens' logits to -inf while fewer than
min_tokens tokens precede the node's choice (transformers' `min_new_tokens` over those ids); then the repetition
penalty divides positive logits and multiplies negative ones of every token seen in the prompt or the output
(transformers' `repetition_penalty`); then the
frequency penalty subtracts penalty x count and the presence penalty subtracts penalty once, for each token of the
output so far. Temperature, top-k, top-p and min_p come after (sampling.py).

In a tree, node i's logits predict the token after node i, so its output so far is the sequence's emitted tokens
(which include the pending root) plus the tokens of the non-root nodes on the path from the root to i. Choosing
each node's token from its own context keeps speculative decoding lossless: the accepted path is exactly what the
target would have chosen one token at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree_serve.decoding.config import SamplingParams
from ddtree_serve.decoding.tree_mask import ancestor_mask

__all__ = ["TokenHistory", "node_path_mask", "path_output_counts", "adjust_logits"]


@dataclass
class TokenHistory:
    """A sequence's prompt tokens (seen or not) and output token counts, over the vocabulary, on its device."""

    prompt_seen: Tensor     # BoolTensor[V]
    output_counts: Tensor   # FloatTensor[V] (float32: counts stay exact far past any context length)
    emitted: int = 0        # tokens emitted so far

    @classmethod
    def empty(cls, vocab_size: int, device: torch.device | str) -> "TokenHistory":
        """No tokens yet."""
        return cls(torch.zeros(vocab_size, dtype=torch.bool, device=device),
                   torch.zeros(vocab_size, dtype=torch.float32, device=device))

    def add_prompt(self, ids: list[int]) -> None:
        """Marks prompt tokens as seen."""
        if ids:
            self.prompt_seen[torch.tensor(ids, dtype=torch.long).to(self.prompt_seen.device)] = True

    def add_output(self, ids: list[int]) -> None:
        """Counts emitted tokens (repeats add up)."""
        if ids:
            idx = torch.tensor(ids, dtype=torch.long).to(self.output_counts.device)
            self.output_counts.index_put_((idx,), torch.ones_like(idx, dtype=torch.float32), accumulate=True)
            self.emitted += len(ids)


def path_output_counts(history: TokenHistory, tokens: Tensor, path: Tensor) -> Tensor:
    """FloatTensor[T, V]: per node, the output counts it is chosen under: the history's plus the tokens of the
    non-root nodes on its root path (itself included). path: BoolTensor[T, T - 1], node_path_mask's."""
    counts = history.output_counts.expand(tokens.shape[0], -1).clone()
    rows, cols = path.nonzero(as_tuple=True)
    counts.index_put_((rows, tokens[1:][cols]), torch.ones_like(rows, dtype=torch.float32), accumulate=True)
    return counts


def node_path_mask(parents: Tensor) -> Tensor:
    """BoolTensor[T, T - 1]: [i, j] iff non-root node j + 1 is node i or one of its ancestors (the root's token
    is the sequence's last emitted one, in its history already)."""
    return ancestor_mask(parents)[:, 1:]


def adjust_logits(logits: Tensor, params: SamplingParams, history: TokenHistory | None = None,
                  tokens: Tensor | None = None, parents: Tensor | None = None) -> Tensor:
    """FloatTensor[T, V]: logits[T, V] of one tree (or of T independent rows with tokens None) with the bias, the
    min_tokens hold on stop tokens and the penalties applied, each node under its own context. The history is
    needed for the penalties and min_tokens."""
    x = logits.float().clone()
    if params.allowed_token_ids:
        keep = torch.tensor(params.allowed_token_ids, dtype=torch.long, device=x.device)
        x = torch.full_like(x, float("-inf")).index_copy_(1, keep, x.index_select(1, keep))
    if params.logit_bias:
        ids = torch.tensor([i for i, _ in params.logit_bias], dtype=torch.long, device=x.device)
        x[:, ids] += torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=x.device)
    path = node_path_mask(parents.to(x.device)) if tokens is not None else None
    if params.holds_back_stops:
        if history is None:
            raise ValueError("min_tokens needs the sequence's token history")
        # node i chooses output token number emitted + (its depth below the root): held back below min_tokens
        depth = path.sum(1).tolist() if path is not None else [0] * x.shape[0]
        held = [i for i, d in enumerate(depth) if history.emitted + d < params.min_tokens]
        if held:
            rows = torch.tensor(held, dtype=torch.long, device=x.device)
            blocked = torch.tensor(params.min_tokens_blocked, dtype=torch.long, device=x.device)
            x[rows[:, None], blocked[None, :]] = float("-inf")
    penalised = params.repetition_penalty != 1.0 or params.frequency_penalty != 0 or params.presence_penalty != 0
    if not penalised:
        return x
    if history is None:
        raise ValueError("penalties need the sequence's token history")
    if path is None:
        counts = history.output_counts.expand(x.shape[0], -1)
    else:
        counts = path_output_counts(history, tokens.to(x.device), path)
    present = counts > 0
    if params.repetition_penalty != 1.0:
        seen = present | history.prompt_seen[None, :]
        r = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if params.frequency_penalty != 0:
        x = x - params.frequency_penalty * counts
    if params.presence_penalty != 0:
        x = x - params.presence_penalty * present.float()
    return x
