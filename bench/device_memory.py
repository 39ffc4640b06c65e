"""Device memory outside torch's allocator during a long prefill, and where the prefill's time goes (CUDA).

`--gpu-memory-cap` bounds torch's allocator; what the CUDA context, loaded kernels, their local memory and
libraries hold beside it is not bounded, yet a real card has to hold it. The flagship fit (bench/flagship_fit.py,
H200, 2026-12-04) measured that share at 1.0-1.4 GiB after the graph warm-up and the short phases (the context
and all 160 captured graphs) and at 4.0 GiB after the phase that prefills 8 prompts of 8128 tokens: something on
the long-prefill path holds ~2.6 GiB of device memory outside the allocator.

This bench finds it. Each variant runs in a process of its own (memory outside the allocator is never given
back), loads one random-weight target and prefills a batch of long prompts chunk by chunk, as the gateway sends
them, recording after every chunk the process's device memory (nvidia-smi; the device's used memory where
nvidia-smi does not list the process) minus what torch's allocator reserved, and the chunk's time. Variants turn
one suspect off at a time:

    default         as served: int8 weights through the Triton kernels, fla's Gated DeltaNet kernels, SDPA's
                    own backend choice
    sdpa-math       attention through SDPA's math backend only
    sdpa-efficient  attention through SDPA's memory-efficient backend only
    sdpa-cudnn      attention through SDPA's cuDNN backend only
    no-fla          Gated DeltaNet chains through the PyTorch reference instead of fla's kernels
    bf16            no quantization

The default variant also profiles its last chunk's kernels (device time per kernel; that chunk's time then
includes the profiler's). Results go to
bench/results/device-memory-<shape>-<hardware>.{md,json}.

    python -m bench.device_memory --shape qwen3.6-27b --layers 8 --batch 8 --prompt-tokens 8128
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import common
from ddtree_serve.plumbing.process_memory import process_device_memory
from bench.shapes import SHAPES, build_target

VARIANTS = ("default", "sdpa-efficient", "sdpa-cudnn", "sdpa-math", "bf16", "no-fla")   # the slowest last
GIB = 1024**3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3.6-27b", choices=SHAPES)
    p.add_argument("--layers", type=int, default=8, help="cut the target to this many layers (full widths)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=8128)
    p.add_argument("--chunk", type=int, default=512, help="prompt tokens per prefill call (the gateway's chunk)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--work-dir", default=None, help="where the checkpoint is built (default: a temporary dir)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per variant")
    p.add_argument("--trace", action="store_true",
                   help="also write the profiled chunk's Chrome trace with Python stacks (device-memory-trace.json "
                        "in --out-dir, tens of MB): which lines launch the prefill's kernels")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)   # internal: run one variant, print JSON
    return p.parse_args(argv)


def device_memory_used(device: torch.device) -> tuple[int, str]:
    """This process's device memory (bytes) and where the figure came from."""
    used = process_device_memory(os.getpid())
    if used is not None:
        return used, "nvidia-smi"
    free, total = torch.cuda.mem_get_info(device)
    return total - free, "device used"


def sample(device: torch.device) -> dict:
    """Process memory, torch's reserved and allocated bytes, and the difference outside the allocator."""
    torch.cuda.synchronize(device)
    used, source = device_memory_used(device)
    reserved = torch.cuda.memory_reserved(device)
    return {"process": used, "reserved": reserved, "allocated": torch.cuda.memory_allocated(device),
            "outside": used - reserved, "source": source}


def reset_local_memory() -> str:
    """Sets the context's stack-size limit to its own value (driver API): the driver then re-sizes the local
    memory it reserves for every resident thread, which a kernel that spills registers grows and the driver may
    keep. Returns what happened, for the report."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"no libcuda: {exc}"
    stack_limit = 0   # CU_LIMIT_STACK_SIZE
    value = ctypes.c_size_t()
    rc = cuda.cuCtxGetLimit(ctypes.byref(value), stack_limit)
    if rc != 0:
        return f"cuCtxGetLimit failed ({rc})"
    rc = cuda.cuCtxSetLimit(stack_limit, ctypes.c_size_t(value.value))
    return f"stack limit {value.value} B re-set" if rc == 0 else f"cuCtxSetLimit failed ({rc})"


def sdpa_context(variant: str):
    """The attention backend restriction of a variant (none for the others)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if variant == "sdpa-math":
        return sdpa_kernel(SDPBackend.MATH)
    if variant == "sdpa-efficient":
        return sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)
    if variant == "sdpa-cudnn":
        return sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
    return contextlib.nullcontext()


