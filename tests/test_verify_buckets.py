"""Shape buckets for captured steps: bucket choice, and padded verify batches that change nothing (CPU).

On CUDA, verify steps run as graphs captured per bucket, so every batch is padded: extra rows are one-node trees
in the scratch slot, extra nodes are isolated padding. These tests run the very functions the graphs capture,
on the CPU, and check that padding changes no real row's result, cache row or state.
"""
from __future__ import annotations

import pytest
import torch

from ddtree_serve.decoding.config import SamplingParams
from ddtree_serve.plumbing.cuda_graphs import (HYBRID_PREFILL_FORWARD_FIXED_ROWS, PREFILL_FORWARD_FIXED_ROWS,
                                               SharedOutput, key_buckets, pick_bucket, power_of_two_buckets,
                                               prefill_chunk, tree_node_buckets)
from target_svc.runner import PrefillItem, TargetConfig, TargetRunner
from target_svc.verify import (SHALLOW_COMMIT_WIDTH, VerifyBatch, VerifyShape, commit_path, commit_widths, unpack,
                               verify_commit, verify_forward, verify_walk)
from tests.fixtures import make_tiny_qwen3, make_tiny_qwen3_5

TREE = [-1, 0, 0, 1, 1, 2, 3]  # node i's parent
PATH = [(0, 1), (1, 3), (3, 6)]  # (parent, child) edges of the path the draft plants


def test_power_of_two_buckets_end_at_the_limit():
    assert power_of_two_buckets(8) == (1, 2, 4, 8)
    assert power_of_two_buckets(6) == (1, 2, 4, 6)
    assert power_of_two_buckets(2305, start=256) == (256, 512, 1024, 2048, 2305)


def test_tree_nodes_bucket_as_decode_steps_and_budget_trees():
    assert tree_node_buckets(257) == (1, 5, 17, 65, 257)
    assert tree_node_buckets(65) == (1, 5, 17, 65)
    assert tree_node_buckets(40) == (1, 5, 17, 40)
    assert tree_node_buckets(1) == (1,)
    assert pick_bucket(tree_node_buckets(65), 16) == 17  # a 15-deep chain and its root
    assert pick_bucket(tree_node_buckets(65), 33) == 65  # a budget-32 tree pads to the budget-64 bucket


def test_a_deployments_own_verify_sizes_add_buckets_up_to_the_largest_block():
    buckets = tree_node_buckets(129, (64, 129, 300))
    assert buckets == (1, 5, 17, 64, 65, 129)   # 300 is past the largest block: no bucket
    assert pick_bucket(buckets, 64) == 64       # a budget-63 tree no longer pads to 65 rows
    with pytest.raises(ValueError):
        tree_node_buckets(65, (0,))


def test_attended_rows_use_one_bucket_up_to_4096_then_powers_of_two():
    assert key_buckets(2305) == (512, 1024, 2048, 2305)
    assert key_buckets(300) == (300,)
    assert key_buckets(32768 + 257) == (512, 1024, 2048, 4096, 8192, 16384, 33025)


def test_a_capacity_just_past_a_power_of_two_replaces_it_as_the_last_key_bucket():
    assert key_buckets(8192 + 65) == (512, 1024, 2048, 4096, 8257)   # max_seq_len 8192 + a 65-node tree
    assert key_buckets(8192 + 2048) == (512, 1024, 2048, 4096, 8192, 10240)
    assert key_buckets(560) == (560,)
    assert key_buckets(600) == (512, 600)


def test_pick_bucket_takes_the_smallest_that_fits_and_refuses_oversize():
    buckets = (1, 2, 4, 8)
    assert [pick_bucket(buckets, n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="exceeds"):
        pick_bucket(buckets, 9)


def test_pack_pads_rows_into_the_scratch_slot_as_one_node_trees():
    tokens, parents = torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 0])
    batch = VerifyBatch.pack([(tokens, parents)], [11], [2], VerifyShape(batch=2, nodes=4, key_len=64),
                             scratch_slot=9)
    ids, par, sizes, ctx, slots = unpack(batch.packed, 4)
    assert ids.tolist() == [[5, 6, 7, 0], [0, 0, 0, 0]]
    assert par.tolist() == [[-1, 0, 0, -1], [-1, -1, -1, -1]]
    assert sizes.tolist() == [3, 1] and ctx.tolist() == [11, 0] and slots.tolist() == [2, 9]
    assert batch.num_real == 1


