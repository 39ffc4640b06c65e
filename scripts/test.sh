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
# pytest exits 5 when it collects no test: set -e turns that into a failure, as it should be.
exec python -m pytest -q "$@"
