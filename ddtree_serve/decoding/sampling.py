"""The target's token choice at each tree node: argmax at temperature 0, else one tempered sample per node.

Filtering follows HF/vLLM: temperature first, then top-k (keep logits >= the k-th largest, ties kept), then
top-p over the renormalised result (drop the low tail whose mass is <= 1 - top_p, always keeping the most
likely token), then min-p (drop tokens less likely than min_p times the likeliest one), in transformers' order.
All math in float32. Logits adjusted by a bias or penalties (logits_processing.py) come in adjusted.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ddtree_serve.decoding.config import SamplingParams

__all__ = ["make_generator", "filter_logits", "target_probs", "choose_tokens"]


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """Per-sequence generator on `device`: seeded when `seed` is given, else from a fresh random seed."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> Tensor:
    """Logits with the tokens outside top-k / top-p / min-p set to -inf (0, 1.0 and 0 disable the filters)."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending: the tail comes first
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= 1.0 - top_p
        drop[..., -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if min_p > 0.0:
        # compared as probabilities, as transformers does; the likeliest token always stays (min_p <= 1)
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return logits


def target_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """FloatTensor[..., V]: the distribution choose_tokens samples from (one-hot of the argmax when greedy)."""
    x = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).float()
    return filter_logits(x / params.temperature, params.top_k, params.top_p, params.min_p).softmax(-1)


def choose_tokens(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> Tensor:
    """LongTensor[T]: the target's choice per node from logits[T, V] (argmax, or an independent sample each)."""
    params.validate()
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V], got {tuple(logits.shape)}")
    x = logits.float()
    if params.greedy or x.shape[0] == 0:
        return x.argmax(-1)
    probs = target_probs(x, params)
    # one draw per row from the sequence's own generator: reproducible given the seed
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
