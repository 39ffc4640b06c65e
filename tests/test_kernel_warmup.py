"""Kernel warm-up passes (target_svc/kernel_warmup.py): the layer prefix they load and the pass itself, on CPU (the
memory they save is a GPU figure: bench/device_memory.py)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from target_svc.kernel_warmup import LEAN_GROWTH_BYTES, WarmupPass, WarmupSpec, prefix_layers, run_pass, run_passes
from target_svc.loader import load_target


def test_the_prefix_holds_one_layer_of_every_type():
    assert prefix_layers(["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 60) == 4
    assert prefix_layers(["full_attention"] * 36) == 1
    assert prefix_layers(["full_attention", "linear_attention", "full_attention"]) == 2


def test_a_pass_is_lean_only_when_it_measured_a_small_growth_and_did_not_fail():
    assert WarmupPass(1.0, 4, LEAN_GROWTH_BYTES - 1).lean
    assert not WarmupPass(1.0, 4, LEAN_GROWTH_BYTES).lean
    assert not WarmupPass(1.0, 4, None).lean
    assert not WarmupPass(1.0, 0, 0, error="boom").lean


def test_a_layer_cut_loads_the_first_layers_of_the_checkpoint_unchanged(checkpoints):
    target_dir, _ = checkpoints("qwen3_5")
    full = load_target(target_dir)
    cut = load_target(target_dir, num_layers=2)
    assert cut.num_layers == 2 and len(cut.layers) == 2
    assert cut.layer_types == full.layer_types[:2]
    for (name, a), (_, b) in zip(cut.layers.state_dict().items(), full.layers[:2].state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(cut.embed_tokens.weight, full.embed_tokens.weight)


def test_a_layer_cut_outside_the_model_is_refused(checkpoints):
    target_dir, _ = checkpoints("qwen3_5")
    with pytest.raises(ValueError, match="num_layers must be in 1..4"):
        load_target(target_dir, num_layers=5)


def test_a_pass_prefills_and_verifies_the_prefix_of_a_hybrid_model(checkpoints):
    target_dir, _ = checkpoints("qwen3_5")
    result = run_pass(WarmupSpec(str(target_dir), device="cpu", dtype="float32", batch=2, chunk=8, tree_nodes=5))
    assert result.layers == 4 and not result.error   # 3 Gated DeltaNet layers, then the full-attention one
    assert result.outside_growth_bytes is None       # no driver figure on CPU


def test_passes_run_in_their_own_processes_and_stop_when_nothing_is_measured(checkpoints):
    target_dir, _ = checkpoints("qwen3")
    spec = WarmupSpec(str(target_dir), device="cpu", dtype="float32", batch=1, chunk=8, tree_nodes=3)
    passes = asyncio.run(run_passes(spec, passes=3))
    assert len(passes) == 1 and passes[0].layers == 1 and not passes[0].error


def test_a_failed_pass_is_reported_not_raised(tmp_path):
    passes = asyncio.run(run_passes(WarmupSpec(str(tmp_path / "missing"), device="cpu", dtype="float32"), passes=3))
    assert len(passes) == 1 and passes[0].error and not passes[0].lean


def test_by_default_only_hybrid_models_get_passes(checkpoints):
    from target_svc.kernel_warmup import DEFAULT_HYBRID_PASSES, default_passes

    assert default_passes(str(checkpoints("qwen3_5")[0])) == DEFAULT_HYBRID_PASSES
    assert default_passes(str(checkpoints("qwen3")[0])) == 0
    assert default_passes(str(checkpoints("llama")[0])) == 0
