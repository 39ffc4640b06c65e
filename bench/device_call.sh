#!/usr/bin/env bash
# One call on a lent GPU machine (run from the repository root there, with .whl/ carried: scripts/device_wheels.sh):
# installs the carried wheels, generates the proto stubs, runs bench/h200.sh's sections into $OUT/x and packs
# $OUT/x/r as h200-results.tgz.
#   NEED_GPU=H200 bash bench/device_call.sh int8tune int8   (any other card: exit 3 before anything runs)
#   NEED_GPU=H200 ELSE_SECTIONS="pdltests" ELSE_QUANTS="none int8 int8pdlk" bash bench/device_call.sh int8
#     (another card runs these sections, with these QUANTS, instead: a start that lands on the wrong card is not lost)
set -uo pipefail
: "${OUT:?the output folder of the run tool}"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
sections=("$@")
if [ -n "${NEED_GPU:-}" ] && ! echo "$gpu" | grep -q "$NEED_GPU"; then
  if [ -z "${ELSE_SECTIONS:-}" ]; then
    echo "NOT $NEED_GPU: $gpu"
    exit 3
  fi
  read -ra sections <<< "$ELSE_SECTIONS"
  [ -z "${ELSE_QUANTS:-}" ] || export QUANTS="$ELSE_QUANTS"
fi
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site2 .whl/*.whl \
    || exit
  export PYTHONPATH=/tmp/site2:$PWD PATH=/tmp/site2/bin:$PATH
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
python3 -m ddtree_serve.proto.generate > /dev/null 2>&1
echo "$gpu: ${sections[*]} (QUANTS=${QUANTS:-})"; date -u
mkdir -p "$OUT/x/r"
bash bench/h200.sh "$OUT/x" "${sections[@]}"; rc=$?
date -u
cd "$OUT/x" && tar czf h200-results.tgz r && ls r
exit $rc
