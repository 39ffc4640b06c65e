"""Memory planning: the cache arithmetic, the batch a budget holds, the refusal, and the runner sized by the plan."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from target_svc.gated_deltanet import LinearAttnStateShape
from target_svc.memory_plan import (
    CARD_48GB_BYTES,
    GIB,
    CacheGeometry,
    MemoryPlanError,
    cap_gpu_memory,
    capped_cache_budget,
    gpu_cache_budget,
    memory_cap_fraction,
    plan_cache,
    plan_for_config,
    qwen36_27b_plan_table,
    qwen36_27b_text_config,
    workspace_estimate,
)
from target_svc.quantization import tensor_bytes
from target_svc.runner import TargetConfig, TargetRunner

GDN = LinearAttnStateShape(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, conv_kernel=4)
HYBRID = CacheGeometry(num_full_layers=2, num_kv_heads=2, head_dim=4, linear_shapes=(GDN, GDN), dtype_bytes=2)
DOCS = Path(__file__).resolve().parents[1] / "docs" / "MEMORY.md"


def test_kv_bytes_per_token_count_k_and_v_of_every_full_attention_layer():
    assert HYBRID.kv_bytes_per_token == 2 * 2 * 2 * 4 * 2  # (K, V) x layers x kv heads x head_dim x bf16


def test_gdn_states_are_conv_windows_in_the_model_dtype_and_fp32_recurrent_states():
    conv = (2 * 16 + 32) * 3 * 2   # (2 key_dim + value_dim) x (kernel - 1) x bf16
    rec = 4 * 8 * 8 * 4            # Hv x Dk x Dv x fp32
    assert HYBRID.state_bytes_per_sequence == 2 * (conv + rec)


def test_a_slot_holds_max_seq_len_plus_one_verify_block_and_the_states():
    assert HYBRID.slot_bytes(100, 9) == 109 * HYBRID.kv_bytes_per_token + HYBRID.state_bytes_per_sequence


def test_the_budget_holds_whole_slots_plus_the_scratch_slot_after_the_workspace():
    slot = HYBRID.slot_bytes(100, 9)
    exact = plan_cache(5 * slot + 1000, HYBRID, 100, 9, requested_batch=8, workspace_bytes=1000)
    assert exact.max_batch == exact.fit_batch == 4 and exact.cache_bytes == 5 * slot
    assert plan_cache(5 * slot + 999, HYBRID, 100, 9, 8, workspace_bytes=1000).max_batch == 3


def test_the_batch_is_capped_at_the_requested_one():
    plan = plan_cache(100 * GIB, HYBRID, 100, 9, requested_batch=8)
    assert plan.max_batch == 8 and plan.fit_batch > 8 and plan.cache_bytes == 9 * plan.slot_bytes


def test_without_a_budget_the_plan_is_reported_but_not_enforced():
    plan = plan_cache(None, HYBRID, 100, 9, requested_batch=8, weight_bytes=123)
    assert plan.max_batch == 8 and plan.budget_bytes is None and plan.workspace_bytes == 0
    assert "not enforced" in plan.summary() and "8 x 100 tokens" in plan.summary()


def test_a_budget_short_of_one_sequence_is_refused_in_one_line():
    slot = HYBRID.slot_bytes(100, 9)
    with pytest.raises(MemoryPlanError) as err:
        plan_cache(2 * slot - 1, HYBRID, 100, 9, requested_batch=8, source="--kv-cache-memory")
    message = str(err.value)
    assert "\n" not in message and "--max-seq-len 100" in message and "--kv-cache-memory" in message


def test_gpu_budget_is_the_utilized_share_of_the_card_minus_what_is_already_in_use():
    assert gpu_cache_budget(total_bytes=100, free_bytes=60, utilization=0.9) == 50
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        gpu_cache_budget(100, 60, 1.5)


def test_a_capped_budget_takes_the_cap_as_the_card_and_counts_only_this_process():
    # A 48 GB card emulated on a larger one: 0.9 x the cap, minus what this process's allocator holds.
    assert capped_cache_budget(cap_bytes=100, held_bytes=30, utilization=0.9) == 60
    assert capped_cache_budget(CARD_48GB_BYTES, 28 * GIB, 0.9) == int(0.9 * CARD_48GB_BYTES) - 28 * GIB
    # The uncapped budget is the same arithmetic with the whole card and everything in use on it.
    assert gpu_cache_budget(100, 60, 0.9) == capped_cache_budget(100, 40, 0.9)
    assert capped_cache_budget(100, 95, 0.9) < 0   # plan_cache then refuses
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        capped_cache_budget(100, 0, 0.0)


def test_a_cap_is_a_share_of_the_card_and_never_larger_than_it():
    assert memory_cap_fraction(CARD_48GB_BYTES, 141 * GIB) == pytest.approx(CARD_48GB_BYTES / (141 * GIB))
    assert memory_cap_fraction(80 * GIB, 80 * GIB) == 1.0
    for cap, message in ((81 * GIB, "larger than the card"), (0, "must be > 0"), (-GIB, "must be > 0")):
        with pytest.raises(MemoryPlanError, match=message) as err:
            memory_cap_fraction(cap, 80 * GIB)
        assert "\n" not in str(err.value) and "--gpu-memory-cap" in str(err.value)


def test_a_cap_off_cuda_is_refused_not_ignored():
    with pytest.raises(MemoryPlanError, match="--gpu-memory-cap needs a CUDA device"):
        cap_gpu_memory(torch.device("cpu"), 48 * GIB)


def test_state_snapshots_come_out_of_the_budget_before_the_slots():
    slot = HYBRID.slot_bytes(100, 9)
    snapshots = 2 * HYBRID.state_bytes_per_sequence
    plan = plan_cache(5 * slot + snapshots, HYBRID, 100, 9, 8, snapshot_bytes=snapshots)
    assert plan.max_batch == 4 and plan.snapshot_bytes == snapshots and "state snapshots" in plan.summary()
    assert plan_cache(5 * slot + snapshots - 1, HYBRID, 100, 9, 8, snapshot_bytes=snapshots).max_batch == 3


# ---- the runner sized by its plan (CPU: only --kv-cache-memory is enforced) --------------------------------------

def _cache_bytes(runner: TargetRunner) -> int:
    cache = runner.model.cache
    return cache.k.nbytes + cache.v.nbytes + sum(s.conv.nbytes + s.rec.nbytes for s in cache.linear)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_the_allocated_cache_is_exactly_the_planned_bytes(kind, checkpoints):
    target_dir, _ = checkpoints(kind)
    runner = TargetRunner(TargetConfig(model_dir=str(target_dir), max_batch=3, max_seq_len=64, max_tree_nodes=8))
    plan = runner.memory
    assert plan.max_batch == runner.max_batch == 3 and plan.budget_bytes is None
    assert _cache_bytes(runner) == plan.cache_bytes == 4 * plan.slot_bytes
    snapshots = TargetRunner(TargetConfig(model_dir=str(target_dir), max_batch=3, max_seq_len=64, max_tree_nodes=8,
                                          state_snapshots=2))
    pool = sum(s.conv.nbytes + s.rec.nbytes for s in snapshots.model.cache.snapshot_pool)
    assert pool == snapshots.memory.snapshot_bytes == 2 * plan.state_bytes_per_sequence   # 0 on a dense target
    t = runner.target
    assert plan.weight_bytes == tensor_bytes(t.embed_tokens, t.layers, t.norm, t.lm_head)


def test_kv_cache_memory_lowers_the_batch_to_what_fits(checkpoints):
    target_dir, _ = checkpoints("qwen3_5")
    probe = TargetRunner(TargetConfig(model_dir=str(target_dir), max_batch=1, max_seq_len=64, max_tree_nodes=8))
    slot = probe.memory.slot_bytes
    runner = TargetRunner(TargetConfig(model_dir=str(target_dir), max_batch=8, max_seq_len=64, max_tree_nodes=8,
                                       kv_cache_memory_bytes=4 * slot))
    assert runner.max_batch == 3 and runner.cache_usage()[1] == 3 and _cache_bytes(runner) == 4 * slot


def test_kv_cache_memory_short_of_one_sequence_refuses_to_start(checkpoints):
    target_dir, _ = checkpoints("qwen3")
    with pytest.raises(MemoryPlanError, match="not enough memory for one sequence of --max-seq-len 64"):
        TargetRunner(TargetConfig(model_dir=str(target_dir), max_seq_len=64, max_tree_nodes=8,
                                  kv_cache_memory_bytes=1000))


def test_a_target_given_a_gpu_memory_cap_on_the_cpu_refuses_before_loading(tmp_path):
    # The model directory is empty: the refusal comes before any weights are read.
    with pytest.raises(MemoryPlanError, match="needs a CUDA device"):
        TargetRunner(TargetConfig(model_dir=str(tmp_path), gpu_memory_cap_bytes=48 * GIB))


def test_int8_weights_shrink_the_planned_weight_bytes(checkpoints):
    target_dir, _ = checkpoints("llama")
    sizes = dict(model_dir=str(target_dir), max_batch=1, max_seq_len=32, max_tree_nodes=4)
    plain, quant = (TargetRunner(TargetConfig(**sizes, quantize=q)).memory for q in ("none", "int8"))
    assert quant.weight_bytes < plain.weight_bytes and quant.slot_bytes == plain.slot_bytes


def test_the_27b_plan_with_an_int8_head_holds_the_heads_int8_bytes_instead_of_its_bf16_ones():
    config = qwen36_27b_text_config()
    args = (CARD_48GB_BYTES, 0.9, 8, 8192, 65, 512)
    body, head = (plan_for_config(config, torch.bfloat16, q, *args) for q in ("int8", "int8-head"))
    vocab, hidden = config.vocab_size, config.hidden_size
    assert body.weight_bytes - head.weight_bytes == 2 * vocab * hidden - (vocab * hidden + 2 * vocab)


# ---- the computed Qwen3.6-27B plan (arithmetic on the shapes, not a measurement) --------------------------------

def test_qwen36_27b_on_a_48gb_card_needs_int8_and_then_holds_8_sequences_of_8192():
    config = qwen36_27b_text_config()
    args = (CARD_48GB_BYTES, 0.9, 8, 8192, 65, 512)
    with pytest.raises(MemoryPlanError):
        plan_for_config(config, torch.bfloat16, "none", *args)   # ~50 GiB of bf16 weights: more than the card
    plan = plan_for_config(config, torch.bfloat16, "int8", *args)
    assert plan.max_batch == 8
    assert plan.kv_bytes_per_token == 2 * 16 * 4 * 256 * 2       # 16 attention layers, 4 kv heads x 256, bf16
    assert 25 * GIB < plan.weight_bytes < 30 * GIB


def test_the_docs_table_is_the_computed_plan():
    assert qwen36_27b_plan_table() in DOCS.read_text()


def test_the_workspace_counts_the_gdn_traces_a_verify_keeps_for_its_commit():
    """Per linear layer: the conv inputs (the committed window and one row per node, model dtype), and per node the
    fp32 key, value and gate of every value head (at the 27B's batch-8 65-node bucket ~1.6 GiB; the traces were
    the largest set a capture kept alive in the H200 fit runs)."""
    gdn = LinearAttnStateShape(num_k_heads=16, num_v_heads=48, head_k_dim=128, head_v_dim=128, conv_kernel=4)
    args = (248320, 5120, 17408, 2, 8, 65, 512)
    extra = workspace_estimate(*args, (gdn,) * 48) - workspace_estimate(*args)
    assert extra == 48 * (8 * (65 + 3) * 10240 * 2 + 8 * 65 * 48 * (128 + 128 + 1) * 4)
    assert 1.6 * GIB < extra < 1.7 * GIB
