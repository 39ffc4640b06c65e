"""Kernel warm-up passes: autotune and compile the target's kernels in throwaway processes before the server loads.

Why: fla's gated-delta-rule kernels autotune on their first call (Triton benchmarks every config of each kernel)
and torch.compile builds the glue kernels. Run inside the serving process, that first call took ~70 s and left
~2.7 GiB of device memory outside torch's allocator for the life of the process (measured on an H200 at the
Qwen3.6-27B widths, bench/device_memory.py: the benchmarked configs' loaded kernels and the local memory of the
ones that spill, which the driver keeps). Both caches persist on disk (fla autotunes with Triton's
cache_results; inductor caches its kernels and their configs), so a process that starts after them loads only
the chosen kernels: 0.07 GiB outside the allocator instead of 2.7, and ~6 s instead of ~70.

A pass loads the checkpoint's first few layers (the real widths, one layer of each type), prefills two chunks at the
server's chunk size and verifies a tree and a single token, at the full batch and at batch 1 (each verify shape
captured as the server captures it, so the graph path's compiled functions are built too), then reports its time and
the device memory it grew outside the allocator. The server runs passes until one is lean (on the H200 the first two
processes after an empty cache still autotuned; the third did not), at most `passes` of them: by default 3 for a
hybrid model and none for a dense one.

    python -m target_svc.kernel_warmup --model DIR --device cuda --dtype bfloat16 --quantize int8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

log = logging.getLogger("ddtree.target.kernel_warmup")

RESULT_PREFIX = "KERNEL_WARMUP "
# Passes when the server is not told: hybrid models' fla kernels autotune (the 2.7 GiB above); a dense model's
# kernels do not (its glue compiles, which the on-disk caches keep anyway), so it starts without a pass.
DEFAULT_HYBRID_PASSES = 3
# A pass that grew less than this outside the allocator found its kernels cached (no autotuning, no spills).
LEAN_GROWTH_BYTES = 256 * 2**20
PASS_TIMEOUT_S = 600.0
GIB = 2**30


@dataclass(frozen=True)
class WarmupSpec:
    """What a pass runs: the server's checkpoint, dtype, quantization, batch and chunk."""

    model_dir: str
    device: str = "cuda"
    dtype: str = "bfloat16"
    quantize: str = "none"
    batch: int = 8
    chunk: int = 512
    tree_nodes: int = 65


@dataclass(frozen=True)
class WarmupPass:
    """One pass's report: seconds, the layers it ran, and the device memory it grew outside torch's allocator
    (None where the driver's per-process figure is not available)."""

    seconds: float
    layers: int
    outside_growth_bytes: int | None
    error: str = ""

    @property
    def lean(self) -> bool:
        """Nothing was autotuned or spilled: the kernels came from the caches."""
        growth = self.outside_growth_bytes
        return not self.error and growth is not None and growth < LEAN_GROWTH_BYTES


def _layer_types(model_dir: str) -> list[str]:
    """The checkpoint's per-layer types (full attention for a config that names none)."""
    from transformers import AutoConfig

    top = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    text = getattr(top, "text_config", top)
    return list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)


def default_passes(model_dir: str) -> int:
    """DEFAULT_HYBRID_PASSES for a model with linear-attention (Gated DeltaNet) layers, else 0."""
    return DEFAULT_HYBRID_PASSES if "linear_attention" in _layer_types(model_dir) else 0


def prefix_layers(layer_types: list[str] | tuple[str, ...]) -> int:
    """The fewest leading layers that hold one layer of every type the model has."""
    wanted = set(layer_types)
    seen: set[str] = set()
    for i, kind in enumerate(layer_types):
        seen.add(kind)
        if seen == wanted:
            return i + 1
    return len(layer_types)


def _outside_allocator(device: torch.device) -> int | None:
    """This process's device memory minus what torch's allocator reserved (None where unavailable)."""
    from ddtree_serve.plumbing.process_memory import process_device_memory

    torch.cuda.synchronize(device)
    used = process_device_memory(os.getpid())
    return None if used is None else used - torch.cuda.memory_reserved(device)


def _chain(runner, seq_id: str, nodes: int, gen: torch.Generator):
    """A verify item: a chain of `nodes` random tokens (distinct siblings trivially) rooted at the pending token."""
    from target_svc.runner import VerifyItem

    tokens = torch.randint(0, runner.target.vocab_size, (nodes,), generator=gen)
    tokens[0] = runner.seqs[seq_id].pending_token
    return VerifyItem(seq_id, tokens, torch.arange(-1, nodes - 1))


