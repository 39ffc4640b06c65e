"""Acceptance walk over a verified tree, and the KV-row moves that commit the accepted path.

The target gives one choice per node (`target_tokens[i]`: argmax, or one sample from its tempered
distribution at node i). Starting at the root, the walk follows the child whose token equals the target's
choice at the current node; the first node without such a child ends it, and the target's choice there is
the next bonus token. Every committed token is thus a target choice under its true context (lossless).
Siblings carry distinct tokens by convention; if they do not, the lowest-index matching child is taken.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree_serve.decoding.tree_mask import ancestor_mask_batch, as_index_tensor

__all__ = [
    "AcceptResult",
    "AcceptBatch",
    "accept_reference",
    "accept_tree",
    "accept_batch",
    "compaction_indices",
    "compaction_indices_batch",
]


@dataclass
class AcceptResult:
    """Outcome of one walk: accepted tree indices (root first), their tokens (non-root), next bonus token."""

    accepted_nodes: list[int]
    accepted_tokens: list[int]
    next_token: int


@dataclass
class AcceptBatch:
    """Walk outcomes of a padded batch, on the device of the inputs (padding -1)."""

    accepted_nodes: Tensor  # LongTensor[B, Tmax]: column k = accepted node at depth k; column 0 is the root
    accepted_tokens: Tensor  # LongTensor[B, Tmax - 1]: token of accepted_nodes[:, k + 1]
    num_accepted: Tensor  # LongTensor[B]: accepted nodes including the root (>= 1)
    next_tokens: Tensor  # LongTensor[B]

    def results(self) -> list[AcceptResult]:
        """Per-sequence results as host lists (one device->host copy)."""
        nodes, toks = self.accepted_nodes.tolist(), self.accepted_tokens.tolist()
        counts, nxt = self.num_accepted.tolist(), self.next_tokens.tolist()
        return [AcceptResult(nodes[b][:n], toks[b][:n - 1], nxt[b]) for b, n in enumerate(counts)]


def accept_reference(tokens: Tensor, parents: Tensor, target_tokens: Tensor) -> AcceptResult:
    """The walk as a plain loop over host lists (oracle for tests)."""
    tok, par, choice = tokens.tolist(), parents.tolist(), target_tokens.tolist()
    children: list[list[int]] = [[] for _ in tok]
    for i in range(1, len(tok)):
        children[par[i]].append(i)
    path, node = [0], 0
    while True:
        nxt = next((c for c in children[node] if tok[c] == choice[node]), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return AcceptResult(path, [tok[i] for i in path[1:]], choice[node])


def accept_batch(
    tokens: Tensor, parents: Tensor, target_tokens: Tensor, sizes: Tensor | Sequence[int] | None = None,
    anc: Tensor | None = None,
) -> AcceptBatch:
    """Vectorised walk over padded trees [B, Tmax]: node i is accepted iff it and all its ancestors matched.

    A non-root node matches when its token equals the target's choice at its parent (and no lower-index
    sibling with the same token exists). Accepted nodes form a root path; no host sync. anc: the trees'
    ancestor_mask_batch(parents, sizes) when the caller has it already (a verify step's TreeStructure).
    """
    b, t = tokens.shape
    device = tokens.device
    sz = torch.full((b,), t, dtype=torch.long, device=device) if sizes is None else as_index_tensor(sizes, b, device)
    idx = torch.arange(t, device=device)
    valid = idx[None, :] < sz[:, None]
    parents = parents.long()
    match = tokens == target_tokens.gather(1, parents.clamp(min=0))
    # duplicate siblings: only the first one can match (what the reference loop picks); the raw parents
    # keep the root (-1) from looking like a sibling of its own children
    twin = (parents[:, :, None] == parents[:, None, :]) & (tokens[:, :, None] == tokens[:, None, :])
    match &= ~(twin & (idx[None, :] < idx[:, None])[None]).any(2)
    match[:, 0] = True
    match &= valid
    if anc is None:
        anc = ancestor_mask_batch(parents, sz)  # [B, T, T]
    accepted = ~(anc & ~match[:, None, :]).any(2) & valid
    depth = anc.sum(2) - 1
    num = accepted.sum(1)
    # place accepted node i at column depth[i]; everything else goes to a scratch column t
    col = torch.where(accepted, depth, t)
    nodes = torch.full((b, t + 1), -1, dtype=torch.long, device=device)
    nodes.scatter_(1, col, idx.expand(b, t).contiguous())
    nodes = nodes[:, :t]
    last = nodes.gather(1, (num - 1)[:, None])
    next_tokens = target_tokens.gather(1, last)[:, 0]
    acc_tok = torch.where(nodes[:, 1:] >= 0, tokens.gather(1, nodes[:, 1:].clamp(min=0)), -1)
    return AcceptBatch(nodes, acc_tok, num, next_tokens)


def accept_tree(tokens: Tensor, parents: Tensor, target_tokens: Tensor) -> AcceptResult:
    """The walk for one tree with tensor ops (one host copy at the end)."""
    return accept_batch(tokens[None], parents[None], target_tokens[None]).results()[0]


def compaction_indices(accepted_nodes: Tensor | Sequence[int], ctx_len: int) -> tuple[Tensor, Tensor]:
    """(src, dst) cache rows to move accepted node k from row ctx_len + node to row ctx_len + k.

    Use as `cache[dst] = cache[src]`: indexing gathers all sources before any write, so it is safe in place
    (src >= dst row-wise, and dst rows are distinct).
    """
    nodes = torch.as_tensor(accepted_nodes, dtype=torch.long)
    src = ctx_len + nodes
    dst = ctx_len + torch.arange(nodes.numel(), device=nodes.device)
    return src, dst


def compaction_indices_batch(
    accepted_nodes: Tensor, num_accepted: Tensor, ctx_lens: Tensor | Sequence[int]
) -> tuple[Tensor, Tensor]:
    """Padded (src, dst) LongTensor[B, W] for a batch (no sync); padded slots copy a row onto itself.

    For padded slot k >= num_accepted[b] the pair is (ctx + k, ctx + k): it reads a row no real pair
    writes and writes it back unchanged, so `cache[b_idx, dst] = cache[b_idx, src]` stays correct.
    """
    b, w = accepted_nodes.shape
    device = accepted_nodes.device
    ctx = as_index_tensor(ctx_lens, b, device)[:, None]
    k = torch.arange(w, device=device)[None, :]
    dst = ctx + k
    src = torch.where(k < num_accepted[:, None], ctx + accepted_nodes, dst)
    return src, dst
