#!/usr/bin/env bash
# The H200 run behind bench/results/h200.md: step costs at the Qwen3-8B shape, the calibrated speed run through
# the services, the GPU equality tests, the hybrid (Qwen3.6-27B layout, 16 layers) step costs, then the report.
# Usage (on the GPU machine, from the repository root): bash bench/h200.sh OUT_DIR
set -uo pipefail
OUT=${1:?output directory}
R=$OUT/r
mkdir -p "$R"
export PYTHONUNBUFFERED=1
PROFILE=bench/results/calibration-profile-smollm2.json
timeout 170 python3 -m bench.step_cost --shape qwen3-8b --batches 1,8 --steps 10 --work-dir /tmp/w8 --out-dir "$R" \
  > "$R/step-cost-8b.log" 2>&1
grep "^|" "$R/step-cost-8b.log" | head -14
timeout 240 python3 -m bench.speed --model /tmp/w8/target --drafter /tmp/w8/drafter --device cuda --dtype bfloat16 \
  --num-prompts 4 --max-tokens 128 --batch 8 --budget 16,64 --no-assisted --calibrated "$PROFILE" \
  --calibrate-chain-tau 7.79 --out-dir "$R" > "$R/speed-8b.log" 2>&1
grep -E "tok/s|CALIB" "$R/speed-8b.log" | tail -14
timeout 80 python3 -m pytest -q tests/test_gpu.py -k "graph_steps or padded_batch or float32_runners" \
  > "$R/gpu-tests.log" 2>&1
tail -2 "$R/gpu-tests.log"
timeout 100 python3 -m bench.step_cost --shape qwen3.6-27b --layers 16 --batches 1 --steps 10 --work-dir /tmp/w27 \
  --out-dir "$R" > "$R/step-cost-27b.log" 2>&1
grep "^|" "$R/step-cost-27b.log" | head -12
python3 -m bench.h200_report --step-cost "$R"/step-cost-qwen3-8b-*.json --speed "$R"/speed-calibrated-*.json \
  $(ls "$R"/step-cost-qwen3.6-27b-*.json 2>/dev/null | sed 's/^/--hybrid-step-cost /') --out-dir "$R" > "$R/report.log" 2>&1
tail -30 "$R/report.log"
tar czf "$OUT/h200-results.tgz" -C "$R" .