@torch.inference_mode()
def run_variant(args: argparse.Namespace, target_dir: str, variant: str) -> dict:
    """Loads the target and prefills the batch chunk by chunk under `variant`; memory and time per chunk."""
    from bench.step_cost import kernel_profile
    from drafter_svc.dflash_config import build_target_layer_ids
    from target_svc.runner import PrefillItem, TargetConfig, TargetRunner

    device = torch.device("cuda")
    start = sample(device)
    runner = TargetRunner(TargetConfig(
        target_dir, device="cuda", dtype=torch.bfloat16, max_batch=args.batch,
        max_seq_len=args.prompt_tokens + 128, max_tree_nodes=65, enforce_eager=True,
        quantize="none" if variant == "bf16" else "int8"))
    runner.set_feature_layers(build_target_layer_ids(runner.num_layers, 5))   # a 5-layer DFlash drafter's
    loaded = sample(device)
    gen = torch.Generator().manual_seed(0)
    vocab = runner.target.vocab_size
    prompts = torch.randint(2, vocab, (args.batch, args.prompt_tokens), generator=gen).tolist()
    chunks = []
    profile = None
    starts = list(range(0, args.prompt_tokens, args.chunk))
    with sdpa_context(variant):
        for c0 in starts:
            c1 = min(c0 + args.chunk, args.prompt_tokens)
            items = [PrefillItem(f"s{b}", prompts[b][c0:c1], want_features=True, start=c0,
                                 more=c1 < args.prompt_tokens) for b in range(args.batch)]
            t0 = time.perf_counter()
            if variant == "default" and c0 == starts[-1] and len(starts) > 1:
                # The last chunk (the longest context) profiled: the earlier ones ran every kernel it needs.
                trace = str(Path(args.out_dir) / "device-memory-trace.json") if args.trace else None
                profile = kernel_profile(lambda: runner.prefill(items), device, warmup=False, trace_path=trace)
            else:
                runner.prefill(items)
            torch.cuda.synchronize(device)
            chunks.append({"start": c0, "tokens": c1 - c0, "seconds": time.perf_counter() - t0,
                           "profiled": profile is not None and c0 == starts[-1], **sample(device)})
    reset = reset_local_memory()
    after_reset = sample(device)
    return {"variant": variant, "layers": runner.num_layers, "start": start, "loaded": loaded, "chunks": chunks,
            "local_memory_reset": reset, "after_reset": after_reset, "profile": profile, "peak_allocated": torch.cuda.max_memory_allocated(device),
            "peak_reserved": torch.cuda.max_memory_reserved(device)}


def child_env(variant: str) -> dict:
    """The environment of a variant's process."""
    from target_svc import gdn_kernels

    env = dict(os.environ)
    if variant == "no-fla":
        env[gdn_kernels.ENV_VAR] = "off"
    return env


