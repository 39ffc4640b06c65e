"""What the target says when its up-front graph warm-up fails (the warm-up itself needs a GPU: tests/test_gpu.py)."""
from __future__ import annotations

import torch

from target_svc.server import warmup_failure


def test_a_warmup_out_of_memory_names_the_bucket_and_the_flags_that_make_room():
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 130.00 MiB.\nmore detail")
    line = warmup_failure(exc, 57, 80)
    assert line.startswith("verify graph warm-up failed at bucket 57 of 80 (its steps run eagerly)")
    assert "Tried to allocate 130.00 MiB." in line and "more detail" not in line
    for flag in ("--max-batch", "--max-seq-len", "--gpu-memory-utilization", "--enforce-eager"):
        assert flag in line


def test_another_warmup_failure_is_reported_without_memory_advice():
    line = warmup_failure(RuntimeError("CUDA error: operation not permitted when stream is capturing"), 3, 80)
    assert "(the rest capture on first use)" in line
    assert "RuntimeError: CUDA error: operation not permitted" in line
    assert "--gpu-memory-utilization" not in line


def test_a_bucket_given_up_is_no_longer_picked_and_its_neighbours_still_are(checkpoints):
    """A bucket whose capture ran out of memory runs eagerly (shape_for says None); other buckets are unaffected."""
    from target_svc.runner import TargetConfig, TargetRunner
    from target_svc.verify import VerifyGraphs

    target_dir, _ = checkpoints("qwen3")
    runner = TargetRunner(TargetConfig(str(target_dir), max_batch=4, max_seq_len=1024, max_tree_nodes=65))
    graphs = VerifyGraphs(runner.model, 4, 65, runner.model.cache.spec.capacity)   # bookkeeping only on CPU
    small, large = graphs.key_buckets[0], graphs.key_buckets[-1]
    shape = graphs.shape_for(3, 10, small - 20)
    assert shape is not None and (shape.batch, shape.nodes, shape.key_len) == (4, 17, small)
    graphs.give_up(shape)
    assert graphs.shape_for(3, 10, small - 20) is None and graphs.shape_for(4, 17, small) is None
    assert graphs.shape_for(3, 10, large) is not None and graphs.shape_for(1, 10, small - 20) is not None
    assert shape in graphs.eager_shapes


def test_a_deployments_graph_node_sizes_become_verify_buckets_of_their_own(checkpoints):
    """--graph-node-sizes 64: a 64-node tree (budget 63) picks a 64-node bucket, a 65-node one still 65's."""
    from target_svc.runner import TargetConfig, TargetRunner
    from target_svc.verify import VerifyGraphs

    target_dir, _ = checkpoints("qwen3")
    runner = TargetRunner(TargetConfig(str(target_dir), max_batch=2, max_seq_len=1024, max_tree_nodes=129,
                                       graph_node_sizes=(64,)))
    graphs = VerifyGraphs(runner.model, 2, 129, runner.model.cache.spec.capacity, runner.cfg.graph_node_sizes)
    assert graphs.node_buckets == (1, 5, 17, 64, 65, 129)
    small = graphs.key_buckets[0]
    assert graphs.shape_for(1, 64, small).nodes == 64 and graphs.shape_for(1, 65, small).nodes == 65
    assert graphs.shape_for(1, 100, small).nodes == 129
