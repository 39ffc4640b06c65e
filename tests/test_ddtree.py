"""DDTree builders: brute-force optimum, heap reference == batched fast path == host fast path, chains, helpers."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from ddtree_serve.decoding.ddtree import (
    DraftTree,
    build_chain,
    build_ddtree_batch,
    build_ddtree_reference,
    expected_acceptance_length,
    expected_acceptance_lengths,
    num_prefixes,
    pad_trees,
    root_tree,
    tree_log_probs,
)
from ddtree_serve.decoding import ddtree_native
from ddtree_serve.decoding.ddtree_host import build_chain_host, build_ddtree_host


def random_topk(gen: torch.Generator, batch: int, n_pos: int, k: int, vocab: int = 40, sharp: float = 2.0):
    """Sorted top-K log-probs/ids of random drafter distributions (continuous: no exact ties)."""
    logp = torch.log_softmax(torch.randn(batch, n_pos, vocab, generator=gen) * sharp, dim=-1)
    values, ids = logp.topk(k, dim=-1)
    return values, ids


def token_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Token sequence from the root (excluded) to each draft node."""
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, len(toks)):
        paths.append(paths[pars[i]] + (toks[i],))
    return paths[1:]


def brute_force_top(logprobs: torch.Tensor, ids: torch.Tensor, budget: int) -> set[tuple[int, ...]]:
    """The `budget` highest-scoring prefixes, enumerated exhaustively (float64 scores)."""
    n_pos, k = logprobs.shape
    lp = logprobs.double()
    scored = []
    for depth in range(1, n_pos + 1):
        for ranks in itertools.product(range(k), repeat=depth):
            score = sum(float(lp[d, r]) for d, r in enumerate(ranks))
            scored.append((score, tuple(int(ids[d, r]) for d, r in enumerate(ranks))))
    scored.sort(key=lambda s: -s[0])
    return {p for _, p in scored[:budget]}


def assert_same_tree(a: DraftTree, b: DraftTree) -> None:
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.parents.tolist() == b.parents.tolist()
    assert a.depths.tolist() == b.depths.tolist()
    assert torch.equal(a.log_probs, b.log_probs)


