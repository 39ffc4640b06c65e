"""Log-probabilities of the tokens the target emitted, as an OpenAI-compatible API reports them.

Of the raw logits (before temperature, top-k and top-p), as vLLM reports them by default: the model's own
distribution, whatever the request sampled with. A speculative step emits the accepted tokens and the bonus
token; each came from the logits row of its parent on the accepted path, so the rows are those of the accepted
nodes, root first (target_svc/runner.py gathers them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# The most alternatives a request may ask for per token (OpenAI's top_logprobs cap).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability, its rank in its row (1: the likeliest; 1 + the tokens strictly more
    likely), and the `top` likeliest tokens of its row (id, log-prob), likeliest first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 0   # 0: not computed


def token_logprobs(logits: Tensor, chosen: Tensor, top: int = 0) -> list[TokenLogprob]:
    """logits [N, V] (any float dtype, any device), chosen [N] token ids -> each row's log-softmax at its chosen
    token and its `top` largest entries (float32 math; one host copy)."""
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, chosen.to(lp.device, torch.long)[:, None])[:, 0]
    rank = (lp > picked[:, None]).sum(1, dtype=torch.float32) + 1   # exact in float32 below 2**24 tokens
    values, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)   # [N, 0] when top is 0
    host = torch.cat([picked[:, None], rank[:, None], values, ids.float()], dim=1).cpu()
    k = values.shape[1]
    return [TokenLogprob(float(row[0]), tuple(zip(row[2 + k:].long().tolist(), row[2:2 + k].tolist())), int(row[1]))
            for row in host]
