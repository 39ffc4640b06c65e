"""Acceptance walk (loop == batched, hand-made cases) and KV compaction indices."""
from __future__ import annotations

import torch

from ddtree_serve.decoding.acceptance import (
    accept_batch,
    accept_reference,
    accept_tree,
    compaction_indices,
    compaction_indices_batch,
)
from ddtree_serve.decoding.ddtree import build_ddtree_reference, pad_trees
from ddtree_serve.decoding.tree_mask import tree_structure

#          0 (tok 5)
#       /      \
#   1 (7)       2 (8)
#    |       /      \
#   3 (9)   4 (3)   5 (4)
#            |
#           6 (6)
TOKENS = torch.tensor([5, 7, 8, 9, 3, 4, 6])
PARENTS = torch.tensor([-1, 0, 0, 1, 2, 2, 4])


def choices(**at: int) -> torch.Tensor:
    """Target choices: 0 everywhere (matches no node) except at the given nodes (n0=..., n4=...)."""
    out = torch.zeros(7, dtype=torch.long)
    for key, tok in at.items():
        out[int(key[1:])] = tok
    return out


def test_full_acceptance_down_the_deepest_path():
    res = accept_reference(TOKENS, PARENTS, choices(n0=8, n2=3, n4=6, n6=42))
    assert res.accepted_nodes == [0, 2, 4, 6]
    assert res.accepted_tokens == [8, 3, 6]
    assert res.next_token == 42


def test_first_level_miss_accepts_only_the_root():
    res = accept_reference(TOKENS, PARENTS, choices(n0=11, n1=9, n2=3))
    assert res.accepted_nodes == [0] and res.accepted_tokens == [] and res.next_token == 11


def test_deep_path_stops_at_the_first_miss():
    res = accept_reference(TOKENS, PARENTS, choices(n0=7, n1=9, n3=13))
    assert res.accepted_nodes == [0, 1, 3] and res.accepted_tokens == [7, 9] and res.next_token == 13
    res = accept_reference(TOKENS, PARENTS, choices(n0=8, n2=4, n5=1))
    assert res.accepted_nodes == [0, 2, 5] and res.next_token == 1


def test_hand_made_cases_tensor_walk_equals_loop():
    for target in (choices(n0=8, n2=3, n4=6, n6=42), choices(n0=11), choices(n0=7, n1=9, n3=13)):
        assert accept_tree(TOKENS, PARENTS, target) == accept_reference(TOKENS, PARENTS, target)


def test_batched_walk_equals_loop_on_random_trees():
    gen = torch.Generator().manual_seed(0)
    longest = 0
    for _ in range(20):
        logp = torch.log_softmax(torch.randn(4, 5, 6, generator=gen), -1)
        lp, ids = logp.topk(4, -1)
        trees = [build_ddtree_reference(lp[b], ids[b], int(n), root_token=b)
                 for b, n in enumerate(torch.randint(0, 30, (4,), generator=gen))]
        batch = pad_trees(trees)
        # a 6-token vocabulary with 4 drafted tokens per position: walks often go deep
        target = torch.randint(0, 6, batch.tokens.shape, generator=gen)
        out = accept_batch(batch.tokens, batch.parents, target, batch.sizes).results()
        for b, tree in enumerate(trees):
            assert out[b] == accept_reference(tree.tokens, tree.parents, target[b, : tree.size])
            longest = max(longest, len(out[b].accepted_nodes))
    assert longest >= 3


def test_batched_walk_reports_padded_columns():
    tokens = torch.stack([TOKENS, torch.tensor([5, 7, 0, 0, 0, 0, 0])])
    parents = torch.stack([PARENTS, torch.tensor([-1, 0, -1, -1, -1, -1, -1])])
    target = torch.stack([choices(n0=8, n2=3, n4=6, n6=42), choices(n0=7, n1=2)])
    out = accept_batch(tokens, parents, target, [7, 2])
    assert out.num_accepted.tolist() == [4, 2]
    assert out.accepted_nodes.tolist() == [[0, 2, 4, 6, -1, -1, -1], [0, 1, -1, -1, -1, -1, -1]]
    assert out.accepted_tokens[1].tolist() == [7, -1, -1, -1, -1, -1]
    assert out.next_tokens.tolist() == [42, 2]


def test_batched_walk_with_the_steps_ancestor_mask_equals_the_one_it_builds():
    tokens = torch.stack([TOKENS, torch.tensor([5, 7, 0, 0, 0, 0, 0])])
    parents = torch.stack([PARENTS, torch.tensor([-1, 0, -1, -1, -1, -1, -1])])
    target = torch.stack([choices(n0=8, n2=3, n4=6, n6=42), choices(n0=7, n1=2)])
    anc = tree_structure(parents, torch.tensor([7, 2])).anc
    assert accept_batch(tokens, parents, target, [7, 2], anc).results() == accept_batch(tokens, parents, target,
                                                                                         [7, 2]).results()


def test_duplicate_siblings_take_the_first_like_the_loop():
    tokens, parents = torch.tensor([1, 4, 4, 6]), torch.tensor([-1, 0, 0, 2])
    target = torch.tensor([4, 9, 6, 0])
    assert accept_tree(tokens, parents, target) == accept_reference(tokens, parents, target)
    assert accept_reference(tokens, parents, target).accepted_nodes == [0, 1]


def test_child_with_the_roots_token_is_not_mistaken_for_a_duplicate():
    tokens, parents = torch.tensor([4, 4]), torch.tensor([-1, 0])
    assert accept_tree(tokens, parents, torch.tensor([4, 8])).accepted_nodes == [0, 1]


def test_compaction_indices_move_accepted_rows_in_place():
    src, dst = compaction_indices([0, 2, 4, 6], ctx_len=10)
    assert src.tolist() == [10, 12, 14, 16] and dst.tolist() == [10, 11, 12, 13]
    cache = torch.arange(20.0)[:, None].repeat(1, 3)  # row r holds r
    cache[dst] = cache[src]
    assert cache[10:14, 0].tolist() == [10.0, 12.0, 14.0, 16.0]
    assert cache[:10, 0].tolist() == list(map(float, range(10)))


def test_compaction_indices_batch_is_safe_with_padding():
    nodes = torch.tensor([[0, 2, 4, 6, -1], [0, 1, -1, -1, -1]])
    src, dst = compaction_indices_batch(nodes, torch.tensor([4, 2]), torch.tensor([3, 0]))
    assert src.tolist() == [[3, 5, 7, 9, 7], [0, 1, 2, 3, 4]]
    assert dst.tolist() == [[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]]
    cache = torch.arange(2 * 12.0).reshape(2, 12)
    rows = torch.arange(2)[:, None]
    cache[rows, dst] = cache[rows, src]
    assert cache[0, 3:7].tolist() == [3.0, 5.0, 7.0, 9.0] and cache[0, 7].item() == 7.0
    assert cache[1].tolist() == list(map(float, range(12, 24)))
