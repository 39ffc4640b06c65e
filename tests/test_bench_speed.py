"""bench.speed end to end on the CPU: three real services, a calibrated run, its report files."""
from __future__ import annotations

import json

import pytest

from bench import speed

PROFILE = "bench/results/calibration-profile-smollm2.steps.npz"


def test_a_calibrated_batch_1_run_times_its_reference_ar_run_as_the_ar_system(checkpoints, tmp_path):
    """At batch 1 the calibration's reference run is the timed ar run (once, not twice); the speculative systems
    and transformers' generate() still run interleaved, every output equals ar's, and the report says which run
    doubled as the reference. The target holds one cache slot (--max-batch 1), all a batch-1 run needs."""
    target, drafter = checkpoints("qwen3")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["Count to three.", "Name a colour."]))   # the tiny model's context is 512
    speed.main(["--model", str(target), "--drafter", str(drafter), "--device", "cpu", "--threads", "1",
                "--prompts", str(prompts), "--num-prompts", "2", "--max-tokens", "12", "--batch", "1",
                "--budget", "16", "--max-batch", "1", "--modes", "ar,ddtree", "--hf-prompts", "1", "--no-assisted", "--calibrated", PROFILE,
                "--calibrate-chain-tau", "7.79", "--warmup-tokens", "2", "--out-dir", str(tmp_path)])
    data = json.loads(next(tmp_path.glob("speed-calibrated-*.json")).read_text())
    systems = [r["system"] for r in data["runs"]]
    assert systems == ["services ar", "services ddtree b16 [calibrated]", "transformers generate (greedy)"]
    ar, ddtree, hf = data["runs"]
    assert ar["requests"] == ddtree["requests"] == 2 and ar["tokens"] == 24
    assert ddtree["outputs_equal_services_ar"] == "2/2" and ddtree["tau"] > 1.0
    assert hf["requests"] == 1 and hf["tokens_per_s"] > 0 and hf["outputs_equal_services_ar"] == "1/1"
    assert data["calibrated_acceptance"]["reference_tokens"] == ar["tokens"]
    assert data["calibrated_acceptance"]["reference_is_timed_ar"] is True
    report = next(tmp_path.glob("speed-calibrated-*.md")).read_text()
    assert "was also the calibration's reference run" in report


def test_a_max_batch_below_the_batch_is_refused_before_any_service_starts(tmp_path):
    """--max-batch smaller than --batch could not hold the requests in flight: the bench says so and stops."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["Count to three.", "Name a colour."]))
    with pytest.raises(SystemExit, match="--max-batch 1 is below --batch 2"):
        speed.main(["--model", str(tmp_path / "none"), "--drafter", str(tmp_path / "none"), "--device", "cpu",
                    "--prompts", str(prompts), "--batch", "2", "--max-batch", "1", "--out-dir", str(tmp_path)])


def test_a_run_past_its_deadline_reports_what_it_finished_and_says_where_it_stopped(checkpoints, tmp_path):
    """--deadline-s: no chunk starts once the run has used that long; the report covers what ran (here the timed
    reference ar run alone, deadline 0) and names the cut, instead of a time limit killing the run unreported."""
    target, drafter = checkpoints("qwen3")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["Count to three.", "Name a colour."]))
    speed.main(["--model", str(target), "--drafter", str(drafter), "--device", "cpu", "--threads", "1",
                "--prompts", str(prompts), "--num-prompts", "2", "--max-tokens", "6", "--batch", "1",
                "--budget", "16", "--max-batch", "1", "--modes", "ar,ddtree", "--no-hf", "--calibrated", PROFILE,
                "--calibrate-chain-tau", "7.79", "--warmup-tokens", "2", "--deadline-s", "0", "--out-dir", str(tmp_path)])
    data = json.loads(next(tmp_path.glob("speed-calibrated-*.json")).read_text())
    ar, ddtree = data["runs"]
    assert ar["system"] == "services ar" and ar["requests"] == 2
    assert ddtree == {"system": "services ddtree b16 [calibrated]", "mode": "ddtree", "batch": 1, "error": "never run"}
    assert data["stopped_at_deadline"] == ["batch 1: 0 of 2 chunks (0 of 2 prompts) before the 0 s deadline"]
    assert "Stopped at its deadline" in next(tmp_path.glob("speed-calibrated-*.md")).read_text()
