#!/usr/bin/env bash
# The H200 run behind bench/results/h200.md: the GPU equality tests, step costs at the Qwen3-8B shape, the
# calibrated speed run through the services (batch 1 and 8), then the report. Hybrid and int8 runs: see
# bench/h200_hybrid.sh.
# Usage (on the GPU machine, from the repository root): bash bench/h200.sh OUT_DIR
set -uo pipefail
OUT=${1:?output directory}
R=$OUT/r
mkdir -p "$R"
export PYTHONUNBUFFERED=1
PROFILE=bench/results/calibration-profile-smollm2.json
timeout 100 python3 -m pytest -q tests/test_gpu.py -k "graph or padded_batch or float32_runners" \
  > "$R/gpu-tests.log" 2>&1
tail -3 "$R/gpu-tests.log"
timeout 170 python3 -m bench.step_cost --shape qwen3-8b --batches 1,8 --steps 10 --work-dir /tmp/w8 --out-dir "$R" \
  > "$R/step-cost-8b.log" 2>&1
grep "^|" "$R/step-cost-8b.log" | head -14
timeout 290 python3 -m bench.speed --model /tmp/w8/target --drafter /tmp/w8/drafter --device cuda --dtype bfloat16 \
  --num-prompts 8 --max-tokens 96 --batch 8 --budget 16,32,64 --no-assisted --calibrated "$PROFILE" \
  --calibrate-chain-tau 7.79 --transport cuda-ipc --out-dir "$R" --log-dir "$R/logs-8b" > "$R/speed-8b.log" 2>&1
grep -E "tok/s|CALIB|Error|error" "$R/speed-8b.log" | tail -16
python3 -m bench.h200_report --step-cost "$R"/step-cost-qwen3-8b-*.json --speed "$R"/speed-calibrated-*.json \
  --out-dir "$R" > "$R/report.log" 2>&1
tail -40 "$R/report.log"
tar czf "$OUT/h200-results.tgz" -C "$R" .