def test_reference_equals_brute_force_top_prefixes():
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        n_pos, k = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
        lp, ids = random_topk(gen, 1, n_pos, k)
        total = num_prefixes(k, n_pos, 10**9)
        for budget in (1, 3, 7, total // 2 + 1, total + 5):
            tree = build_ddtree_reference(lp[0], ids[0], budget)
            assert tree.size == 1 + min(budget, total)
            assert set(token_paths(tree)) == brute_force_top(lp[0], ids[0], budget)


def test_batch_equals_brute_force_top_prefixes():
    gen = torch.Generator().manual_seed(1)
    for _ in range(40):
        n_pos, k = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
        lp, ids = random_topk(gen, 3, n_pos, k)
        budgets = [int(b) for b in torch.randint(1, 30, (3,), generator=gen)]
        batch = build_ddtree_batch(lp, ids, [0, 0, 0], budgets)
        for b in range(3):
            assert set(token_paths(batch.tree(b))) == brute_force_top(lp[b], ids[b], budgets[b])


@pytest.mark.parametrize("budget", [1, 4, 16, 64, 10_000])
def test_batch_equals_reference_same_order(budget):
    gen = torch.Generator().manual_seed(budget)
    lp, ids = random_topk(gen, 4, 5, 6)
    roots = [11, 12, 13, 14]
    batch = build_ddtree_batch(lp, ids, roots, budget)
    for b in range(4):
        assert_same_tree(batch.tree(b), build_ddtree_reference(lp[b], ids[b], budget, root_token=roots[b]))
    assert batch.sizes == [1 + min(budget, num_prefixes(6, 5, budget))] * 4


def test_batch_equals_reference_mixed_budgets_and_depths():
    gen = torch.Generator().manual_seed(7)
    for _ in range(25):
        bsz, n_pos = 5, int(torch.randint(1, 8, (1,), generator=gen))
        k = int(torch.randint(1, 12, (1,), generator=gen))
        lp, ids = random_topk(gen, bsz, n_pos, k, vocab=64, sharp=float(torch.rand(1, generator=gen)) * 4)
        budgets = [int(x) for x in torch.randint(0, 80, (bsz,), generator=gen)]
        depths = [int(x) for x in torch.randint(0, n_pos + 2, (bsz,), generator=gen)]
        batch = build_ddtree_batch(lp, ids, torch.arange(bsz), budgets, depths)
        for b in range(bsz):
            ref = build_ddtree_reference(lp[b], ids[b], budgets[b], max_depth=depths[b], root_token=b)
            assert_same_tree(batch.tree(b), ref)
            assert int(batch.tree(b).depths.max()) <= depths[b]


def test_batch_equals_reference_large_budget():
    gen = torch.Generator().manual_seed(3)
    lp, ids = random_topk(gen, 2, 15, 64, vocab=500, sharp=3.0)
    batch = build_ddtree_batch(lp, ids, [5, 6], [300, 57])
    assert_same_tree(batch.tree(0), build_ddtree_reference(lp[0], ids[0], 300, root_token=5))
    assert_same_tree(batch.tree(1), build_ddtree_reference(lp[1], ids[1], 57, root_token=6))


def test_ties_broken_by_rank_tuple_like_the_heap():
    # all log-probs equal: every depth-1 prefix ties, then every depth-2 prefix: order = rank tuples
    lp = torch.full((2, 2), -1.0)
    ids = torch.tensor([[10, 11], [20, 21]])
    ref = build_ddtree_reference(lp, ids, 6)
    assert ref.tokens.tolist() == [0, 10, 11, 20, 21, 20, 21]
    assert ref.parents.tolist() == [-1, 0, 0, 1, 1, 2, 2]
    assert_same_tree(build_ddtree_batch(lp[None], ids[None], [0], 6).tree(0), ref)


def test_ties_on_coarse_grid_batch_equals_reference():
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        # log-probs on a coarse grid, sorted: many exact ties between prefixes of different depths
        lp = (-0.5 * torch.randint(0, 4, (3, 6, 5), generator=gen).float()).sort(dim=-1, descending=True).values
        ids = torch.arange(5).expand(3, 6, 5) + 100 * torch.arange(6)[None, :, None]
        budgets = [int(x) for x in torch.randint(1, 60, (3,), generator=gen)]
        batch = build_ddtree_batch(lp, ids, [0, 0, 0], budgets)
        for b in range(3):
            assert_same_tree(batch.tree(b), build_ddtree_reference(lp[b], ids[b], budgets[b]))


def test_pop_order_parents_first_scores_non_increasing():
    gen = torch.Generator().manual_seed(9)
    lp, ids = random_topk(gen, 3, 8, 10)
    batch = build_ddtree_batch(lp, ids, [0, 0, 0], [50, 20, 90])
    for tree in batch.unbind():
        par = tree.parents[1:]
        assert bool((par < torch.arange(1, tree.size)).all()) and bool((par >= 0).all())
        assert bool((tree.depths[1:] == tree.depths[par] + 1).all())
        assert bool((tree.log_probs[1:].diff() <= 0).all())
        siblings = torch.stack([par, tree.tokens[1:]], 1)
        assert torch.unique(siblings, dim=0).shape[0] == tree.size - 1   # siblings carry distinct tokens


def test_padding_of_batch_rows():
    gen = torch.Generator().manual_seed(2)
    lp, ids = random_topk(gen, 2, 4, 3)
    batch = build_ddtree_batch(lp, ids, [7, 8], [10, 3])
    assert batch.tokens.shape == (2, 11) and batch.sizes == [11, 4]
    assert batch.parents[1, 4:].tolist() == [-1] * 7
    assert bool(torch.isinf(batch.log_probs[1, 4:]).all())


def test_zero_budget_and_zero_depth_give_root_only():
    gen = torch.Generator().manual_seed(4)
    lp, ids = random_topk(gen, 2, 4, 3)
    batch = build_ddtree_batch(lp, ids, [7, 8], [0, 5], max_depths=[3, 0])
    assert batch.sizes == [1, 1]
    assert batch.tokens.tolist() == [[7], [8]] and batch.parents.tolist() == [[-1], [-1]]
    single = root_tree(42)
    assert single.size == 1 and single.tokens.tolist() == [42] and single.parents.tolist() == [-1]


def test_chain_shape_and_tokens():
    gen = torch.Generator().manual_seed(6)
    lp, ids = random_topk(gen, 3, 6, 4)
    chain = build_chain(lp, ids, [1, 2, 3], max_depths=[6, 2, 0])
    assert chain.sizes == [7, 3, 1]
    first = chain.tree(0)
    assert first.parents.tolist() == [-1, 0, 1, 2, 3, 4, 5]
    assert first.depths.tolist() == list(range(7))
    assert first.tokens.tolist() == [1] + ids[0, :, 0].tolist()
    assert chain.tree(1).tokens.tolist() == [2] + ids[1, :2, 0].tolist()
    assert chain.tree(2).tokens.tolist() == [3]


def test_chain_equals_top1_ddtree():
    gen = torch.Generator().manual_seed(8)
    lp, ids = random_topk(gen, 2, 5, 4)
    chain = build_chain(lp, ids, [1, 2], max_depths=[5, 3])
    tree = build_ddtree_batch(lp[..., :1], ids[..., :1], [1, 2], [100, 100], max_depths=[5, 3])
    for a, b in zip(chain.unbind(), tree.unbind()):
        assert_same_tree(a, b)


def test_expected_acceptance_length_of_chain():
    lp = torch.full((1, 4, 2), math.log(0.5))
    ids = torch.tensor([[[1, 2]] * 4])
    chain = build_chain(lp, ids, [0])
    assert expected_acceptance_length(chain.tree(0)) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)
    assert float(expected_acceptance_lengths(chain)[0]) == pytest.approx(1.9375)


