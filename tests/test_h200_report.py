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
