"""bench.h200_report: the H200 headline figures, assembled from the step-cost and speed files of one run."""
from __future__ import annotations

import json

import pytest

from bench import common, h200_report

STEP = common.RESULTS_DIR / "step-cost-qwen3-8b-cuda-nvidia-h200.json"
SPEED = common.RESULTS_DIR / "speed-8b-h200-2026-12-04-1654.json"


def _tokens_per_s(speed: dict, mode: str, batch: int, budget: int | None = None) -> float:
    [run] = [r for r in speed["runs"] if r.get("mode") == mode and r["batch"] == batch
             and (budget is None or r.get("budget") == budget)]
    return run["tokens_per_s"]


def test_a_calibrated_speed_run_is_labelled_and_its_ratios_come_from_its_own_runs(tmp_path):
    h200_report.main(["--step-cost", str(STEP), "--speed", str(SPEED), "--out-dir", str(tmp_path)])
    speed = json.loads(SPEED.read_text())
    data = json.loads((tmp_path / "h200.json").read_text())
    assert data["calibration"]["label"] == "calibrated acceptance (bench-only)"
    assert "**Acceptance is calibrated (bench-only)**" in (tmp_path / "h200.md").read_text()
    best = max(_tokens_per_s(speed, "ddtree", 1, b) for b in speed["budgets"])
    assert data["ddtree_over_ar_8b_b1"] == pytest.approx(best / _tokens_per_s(speed, "ar", 1), rel=1e-3)
    assert data["ddtree_over_dflash_8b_b1"] == pytest.approx(best / _tokens_per_s(speed, "dflash", 1), rel=1e-3)


def test_another_gpus_run_is_written_under_its_own_stem(tmp_path):
    h200_report.main(["--step-cost", str(STEP), "--speed", str(SPEED), "--out-dir", str(tmp_path), "--stem", "h100"])
    assert not (tmp_path / "h200.json").exists()
    assert json.loads((tmp_path / "h100.json").read_text())["ddtree_budget_8b_b1"] > 0
    assert (tmp_path / "h100.md").read_text().startswith("# H100 results (")


