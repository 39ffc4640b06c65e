"""bench.speed end to end on the CPU: three real services, a calibrated run, its report files."""
from __future__ import annotations

import json

from bench import speed

PROFILE = "bench/results/calibration-profile-smollm2.steps.npz"


def test_a_calibrated_batch_1_run_times_its_reference_ar_run_as_the_ar_system(checkpoints, tmp_path):
    """At batch 1 the calibration's reference run is the timed ar run (once, not twice); the speculative systems
    still run interleaved, every output equals ar's, and the report says which run doubled as the reference."""
    target, drafter = checkpoints("qwen3")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["Count to three.", "Name a colour."]))   # the tiny model's context is 512
    speed.main(["--model", str(target), "--drafter", str(drafter), "--device", "cpu", "--threads", "1",
                "--prompts", str(prompts), "--num-prompts", "2", "--max-tokens", "12", "--batch", "1",
                "--budget", "16", "--modes", "ar,ddtree", "--no-hf", "--calibrated", PROFILE, "--calibrate-chain-tau", "7.79", "--warmup-tokens", "2",
                "--out-dir", str(tmp_path)])
    data = json.loads(next(tmp_path.glob("speed-calibrated-*.json")).read_text())
    systems = [r["system"] for r in data["runs"]]
    assert systems == ["services ar", "services ddtree b16 [calibrated]"]
    ar, ddtree = data["runs"]
    assert ar["requests"] == ddtree["requests"] == 2 and ar["tokens"] == 24
    assert ddtree["outputs_equal_services_ar"] == "2/2" and ddtree["tau"] > 1.0
    assert data["calibrated_acceptance"]["reference_tokens"] == ar["tokens"]
    assert data["calibrated_acceptance"]["reference_is_timed_ar"] is True
    report = next(tmp_path.glob("speed-calibrated-*.md")).read_text()
    assert "was also the calibration's reference run" in report