def test_tree_log_probs_match_builder_scores():
    gen = torch.Generator().manual_seed(10)
    lp, ids = random_topk(gen, 1, 5, 6)
    tree = build_ddtree_reference(lp[0], ids[0], 40)
    bare = DraftTree(tree.tokens, tree.parents, tree.depths)
    torch.testing.assert_close(tree_log_probs(bare, lp[0], ids[0]), tree.log_probs, atol=1e-5, rtol=0)
    assert expected_acceptance_length(bare, lp[0], ids[0]) == pytest.approx(expected_acceptance_length(tree))


def test_larger_budget_never_lowers_expected_acceptance():
    gen = torch.Generator().manual_seed(11)
    lp, ids = random_topk(gen, 1, 6, 8)
    values = [expected_acceptance_length(build_ddtree_reference(lp[0], ids[0], b)) for b in (1, 4, 16, 64)]
    assert values == sorted(values) and values[0] > 1.0


def test_pad_trees_roundtrip():
    gen = torch.Generator().manual_seed(12)
    lp, ids = random_topk(gen, 2, 4, 3)
    trees = [build_ddtree_reference(lp[b], ids[b], n, root_token=b) for b, n in enumerate((9, 2))]
    batch = pad_trees(trees)
    assert batch.sizes == [10, 3]
    for a, b in zip(batch.unbind(), trees):
        assert_same_tree(a, b)


def test_mismatched_shapes_raise_value_error():
    lp = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError):
        build_ddtree_batch(lp, torch.zeros(2, 3, 5, dtype=torch.long), [0, 0], 4)
    with pytest.raises(ValueError):
        build_ddtree_batch(lp, torch.zeros(2, 3, 4, dtype=torch.long), [0, 0], [4, 4, 4])


# ---- build_ddtree_host: the reference's tree, bit for bit ------------------------------------------------------
@pytest.fixture(params=["c-heap", "python-heap"])
def host_heap(request, monkeypatch):
    """Every host-builder test runs with the C heap (where a compiler is) and with the Python heap."""
    if request.param == "python-heap":
        monkeypatch.setattr(ddtree_native, "available", lambda width, depth_limit: False)
    elif not ddtree_native.available(64, 15):
        pytest.skip("no C compiler: the C heap is not built here")
    return request.param


def test_the_c_heap_is_the_one_that_builds_where_a_compiler_is(host_heap, monkeypatch):
    calls = []
    real = ddtree_native.best_first
    monkeypatch.setattr(ddtree_native, "best_first", lambda *a: calls.append(a) or real(*a))
    gen = torch.Generator().manual_seed(3)
    lp, ids = random_topk(gen, 1, 15, 64, vocab=5000, sharp=3.0)
    build_ddtree_host(lp[0], ids[0], 64)
    assert len(calls) == (1 if host_heap == "c-heap" else 0)


def test_a_sharp_drafters_draft_takes_the_c_heap_and_gives_the_references_tree(monkeypatch):
    """Top log-probs within 2**-17 of 0 (a confident drafter; most calibrated drafts) are built by the C heap on the
    fixed point, one call, no Python fallback, bit for bit the reference's tree."""
    if not ddtree_native.available(64, 15):
        pytest.skip("no C compiler: the C heap is not built here")
    calls = []
    real = ddtree_native.best_first
    monkeypatch.setattr(ddtree_native, "best_first", lambda *a: calls.append(a) or real(*a))
    gen = torch.Generator().manual_seed(5)
    lp, ids = random_topk(gen, 1, 15, 64, vocab=5000, sharp=3.0)
    lp = lp[0].clone()
    lp[:, 0] = -torch.rand(15, generator=gen) * 2.0**-18   # p(top-1) > 0.999996 at every depth
    assert_host_equals_reference(lp, ids[0], budgets=(64,), depths=(None, 15))
    assert len(calls) == 2


