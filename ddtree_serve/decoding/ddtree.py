"""DDTree draft trees (best-first optimum of the factorised draft distribution) and DFlash chains.

Input per sequence: the drafter's top-K log-probs and ids for L future positions, sorted by decreasing
log-prob (`topk_logprobs[B, L, K]`, `topk_ids[B, L, K]`). A prefix is a path of ranks (r_1, .., r_d); its
score is the sum of the log-probs along it (log of the product of marginals). For a budget of N nodes the
optimal tree is the N highest-scoring prefixes; DDTree's best-first heap over (depth, rank) pops them in
order of (score desc, rank tuple lexicographically asc), which is also our node order: node 0 is the root
(the caller's bonus token), parents precede children, scores are non-increasing.

Scores are summed in fixed point (log-probs rounded to 2**-40, clamped to [-1024, 0], NaN -> -1024), so
sums are exact and both builders see the very same numbers: ties are real ties, broken by the rank tuple as
the reference heap does, and prefixes whose log-probs differ by less than ~1e-12 count as tied.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from ddtree_serve.decoding.tree_mask import ancestor_mask, as_index_tensor

__all__ = [
    "DraftTree",
    "DraftTreeBatch",
    "root_tree",
    "build_ddtree_reference",
    "build_ddtree_batch",
    "build_chain",
    "pad_trees",
    "num_prefixes",
    "tree_log_probs",
    "expected_acceptance_length",
    "expected_acceptance_lengths",
    "MAX_TOP_K",
]

# Candidates per draft position a step asks the drafter for: a DDTree of budget N uses at most min(N, vocab)
# per position, and the drafter refuses to return more (one limit for gateway and drafter).
MAX_TOP_K = 1024
_SCALE_BITS = 40  # fixed-point resolution 2**-40 (~1e-12) in log space
_LOGP_FLOOR = 1024.0  # exp(-1024) is 0 in any float; keeps L * floor * 2**40 far inside int64
_MAX_DEPTH = 4096
_INVALID = torch.iinfo(torch.int64).min  # score of padding candidates: below every real prefix


@dataclass
class DraftTree:
    """One verify tree: node 0 = root (bonus token), parents[0] = -1, parents[i] < i."""

    tokens: Tensor  # LongTensor[T]
    parents: Tensor  # LongTensor[T]
    depths: Tensor  # LongTensor[T]
    log_probs: Tensor | None = None  # FloatTensor[T]: log of the prefix's draft probability, root 0

    @property
    def size(self) -> int:
        """Number of nodes T, root included (the draft node count is size - 1)."""
        return int(self.tokens.shape[0])

    def to(self, device: torch.device | str) -> DraftTree:
        """The same tree on `device`."""
        lp = None if self.log_probs is None else self.log_probs.to(device)
        return DraftTree(self.tokens.to(device), self.parents.to(device), self.depths.to(device), lp)


@dataclass
class DraftTreeBatch:
    """Padded trees of a batch: row b holds sizes[b] valid nodes; padding is token 0, parent -1, depth 0."""

    tokens: Tensor  # LongTensor[B, Tmax]
    parents: Tensor  # LongTensor[B, Tmax]
    depths: Tensor  # LongTensor[B, Tmax]
    log_probs: Tensor  # FloatTensor[B, Tmax], padding -inf
    sizes: list[int]  # T_b, root included (known on the host, no sync needed)

    def tree(self, b: int) -> DraftTree:
        """Tree of sequence b (views into the batch tensors)."""
        t = self.sizes[b]
        return DraftTree(self.tokens[b, :t], self.parents[b, :t], self.depths[b, :t], self.log_probs[b, :t])

    def unbind(self) -> list[DraftTree]:
        """All trees of the batch."""
        return [self.tree(b) for b in range(len(self.sizes))]

    def to(self, device: torch.device | str) -> DraftTreeBatch:
        """The same batch on `device` (one copy per field)."""
        return DraftTreeBatch(self.tokens.to(device), self.parents.to(device), self.depths.to(device),
                              self.log_probs.to(device), list(self.sizes))


def root_tree(root_token: int, device: torch.device | str = "cpu") -> DraftTree:
    """The one-node tree of an autoregressive step."""
    return DraftTree(
        tokens=torch.tensor([root_token], dtype=torch.long, device=device),
        parents=torch.tensor([-1], dtype=torch.long, device=device),
        depths=torch.zeros(1, dtype=torch.long, device=device),
        log_probs=torch.zeros(1, dtype=torch.float32, device=device),
    )


def num_prefixes(k: int, depth: int, cap: int) -> int:
    """min(cap, k + k**2 + ... + k**depth): how many nodes a budget of `cap` can actually get."""
    total, level = 0, 1
    for _ in range(depth):
        level *= k
        total += level
        if total >= cap or level == 0:
            break
    return min(total, cap)


def _quantize(logprobs: Tensor) -> Tensor:
    """Fixed-point int64 log-probs: exact sums, identical in both builders."""
    x = logprobs.detach().to(torch.float64)
    x = torch.where(torch.isnan(x), torch.full_like(x, -_LOGP_FLOOR), x).clamp(-_LOGP_FLOOR, 0.0)
    return torch.round(x * float(2**_SCALE_BITS)).to(torch.int64)


def _dequantize(score: Tensor) -> Tensor:
    return (score.to(torch.float64) / float(2**_SCALE_BITS)).to(torch.float32)


def _check_topk(topk_logprobs: Tensor, topk_ids: Tensor, dims: int) -> None:
    # .ndim and .shape: tensors and the host builders' numpy arrays alike
    if topk_logprobs.ndim != dims or topk_logprobs.shape != topk_ids.shape:
        raise ValueError(f"topk_logprobs and topk_ids must have the same {dims}-D shape, "
                         f"got {tuple(topk_logprobs.shape)} and {tuple(topk_ids.shape)}")
    if topk_logprobs.shape[-2] > _MAX_DEPTH:
        raise ValueError(f"at most {_MAX_DEPTH} draft positions are supported")


def _host_ints(values: Tensor | Sequence[int] | int, n: int, name: str) -> list[int]:
    if isinstance(values, Tensor):
        values = values.tolist()  # a sync if on device: pass host ints where possible
    if isinstance(values, int):
        values = [values] * n
    out = [int(v) for v in values]
    if len(out) != n:
        raise ValueError(f"{name}: expected {n} values, got {len(out)}")
    if any(v < 0 for v in out):
        raise ValueError(f"{name} must be >= 0, got {out}")
    return out


def build_ddtree_reference(
    logprobs: Tensor, ids: Tensor, budget: int, max_depth: int | None = None, root_token: int = 0
) -> DraftTree:
    """DDTree for one sequence with the paper's best-first heap (readable oracle; host Python)."""
    _check_topk(logprobs, ids, 2)
    depth_limit = logprobs.shape[0] if max_depth is None else min(logprobs.shape[0], max_depth)
    width = min(budget, logprobs.shape[1])  # only the top-min(B, K) tokens per position can be chosen
    q = _quantize(logprobs).tolist()
    tok = ids.tolist()
    tokens, parents, depths, scores = [root_token], [-1], [0], [0]
    if budget > 0 and depth_limit > 0 and width > 0:
        # entries: (-score, rank tuple, parent node, score); the rank tuple breaks ties and is unique
        heap = [(-q[0][0], (0,), 0, q[0][0])]
        while heap and len(tokens) <= budget:
            _, ranks, parent, score = heapq.heappop(heap)
            depth, rank = len(ranks), ranks[-1]
            node = len(tokens)
            tokens.append(tok[depth - 1][rank])
            parents.append(parent)
            depths.append(depth)
            scores.append(score)
            if rank + 1 < width:  # next sibling: same parent, next rank
                s = scores[parent] + q[depth - 1][rank + 1]
                heapq.heappush(heap, (-s, ranks[:-1] + (rank + 1,), parent, s))
            if depth < depth_limit:  # first child: best token of the next position
                s = score + q[depth][0]
                heapq.heappush(heap, (-s, ranks + (0,), node, s))
    device = logprobs.device
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        parents=torch.tensor(parents, dtype=torch.long, device=device),
        depths=torch.tensor(depths, dtype=torch.long, device=device),
        log_probs=_dequantize(torch.tensor(scores, dtype=torch.int64)).to(device),
    )