def _prefilled(model_dir, prompts, tree_gdn="depthwise"):
    runner = TargetRunner(TargetConfig(model_dir=str(model_dir), max_batch=4, max_seq_len=128, max_tree_nodes=16))
    runner.model.tree_gdn = tree_gdn
    outs = runner.prefill([PrefillItem(f"s{i}", p, SamplingParams()) for i, p in enumerate(prompts)])
    return runner, [o.next_token for o in outs]


def _trees(runner, roots, tokens):
    ctx = [runner.model.cache.ctx_len[runner.seqs[f"s{b}"].slot] for b in range(len(roots))]
    slots = [runner.seqs[f"s{b}"].slot for b in range(len(roots))]
    return [(torch.tensor([roots[b]] + tokens[b]), torch.tensor(TREE)) for b in range(len(roots))], ctx, slots


def _accepting_draft(runner, roots, tokens):
    """Draft tokens rewritten so the path 0 -> 1 -> 3 -> 6 follows the target's greedy choices (4 accepted)."""
    tokens = [list(t) for t in tokens]
    for parent, child in PATH:
        trees, ctx, slots = _trees(runner, roots, tokens)
        shape = VerifyShape(len(roots), len(TREE), max(ctx) + len(TREE))
        batch = VerifyBatch.pack(trees, ctx, slots, shape, runner.model.cache.spec.scratch_slot)
        _, greedy, _, _ = verify_forward(runner.model, batch.packed, shape.nodes, shape.key_len, ())
        for b in range(len(roots)):
            tokens[b][child - 1] = int(greedy[b, parent])
    runner.model.pending_traces = None
    return tokens


def _step(runner, roots, shape, tokens):
    """One verify step of TREE per sequence through verify_forward + verify_commit at `shape`."""
    n = len(roots)
    trees, ctx, slots = _trees(runner, roots, tokens)
    batch = VerifyBatch.pack(trees, ctx, slots, shape, runner.model.cache.spec.scratch_slot)
    logits, greedy, features, _ = verify_forward(runner.model, batch.packed, shape.nodes, shape.key_len, (0, 1))
    result, rows = verify_commit(runner.model, batch.packed, shape.nodes, greedy, features, shape.nodes)
    for b in range(n):
        runner.model.cache.ctx_len[slots[b]] += int(result[b, 0])
    return logits[:n, : len(TREE)], result[:n], rows[:n]


@pytest.mark.parametrize("maker,tree_gdn", [(make_tiny_qwen3, "depthwise"), (make_tiny_qwen3_5, "depthwise"),
                                            (make_tiny_qwen3_5, "wy")], ids=["dense", "hybrid", "hybrid-wy"])
def test_padding_rows_nodes_and_keys_changes_no_real_result(tmp_path, maker, tree_gdn):
    model_dir = maker(tmp_path / "m", seed=3)
    prompts = [list(range(10, 10 + n)) for n in (7, 12)]
    # the exact-shape run keeps the reference tree pass; the padded one may take the one-pass (graph) form
    exact_runner, roots = _prefilled(model_dir, prompts)
    padded_runner, _ = _prefilled(model_dir, prompts, tree_gdn)
    padded = VerifyShape(batch=4, nodes=16, key_len=64)
    for _ in range(3):  # each step commits, so later steps read what padding may have disturbed
        draft = _accepting_draft(exact_runner, roots, [[40 + i for i in range(len(TREE) - 1)]] * 2)
        ctx = max(exact_runner.model.cache.ctx_len[exact_runner.seqs[f"s{b}"].slot] for b in range(2))
        want = _step(exact_runner, roots, VerifyShape(batch=2, nodes=len(TREE), key_len=ctx + len(TREE)), draft)
        got = _step(padded_runner, roots, padded, draft)
        assert want[1][:, 0].tolist() == [4, 4]  # the walk accepted the planted path
        torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=0)
        assert got[1][:, :6].tolist() == want[1][:, :6].tolist()  # counts, bonus tokens, accepted paths
        torch.testing.assert_close(got[2][:, :4], want[2][:, :4], atol=1e-4, rtol=0)
        roots = want[1][:, 1].tolist()
    for want_state, got_state in zip(exact_runner.model.cache.linear, padded_runner.model.cache.linear):
        torch.testing.assert_close(got_state.rec[:2], want_state.rec[:2], atol=1e-4, rtol=0)