def markdown(data: dict) -> str:
    """The report: per variant, memory outside the allocator after load, after the first and last chunk."""
    def gib(x):
        return None if x is None else round(x / GIB, 3)

    rows = []
    for r in data["variants"]:
        if "error" in r:
            rows.append([r["variant"], "-", "-", "-", "-", "-", "-", r["error"][:120]])
            continue
        ch = r["chunks"]
        rows.append([r["variant"], gib(r["loaded"]["outside"]), gib(ch[0]["outside"]), gib(ch[-1]["outside"]),
                     gib(r["after_reset"]["outside"]), round(sum(c["seconds"] for c in ch if not c.get("profiled")), 2),
                     gib(r["peak_reserved"]), ch[-1]["source"]])
    md = [f"# Device memory outside torch's allocator during a long prefill: {data['shape']} "
          f"({data['layers']} layers), {data['hardware'].get('gpu', '?')}", "",
          f"Command: `{data['command']}`  ", f"Date: {data['date']}  ",
          f"Batch {data['batch']} x {data['prompt_tokens']} prompt tokens, prefilled {data['chunk']} tokens per call "
          "(int8 weights unless the variant says bf16; eager: no graphs). Outside = the process's device memory "
          "- torch's reserved bytes.", "",
          common.md_table(["variant", "outside after load (GiB)", "after chunk 1", "after the last chunk",
                           "after re-setting the stack limit", "prefill s (unprofiled chunks)", "peak reserved (GiB)",
                           "source"], rows),
          "", "Re-setting the stack-size limit makes the driver re-size the local memory it reserves per resident "
              "thread: a drop there means a register-spilling kernel had grown it."]
    for r in data["variants"]:
        if r.get("profile"):
            p = r["profile"]
            md += ["", f"## Kernels of one {data['chunk']}-token prefill call at batch {data['batch']} "
                       f"({r['variant']}): {p['kernel_launches']} kernels, {p['kernel_ms_total']} ms", "",
                   common.md_table(["kernel", "ms", "calls"], [[k["kernel"], k["ms"], k["calls"]] for k in p["top"]])]
    for r in data["variants"]:
        if r.get("chunks"):
            md += ["", f"## {r['variant']}: after each chunk", "",
                   common.md_table(["start", "s", "process GiB", "reserved GiB", "outside GiB"],
                                   [[c["start"], f"{c['seconds']:.3f}{' (profiled)' if c.get('profiled') else ''}",
                                     gib(c["process"]), gib(c["reserved"]), gib(c["outside"])]
                                    for c in r["chunks"]])]
    return "\n".join(md) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        variant, target_dir = args.child.split(":", 1)
        print("RESULT " + json.dumps(run_variant(args, target_dir, variant)), flush=True)
        return
    if not torch.cuda.is_available():
        sys.exit("bench.device_memory measures CUDA device memory: it needs a CUDA device")
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        sys.exit(f"variants must name some of {VARIANTS}; got {args.variants!r}")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="ddtree-device-memory-"))
    t0 = time.perf_counter()
    target_dir = str(build_target(args.shape, work / "target", args.layers, device="cuda", dtype=torch.bfloat16))
    print(f"checkpoint built in {time.perf_counter() - t0:.1f} s", flush=True)
    torch.cuda.empty_cache()
    hw = common.hardware("cuda", "bfloat16", None)
    data = {"bench": "device_memory", "command": common.command_line("bench.device_memory"), "date": common.now_utc(),
            "hardware": hw, "shape": args.shape, "layers": args.layers, "batch": args.batch,
            "prompt_tokens": args.prompt_tokens, "chunk": args.chunk, "variants": []}
    stem = f"device-memory-{args.shape}-{common.hardware_tag(hw)}"
    passthrough = [f"--shape={args.shape}", f"--batch={args.batch}", f"--prompt-tokens={args.prompt_tokens}",
                   f"--chunk={args.chunk}", f"--out-dir={args.out_dir}", *(["--trace"] if args.trace else [])]
    for variant in variants:
        cmd = [sys.executable, "-m", "bench.device_memory", *passthrough, f"--child={variant}:{target_dir}"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, env=child_env(variant))
            found = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            result = json.loads(found[-1]) if found else {"variant": variant,
                                                          "error": (proc.stderr or proc.stdout)[-2000:]}
        except subprocess.TimeoutExpired:
            result = {"variant": variant, "error": f"timed out after {args.timeout_s} s"}
        data["variants"].append(result)
        summary = result.get("error") or (f"outside after load {result['loaded']['outside'] / GIB:.2f} GiB, after "
                                          f"the prefill {result['chunks'][-1]['outside'] / GIB:.2f} GiB, "
                                          f"{sum(c['seconds'] for c in result['chunks']):.1f} s")
        print(f"{variant}: {summary}", flush=True)
        paths = common.write_outputs(args.out_dir, stem, data, markdown(data))   # after each: a run cut short keeps them
    print(markdown(data))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
