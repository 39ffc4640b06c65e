"""Depths, ancestor masks and the verify attention mask, against hand-made trees and loops."""
from __future__ import annotations

import torch

from ddtree_serve.decoding.tree_mask import (
    ancestor_mask,
    ancestor_mask_batch,
    depths_from_parents,
    depths_from_parents_batch,
    tree_attention_mask,
    tree_structure,
)

#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
#   |
#   6
HAND_PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
HAND_ANCESTORS = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 2, 5}, 6: {0, 1, 3, 6}}


def random_parents(gen: torch.Generator, t: int) -> torch.Tensor:
    """Random tree of t nodes in the convention parents[i] < i."""
    par = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, t)]
    return torch.tensor(par)


def loop_ancestors(parents: list[int]) -> list[set[int]]:
    out: list[set[int]] = []
    for i, p in enumerate(parents):
        out.append({i} | (out[p] if p >= 0 else set()))
    return out


def test_depths_hand_made_tree():
    assert depths_from_parents(HAND_PARENTS).tolist() == [0, 1, 1, 2, 2, 2, 3]


def test_long_chain_depths_and_mask():
    chain = torch.arange(-1, 39)
    assert depths_from_parents(chain).tolist() == list(range(40))
    assert torch.equal(ancestor_mask(chain), torch.ones(40, 40, dtype=torch.bool).tril())


def test_ancestor_mask_hand_made_tree():
    mask = ancestor_mask(HAND_PARENTS)
    for i in range(7):
        assert {j for j in range(7) if mask[i, j]} == HAND_ANCESTORS[i]


def test_ancestor_mask_random_trees_match_loop():
    gen = torch.Generator().manual_seed(0)
    for t in (1, 2, 3, 17, 64):
        parents = random_parents(gen, t)
        mask = ancestor_mask(parents)
        expected = loop_ancestors(parents.tolist())
        assert [{j for j in range(t) if mask[i, j]} for i in range(t)] == expected


def test_batched_padding_sees_only_itself():
    parents = torch.tensor([[-1, 0, 1, 1, 3], [-1, 0, 0, -1, -1]])
    mask = ancestor_mask_batch(parents, [5, 3])
    assert torch.equal(mask[0], ancestor_mask(parents[0]))
    assert torch.equal(mask[1, :3, :3], ancestor_mask(parents[1, :3]))
    assert not bool(mask[1, :3, 3:].any())
    assert torch.equal(mask[1, 3:, :], torch.eye(5, dtype=torch.bool)[3:])
    assert depths_from_parents_batch(parents, [5, 3]).tolist() == [[0, 1, 2, 2, 3], [0, 1, 1, 0, 0]]


def test_tree_attention_mask_matches_loop():
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3], [-1, 0, 1, 0, -1, -1]])
    sizes, ctx, key_len = [6, 4], [3, 5], 12
    mask = tree_attention_mask(torch.tensor(ctx), parents, torch.tensor(sizes), key_len)
    assert mask.shape == (2, 6, key_len)
    expected = torch.zeros_like(mask)
    for b in range(2):
        anc = loop_ancestors(parents[b, : sizes[b]].tolist())
        for i in range(6):
            for j in range(key_len):
                if j < ctx[b]:
                    expected[b, i, j] = True
                elif i < sizes[b] and ctx[b] <= j < ctx[b] + sizes[b]:
                    expected[b, i, j] = (j - ctx[b]) in anc[i]
                elif i >= sizes[b]:
                    expected[b, i, j] = j == ctx[b] + i  # padded query: context + its own row
    assert torch.equal(mask, expected)


def test_tree_structure_equals_the_separate_mask_and_depths_on_padded_random_trees():
    gen = torch.Generator().manual_seed(3)
    for t in (1, 2, 9, 65):
        rows = [random_parents(gen, int(torch.randint(1, t + 1, (1,), generator=gen))) for _ in range(4)]
        parents = torch.full((4, t), -1, dtype=torch.long)
        for b, p in enumerate(rows):
            parents[b, : len(p)] = p
        sizes = torch.tensor([len(p) for p in rows])
        got = tree_structure(parents, sizes)
        assert torch.equal(got.anc, ancestor_mask_batch(parents, sizes))
        assert got.anc.is_contiguous()
        assert torch.equal(got.depth, depths_from_parents_batch(parents, sizes))


def test_tree_attention_mask_takes_a_given_ancestor_mask():
    parents = torch.stack([HAND_PARENTS, torch.tensor([-1, 0, 1, -1, -1, -1, -1])])
    sizes = torch.tensor([7, 3])
    anc = tree_structure(parents, sizes).anc
    assert torch.equal(tree_attention_mask([4, 2], parents, sizes, 12, anc),
                       tree_attention_mask([4, 2], parents, sizes, 12))