@pytest.mark.usefixtures("host_heap")
def test_host_equals_reference_on_float64_and_bfloat16_log_probs():
    """float32 log-probs are quantized inside the C heap; other dtypes arrive quantized (float64) or widened to
    float32 (half types): every path gives the reference's tree."""
    gen = torch.Generator().manual_seed(25)
    lp, ids = random_topk(gen, 1, 15, 64, vocab=5000, sharp=3.0)
    lp64 = lp[0].double() + torch.rand(15, 64, generator=gen, dtype=torch.float64) * 1e-9   # past float32's bits
    assert_host_equals_reference(lp64, ids[0], budgets=(64,), depths=(None, 15))
    assert_host_equals_reference(lp[0].bfloat16(), ids[0], budgets=(64,), depths=(None, 15))


def test_the_c_heap_leaves_rank_keys_wider_than_128_bits_to_python():
    assert ddtree_native.available(64, 18) is (ddtree_native.library() is not None)   # 7 bits x 18 = 126
    assert not ddtree_native.available(1024, 15)                                       # 11 bits x 15 = 165

def assert_identical_tree(a: DraftTree, b: DraftTree) -> None:
    """Same values, dtypes and bits (log-probs compared as bytes: -0.0 is not +0.0, NaN is NaN)."""
    for name in ("tokens", "parents", "depths", "log_probs"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        assert x.numpy().tobytes() == y.numpy().tobytes(), (name, x, y)


def assert_host_equals_reference(lp: torch.Tensor, ids: torch.Tensor, budgets=(0, 1, 2, 5, 17, 64, 500),
                                 depths=(None, 0, 1, 3)) -> None:
    for budget in budgets:
        for depth in depths:
            assert_identical_tree(build_ddtree_host(lp, ids, budget, depth, root_token=7),
                                  build_ddtree_reference(lp, ids, budget, depth, root_token=7))


@pytest.mark.usefixtures("host_heap")
def test_host_equals_reference_on_drafter_like_drafts():
    gen = torch.Generator().manual_seed(20)
    for _ in range(40):
        n_pos, k = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 17, (1,), generator=gen))
        lp, ids = random_topk(gen, 1, n_pos, k, vocab=50, sharp=float(torch.rand(1, generator=gen)) * 6)
        assert_host_equals_reference(lp[0], ids[0])


@pytest.mark.usefixtures("host_heap")
def test_host_equals_reference_at_gateway_shapes():
    gen = torch.Generator().manual_seed(21)
    for budget in (16, 64, 300):
        lp, ids = random_topk(gen, 1, 15, min(budget, 64), vocab=4000, sharp=4.0)
        assert_host_equals_reference(lp[0], ids[0], budgets=(budget,), depths=(None, 15, 4))


@pytest.mark.usefixtures("host_heap")
def test_host_equals_reference_on_unsorted_rows():
    # not a drafter's (rows not sorted): the heap order is no longer the score order, and must still match
    gen = torch.Generator().manual_seed(22)
    for _ in range(40):
        lp = -torch.rand(int(torch.randint(1, 6, (1,), generator=gen)), 6, generator=gen) * 3
        ids = torch.randint(0, 1000, lp.shape, generator=gen)
        assert_host_equals_reference(lp, ids)


@pytest.mark.usefixtures("host_heap")
def test_host_breaks_ties_by_rank_tuple_like_the_reference():
    gen = torch.Generator().manual_seed(23)
    for _ in range(60):
        # a coarse grid of log-probs: exact ties between siblings and between prefixes of different depths
        lp = -0.25 * torch.randint(1, 5, (int(torch.randint(1, 6, (1,), generator=gen)), 5), generator=gen).float()
        if torch.rand(1, generator=gen) < 0.5:
            lp = lp.sort(dim=-1, descending=True).values
        ids = torch.randint(0, 1000, lp.shape, generator=gen)
        assert_host_equals_reference(lp, ids)
    lp, ids = torch.full((3, 4), -1.0), torch.arange(12).reshape(3, 4)  # all equal
    assert_host_equals_reference(lp, ids)