def test_a_shared_output_views_one_buffer_at_every_bucket_shape_and_refuses_a_larger_one():
    out = SharedOutput(4 * 9 * 5, torch.float32, torch.device("cpu"))
    small, large = out.view(1, 9, 5), out.view(4, 9, 5)
    assert small.is_contiguous() and small.shape == (1, 9, 5) and large.shape == (4, 9, 5)
    assert small.data_ptr() == large.data_ptr() == out.buffer.data_ptr()
    small.fill_(3.0)
    assert torch.equal(large.reshape(-1)[:45], torch.full((45,), 3.0))
    with pytest.raises(ValueError, match="exceeds"):
        out.view(5, 9, 5)


def test_commit_writes_the_accepted_rows_into_a_given_buffer_as_it_would_allocate_them(tmp_path):
    model_dir = make_tiny_qwen3_5(tmp_path / "m", seed=5)
    prompts = [list(range(20, 29)), list(range(30, 36))]
    runners = [_prefilled(model_dir, prompts)[0] for _ in range(2)]
    roots = _prefilled(model_dir, prompts)[1]
    draft = _accepting_draft(runners[0], roots, [[50 + i for i in range(len(TREE) - 1)]] * 2)
    _accepting_draft(runners[1], roots, draft)   # the same forwards on the second runner (none commits)
    shape = VerifyShape(batch=2, nodes=len(TREE), key_len=64)
    results = []
    for runner, give_buffer in zip(runners, (False, True)):
        trees, ctx, slots = _trees(runner, roots, draft)
        batch = VerifyBatch.pack(trees, ctx, slots, shape, runner.model.cache.spec.scratch_slot)
        _, greedy, features, _ = verify_forward(runner.model, batch.packed, shape.nodes, shape.key_len, (0, 1))
        buffer = torch.full_like(features, float("nan")) if give_buffer else None
        result, rows = verify_commit(runner.model, batch.packed, shape.nodes, greedy, features, shape.nodes,
                                     rows_out=buffer)
        if give_buffer:
            assert rows.data_ptr() == buffer.data_ptr()
        results.append((result, rows))
    (want_result, want_rows), (got_result, got_rows) = results
    assert want_result[:, 0].tolist() == [4, 4]   # the planted path was accepted
    assert torch.equal(got_result, want_result)
    assert torch.equal(got_rows, want_rows)


def test_the_walk_commits_nothing_and_the_commit_after_it_equals_walk_and_commit_in_one(tmp_path):
    model_dir = make_tiny_qwen3_5(tmp_path / "m", seed=6)
    prompts = [list(range(20, 29)), list(range(30, 36))]
    (split, roots), (whole, _) = _prefilled(model_dir, prompts), _prefilled(model_dir, prompts)
    draft = _accepting_draft(split, roots, [[50 + i for i in range(len(TREE) - 1)]] * 2)
    _accepting_draft(whole, roots, draft)
    shape = VerifyShape(batch=2, nodes=len(TREE), key_len=64)
    outs = []
    for runner in (split, whole):
        trees, ctx, slots = _trees(runner, roots, draft)
        batch = VerifyBatch.pack(trees, ctx, slots, shape, runner.model.cache.spec.scratch_slot)
        _, greedy, features, _ = verify_forward(runner.model, batch.packed, shape.nodes, shape.key_len, (0, 1))
        if runner is split:
            before = [st.rec.clone() for st in runner.model.cache.linear]
            result, rows, path, n_acc = verify_walk(batch.packed, shape.nodes, greedy, features, shape.nodes)
            assert all(torch.equal(b, st.rec) for b, st in zip(before, runner.model.cache.linear))
            commit_path(runner.model, batch.packed, shape.nodes, path, n_acc)
        else:
            result, rows = verify_commit(runner.model, batch.packed, shape.nodes, greedy, features, shape.nodes)
        outs.append((result, rows))
    assert outs[0][0][:, 0].tolist() == [4, 4]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    for a, b in zip(split.model.cache.linear, whole.model.cache.linear):
        assert torch.equal(a.rec, b.rec) and torch.equal(a.conv, b.conv)
    assert torch.equal(split.model.cache.k, whole.model.cache.k)


