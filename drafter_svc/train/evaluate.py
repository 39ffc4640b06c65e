"""Offline acceptance of a drafter at temperature 0, as the serving loop would see it.

For a held-out prompt and the target's greedy continuation x[P..L-1] (x[P] comes out of the prefill), a
verify step with root x[p] (context = x[0..p-1]) accepts the longest drafted path that follows the target's
own greedy tokens x[p+1], x[p+2], ...; it commits those plus one bonus token, and the next step's root is
the last committed token. At T=0 the target's choice at any node of that path is known in advance (it is
the greedy continuation), so the walk needs no target calls: the drafter's outputs at every possible root
are computed in batched forwards (one anchor per position, the training layout), trees and chains are built
by ddtree_serve.decoding.ddtree's builders and walked by ddtree_serve.decoding.acceptance, exactly as the gateway and the target
service do. Reported: mean acceptance length (tokens committed per verify step, bonus included) and the
per-position acceptance rates (share of steps whose draft token at depth k was accepted).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ddtree_serve.decoding.acceptance import accept_batch
from ddtree_serve.decoding.ddtree import build_chain, build_ddtree_batch
from drafter_svc.dflash_model import DFlashDraftModel
from drafter_svc.train.samples import Sample
from drafter_svc.train.blocks import block_attention_mask, block_inputs_and_labels, block_position_ids
from drafter_svc.train.target_features import target_features


@dataclass
class WalkStats:
    """Acceptance of one decoding mode over all held-out sequences."""

    mode: str  # "chain" or "ddtree-B"
    steps: int
    committed: int  # tokens committed by verify steps (bonus included)
    mean_acceptance_length: float
    per_position: list[float]  # k = 1..bs-1: share of steps that accepted a draft token at depth k
    conditional: list[float]  # k = 1..bs-1: P(depth k accepted | depth k-1 accepted)
    histogram: list[int]  # steps by number of accepted draft tokens 0..bs-1


@dataclass
class EvalResult:
    """Offline evaluation of a drafter on held-out continuations."""

    sequences: int
    response_tokens: int
    chain: WalkStats
    trees: dict[int, WalkStats]
    teacher_forced_acc: list[float]  # top-1 accuracy per slot k = 1..bs-1 over every root position
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """Flat JSON-friendly view."""
        out: dict[str, Any] = {
            "sequences": self.sequences,
            "response_tokens": self.response_tokens,
            "chain_mean_acceptance_length": self.chain.mean_acceptance_length,
            "teacher_forced_acc": self.teacher_forced_acc,
            "chain": asdict(self.chain),
        }
        for b, w in self.trees.items():
            out[f"ddtree_b{b}_mean_acceptance_length"] = w.mean_acceptance_length
            out[f"ddtree_b{b}_over_chain"] = w.mean_acceptance_length / max(1e-9, self.chain.mean_acceptance_length)
            out[f"ddtree_b{b}"] = asdict(w)
        out.update(self.extra)
        return out


@torch.no_grad()
def draft_topk_all_roots(
    drafter: DFlashDraftModel,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    roots: torch.Tensor,
    top_k: int,
    chunk: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k draft log-probs/ids [N, bs-1, k] (descending) for blocks rooted at `roots` of one sequence.

    input_ids [1, L], features [1, L, F]; block n = [x[roots[n]], MASK...] seeing context < roots[n].
    Log-probs are a float32 log-softmax over the full vocabulary (draft temperature 1), as the drafter service
    returns them.
    """
    cfg = drafter.config
    bs = cfg.block_size
    length = torch.tensor([input_ids.shape[1]], device=input_ids.device)
    lps, ids = [], []
    for i in range(0, roots.numel(), chunk):
        anchors = roots[i : i + chunk][None, :]
        keep = torch.ones_like(anchors, dtype=torch.bool)
        noise_ids, _, _ = block_inputs_and_labels(input_ids, length, anchors, keep, bs, cfg.mask_token_id)
        noise = drafter.embed(noise_ids, embed_weight)
        pos = block_position_ids(anchors, input_ids.shape[1], bs)
        mask = block_attention_mask(anchors, keep, input_ids.shape[1], bs)
        hidden = drafter(noise, features.to(noise.dtype), pos, attention_mask=mask)
        hidden = hidden.reshape(anchors.shape[1], bs, -1)[:, 1:]
        logits = drafter.compute_logits(hidden, lm_head_weight.to(hidden.dtype)).float()
        lp = torch.log_softmax(logits, dim=-1)
        v, k = lp.topk(min(top_k, lp.shape[-1]), dim=-1)
        lps.append(v)
        ids.append(k)
    return torch.cat(lps), torch.cat(ids)