@pytest.mark.usefixtures("host_heap")
def test_host_equals_reference_with_nan_inf_and_zero_log_probs():
    gen = torch.Generator().manual_seed(24)
    specials = torch.tensor([float("nan"), float("-inf"), float("inf"), 0.0, -0.0, -1e-30, -2.0**-18, -2000.0])
    for _ in range(60):
        lp = -torch.rand(int(torch.randint(1, 6, (1,), generator=gen)), 5, generator=gen) * 4
        hit = torch.rand(lp.shape, generator=gen) < 0.25
        lp[hit] = specials[torch.randint(0, len(specials), (int(hit.sum()),), generator=gen)]
        ids = torch.randint(0, 1000, lp.shape, generator=gen)
        assert_host_equals_reference(lp, ids)
    assert_host_equals_reference(torch.zeros(4, 3), torch.arange(12).reshape(4, 3))  # scores of exactly 0
    assert_host_equals_reference(torch.full((4, 3), float("nan")), torch.arange(12).reshape(4, 3))


@pytest.mark.usefixtures("host_heap")
def test_host_equals_reference_on_deep_floor_sums():
    # log-probs near the -1024 floor: 15 of them sum past what float64 holds exactly (the fixed-point path)
    lp = torch.full((15, 3), -1000.0) - torch.arange(3.0)
    assert_host_equals_reference(lp, torch.arange(45).reshape(15, 3), budgets=(64, 500))


@pytest.mark.usefixtures("host_heap")
def test_host_equals_reference_for_other_dtypes():
    gen = torch.Generator().manual_seed(25)
    lp, ids = random_topk(gen, 1, 5, 6)
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        assert_host_equals_reference(lp[0].to(dtype), ids[0].to(torch.int32), depths=(None, 2))


@pytest.mark.usefixtures("host_heap")
def test_host_edge_cases():
    gen = torch.Generator().manual_seed(26)
    lp, ids = random_topk(gen, 1, 4, 1)  # K = 1: a chain
    assert build_ddtree_host(lp[0], ids[0], 64).parents.tolist() == [-1, 0, 1, 2, 3]
    assert_host_equals_reference(lp[0], ids[0])
    lp, ids = random_topk(gen, 1, 3, 3)
    assert build_ddtree_host(lp[0], ids[0], 10_000).size == 1 + num_prefixes(3, 3, 10_000)  # budget > prefixes
    assert_host_equals_reference(lp[0], ids[0], budgets=(10_000,))
    for budget, depth in ((0, None), (5, 0)):  # root only
        tree = build_ddtree_host(lp[0], ids[0], budget, depth, root_token=9)
        assert tree.tokens.tolist() == [9] and tree.parents.tolist() == [-1] and tree.log_probs.tolist() == [0.0]
    assert_host_equals_reference(torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.long))  # no positions
    assert_host_equals_reference(torch.zeros(3, 0), torch.zeros(3, 0, dtype=torch.long))  # no candidates
    with pytest.raises(ValueError):
        build_ddtree_host(lp[0], ids[0, :, :2], 4)


# ---- build_chain_host: build_chain's row, bit for bit -------------------------------------------------------------
def test_host_chain_equals_the_batched_chain_builder():
    gen = torch.Generator().manual_seed(27)
    specials = torch.tensor([float("nan"), float("-inf"), 0.0, -0.0, -2000.0])
    cases = [random_topk(gen, 1, n, k, vocab=500, sharp=3.0) for n, k in ((1, 1), (5, 3), (15, 64), (16, 1))]
    lp, ids = random_topk(gen, 1, 6, 4)
    lp[0, ::2, 0] = specials[:3]   # NaN, -inf and 0 on the chain's own column
    cases.append((lp, ids))
    cases.append((torch.full((1, 15, 2), -1000.0), torch.arange(30).reshape(1, 15, 2)))   # past float64's exact sums
    for lp, ids in cases:
        for depth in (None, 0, 1, 3, 100):
            want = build_chain(lp, ids, [7], None if depth is None else [depth]).tree(0)
            assert_identical_tree(build_chain_host(lp[0], ids[0], depth, root_token=7), want)
    for dtype in (torch.float16, torch.bfloat16):
        lp, ids = random_topk(gen, 1, 5, 3)
        assert_identical_tree(build_chain_host(lp[0].to(dtype), ids[0].to(torch.int32), 4, root_token=2),
                              build_chain(lp.to(dtype), ids, [2], [4]).tree(0))


def test_host_chain_of_no_candidates_or_no_depth_is_the_root_alone():
    for lp, ids, depth in ((torch.zeros(3, 0), torch.zeros(3, 0, dtype=torch.long), None),
                           (torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.long), None),
                           (-torch.rand(4, 2), torch.arange(8).reshape(4, 2), 0)):
        tree = build_chain_host(lp, ids, depth, root_token=9)
        assert tree.tokens.tolist() == [9] and tree.parents.tolist() == [-1] and tree.log_probs.tolist() == [0.0]