def test_every_batched_size_of_a_run_gets_its_ddtree_over_ar(tmp_path):
    """A speed file with batches [8, 32] (here: the batch-8 runs copied as batch 32 at other speeds) gives a ratio
    per batched size, each from its own batch's runs."""
    speed = json.loads(SPEED.read_text())
    wide = []
    for r in speed["runs"]:
        if r.get("batch") == 8:
            copy = {**r, "batch": 32, "tokens_per_s": r["tokens_per_s"] * (3.0 if r.get("mode") == "ddtree" else 2.0)}
            copy["x_vs_services_ar"] = round(1.5 * r.get("x_vs_services_ar", 1.0), 3) if r.get("mode") == "ddtree" \
                else r.get("x_vs_services_ar")
            wide.append(copy)
    speed["runs"] += wide
    speed["batches"] = [8, 32]
    path = tmp_path / "speed.json"
    path.write_text(json.dumps(speed))
    h200_report.main(["--step-cost", str(STEP), "--speed", str(path), "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "h200.json").read_text())
    assert data["ddtree_over_ar_8b_b32"] == pytest.approx(1.5 * data["ddtree_over_ar_8b_b8"], rel=1e-2)
    assert data["ddtree_budget_8b_b32"] == data["ddtree_budget_8b_b8"]


def test_a_quantized_run_with_a_64_node_bucket_reports_both_tree_sizes():
    """summarize_quantized: the 65-node verify over the 1-token forward, and the 64-node one where the run measured
    it (budget 63 in a bucket of its own); without that row, no 64-node key."""
    rows = [{"batch": 1, "nodes": n, "forward_graph_ms": ms} for n, ms in ((1, 4.0), (64, 5.0), (65, 8.0))]
    runs = [{"quantize": q, "target": rows, "floors": {"weight_read_floor_ms": 3.0, "gemv_floor_ms": 3.5}}
            for q in ("none", "int8")]
    out = h200_report.summarize_quantized(runs)
    assert out["int8_verify64_over_ar_8b"] == pytest.approx(2.0, rel=1e-3)
    assert out["int8_verify_64_nodes_over_ar_8b"] == pytest.approx(1.25, rel=1e-3)
    runs[1]["target"] = [r for r in rows if r["nodes"] != 64]
    assert "int8_verify_64_nodes_over_ar_8b" not in h200_report.summarize_quantized(runs)


def test_a_quantized_run_of_a_64_node_tree_alone_reports_it_as_the_64_node_verify():
    """A session that timed 1 and 64 nodes only (no 65-node bucket): the verify64 ratio is the 64-node tree's, and
    the report names the node count it took."""
    rows = [{"batch": 1, "nodes": n, "forward_graph_ms": ms} for n, ms in ((1, 4.0), (64, 6.0))]
    runs = [{"quantize": q, "target": rows, "floors": {"weight_read_floor_ms": 3.0, "gemv_floor_ms": 3.5}}
            for q in ("none", "int8")]
    out = h200_report.summarize_quantized(runs)
    assert out["int8_verify64_over_ar_8b"] == pytest.approx(1.5, rel=1e-3)
    assert out["int8_verify64_nodes_8b"] == 64


def test_the_speed_bench_reads_one_or_several_batched_sizes():
    from bench.speed import batch_sizes

    assert batch_sizes(None, on_cpu=True) == [4] and batch_sizes(None, on_cpu=False) == [8]
    assert batch_sizes("32,8", on_cpu=False) == [8, 32] and batch_sizes(8, on_cpu=False) == [8]
    with pytest.raises(SystemExit):
        batch_sizes("0", on_cpu=False)


def test_the_64_node_verify_ratio_takes_a_measured_64_node_bucket_over_65_nodes():
    """A run that measured budget 63 in a bucket of its own reports that 64-node tree; one without, the 65 nodes."""
    step = json.loads(STEP.read_text())
    plain = h200_report.summarize(step, None, None, "8b")
    assert plain["verify64_nodes_8b"] == 65
    ar = next(r for r in step["target"] if r["batch"] == 1 and r["nodes"] == 1)
    step["target"].append({**ar, "nodes": 64, "forward_graph_ms": 1.25 * ar["forward_graph_ms"]})
    bucketed = h200_report.summarize(step, None, None, "8b")
    assert bucketed["verify64_nodes_8b"] == 64 and bucketed["verify64_over_decode_8b"] == pytest.approx(1.25, abs=1e-3)


def test_a_quantized_run_with_the_fused_reduction_on_is_reported_beside_the_plain_one():
    """Two int8 runs of one session, the second with DDTREE_INT8_FUSED_REDUCE=on in its switches: int8 and
    int8fused keys, each against the same bf16 run."""
    def run(q, ar_ms, switches=None):
        rows = [{"batch": 1, "nodes": n, "forward_graph_ms": ms} for n, ms in ((1, ar_ms), (65, 2 * ar_ms))]
        return {"quantize": q, "target": rows, "switches": switches or {},
                "floors": {"weight_read_floor_ms": 2.0, "gemv_floor_ms": 3.0}}

    out = h200_report.summarize_quantized([run("none", 6.0), run("int8", 4.5),
                                           run("int8", 4.0, {"DDTREE_INT8_FUSED_REDUCE": "on"})])
    assert out["int8_ar_over_bf16_8b"] == pytest.approx(0.75, rel=1e-3)
    assert out["int8fused_ar_over_bf16_8b"] == pytest.approx(0.667, rel=1e-3)


def test_untuned_and_pdl_int8_runs_are_reported_under_names_of_their_own():
    """DDTREE_INT8_TILES=off names its run int8untuned, inductor's PDL (with the kernels' or not) int8pdl, the
    kernels' DDTREE_INT8_PDL alone int8pdlk, each against the plain bf16 run (not bf16 with PDL, which is nonepdl);
    the tuned run keeps the plain name."""
    def run(q, ar_ms, switches=None):
        rows = [{"batch": 1, "nodes": n, "forward_graph_ms": ms} for n, ms in ((1, ar_ms), (64, 1.25 * ar_ms))]
        return {"quantize": q, "target": rows, "switches": switches or {},
                "floors": {"weight_read_floor_ms": 2.0, "gemv_floor_ms": 3.0}}

    out = h200_report.summarize_quantized([run("none", 6.0), run("int8", 4.2), run("int8", 4.5, {"DDTREE_INT8_TILES": "off"}),
                                           run("int8", 3.9, {"DDTREE_INT8_PDL": "on", "TORCHINDUCTOR_ENABLE_PDL": "1"}),
                                           run("int8", 4.08, {"DDTREE_INT8_PDL": "on"}),
                                           run("none", 5.4, {"DDTREE_INT8_PDL": "off", "TORCHINDUCTOR_ENABLE_PDL": "1"})])
    assert out["int8pdlk_ar_over_bf16_8b"] == pytest.approx(0.68, rel=1e-3)
    assert out["int8_ar_over_bf16_8b"] == pytest.approx(0.7, rel=1e-3)
    assert out["int8pdl_ar_over_bf16_8b"] == pytest.approx(0.65, rel=1e-3)
    assert out["int8untuned_ar_over_bf16_8b"] == pytest.approx(0.75, rel=1e-3)
    assert out["int8untuned_verify64_over_ar_8b"] == pytest.approx(1.25, rel=1e-3)


def test_a_speed_run_with_tau_errors_reports_them_beside_the_ratio(tmp_path):
    """Speed files that carry tau_se (2026-12-06 on) put the ddtree tau's error and the ddtree / dflash ratio's
    error from the draws into the report; older files (no tau_se) add no such keys."""
    h200_report.main(["--step-cost", str(STEP), "--speed", str(SPEED), "--out-dir", str(tmp_path)])
    assert "ddtree_over_dflash_tau_se_8b_b1" not in json.loads((tmp_path / "h200.json").read_text())
    speed = json.loads(SPEED.read_text())
    for r in speed["runs"]:
        if r.get("batch") == 1 and r.get("mode") == "ddtree":
            r["tau_se"], r["x_vs_services_dflash_tau_se"] = 0.14, 0.03
    path = tmp_path / "speed.json"
    path.write_text(json.dumps(speed))
    h200_report.main(["--step-cost", str(STEP), "--speed", str(path), "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "h200.json").read_text())
    assert data["ddtree_tau_se_8b_b1"] == 0.14 and data["ddtree_over_dflash_tau_se_8b_b1"] == 0.03


def test_a_hybrid_only_run_makes_a_report_of_its_own(tmp_path):
    """`bash bench/h200.sh OUT hybrid speedhyb report` has no 8B files: the hybrid keys alone, dated by its run."""
    run = common.RESULTS_DIR / "h200-hybrid-2026-12-06"
    step = run / "step-cost-qwen3.6-27b-cuda-nvidia-h200.json"
    speed = run / "speed-calibrated-cuda-nvidia-h200.json"
    h200_report.main(["--hybrid-step-cost", str(step), "--hybrid-speed", str(speed), "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "h200.json").read_text())
    runs = json.loads(speed.read_text())
    assert data["date"] == json.loads(step.read_text())["date"] and "ar_step_ms_8b" not in data
    best = max(_tokens_per_s(runs, "ddtree", 1, b) for b in runs["budgets"])
    assert data["hybrid_ddtree_over_ar_b1"] == pytest.approx(best / _tokens_per_s(runs, "ar", 1), rel=1e-3)


def test_the_drafter_ratio_takes_the_captured_forward_where_the_run_timed_it(tmp_path):
    """A step-cost file with the drafter's captured forward timed: drafter_forward_over_ar_step is that forward
    over the ar step, drafter_call_over_ar_step the whole draft call's; a file without it keeps the call."""
    step = json.loads(STEP.read_text())
    [tree] = [r for r in step["drafter"] if r["batch"] == 1 and r["mode"] == "tree"]
    tree["forward_graph_ms"] = tree["draft_graph_ms"] / 2
    path = tmp_path / "step.json"
    path.write_text(json.dumps(step))
    h200_report.main(["--step-cost", str(path), "--speed", str(SPEED), "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "h200.json").read_text())
    assert data["drafter_forward_over_ar_step_8b"] == pytest.approx(data["drafter_call_over_ar_step_8b"] / 2, rel=1e-2)
    h200_report.main(["--step-cost", str(STEP), "--speed", str(SPEED), "--out-dir", str(tmp_path)])
    old = json.loads((tmp_path / "h200.json").read_text())
    assert old["drafter_forward_over_ar_step_8b"] == old["drafter_call_over_ar_step_8b"]


def test_a_batch_1_run_takes_its_batched_ratios_from_the_named_earlier_run(tmp_path):
    """--batched-speed: where --speed ran batch 1 alone, the batch-8 ratio comes from the earlier file, within that
    file's own runs, and the report names it; a run with batched rows of its own keeps them."""
    speed = json.loads(SPEED.read_text())
    alone = {**speed, "batches": [], "batch": None, "runs": [r for r in speed["runs"] if r.get("batch") == 1]}
    path = tmp_path / "batch1.json"
    path.write_text(json.dumps(alone))
    h200_report.main(["--step-cost", str(STEP), "--speed", str(path), "--out-dir", str(tmp_path)])
    assert "ddtree_over_ar_8b_b8" not in json.loads((tmp_path / "h200.json").read_text())
    h200_report.main(["--step-cost", str(STEP), "--speed", str(path), "--batched-speed", str(SPEED),
                      "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "h200.json").read_text())
    best8 = max(_tokens_per_s(speed, "ddtree", 8, b) for b in speed["budgets"])
    assert data["ddtree_over_ar_8b_b8"] == pytest.approx(best8 / _tokens_per_s(speed, "ar", 8), rel=1e-3)
    assert data["batched_from_8b"].startswith(speed["date"]) and speed["command"] in data["commands"]
    h200_report.main(["--step-cost", str(STEP), "--speed", str(SPEED), "--batched-speed", str(path),
                      "--out-dir", str(tmp_path)])
    assert "batched_from_8b" not in json.loads((tmp_path / "h200.json").read_text())