def test_commit_widths_add_a_chains_width_to_wide_buckets_only():
    """A bucket of more nodes than a DFlash block's chain also captures its commit at the chain's width."""
    assert commit_widths(1) == (1,) and commit_widths(17) == (17,)
    assert commit_widths(65) == (SHALLOW_COMMIT_WIDTH, 65) and commit_widths(129) == (SHALLOW_COMMIT_WIDTH, 129)


@pytest.mark.parametrize("maker", [make_tiny_qwen3, make_tiny_qwen3_5], ids=["dense", "hybrid"])
def test_a_commit_over_paths_narrowed_to_the_deepest_tree_equals_the_full_width_one(tmp_path, maker):
    """What the captured narrow commit does: the walked paths cut to the deepest tree's depth + 1 columns commit the
    same K/V rows and conv states, and recurrent states to float32 rounding (the state GEMM sums the same terms)."""
    model_dir = maker(tmp_path / "m", seed=8)
    prompts = [list(range(20, 31)), list(range(40, 45))]
    (narrow, roots), (full, _) = _prefilled(model_dir, prompts, "wy"), _prefilled(model_dir, prompts, "wy")
    draft = _accepting_draft(narrow, roots, [[60 + i for i in range(len(TREE) - 1)]] * 2)
    _accepting_draft(full, roots, draft)
    shape = VerifyShape(batch=2, nodes=len(TREE), key_len=64)
    deepest = 4   # TREE's longest root path: 0 -> 1 -> 3 -> 6
    for runner, width in ((narrow, deepest), (full, shape.nodes)):
        trees, ctx, slots = _trees(runner, roots, draft)
        batch = VerifyBatch.pack(trees, ctx, slots, shape, runner.model.cache.spec.scratch_slot)
        _, greedy, features, _ = verify_forward(runner.model, batch.packed, shape.nodes, shape.key_len, (0, 1))
        result, _, path, n_acc = verify_walk(batch.packed, shape.nodes, greedy, features, shape.nodes)
        assert result[:, 0].tolist() == [4, 4] and (path[:, deepest:] < 0).all()
        commit_path(runner.model, batch.packed, shape.nodes, path[:, :width], n_acc)
    assert torch.equal(narrow.model.cache.k, full.model.cache.k) and torch.equal(narrow.model.cache.v, full.model.cache.v)
    for a, b in zip(narrow.model.cache.linear, full.model.cache.linear):
        assert torch.equal(a.conv, b.conv)
        torch.testing.assert_close(a.rec, b.rec, atol=1e-6, rtol=0)


def test_a_prefill_chunk_is_the_node_bucket_that_takes_the_rest_of_the_prompts_at_the_least_cost():
    """One prompt of 70 tokens takes one 257-node forward (its fixed cost once), not 65 + 5; a 65-token one the
    65-node bucket; eight prompts of 70 tokens two 65-node forwards, eight padded 257-node rows costing more."""
    buckets = tree_node_buckets(257)
    assert prefill_chunk(70, buckets) == 257
    assert prefill_chunk(65, buckets) == 65
    assert prefill_chunk(3, buckets) == 5
    assert prefill_chunk(300, buckets) == 257
    assert prefill_chunk(70, tree_node_buckets(65)) == 65
    assert prefill_chunk(66, tree_node_buckets(257, (129,))) == 129
    assert prefill_chunk(70, buckets, batch=8) == 65
    assert prefill_chunk(250, buckets, batch=4) == 257


def test_a_hybrid_target_weighs_its_prefill_forwards_with_its_own_lower_fixed_cost():
    """Two prompts of 66 tokens: at the dense 8B's fixed cost (310 rows) one 257-node forward beats two 65-node
    ones (824 rows against 880); at the hybrid's (200 rows) the two win (660 against 714)."""
    buckets = tree_node_buckets(257)
    assert prefill_chunk(66, buckets, batch=2, fixed_rows=PREFILL_FORWARD_FIXED_ROWS) == 257
    assert prefill_chunk(66, buckets, batch=2, fixed_rows=HYBRID_PREFILL_FORWARD_FIXED_ROWS) == 65