def run_pass(spec: WarmupSpec) -> WarmupPass:
    """One pass in this process: load the layer prefix; prefill two chunks and verify a tree and a single token,
    for a full batch and for one sequence."""
    from target_svc.runner import PrefillItem, TargetConfig, TargetRunner

    t0 = time.perf_counter()
    layers = prefix_layers(_layer_types(spec.model_dir))
    device = torch.device(spec.device)
    runner = TargetRunner(TargetConfig(
        spec.model_dir, device=spec.device, dtype=getattr(torch, spec.dtype), max_batch=spec.batch,
        max_seq_len=2 * spec.chunk + 2 * spec.tree_nodes + 2, max_tree_nodes=spec.tree_nodes, prefill_chunk=spec.chunk,
        lazy_graphs=True, quantize=spec.quantize, num_layers=layers))
    before = _outside_allocator(device) if device.type == "cuda" else None
    gen = torch.Generator().manual_seed(0)
    # The full batch, then one sequence alone: torch.compile specialises size-1 dimensions, so batch 1 builds
    # kernels of its own (as the server's one-request phases do).
    for batch in sorted({spec.batch, 1}, reverse=True):
        seq_ids = [f"warm{batch}-{b}" for b in range(batch)]
        prompts = torch.randint(0, runner.target.vocab_size, (batch, 2 * spec.chunk), generator=gen).tolist()
        for start in (0, spec.chunk):
            runner.prefill([PrefillItem(seq_id, prompt[start:start + spec.chunk], start=start, more=start == 0)
                            for seq_id, prompt in zip(seq_ids, prompts)])
        for nodes in (spec.tree_nodes, 1):
            runner.verify([_chain(runner, seq_id, nodes, gen) for seq_id in seq_ids])
        for seq_id in seq_ids:
            runner.release(seq_id)
    after = _outside_allocator(device) if device.type == "cuda" else None
    growth = None if before is None or after is None else after - before
    return WarmupPass(seconds=time.perf_counter() - t0, layers=layers, outside_growth_bytes=growth)


async def run_passes(spec: WarmupSpec, passes: int, timeout_s: float = PASS_TIMEOUT_S) -> list[WarmupPass]:
    """Runs up to `passes` passes, each in a process of its own, until one is lean; logs each. Never raises: a
    failed pass is logged and ends the warm-up (the server then autotunes in its own process, as without it)."""
    done: list[WarmupPass] = []
    for i in range(passes):
        cmd = [sys.executable, "-m", "target_svc.kernel_warmup", "--json", f"--model={spec.model_dir}",
               f"--device={spec.device}", f"--dtype={spec.dtype}", f"--quantize={spec.quantize}",
               f"--batch={spec.batch}", f"--chunk={spec.chunk}", f"--tree-nodes={spec.tree_nodes}"]
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            out, err = b"", f"timed out after {timeout_s:.0f} s".encode()
        found = [line[len(RESULT_PREFIX):] for line in out.decode(errors="replace").splitlines()
                 if line.startswith(RESULT_PREFIX)]
        if found:
            result = WarmupPass(**json.loads(found[-1]))
        else:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
            result = WarmupPass(seconds=time.perf_counter() - t0, layers=0, outside_growth_bytes=None,
                                error=tail[0][:300])
        done.append(result)
        if result.error:
            log.warning("kernel warm-up pass %d failed (%s): the server autotunes its kernels itself", i + 1,
                        result.error)
            break
        growth = ("unknown" if result.outside_growth_bytes is None
                  else f"{result.outside_growth_bytes / GIB:.2f} GiB")
        log.info("kernel warm-up pass %d of at most %d: %d layers, %.1f s, device memory outside the allocator grew "
                 "%s%s", i + 1, passes, result.layers, result.seconds, growth, " (lean: kernels cached)"
                 if result.lean else "")
        if result.lean or result.outside_growth_bytes is None:
            break
    return done


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m target_svc.kernel_warmup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the target checkpoint directory")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quantize", default="none")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--tree-nodes", type=int, default=65)
    p.add_argument("--passes", type=int, default=1, help="passes in fresh processes until one is lean")
    p.add_argument("--json", action="store_true", help="run one pass here and print its report as one JSON line")
    args = p.parse_args(argv)
    spec = WarmupSpec(args.model, args.device, args.dtype, args.quantize, args.batch, args.chunk, args.tree_nodes)
    if args.json:
        print(RESULT_PREFIX + json.dumps(asdict(run_pass(spec))), flush=True)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(run_passes(spec, args.passes))


if __name__ == "__main__":
    main()
