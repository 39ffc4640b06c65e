#!/usr/bin/env bash
# The main job: the three services on CPU with SmolLM2-135M-Instruct and its bundled DFlash drafter,
# one chat prompt answered, acceptance statistics printed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec ddtree-serve up --prompt "${1:-Write a Python function that checks whether a number is prime.}" --max-tokens "${MAX_TOKENS:-128}"