def _walk(
    mode: str,
    budget: int,
    seqs: Sequence[torch.Tensor],
    starts: Sequence[int],
    topk: Sequence[tuple[torch.Tensor, torch.Tensor]],
    block_size: int,
) -> WalkStats:
    """Simulates decoding of every sequence at once (one batched tree build + walk per round)."""
    depth_max = block_size - 1
    pos = list(starts)  # current root position per sequence
    hist = [0] * (depth_max + 1)
    steps = committed = 0
    while True:
        active = [b for b, s in enumerate(seqs) if pos[b] < s.numel() - 1]
        if not active:
            break
        lp = torch.stack([topk[b][0][pos[b] - starts[b]] for b in active])
        ids = torch.stack([topk[b][1][pos[b] - starts[b]] for b in active])
        roots = [int(seqs[b][pos[b]]) for b in active]
        if mode == "chain":
            trees = build_chain(lp, ids, roots)
        else:
            trees = build_ddtree_batch(lp, ids, roots, budget)
        # the target's greedy choice at a node of depth d on the true path is x[p + d + 1]
        choice = torch.full_like(trees.tokens, -1)
        for r, b in enumerate(active):
            s, p = seqs[b], pos[b]
            look = p + 1 + trees.depths[r]
            ok = look < s.numel()
            choice[r] = torch.where(ok, s[look.clamp(max=s.numel() - 1)], torch.full_like(look, -1))
        res = accept_batch(trees.tokens, trees.parents, choice, trees.sizes)
        acc = (res.num_accepted - 1).tolist()
        for r, b in enumerate(active):
            remaining = seqs[b].numel() - 1 - pos[b]  # tokens still to commit after the root
            a = min(acc[r], remaining)
            got = min(a + 1, remaining)  # no bonus past the end of the continuation
            hist[a] += 1
            steps += 1
            committed += got
            pos[b] += got
    per_pos = [sum(hist[k:]) / max(1, steps) for k in range(1, depth_max + 1)]
    cond = []
    for k in range(1, depth_max + 1):
        prev = sum(hist[k - 1 :])
        cond.append(sum(hist[k:]) / prev if prev else math.nan)
    return WalkStats(mode if mode == "chain" else f"ddtree-{budget}", steps, committed,
                     committed / max(1, steps), per_pos, cond, hist)


@torch.no_grad()
def evaluate_acceptance(
    drafter: DFlashDraftModel,
    target: nn.Module,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    samples: Sequence[Sample],
    budgets: Sequence[int] = (64,),
    amp: bool = False,
    chunk: int = 256,
) -> EvalResult:
    """Chain and DDTree (each budget) acceptance at T=0 on samples = prompt + target greedy continuation."""
    device = embed_weight.device
    was_training = drafter.training
    drafter.eval()
    cfg = drafter.config
    bs = cfg.block_size
    top_k = max([1, *budgets])
    seqs, starts, topk = [], [], []
    tf_hits = torch.zeros(bs - 1)
    tf_counts = torch.zeros(bs - 1)
    ctx = torch.autocast(device_type=device.type, dtype=torch.bfloat16) if amp else contextlib.nullcontext()
    for s in samples:
        x = torch.tensor(s.input_ids, dtype=torch.long, device=device)
        p0 = s.loss_start  # x[p0] is the first generated token (the prefill's output)
        if x.numel() - 1 - p0 < 1:
            continue
        roots = torch.arange(p0, x.numel() - 1, device=device)
        with ctx:
            feats = target_features(target, x[None], cfg.target_layer_ids)
            lp, ids = draft_topk_all_roots(drafter, embed_weight, lm_head_weight, x[None], feats, roots, top_k, chunk)
        # teacher-forced top-1 accuracy per slot over every root
        look = roots[:, None] + torch.arange(1, bs, device=device)[None, :]
        ok = look < x.numel()
        hit = (ids[:, :, 0] == x[look.clamp(max=x.numel() - 1)]) & ok
        tf_hits += hit.sum(0).float().cpu()
        tf_counts += ok.sum(0).float().cpu()
        seqs.append(x.cpu())
        starts.append(p0)
        topk.append((lp.cpu(), ids.cpu()))
    if was_training:
        drafter.train()
    if not seqs:
        raise ValueError("no evaluable sample (each needs a continuation of >= 2 tokens)")
    chain = _walk("chain", 1, seqs, starts, topk, bs)
    trees = {b: _walk("ddtree", b, seqs, starts, topk, bs) for b in budgets}
    return EvalResult(
        sequences=len(seqs),
        response_tokens=sum(s.numel() - p for s, p in zip(seqs, starts)),
        chain=chain,
        trees=trees,
        teacher_forced_acc=(tf_hits / tf_counts.clamp(min=1)).tolist(),
    )


def format_result(res: EvalResult) -> str:
    """Human-readable summary lines."""
    lines = [f"held-out sequences: {res.sequences}, response tokens: {res.response_tokens}"]
    modes = [res.chain, *res.trees.values()]
    for w in modes:
        pp = " ".join(f"{v:.2f}" for v in w.per_position[:8])
        lines.append(f"{w.mode:>11}: mean acceptance length {w.mean_acceptance_length:.3f} over {w.steps} steps; "
                     f"P(depth k accepted) k=1..8: {pp}")
    for b, w in res.trees.items():
        lines.append(f"ddtree-{b} / chain = {w.mean_acceptance_length / max(1e-9, res.chain.mean_acceptance_length):.3f}")
    lines.append("teacher-forced top-1 per slot: " + " ".join(f"{v:.2f}" for v in res.teacher_forced_acc))
    return "\n".join(lines)
