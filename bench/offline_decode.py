"""In-process decoding over TargetRunner / DrafterRunner (no services): greedy or DDTree steps as the gateway takes
them, and teacher-forced log-probs of given tokens through the target's own forward."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree_serve.decoding.config import SamplingParams
from ddtree_serve.decoding.ddtree import MAX_TOP_K, build_ddtree_reference, root_tree
from drafter_svc.runner import DraftItem, DrafterRunner
from target_svc.runner import PrefillItem, TargetRunner, VerifyItem


@dataclass
class Decoded:
    """One prompt's output and its verify-step counts (tau = 1 + accepted / drafted_steps)."""

    tokens: list[int]
    steps: int = 0          # verify steps (the prefill's first token is not a step's)
    drafted_steps: int = 0  # steps whose tree held draft nodes
    accepted: int = 0       # draft tokens accepted over all steps


def decode(target: TargetRunner, drafter: DrafterRunner | None, seq_id: str, prompt: list[int], max_tokens: int,
           budget: int = 0) -> Decoded:
    """Greedy decoding of one prompt (EOS honoured), DDTree-`budget` steps with the drafter, or plain
    autoregressive with budget 0 / no drafter; the output is the target's greedy answer either way (lossless)."""
    if len(prompt) + max_tokens > target.max_seq_len:  # the gateway refuses such a request up front too
        raise ValueError(f"{seq_id}: prompt ({len(prompt)} tokens) + {max_tokens} new tokens exceed the target's "
                         f"max_seq_len {target.max_seq_len}")
    speculative = drafter is not None and budget > 0
    eos = set(target.eos_token_ids)
    (out,) = target.prefill([PrefillItem(seq_id, prompt, SamplingParams(), want_features=speculative)])
    result, ctx = Decoded([out.next_token]), out.context_len
    try:
        if speculative:
            drafter.add_context(seq_id, 0, out.features)
        while len(result.tokens) < max_tokens and result.tokens[-1] not in eos:
            bonus = result.tokens[-1]
            # The gateway's bound (gateway/engine.py _max_depth): the block, the tokens still wanted, the context.
            depth = min(drafter.block_size - 1, max_tokens - len(result.tokens) - 1,
                        target.max_seq_len - ctx - 1) if speculative else 0
            if depth > 0:
                top_k = max(1, min(budget, drafter.vocab_size, MAX_TOP_K))
                lp, ids = drafter.draft([DraftItem(seq_id, bonus, ctx)], top_k=top_k, max_depth=depth)
                # The host heap builder: the same tree as the batched one (tests/test_ddtree.py).
                tree = build_ddtree_reference(lp[0].float().cpu(), ids[0].cpu(), budget, depth, bonus)
            else:
                tree = root_tree(bonus)
            (r,) = target.verify([VerifyItem(seq_id, tree.tokens, tree.parents)])
            if speculative:
                drafter.add_context(seq_id, ctx, r.features)
            result.steps += 1
            result.drafted_steps += tree.size > 1
            result.accepted += len(r.accepted_tokens)
            ctx = r.context_len
            # Committed tokens up to the first EOS, as the gateway's Sequence.append keeps them.
            for tok in r.accepted_tokens + [r.next_token]:
                result.tokens.append(tok)
                if tok in eos or len(result.tokens) >= max_tokens:
                    break
    finally:
        target.release(seq_id)
        if speculative:
            drafter.release(seq_id)
    return result


@torch.inference_mode()
def teacher_forced_logprobs(target: TargetRunner, seq_id: str, prompt: list[int], answer: list[int]) -> Tensor:
    """log p(answer[i] | prompt + answer[:i]) for every i, float32 [len(answer)], from the target's own forward
    (TargetModel.forward_block over a cache slot, in prefill-sized chunks): the weights as served."""
    if not prompt or not answer:
        raise ValueError("teacher forcing needs a non-empty prompt and answer")
    ids = prompt + answer
    if len(ids) > target.max_seq_len:
        raise ValueError(f"{len(ids)} tokens exceed the target's max_seq_len {target.max_seq_len}")
    dev = target.device
    # Position i's logits predict token i + 1: the last token is never an input, and only the answer's
    # predictors (positions len(prompt) - 1 ..) are scored.
    inputs, first = ids[:-1], len(prompt) - 1
    parts = []
    for c0, n, logits in _chunked_forward(target, seq_id, inputs):
        lo = max(first, c0)
        if lo >= c0 + n:
            continue  # a prompt-only chunk: it fills the cache, nothing to score
        rows = logits[0, lo - c0:].float().log_softmax(dim=-1)
        nxt = torch.tensor(ids[lo + 1:c0 + n + 1], device=dev)
        parts.append(rows.gather(1, nxt[:, None])[:, 0].cpu())
    return torch.cat(parts)


def _chunked_forward(target: TargetRunner, seq_id: str, ids: list[int]):
    """Yields (start, length, logits [1, length, V]) of ids' forward in prefill-sized chunks over a cache slot
    held for seq_id (released when the generator ends)."""
    model, dev = target.model, target.device
    chunk = target.cfg.prefill_chunk or len(ids)
    slot = model.cache.add_sequence(seq_id)
    try:
        for c0 in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - c0)
            x = torch.tensor([ids[c0:c0 + n]], device=dev)
            # chain=True: each chunk attends to the rows already cached and commits linear-attention states, so
            # the chunks make one forward over the whole sequence (as TargetRunner._prefill does).
            logits, _ = model.forward_block(
                x, (torch.arange(n, device=dev) - 1)[None], torch.ones(1, n, dtype=torch.bool, device=dev),
                torch.tensor([c0], device=dev), torch.tensor([slot], device=dev), key_len=c0 + n, chain=True)
            yield c0, n, logits
    finally:
        model.cache.release(seq_id)


@torch.inference_mode()
def next_token_gap(target: TargetRunner, seq_id: str, ids: list[int]) -> tuple[float, int, int]:
    """(log p(top-1) - log p(top-2), top-1, top-2) of the token after ids, from the target's own chunked forward:
    how near a tie the greedy choice there is."""
    for _, _, logits in _chunked_forward(target, seq_id, ids):
        last = logits[0, -1]
    top = last.float().log_softmax(dim=-1).topk(2)
    return float(top.values[0] - top.values[1]), int(top.indices[0]), int(top.indices[1])
