#!/usr/bin/env bash
# The test suite: installs everything (Python packages, and Prometheus for the end-to-end metrics test), runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) \
      >/tmp/ddtree-apt.log 2>&1 || { echo "installing prometheus failed; see /tmp/ddtree-apt.log" >&2; exit 1; }
  fi
fi
. .venv/bin/activate
# Triton, for its interpreter: the kernel tests run our Triton kernels (tree WY core, tree layout, K/V write, tree
# attention, weight-only matmul) on the CPU against their PyTorch references. setup.sh installs it with xgrammar on
# Linux x86-64; elsewhere it is installed here. Pinned: the tests patch 3.6's interpreter.
if ! python -c "import triton" 2>/dev/null; then
  echo "test: installing triton 3.6.0 (its interpreter runs the kernel tests on the CPU)" >&2
  python -m pip install -q --disable-pip-version-check "triton==3.6.0" 2>&1 | grep -v "^WARNING: Location" || true
  python -c "import triton" || { echo "installing triton failed" >&2; exit 1; }
fi
# Two pytest workers (DDTREE_TEST_WORKERS; 0 runs in this process alone), each taking whole files (--dist
# loadfile: a module's shared service stack stays in one worker): on CI's 2 cores the suite ran 493 s instead of
# 737 s, since much of it waits on service start-ups and RPCs.
workers=${DDTREE_TEST_WORKERS:-2}
parallel=()
if [ "$workers" != 0 ]; then parallel=(-n "$workers" --dist loadfile); fi
# pytest exits 5 when it collects no test: set -e turns that into a failure, as it should be.
exec python -m pytest -q "${parallel[@]}" "$@"
