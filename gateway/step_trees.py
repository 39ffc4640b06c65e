"""Turns one step's drafts into verify trees: DDTree, DFlash chain or root-only, batched per kind."""
from __future__ import annotations

import numpy as np
import torch

from ddtree_serve.decoding.ddtree import DraftTree, build_chain, build_ddtree_batch, root_tree
from ddtree_serve.decoding.ddtree_host import build_chain_host, build_ddtree_host
from gateway.sequence import Sequence


Draft = tuple[np.ndarray, np.ndarray] | tuple[torch.Tensor, torch.Tensor]   # (log-probs, ids), each [depth, k]


def build_step_trees(seqs: list[Sequence], drafts: dict[str, Draft],
                     max_depths: dict[str, int], budgets: dict[str, int] | None = None) -> dict[str, DraftTree]:
    """One tree per sequence; sequences without a draft this step (AR, drafter down, no room) get the root alone.
    budgets: this step's DDTree budget per sequence (default: each sequence's own)."""
    budgets = budgets or {}
    trees: dict[str, DraftTree] = {}
    for kind in ("ddtree", "dflash"):
        group = [s for s in seqs if s.mode == kind and s.seq_id in drafts]
        if not group:
            continue
        first = drafts[group[0].seq_id][0]
        if isinstance(first, np.ndarray) or first.is_cpu:
            # On the host (the gateway's numpy drafts), per-sequence numpy builders beat the batched tensor ones many
            # times over (torch's per-op overhead dominates on tensors this small); identical trees
            # (tests/test_ddtree.py, bench/tree_build.py).
            for s in group:
                logprobs, ids = drafts[s.seq_id]
                trees[s.seq_id] = (build_ddtree_host(logprobs, ids, budgets.get(s.seq_id, s.budget),
                                                     max_depths[s.seq_id], s.bonus)
                                   if kind == "ddtree" else
                                   build_chain_host(logprobs, ids, max_depths[s.seq_id], s.bonus))
            continue
        logprobs = torch.stack([drafts[s.seq_id][0] for s in group])
        ids = torch.stack([drafts[s.seq_id][1] for s in group])
        roots = [s.bonus for s in group]
        depths = [max_depths[s.seq_id] for s in group]
        if kind == "ddtree":
            batch = build_ddtree_batch(logprobs, ids, roots, [budgets.get(s.seq_id, s.budget) for s in group], depths)
        else:
            batch = build_chain(logprobs, ids, roots, depths)
        trees.update(zip((s.seq_id for s in group), batch.unbind()))
    for s in seqs:
        if s.seq_id not in trees:
            trees[s.seq_id] = root_tree(s.bonus)
    return trees