@lru_cache(maxsize=256)
def _expansion_pairs(prev_width: int, k: int, width: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(parent slot i, rank r) pairs with (i+1)(r+1) <= width: the only expansions that can make the top-width.

    With the previous beam in key order, the expansion (i, r) is beaten by every (i', r') with i' <= i and
    r' <= r (sums are exact, so that order is monotone), i.e. by (i+1)(r+1)-1 others.
    """
    i = torch.arange(prev_width).repeat_interleave(torch.clamp(width // torch.arange(1, prev_width + 1), max=k))
    start = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(torch.bincount(i, minlength=prev_width), 0)[:-1]])
    r = torch.arange(i.numel()) - start[i]
    return i.to(device, non_blocking=True), r.to(device, non_blocking=True)


def _stable_sort_perm(key: Tensor, perm: Tensor, descending: bool = False) -> Tensor:
    """Refines `perm` by a stable sort on key[perm] (for lexicographic multi-key sorts, last key first)."""
    order = torch.sort(key.gather(1, perm), dim=1, descending=descending, stable=True).indices
    return perm.gather(1, order)


def build_ddtree_batch(
    topk_logprobs: Tensor,
    topk_ids: Tensor,
    root_tokens: Tensor | Sequence[int],
    budgets: Sequence[int] | int,
    max_depths: Sequence[int] | int | None = None,
) -> DraftTreeBatch:
    """DDTree for a batch with tensor ops on the inputs' device; equals build_ddtree_reference per sequence.

    A beam of width W = max budget per depth: the top-W prefixes of depth d have their parents among the
    top-W of depth d-1, so expanding only the beam loses nothing (and, the beam being in key order, only
    the ~W ln W expansions of `_expansion_pairs` can qualify). The union of the beams is then sorted
    globally by (score desc, rank tuple asc) and each sequence keeps its first min(budget, #prefixes).
    The loop runs over depths only; no host synchronisation (pass budgets and max_depths as host ints).
    """
    _check_topk(topk_logprobs, topk_ids, 3)
    bsz, n_pos, k_in = topk_logprobs.shape
    device = topk_logprobs.device
    budget_l = _host_ints(budgets, bsz, "budgets")
    caps = [n_pos] * bsz if max_depths is None else [min(n_pos, d) for d in _host_ints(max_depths, bsz, "max_depths")]
    n_nodes = [num_prefixes(k_in, d, b) for b, d in zip(budget_l, caps)]
    width = max(n_nodes, default=0)
    t_max = 1 + width
    roots = as_index_tensor(root_tokens, bsz, device)

    tokens = torch.zeros(bsz, t_max, dtype=torch.long, device=device)
    parents = torch.full((bsz, t_max), -1, dtype=torch.long, device=device)
    depths = torch.zeros(bsz, t_max, dtype=torch.long, device=device)
    log_probs = torch.full((bsz, t_max), float("-inf"), dtype=torch.float32, device=device)
    tokens[:, 0] = roots
    log_probs[:, 0] = 0.0
    sizes = [1 + n for n in n_nodes]
    if width == 0:
        return DraftTreeBatch(tokens, parents, depths, log_probs, sizes)

    k = min(k_in, width)  # a rank-r token has r better siblings, so ranks >= width never make it
    n_depth = min(width, max(c for c, n in zip(caps, n_nodes) if n > 0))  # depth d needs d-1 ancestors first
    q = _quantize(topk_logprobs[:, :n_depth, :k])
    ids = topk_ids[:, :n_depth, :k].long()
    cap_t = as_index_tensor(caps, bsz, device)
    # rank tuples packed big-endian into int64 words, digit = rank + 1 (0 = "no digit"): a word-wise
    # lexicographic compare of these is the rank-tuple compare, prefix before extension
    bits = k.bit_length()
    per_word = 63 // bits
    n_words = -(-n_depth // per_word)

    # beam at depth 0 = the root
    score = torch.zeros(bsz, 1, dtype=torch.int64, device=device)
    valid = torch.ones(bsz, 1, dtype=torch.bool, device=device)
    lex_rank = torch.zeros(bsz, 1, dtype=torch.long, device=device)  # rank tuple order within the beam
    words = torch.zeros(bsz, 1, n_words, dtype=torch.int64, device=device)
    per_depth: list[tuple[Tensor, ...]] = []
    for d in range(1, n_depth + 1):
        pi, pr = _expansion_pairs(score.shape[1], k, width, device)
        # index_select/gather, not advanced indexing: much faster on CPU, same kernels' worth on GPU
        c_score = score.index_select(1, pi) + q[:, d - 1].index_select(1, pr)
        c_valid = valid.index_select(1, pi) & (cap_t >= d)[:, None]
        c_score = c_score.masked_fill(~c_valid, _INVALID)
        c_lex = lex_rank.index_select(1, pi) * k + pr  # rank tuple order among this depth's candidates
        # key order (score desc, rank tuple asc): stable sort by the tie-break first, then by score
        perm = torch.arange(pi.numel(), device=device).expand(bsz, -1)
        perm = _stable_sort_perm(c_lex, perm)
        perm = _stable_sort_perm(c_score, perm, descending=True)[:, :width]
        slot, rank = pi.expand(bsz, -1).gather(1, perm), pr.expand(bsz, -1).gather(1, perm)
        score, valid = c_score.gather(1, perm), c_valid.gather(1, perm)
        lex_key = c_lex.gather(1, perm).masked_fill(~valid, torch.iinfo(torch.int64).max)
        lex_rank = torch.empty_like(lex_key).scatter_(
            1, torch.argsort(lex_key, dim=1), torch.arange(lex_key.shape[1], device=device).expand_as(lex_key))
        words = words.gather(1, slot[:, :, None].expand(-1, -1, n_words))
        w, shift = divmod(d - 1, per_word)
        words[:, :, w] += (rank + 1) << (bits * (per_word - 1 - shift))
        per_depth.append((score, valid, slot, rank, words))

    # union of the beams, flattened depth-major; parent pointers into the same flat index space
    offsets = [0]
    for s, *_ in per_depth:
        offsets.append(offsets[-1] + s.shape[1])
    all_score = torch.cat([s for s, *_ in per_depth], 1)
    all_words = torch.cat([w for *_, w in per_depth], 1)
    all_tok = torch.cat([ids[:, d].gather(1, r) for d, (_, _, _, r, _) in enumerate(per_depth)], 1)
    all_par = torch.cat([sl + offsets[d - 1] if d > 0 else torch.full_like(sl, -1)
                         for d, (_, _, sl, _, _) in enumerate(per_depth)], 1)
    all_depth = torch.cat([torch.full_like(sl, d + 1) for d, (_, _, sl, _, _) in enumerate(per_depth)], 1)
    perm = torch.arange(all_score.shape[1], device=device).expand(bsz, -1)
    for wi in reversed(range(n_words)):
        perm = _stable_sort_perm(all_words[:, :, wi], perm)
    perm = _stable_sort_perm(all_score, perm, descending=True)  # invalid score is int64 min: last

    order = perm[:, :width]
    pos = torch.empty_like(perm).scatter_(1, perm, torch.arange(perm.shape[1], device=device).expand_as(perm))
    par_flat = all_par.gather(1, order)
    node_parent = torch.where(par_flat >= 0, pos.gather(1, par_flat.clamp(min=0)) + 1, torch.zeros_like(par_flat))
    keep = torch.arange(width, device=device)[None, :] < (as_index_tensor(sizes, bsz, device) - 1)[:, None]
    tokens[:, 1:] = torch.where(keep, all_tok.gather(1, order), 0)
    parents[:, 1:] = torch.where(keep, node_parent, -1)
    depths[:, 1:] = torch.where(keep, all_depth.gather(1, order), 0)
    log_probs[:, 1:] = torch.where(keep, _dequantize(all_score.gather(1, order)), float("-inf"))
    return DraftTreeBatch(tokens, parents, depths, log_probs, sizes)


def build_chain(
    topk_logprobs: Tensor,
    topk_ids: Tensor,
    root_tokens: Tensor | Sequence[int],
    max_depths: Sequence[int] | int | None = None,
) -> DraftTreeBatch:
    """DFlash chain per sequence: the top-1 token of each position, up to max_depths[b] nodes."""
    _check_topk(topk_logprobs, topk_ids, 3)
    bsz, n_pos, _ = topk_logprobs.shape
    device = topk_logprobs.device
    caps = [n_pos] * bsz if max_depths is None else [min(n_pos, d) for d in _host_ints(max_depths, bsz, "max_depths")]
    if topk_logprobs.shape[2] == 0:
        caps = [0] * bsz
    depth = max(caps, default=0)
    sizes = [1 + c for c in caps]
    idx = torch.arange(1 + depth, device=device)
    keep = idx[None, :] < as_index_tensor(sizes, bsz, device)[:, None]
    keep[:, 0] = False
    tokens = torch.zeros(bsz, 1 + depth, dtype=torch.long, device=device)
    tokens[:, 1:] = topk_ids[:, :depth, 0]
    tokens = torch.where(keep, tokens, 0)
    tokens[:, 0] = as_index_tensor(root_tokens, bsz, device)
    parents = torch.where(keep, idx - 1, -1).expand(bsz, -1).contiguous()
    depths = torch.where(keep, idx, 0).expand(bsz, -1).contiguous()
    score = torch.zeros(bsz, 1 + depth, dtype=torch.int64, device=device)
    score[:, 1:] = torch.cumsum(_quantize(topk_logprobs[:, :depth, 0]), 1)
    log_probs = torch.where(keep, _dequantize(score), float("-inf"))
    log_probs[:, 0] = 0.0
    return DraftTreeBatch(tokens, parents, depths, log_probs, sizes)


def pad_trees(trees: Sequence[DraftTree], device: torch.device | str | None = None) -> DraftTreeBatch:
    """Pads single trees into a batch (missing log-probs become 0; padding as in DraftTreeBatch)."""
    if not trees:
        raise ValueError("pad_trees needs at least one tree")
    device = device if device is not None else trees[0].tokens.device
    sizes = [t.size for t in trees]
    t_max = max(sizes)
    tokens = torch.zeros(len(trees), t_max, dtype=torch.long, device=device)
    parents = torch.full((len(trees), t_max), -1, dtype=torch.long, device=device)
    depths = torch.zeros(len(trees), t_max, dtype=torch.long, device=device)
    log_probs = torch.full((len(trees), t_max), float("-inf"), dtype=torch.float32, device=device)
    for b, t in enumerate(trees):
        n = t.size
        tokens[b, :n] = t.tokens
        parents[b, :n] = t.parents
        depths[b, :n] = t.depths
        log_probs[b, :n] = 0.0 if t.log_probs is None else t.log_probs.to(torch.float32)
    return DraftTreeBatch(tokens, parents, depths, log_probs, sizes)


def tree_log_probs(tree: DraftTree, topk_logprobs: Tensor, topk_ids: Tensor) -> Tensor:
    """FloatTensor[T]: log draft probability of each node's prefix, looked up in the drafter's top-K."""
    _check_topk(topk_logprobs, topk_ids, 2)
    depth = tree.depths.clamp(min=1) - 1
    hit = topk_ids[depth] == tree.tokens[:, None]  # [T, K]
    own = torch.where(hit, topk_logprobs[depth].to(torch.float64), 0.0).sum(1)
    # a token outside the top-K has unknown (treated as zero) probability: -inf for it and its subtree
    missing = ~hit.any(1)
    own = torch.where(missing, 0.0, own)
    own[0] = 0.0
    missing[0] = False
    anc = ancestor_mask(tree.parents).to(torch.float64)
    prefix = anc @ own
    return prefix.masked_fill((anc @ missing.to(torch.float64)) > 0, float("-inf")).to(torch.float32)


def expected_acceptance_length(
    tree: DraftTree, topk_logprobs: Tensor | None = None, topk_ids: Tensor | None = None
) -> float:
    """1 + sum of the draft nodes' prefix probabilities: expected tokens per step if the drafter were right."""
    lp = tree.log_probs
    if lp is None:
        if topk_logprobs is None or topk_ids is None:
            raise ValueError("tree has no log_probs: pass the drafter's topk_logprobs and topk_ids")
        lp = tree_log_probs(tree, topk_logprobs, topk_ids)
    return 1.0 + float(lp[1:].to(torch.float64).exp().sum())


def expected_acceptance_lengths(batch: DraftTreeBatch) -> Tensor:
    """FloatTensor[B]: expected_acceptance_length of each tree of a batch (no host sync)."""
    return 1.0 + batch.log_probs[:, 1:].to(torch.float64).exp().sum(1)
