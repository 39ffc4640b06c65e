#!/usr/bin/env bash
# The wheels a lent GPU machine lacks, for Python 3.12 on x86-64 Linux, into .whl/ (git-ignored; carried to the
# machine beside the source tree): grpcio-tools and friends (the proto stubs are generated there), the HTTP stack,
# py-spy, fla (the hybrid's Gated DeltaNet kernels) and xgrammar. About 40 MiB; run once per checkout, with network.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  grpcio-tools==1.84.0 grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 fastapi starlette pydantic \
  pydantic-core uvicorn annotated-types typing-inspection annotated-doc py-spy fla-core==0.6.0 \
  flash-linear-attention==0.6.0 einops xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
ls .whl | wc -l
