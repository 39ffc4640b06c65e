"""The flagship fit bench's parts on the CPU: the shard-by-shard checkpoint, its verdict, and one tiny run."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors import safe_open

from bench import common, flagship_fit
from bench.shapes import build_target, build_target_streaming, checkpoint_bytes, is_streamed_checkpoint
from target_svc.loader import load_target

GIB = 1024**3


def _tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_the_streamed_checkpoint_is_build_targets_layout_in_shards(tmp_path):
    whole = build_target("tiny-hybrid", tmp_path / "whole", device="cpu", dtype=torch.bfloat16)
    streamed = build_target_streaming("tiny-hybrid", tmp_path / "streamed", device="cpu", dtype=torch.bfloat16,
                                      shard_bytes=2**20)
    a, b = _tensors(whole), _tensors(streamed)
    assert {k: (v.shape, v.dtype) for k, v in a.items()} == {k: (v.shape, v.dtype) for k, v in b.items()}
    assert json.loads((whole / "config.json").read_text()) == json.loads((streamed / "config.json").read_text())
    index = json.loads((streamed / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(b) and len(set(index["weight_map"].values())) > 2
    assert index["metadata"]["total_size"] == checkpoint_bytes("tiny-hybrid", dtype=torch.bfloat16)
    # HF's init where it matters: norms of (1 + w) zero, GDN norm ones, A_log = log U(0.01, 16), dt_bias ones.
    assert not b["model.layers.0.input_layernorm.weight"].any()
    assert (b["model.layers.0.linear_attn.norm.weight"] == 1).all()
    assert (b["model.layers.0.linear_attn.dt_bias"] == 1).all()
    a_log = b["model.layers.0.linear_attn.A_log"].float()
    assert ((a_log.exp() > 0.009) & (a_log.exp() < 16.1)).all()
    assert 0.015 < b["model.layers.1.mlp.down_proj.weight"].float().std() < 0.025
    # The successor LM head: a row permutation of the embedding / 10.
    emb, head = b["model.embed_tokens.weight"].float(), b["lm_head.weight"].float()
    assert torch.allclose(torch.sort(head.sum(1)).values, torch.sort(emb.sum(1) / 10).values, rtol=0.02, atol=0.05)
    assert 9 < emb.std() < 11
    assert is_streamed_checkpoint(streamed, "tiny-hybrid", None, torch.bfloat16)
    assert not is_streamed_checkpoint(streamed, "tiny-hybrid", 8, torch.bfloat16)
    assert not is_streamed_checkpoint(whole, "tiny-hybrid", None, torch.bfloat16)
    target = load_target(streamed, "cpu", torch.float32, quantize="int8")
    assert target.num_layers == 4 and target.linear_attention_layers == [0, 1, 2]


def test_a_build_over_another_builds_checkpoint_leaves_only_its_own_files(tmp_path):
    """The streamed build's shards and index, then a whole build in the same directory (bench/h200.sh's w8, then
    8b): the loader must find the whole build's file, not the stale index's shards; and back again."""
    out = tmp_path / "target"
    build_target_streaming("tiny", out, device="cpu", dtype=torch.bfloat16, shard_bytes=2**20)
    build_target("tiny", out, device="cpu", dtype=torch.bfloat16)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    assert load_target(out, "cpu", torch.float32).num_layers > 0
    build_target_streaming("tiny", out, device="cpu", dtype=torch.bfloat16, shard_bytes=2**20)
    assert not (out / "model.safetensors").exists() and is_streamed_checkpoint(out, "tiny", None, torch.bfloat16)


def test_defaults_emulate_a_48gb_card_on_cuda_and_no_cap_on_cpu():
    cuda = flagship_fit.parse_args([])
    assert cuda.gpu_memory_cap * GIB == 46068 * 2**20 and cuda.quantize == "int8"
    assert (cuda.max_batch, cuda.max_seq_len, cuda.max_tree_nodes, cuda.budget) == (8, 8192, 65, 64)
    assert cuda.long_prompt_tokens == 8192 - 64
    assert flagship_fit.parse_args(["--device", "cpu"]).gpu_memory_cap is None
    assert flagship_fit.parse_args(["--no-cap"]).gpu_memory_cap is None
    with pytest.raises(SystemExit):
        flagship_fit.parse_args(["--device", "cpu", "--gpu-memory-cap", "40"])
    with pytest.raises(SystemExit):
        flagship_fit.parse_args(["--build-only"])   # a temporary work dir would be removed at once


def test_random_prompts_are_reproducible_and_avoid_eos():
    prompts = flagship_fit.random_prompts(3, 50, 100, seed=4)
    assert prompts == flagship_fit.random_prompts(3, 50, 100, seed=4)
    assert all(2 <= t < 100 for p in prompts for t in p) and [len(p) for p in prompts] == [50, 50, 50]


def _data(peak=40 * GIB, process=None, outside=None, equal=True, problems=(), error=None) -> dict:
    return {"error": error, "target_log_problems": list(problems), "info": {"max_batch": 8},
            "target": {"gpu_memory_cap_bytes": 46068 * 2**20, "max_seq_len": 8192},
            "memory": {"peak_reserved": peak, "process_max": process, "outside_allocator_max": outside},
            "phases": [{"outputs_equal": True}, {"outputs_equal": equal}]}


def test_the_verdict():
    assert flagship_fit.verdict(_data()).startswith("FITS: 8 sequences of 8192 tokens")
    assert flagship_fit.verdict(_data(process=46 * GIB)).startswith("DOES NOT FIT")   # context included: over
    # The peak plus the CUDA context (nvidia-smi - reserved) is what a real card must hold.
    assert "40.50 GiB with the CUDA context" in flagship_fit.verdict(_data(process=int(40.2 * GIB), outside=GIB // 2))
    assert flagship_fit.verdict(_data(peak=44.5 * GIB, process=41 * GIB, outside=GIB)).startswith("DOES NOT FIT")
    assert flagship_fit.verdict(_data(equal=False)).startswith("DOES NOT FIT: ddtree's outputs differ")
    assert flagship_fit.verdict(_data(problems=["torch.OutOfMemoryError: CUDA out of memory"])).startswith(
        "DOES NOT FIT: the target ran out of memory")
    assert flagship_fit.verdict(_data(problems=['"level": "ERROR", "msg": "x"'])).startswith("INCOMPLETE")
    assert flagship_fit.verdict(_data(error="SystemExit: 143")).startswith("INCOMPLETE")
    assert flagship_fit.verdict(_data(peak=None)).startswith("SERVED (no cap")


@pytest.mark.slow
def test_a_tiny_hybrid_run_on_the_cpu_serves_losslessly_and_writes_the_report(tmp_path):
    out = tmp_path / "out"
    flagship_fit.main(["--shape", "tiny-hybrid", "--device", "cpu", "--dtype", "float32", "--max-seq-len", "128",
                       "--num-prompts", "2", "--prompt-tokens", "12", "--max-tokens", "6", "--max-batch", "2",
                       "--threads", "1", "--work-dir", str(tmp_path / "w"), "--out-dir", str(out)])
    [report] = out.glob("flagship-fit-tiny-hybrid-*.json")
    data = json.loads(report.read_text())
    assert data["verdict"].startswith("SERVED") and data["error"] is None
    assert [p["name"] for p in data["phases"]] == ["warm-up b1", "short b1", "short b2", "long b2"]
    assert all(p["outputs_equal"] for p in data["phases"])
    assert data["phases"][-1]["runs"][0]["prompt_tokens"] == 128 - 6
    assert data["info"]["quantize"] == "int8" and data["info"]["memory_plan"]["max_batch"] == 2
    assert "## Served memory plan" in report.with_suffix(".md").read_text()


def test_the_headline_figures_for_the_h200_report(tmp_path):
    data = {**_data(), "verdict": "FITS: ...", "date": "d", "command": "c", "hardware": {"gpu": "NVIDIA H200"},
            "info": {"max_batch": 8, "memory_plan": {"source": "s", "weight_bytes": 27 * GIB, "cache_bytes": 6 * GIB,
                                                     "max_batch": 8, "max_seq_len": 8192}}}
    data["target"].update(num_layers=64, quantize="int8")
    data["memory"]["peak_allocated"] = 38 * GIB
    data["info"]["memory_plan"].update(workspace_bytes=2 * GIB)
    head = flagship_fit.headline(data)
    assert head["fit_cap_gib"] == 44.99 and head["fit_peak_reserved_gib"] == 40.0 and head["fit_outputs_equal"]
    assert head["fit_activation_peak_gib"] == 5.0 and head["fit_workspace_estimate_gib"] == 2.0
    assert head["fit_sequences_held"] == 8 and head["fit_weights_gib"] == 27.0 and head["fit_process_gib"] is None
    assert head["fit_outside_allocator_gib"] is None   # nvidia-smi did not list the process
    data["memory"].update(process_max=41 * GIB, outside_allocator_max=3 * GIB)
    assert flagship_fit.headline(data)["fit_outside_allocator_gib"] == 3.0
    from bench import h200_report

    path = tmp_path / "fit.json"
    path.write_text(json.dumps(data))
    h200_report.main(["--fit", str(path), "--out-dir", str(tmp_path)])
    assert "| fit_peak_reserved_gib | 40.000 |" in (tmp_path / "h200.md").read_text()


def test_a_results_command_line_records_the_allocator_setting_it_ran_under(monkeypatch):
    for name in common.RECORDED_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["flagship_fit.py", "--out-dir", "o"])
    assert common.command_line("bench.flagship_fit") == "python -m bench.flagship_fit --out-dir o"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert common.command_line("bench.flagship_fit") == (
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m bench.flagship_fit --out-dir o")


def test_the_memory_sampler_reports_the_largest_process_figure_and_outside_share_with_their_phase():
    sampler = flagship_fit.MemorySampler(stack=None, pid=0, period_s=2.0)
    sampler.samples = [(1.0, 30 * GIB, 29 * GIB), (5.0, 34 * GIB, 30 * GIB), (9.0, 35 * GIB, 33 * GIB)]
    s = sampler.summary()
    assert s["samples"] == 3 and s["process_max"] == 35 * GIB and s["process_max_at_s"] == 9.0
    assert s["outside_allocator_max"] == 4 * GIB and s["outside_allocator_max_at_s"] == 5.0
    data = {"memory_sampled": s, "phases": [{"name": "short b1", "start_s": 0.5, "end_s": 4.0},
                                            {"name": "long b8", "start_s": 4.5, "end_s": 8.0}]}
    line = flagship_fit.sampled_line(data)
    assert "35.00 GiB at 9.0 s (after the last phase)" in line and "4.00 GiB at 5.0 s (long b8)" in line
    assert flagship_fit.MemorySampler(None, 0, 2.0).summary() == {"samples": 0}
    assert "no readings" in flagship_fit.sampled_line({"memory_sampled": {"samples": 0}, "phases": []})
