"""Logit adjustments that depend on the sequence's tokens: logit_bias, min_tokens, bad_words and the repetition,
frequency and presence penalties, applied to every node of a draft tree under that node's own context.

Semantics follow vLLM (and transformers for what it has): tokens outside allowed_token_ids are set to -inf, then
each bad word's last token where the output so far ends with the rest of it (vLLM matches generated tokens only,
not the prompt; should that leave a row of allowed_token_ids with no finite logit, that row keeps its bad words:
something must be chosen), the bias is added (transformers' `sequence_bias` for one-token sequences); min_tokens
sets the stop tokens' logits to -inf while fewer than min_tokens tokens precede the node's choice (transformers'
`min_new_tokens` over those ids); then the repetition penalty divides positive logits and multiplies negative ones
of every token seen in the prompt or the output (transformers' `repetition_penalty`); then the frequency penalty
subtracts penalty x count and the presence penalty subtracts penalty once, for each token of the output so far.
Temperature, top-k, top-p and min_p come after (sampling.py).

In a tree, node i's logits predict the token after node i, so its output so far is the sequence's emitted tokens
(which include the pending root) plus the tokens of the non-root nodes on the path from the root to i. Choosing
each node's token from its own context keeps speculative decoding lossless: the accepted path is exactly what the
target would have chosen one token at a time.
"""
from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ddtree_serve.decoding.config import MAX_BAD_WORD_TOKENS, SamplingParams
from ddtree_serve.decoding.tree_mask import ancestor_mask

__all__ = ["TokenHistory", "node_path_mask", "path_output_counts", "bad_word_bans", "adjust_logits"]


@dataclass
class TokenHistory:
    """A sequence's prompt tokens (seen or not) and output token counts, over the vocabulary, on its device."""

    prompt_seen: Tensor     # BoolTensor[V]
    output_counts: Tensor   # FloatTensor[V] (float32: counts stay exact far past any context length)
    emitted: int = 0        # tokens emitted so far
    tail: list[int] = field(default_factory=list)   # the last emitted ones, as many as a bad word's prefix can be

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
            self.tail = (self.tail + list(ids))[-(MAX_BAD_WORD_TOKENS - 1):]


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


@functools.lru_cache(maxsize=256)
def _bad_word_index(bad_words: tuple[tuple[int, ...], ...]) -> dict[int, dict[tuple[int, ...], list[int]]]:
    """Multi-token bad words by prefix length, then prefix -> the last tokens it bans (made once per word list: a
    request's list is looked up every step). Read only."""
    by_prefix: dict[int, dict[tuple[int, ...], list[int]]] = defaultdict(lambda: defaultdict(list))
    for word in bad_words:
        if len(word) > 1:
            by_prefix[len(word) - 1][word[:-1]].append(word[-1])
    return {k: dict(v) for k, v in by_prefix.items()}


def bad_word_bans(bad_words: tuple[tuple[int, ...], ...], tail: list[int], rows: int,
                  tokens: list[int] | None = None, parents: list[int] | None = None) -> tuple[list[int], list[int]]:
    """(rows, token ids) whose logits bad_words set to -inf: each multi-token word's last token in every row whose
    output so far (tail: the history's last tokens; in a tree, followed by the node's root path, root excluded)
    ends with the rest of the word. One-token words are not listed: they hold in every row."""
    by_prefix = _bad_word_index(bad_words)
    if not by_prefix:
        return [], []
    longest = max(by_prefix)
    out_rows, out_ids = [], []
    for row in range(rows):
        path = []   # the node's own root path, newest first, as far as the longest prefix needs
        node = row if tokens is not None else 0
        while node > 0 and len(path) < longest:
            path.append(tokens[node])
            node = parents[node]
        context = (tail + path[::-1])[-longest:]
        for k, words in by_prefix.items():
            if len(context) >= k:
                banned = words.get(tuple(context[-k:]))
                if banned:
                    out_rows += [row] * len(banned)
                    out_ids += banned
    return out_rows, out_ids


def _ban_bad_words(x: Tensor, params: SamplingParams, history: TokenHistory | None, tokens: Tensor | None,
                   parents: Tensor | None) -> Tensor:
    """x with the bad words' tokens at -inf where each applies (a row of allowed tokens left with none keeps x)."""
    single = [w[0] for w in params.bad_words if len(w) == 1]
    multi = len(single) < len(params.bad_words)
    if multi and history is None:
        raise ValueError("bad_words of several tokens need the sequence's token history")
    banned = x.clone()
    if single:
        banned[:, torch.tensor(single, dtype=torch.long, device=x.device)] = float("-inf")
    if multi:
        rows, ids = bad_word_bans(params.bad_words, history.tail, x.shape[0],
                                  None if tokens is None else tokens.tolist(),
                                  None if parents is None else parents.tolist())
        if rows:
            banned[torch.tensor(rows, dtype=torch.long, device=x.device),
                   torch.tensor(ids, dtype=torch.long, device=x.device)] = float("-inf")
    if params.allowed_token_ids:   # only then can a row lose every finite logit
        dead = torch.isneginf(banned).all(dim=1, keepdim=True)
        banned = torch.where(dead, x, banned)
    return banned


def adjust_logits(logits: Tensor, params: SamplingParams, history: TokenHistory | None = None,
                  tokens: Tensor | None = None, parents: Tensor | None = None) -> Tensor:
    """FloatTensor[T, V]: logits[T, V] of one tree (or of T independent rows with tokens None) with the bias, the
    min_tokens hold on stop tokens and the penalties applied, each node under its own context. The history is
    needed for the penalties and min_tokens."""
    x = logits.float().clone()
    if params.allowed_token_ids:
        keep = torch.tensor(params.allowed_token_ids, dtype=torch.long, device=x.device)
        x = torch.full_like(x, float("-inf")).index_copy_(1, keep, x.index_select(1, keep))
    if params.bad_words:
        x = _ban_bad_words(x, params, history, tokens, parents)
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
