"""Does the Qwen3.6-27B target serve within one 48 GB card? The flagship fit check, through the three services.

On one large GPU (the H200), the target process caps its allocator with --gpu-memory-cap at what a "48 GB" card
offers (46068 MiB, as nvidia-smi reports an L40S: 44.99 GiB, 48.3e9 bytes) and its memory plan takes the cap as
the card. The target is the Qwen3.6-27B text layout with all 64 layers (random bf16 weights at the real shapes,
bench/shapes.py, written shard by shard: ~54 GB on disk), quantized at load (--quantize int8), asked for 8
sequences of 8192 tokens with DDTree trees of 65 nodes. The drafter (a random DFlash drafter) shares the GPU
outside the cap. Then, through the gateway, greedy requests:

  short  --num-prompts prompts of --prompt-tokens random token ids, --max-tokens new tokens each, at batch 1 (one
         at a time) and at batch --max-batch (all in flight), in `ar` and `ddtree` (budget --budget);
  long   one prompt per cache slot the plan holds, each --max-seq-len - --max-tokens tokens long, all in flight:
         every slot filled to the context limit, in `ar` and `ddtree`.

ddtree's outputs must equal ar's (lossless; the LM head follows a fixed successor map, so bf16 rounding does not
flip greedy choices). The random drafter is almost never accepted, so ddtree's tok/s here is no speed figure.
After each phase the target's Prometheus gauges are scraped (torch's reserved / allocated bytes and their peaks)
and, where nvidia-smi lists processes, the target process's device memory (CUDA context included, which the cap
does not cover); a thread also samples both every --sample-s seconds, so that what happens inside a phase (the
long prefill's growth outside the allocator) is seen when it happens. The served memory plan is read from the
target's Info.

    python -m bench.flagship_fit --work-dir /tmp/wfit --build-only        # the checkpoint only (~54 GB of disk)
    python -m bench.flagship_fit --work-dir /tmp/wfit --out-dir OUT       # the H200 run (builds if needed)
    python -m bench.flagship_fit --shape tiny-hybrid --device cpu --dtype float32 --max-seq-len 256 \\
        --num-prompts 2 --prompt-tokens 16 --max-tokens 8 --max-batch 2 --threads 1 --out-dir /tmp/fit-smoke

Writes <out-dir>/flagship-fit-<shape>-<hardware>.{md,json}, rewritten after every phase (a run cut short keeps
what it measured).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import common
from bench.shapes import SHAPES
from ddtree_serve.plumbing.process_memory import process_device_memory

# A "48 GB" card as nvidia-smi reports it (target_svc/memory_plan.py CARD_48GB_BYTES), in GiB: the flag's unit.
CARD_48GB_GIB = 46068 / 1024
GAUGES = {"reserved": "ddtree_gpu_memory_reserved_bytes", "allocated": "ddtree_gpu_memory_allocated_bytes",
          "peak_reserved": "ddtree_gpu_memory_peak_reserved_bytes",
          "peak_allocated": "ddtree_gpu_memory_peak_allocated_bytes"}
GIB = 1024**3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.flagship_fit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3.6-27b", choices=SHAPES)
    p.add_argument("--layers", type=int, default=None, help="cut the target to this many layers (smoke runs)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--quantize", default="int8", choices=["none", "int8", "int4", "int8-head"])
    p.add_argument("--gpu-memory-cap", type=float, default=None, metavar="GB",
                   help=f"the target's --gpu-memory-cap in GiB (default on CUDA: {CARD_48GB_GIB}, a 48 GB card; "
                        "none on CPU)")
    p.add_argument("--no-cap", action="store_true", help="run the target without --gpu-memory-cap")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="the target's (default: its own, 0.9)")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=8192)
    p.add_argument("--max-tree-nodes", type=int, default=65, help="the target's largest verify block (budget + 1)")
    p.add_argument("--budget", type=int, default=64, help="DDTree node budget of the ddtree requests")
    p.add_argument("--num-prompts", type=int, default=8, help="short prompts (batch 1: one at a time)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="length of the short prompts")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--long-prompt-tokens", type=int, default=None,
                   help="length of the long prompts (default: --max-seq-len - --max-tokens; 0: no long phase)")
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads per model service")
    p.add_argument("--lazy-graphs", action="store_true",
                   help="the target captures CUDA graphs on first use (faster start; the peak then covers only the "
                        "buckets the requests used)")
    p.add_argument("--work-dir", default=None,
                   help="checkpoints (target/, drafter/), reused when complete (default: a temporary dir, removed)")
    p.add_argument("--build-only", action="store_true", help="build the checkpoints in --work-dir and stop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout-s", type=float, default=900.0)
    p.add_argument("--log-dir", default="", help="service logs (default: a temporary dir, kept on failure)")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    p.add_argument("--sample-s", type=float, default=2.0,
                   help="seconds between the memory sampler's readings (0: phase ends only)")
    args = p.parse_args(argv)
    if args.no_cap or not args.device.startswith("cuda"):
        if args.gpu_memory_cap is not None and not args.no_cap:
            p.error("--gpu-memory-cap needs --device cuda (the target refuses it elsewhere)")
        args.gpu_memory_cap = None
    elif args.gpu_memory_cap is None:
        args.gpu_memory_cap = CARD_48GB_GIB
    if args.build_only and not args.work_dir:
        p.error("--build-only needs --work-dir (a temporary one is removed at the end)")
    if args.long_prompt_tokens is None:
        args.long_prompt_tokens = args.max_seq_len - args.max_tokens
    if args.prompt_tokens + args.max_tokens > args.max_seq_len or args.long_prompt_tokens + args.max_tokens > \
            args.max_seq_len:
        p.error("prompts + --max-tokens must fit --max-seq-len")
    return args


# ---- the checkpoints --------------------------------------------------------------------------------------------
def ensure_checkpoints(args, work: Path) -> dict:
    """target/ and drafter/ in work, built unless a finished build of this shape is there; returns build facts."""
    import torch

    from bench.shapes import (
        build_drafter,
        build_target_streaming,
        checkpoint_bytes,
        drafter_bytes,
        is_streamed_checkpoint,
        target_config,
    )

    dtype = getattr(torch, args.dtype)
    target, drafter = work / "target", work / "drafter"
    facts: dict = {"target_bytes": checkpoint_bytes(args.shape, args.layers, dtype),
                   "drafter_bytes": drafter_bytes(target_config(args.shape, args.layers).to_dict(),
                                                  args.drafter_layers, dtype)}
    if is_streamed_checkpoint(target, args.shape, args.layers, dtype) and (drafter / "config.json").is_file():
        print(f"reusing the checkpoints in {work}", flush=True)
        facts["built_s"] = None
        return facts
    partial = work / "drafter.partial"   # renamed when complete: a drafter/ directory is always a whole one
    for old in (target, drafter, partial):   # an interrupted build, or another shape: its disk is needed
        shutil.rmtree(old, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    need = facts["target_bytes"] + facts["drafter_bytes"] + GIB   # + 1 GiB: tokenizer, headers, what else grows
    free = shutil.disk_usage(work).free
    if free < need:
        raise SystemExit(f"{work}: {free / GIB:.1f} GiB free, the checkpoints need ~{need / GIB:.1f} GiB; remove "
                         "other checkpoints (e.g. /tmp/w8, /tmp/w27) first")
    t0 = time.perf_counter()
    print(f"building {args.shape} ({facts['target_bytes'] / GIB:.1f} GiB of {args.dtype} weights) in {target} on "
          f"{args.device}, shard by shard", flush=True)
    build_target_streaming(args.shape, target, args.layers, device=args.device, dtype=dtype, seed=args.seed)
    build_drafter(target, partial, num_layers=args.drafter_layers, device=args.device, dtype=dtype)
    partial.rename(drafter)
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()   # this process stays alive beside the services: it keeps nothing cached
    facts["built_s"] = round(time.perf_counter() - t0, 1)
    print(f"checkpoints built in {facts['built_s']} s", flush=True)
    return facts


# ---- what the target reports ------------------------------------------------------------------------------------
def target_info(stack) -> dict:
    """The target's Info: the served memory plan and what it holds."""
    from ddtree_serve.proto import target_pb2, target_pb2_grpc

    async def go():
        async with stack.internal_channel("target") as channel:
            return await target_pb2_grpc.TargetServiceStub(channel).Info(target_pb2.InfoRequest(), timeout=30)

    info = asyncio.run(go())
    plan = {f.name: getattr(info.memory, f.name) for f in info.memory.DESCRIPTOR.fields}
    return {"quantize": info.quantize, "max_batch": info.max_batch, "max_seq_len": info.max_seq_len,
            "num_layers": info.num_layers, "memory_plan": plan}


def gpu_memory(stack) -> dict:
    """The target's torch allocator gauges (bytes; None where not exported, e.g. on CPU)."""
    samples = common.scrape(stack.metrics_ports["target"])
    out = {}
    for key, name in GAUGES.items():
        values = [v for (n, _), v in samples.items() if n == name]
        out[key] = int(sum(values)) if values else None
    return out


class MemorySampler:
    """Reads the target's device memory (nvidia-smi) and torch's reserved bytes every period_s, in a thread, until
    stopped; samples are (seconds since start, process bytes, reserved bytes), where nvidia-smi lists the process."""

    def __init__(self, stack, pid: int, period_s: float) -> None:
        self.stack, self.pid, self.period_s = stack, pid, period_s
        self.samples: list[tuple[float, int, int]] = []
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fit-memory-sampler", daemon=True)

    def start(self) -> "MemorySampler":
        """Starts sampling (a no-op sampler when period_s <= 0)."""
        if self.period_s > 0:
            self._thread.start()
        return self

    def now(self) -> float:
        """Seconds since the sampler was made (the samples' clock)."""
        return round(time.perf_counter() - self.t0, 1)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                reserved = gpu_memory(self.stack)["reserved"]
            except Exception:  # noqa: BLE001 - a scrape racing the shutdown; the next reading decides
                continue
            process = process_device_memory(self.pid)
            if process is not None and reserved is not None:
                self.samples.append((self.now(), process, reserved))

    def stop(self) -> None:
        """Stops the thread (waits for its last reading)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    def summary(self, max_points: int = 400) -> dict:
        """Largest process figure and largest outside-the-allocator share, with when, and the samples thinned to
        at most max_points."""
        s = list(self.samples)
        if not s:
            return {"samples": 0}
        top = max(s, key=lambda x: x[1])
        out = max(s, key=lambda x: x[1] - x[2])
        step = max(1, -(-len(s) // max_points))
        return {"samples": len(s), "period_s": self.period_s, "process_max": top[1], "process_max_at_s": top[0],
                "outside_allocator_max": out[1] - out[2], "outside_allocator_max_at_s": out[0],
                "timeline": [list(x) for x in s[::step]]}


LOG_PROBLEMS = ("out of memory", "OutOfMemoryError", "Traceback", '"level": "ERROR"', " ERROR ")


def log_problems(log_dir: str, service: str = "target", limit: int = 10) -> list[str]:
    """Lines of a service's log that report an error or running out of memory (the first `limit`)."""
    path = Path(log_dir) / f"{service}.log"
    if not path.is_file():
        return []
    found = [line.strip()[:400] for line in path.read_text(errors="replace").splitlines()
             if any(word in line for word in LOG_PROBLEMS)]
    return found[:limit]


# ---- requests ---------------------------------------------------------------------------------------------------
def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """n prompts of random token ids, never the EOS / pad id 1 nor 0 (reproducible)."""
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab_size) for _ in range(length)] for _ in range(n)]


def request(ids: list[int], max_tokens: int, mode: str, budget: int):
    """A greedy GenerateRequest over token ids that runs to max_tokens (EOS ignored: equal lengths to compare)."""
    from ddtree_serve.client import build_request

    return build_request(None, prompt_ids=ids, chat=False, max_tokens=max_tokens, temperature=0.0, mode=mode,
                         budget=budget if mode == "ddtree" else 0, ignore_eos=True)


@dataclass
class Run:
    """One request set in one mode, as the client saw it."""

    phase: str
    mode: str
    batch: int
    prompts: int
    prompt_tokens: int
    generated_tokens: int
    steps: int            # target verify steps (tokens per step: 1 for ar, 1 + accepted for ddtree)
    wall_s: float
    outputs: list[list[int]] = field(repr=False)

    @property
    def tok_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {"phase": self.phase, "mode": self.mode, "batch": self.batch, "prompts": self.prompts,
                "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens, "steps": self.steps,
                "tokens_per_step": round(self.generated_tokens / self.steps, 3) if self.steps else None,
                "wall_s": round(self.wall_s, 3), "tok_s": round(self.tok_s, 2)}


def run_set(stack, phase: str, prompts: list[list[int]], batch: int, mode: str, max_tokens: int, budget: int,
            timeout_s: float) -> Run:
    """The prompts through the gateway, `batch` in flight at a time."""
    reqs = [request(ids, max_tokens, mode, budget) for ids in prompts]
    results, wall = common.run_requests(stack.gateway, reqs, concurrency=batch, timeout_s=timeout_s)
    run = Run(phase, mode, batch, len(prompts), len(prompts[0]), sum(len(r.token_ids) for r in results),
              sum(r.stats["steps"] for r in results), wall, [r.token_ids for r in results])
    print(f"{phase} {mode} batch {batch}: {run.generated_tokens} tokens in {wall:.2f} s ({run.tok_s:.1f} tok/s)",
          flush=True)
    return run


# ---- the report -------------------------------------------------------------------------------------------------
def verdict(data: dict) -> str:
    """FITS / DOES NOT FIT / INCOMPLETE, and why, from the collected data."""
    if data.get("error"):
        return f"INCOMPLETE: {data['error']}"
    problems = data.get("target_log_problems") or []
    if any("out of memory" in line.lower() or "OutOfMemoryError" in line for line in problems):
        return "DOES NOT FIT: the target ran out of memory (target_log_problems)"
    if problems:
        return "INCOMPLETE: errors in the target's log (target_log_problems)"
    equal = [p["outputs_equal"] for p in data["phases"] if p.get("outputs_equal") is not None]
    if not equal or not all(equal):
        return "DOES NOT FIT: ddtree's outputs differ from ar's" if equal else "INCOMPLETE: no phase compared outputs"
    cap = data["target"]["gpu_memory_cap_bytes"]
    peak = data["memory"].get("peak_reserved")
    if cap is None or peak is None:
        return "SERVED (no cap: plumbing check only, nothing measured against a card)"
    total = card_peak(data["memory"])
    if peak > cap or (total is not None and total > cap):
        return "DOES NOT FIT: the memory used exceeds the cap"
    held = data["info"]["max_batch"] if data.get("info") else None
    with_context = "" if total is None else f", {total / GIB:.2f} GiB with the CUDA context"
    return (f"FITS: {held} sequences of {data['target']['max_seq_len']} tokens served within the "
            f"{cap / GIB:.2f} GiB cap (peak reserved {peak / GIB:.2f} GiB{with_context})")


def card_peak(memory: dict) -> int | None:
    """What a real card of the cap's size would have had to hold at the peak: torch's peak reserved plus what
    the process holds outside the allocator (the CUDA context), or nvidia-smi's largest sample if larger; None
    without nvidia-smi's figures."""
    peak, outside, proc = memory.get("peak_reserved"), memory.get("outside_allocator_max"), memory.get("process_max")
    if peak is None or outside is None:
        return proc
    return max(peak + outside, proc or 0)


def phase_at(data: dict, t: float) -> str:
    """The phase running at t seconds on the sampler's clock, or where t falls outside every phase."""
    for p in data["phases"]:
        if p.get("start_s") is not None and p["start_s"] <= t <= p.get("end_s", float("inf")):
            return p["name"]
    phases = data["phases"]
    if not phases or t < phases[0].get("start_s", 0):
        return "before the first phase"
    return "after the last phase" if t > phases[-1].get("end_s", float("inf")) else "between phases"


def sampled_line(data: dict) -> str:
    """The memory sampler's finding in one sentence."""
    s = data.get("memory_sampled") or {}
    if not s.get("samples"):
        return "Sampled during the phases: no readings (nvidia-smi does not list the process, or --sample-s 0)."
    return (f"Sampled every {s['period_s']} s ({s['samples']} readings): the process's largest figure "
            f"{s['process_max'] / GIB:.2f} GiB at {s['process_max_at_s']} s ({phase_at(data, s['process_max_at_s'])}), "
            f"the most outside the allocator {s['outside_allocator_max'] / GIB:.2f} GiB at "
            f"{s['outside_allocator_max_at_s']} s ({phase_at(data, s['outside_allocator_max_at_s'])}).")


def activation_peak(data: dict) -> int | None:
    """Peak allocated bytes beyond the weights and the cache (to set against the plan's workspace estimate)."""
    plan = (data.get("info") or {}).get("memory_plan") or {}
    peak = (data.get("memory") or {}).get("peak_allocated")
    if peak is None or "weight_bytes" not in plan:
        return None
    return peak - plan["weight_bytes"] - plan["cache_bytes"]


def headline(data: dict) -> dict:
    """The figures bench/results/h200.md carries (fit_*; GiB rounded to 2 places, None where not measured)."""
    gib = lambda b: None if b is None else round(b / GIB, 2)  # noqa: E731
    plan = (data.get("info") or {}).get("memory_plan") or {}
    m = data.get("memory") or {}
    equal = [p.get("outputs_equal") for p in data.get("phases", [])]
    verdict = " ".join((data.get("verdict") or "").split()) or None   # one line: it goes into a table cell
    return {"fit_verdict": verdict, "fit_layers": data["target"]["num_layers"],
            "fit_quantize": data["target"]["quantize"], "fit_cap_gib": gib(data["target"]["gpu_memory_cap_bytes"]),
            "fit_plan_source": plan.get("source"), "fit_weights_gib": gib(plan.get("weight_bytes")),
            "fit_cache_gib": gib(plan.get("cache_bytes")), "fit_sequences_held": plan.get("max_batch"),
            "fit_max_seq_len": plan.get("max_seq_len"), "fit_peak_reserved_gib": gib(m.get("peak_reserved")),
            "fit_peak_allocated_gib": gib(m.get("peak_allocated")), "fit_process_gib": gib(m.get("process_max")),
            "fit_outside_allocator_gib": gib(m.get("outside_allocator_max")),
            "fit_card_peak_gib": gib(card_peak(m)), "fit_activation_peak_gib": gib(activation_peak(data)),
            "fit_workspace_estimate_gib": gib(plan.get("workspace_bytes")),
            "fit_outputs_equal": bool(equal) and all(e is True for e in equal)}


def markdown(data: dict) -> str:
    """The Markdown report of the collected data."""
    t, hw = data["target"], data["hardware"]
    gib = lambda b: None if b is None else round(b / GIB, 2)  # noqa: E731
    cap = f"a {gib(t['gpu_memory_cap_bytes'])} GiB cap" if t["gpu_memory_cap_bytes"] else "no cap"
    lines = [f"# Flagship fit: {data['shape']} ({t['num_layers']} layers), {t['quantize']} target within {cap}",
             "", f"**{data['verdict']}**", "",
             f"- Date: {data['date']}", f"- Command: `{data['command']}`",
             f"- Hardware: {hw.get('gpu') or hw['cpu_model']} ({hw['device']}, {hw['dtype']}); torch {hw['torch']}",
             f"- Checkpoint: random weights at the shape, {gib(data['checkpoint']['target_bytes'])} GiB of "
             f"{hw['dtype']} on disk (built in {data['checkpoint']['built_s']} s; None: reused)",
             f"- Target flags: `{' '.join(t['args'])}`", ""]
    if data.get("info"):
        plan = data["info"]["memory_plan"]
        lines += ["## Served memory plan (target Info)", "", common.md_table(["field", "value"], [
            ["source", plan["source"]], ["weights (GiB)", gib(plan["weight_bytes"])],
            ["KV per token (KiB)", plan["kv_bytes_per_token"] / 1024],
            ["GDN states per sequence (MiB)", plan["state_bytes_per_sequence"] / 2**20],
            ["slot (MiB)", plan["slot_bytes"] / 2**20], ["cache incl. scratch slot (GiB)", gib(plan["cache_bytes"])],
            ["cache budget (GiB)", gib(plan["budget_bytes"]) if plan["enforced"] else "not enforced"],
            ["workspace estimate (GiB)", gib(plan["workspace_bytes"])],
            ["sequences held / budget fits / requested",
             f"{plan['max_batch']} / {plan['fit_batch']} / {plan['requested_batch']}"],
            ["max_seq_len", plan["max_seq_len"]]]), ""]
    m = data["memory"]
    lines += ["## Target GPU memory", "", common.md_table(["figure", "GiB"], [
        ["cap (--gpu-memory-cap)", gib(t["gpu_memory_cap_bytes"])],
        ["peak reserved by torch (max_memory_reserved)", gib(m.get("peak_reserved"))],
        ["peak allocated by tensors (max_memory_allocated)", gib(m.get("peak_allocated"))],
        ["reserved at the end", gib(m.get("reserved"))],
        ["process device memory, largest sample (nvidia-smi, CUDA context included)", gib(m.get("process_max"))],
        ["outside the allocator (nvidia-smi - reserved: CUDA context, kernels)", gib(m.get("outside_allocator_max"))],
        ["peak a real card would hold (peak reserved + outside the allocator)", gib(card_peak(m))],
        ["peak allocated beyond weights and cache (activations, graph pool)", gib(activation_peak(data))],
        ["the plan's workspace estimate", gib(((data.get("info") or {}).get("memory_plan") or {})
                                               .get("workspace_bytes"))]]),
        "", "After each phase (GiB): " + "; ".join(
            f"{p['name']}: peak reserved {gib(p['memory'].get('peak_reserved'))}, nvidia-smi "
            f"{gib(p['memory'].get('process'))}, outside the allocator {gib(p['memory'].get('outside_allocator'))}"
            for p in data["phases"] if p.get("memory")), "", sampled_line(data), ""]
    rows = [[r["phase"], r["mode"], r["batch"], r["prompts"], r["prompt_tokens"], r["generated_tokens"],
             r["tokens_per_step"], r["wall_s"], r["tok_s"], p.get("outputs_equal")]
            for p in data["phases"] for r in p.get("runs", [])]
    lines += ["## Requests through the gateway (greedy)", "", common.md_table(
        ["phase", "mode", "batch", "prompts", "prompt tokens", "generated", "tokens/step", "wall s", "tok/s",
         "ddtree == ar"], rows),
        "", "## Notes", "",
        "- The drafter has random weights: its drafts are almost never accepted, so ddtree tok/s is not a speed "
        "figure; the phases check that the target serves (and stays lossless) at this size.",
        "- The cap bounds torch's allocator (tensors, cache, CUDA-graph pools), not the CUDA context and kernel "
        "images; nvidia-smi's figure for the process includes them where the container lets it list processes.",
        "- The drafter runs on the same GPU outside the cap (on a real 48 GB card it goes on a second card)."]
    if data.get("target_log_problems"):
        lines += ["", "## Errors in the target's log", "", "```", *data["target_log_problems"], "```"]
    if data.get("error"):
        lines += ["", "## Error", "", "```", data["error"], data.get("log_tail", ""), "```"]
    return "\n".join(lines)


# ---- main -------------------------------------------------------------------------------------------------------
def _stop_on_sigterm() -> None:
    # `timeout` sends SIGTERM: turned into SystemExit so that the services (own sessions) are stopped and the
    # partial results written, not left holding the GPU.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def main(argv=None) -> None:
    """Builds (or reuses) the checkpoints, serves them, runs the phases, writes the report."""
    args = parse_args(argv)
    _stop_on_sigterm()
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="ddtree-fit-"))
    checkpoint = ensure_checkpoints(args, work)
    if args.build_only:
        print(f"checkpoints in {work}", flush=True)
        return
    target_args = ["--quantize", args.quantize, "--max-tree-nodes", str(args.max_tree_nodes)]
    if args.gpu_memory_cap is not None:
        target_args += ["--gpu-memory-cap", repr(args.gpu_memory_cap)]
    if args.gpu_memory_utilization is not None:
        target_args += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.lazy_graphs:
        target_args.append("--lazy-graphs")
    from bench.shapes import target_config

    vocab = target_config(args.shape, args.layers).vocab_size
    data: dict = {
        "bench": "flagship_fit", "shape": args.shape, "command": common.command_line("bench.flagship_fit"),
        "date": common.now_utc(), "hardware": common.hardware(args.device, args.dtype, args.threads),
        "checkpoint": {**checkpoint, "dir": str(work)},
        "target": {"num_layers": target_config(args.shape, args.layers).num_hidden_layers, "quantize": args.quantize,
                   "gpu_memory_cap_bytes": None if args.gpu_memory_cap is None else int(args.gpu_memory_cap * GIB),
                   "max_batch": args.max_batch, "max_seq_len": args.max_seq_len,
                   "max_tree_nodes": args.max_tree_nodes, "args": target_args},
        "phases": [], "memory": {}, "info": None, "error": None}
    stem = f"flagship-fit-{args.shape}-{common.hardware_tag(data['hardware'])}"

    def save() -> None:
        data["verdict"] = verdict(data)
        common.write_outputs(args.out_dir, stem, data, markdown(data))

    stack = sampler = None
    try:
        stack = common.start_stack(str(work / "target"), str(work / "drafter"), args.device, args.dtype,
                                   args.threads, budget=args.budget, max_batch=args.max_batch,
                                   max_seq_len=args.max_seq_len, log_dir=args.log_dir, target_args=target_args)
        target_pid = stack.procs["target"].pid
        sampler = MemorySampler(stack, target_pid, args.sample_s).start()
        data["info"] = target_info(stack)
        print(f"memory plan: {data['info']['memory_plan']}", flush=True)

        def measure(phase: dict) -> None:
            mem = gpu_memory(stack)
            mem["process"] = process_device_memory(target_pid)
            # What the allocator does not hold: the CUDA context and kernel images, outside the cap.
            mem["outside_allocator"] = (None if mem["process"] is None or mem["reserved"] is None
                                        else mem["process"] - mem["reserved"])
            phase["memory"] = mem
            samples = [p["memory"] for p in data["phases"] if p.get("memory")]
            sampled = sampler.summary()
            data["memory_sampled"] = sampled
            process = [m["process"] for m in samples if m["process"]] + [sampled.get("process_max") or 0]
            outside = [m["outside_allocator"] for m in samples if m["outside_allocator"] is not None]
            if sampled.get("outside_allocator_max") is not None:
                outside.append(sampled["outside_allocator_max"])
            data["memory"] = {**mem, "process_max": max(process) or None,
                              "outside_allocator_max": max(outside, default=None)}
            dead = [n for n, alive in stack.alive().items() if not alive]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited")

        held = data["info"]["max_batch"]   # what the plan holds (at most --max-batch)
        short = random_prompts(args.num_prompts, args.prompt_tokens, vocab, args.seed)
        # (name, prompts, requests in flight, new tokens); the warm-up's first request waits for the target's
        # graph capture (queued when the gateway attached the drafter).
        phases = [("warm-up", short[:1], 1, 8), ("short", short, 1, args.max_tokens),
                  ("short", short, held, args.max_tokens)]
        if args.long_prompt_tokens > 0:   # every slot the plan holds, filled to the context limit
            phases.append(("long", random_prompts(held, args.long_prompt_tokens, vocab, args.seed + 1), held,
                           args.max_tokens))
        for name, prompts, batch, max_tokens in phases:
            phase: dict = {"name": f"{name} b{batch}", "runs": [], "start_s": sampler.now()}
            data["phases"].append(phase)
            t0 = time.perf_counter()
            runs = {}
            for mode in ("ar", "ddtree"):
                runs[mode] = run_set(stack, name, prompts, batch, mode, max_tokens, args.budget,
                                     args.request_timeout_s)
                phase["runs"].append(runs[mode].as_dict())
            mismatched = [i for i, (a, b) in enumerate(zip(runs["ar"].outputs, runs["ddtree"].outputs)) if a != b]
            phase["outputs_equal"] = not mismatched
            phase["mismatched_prompts"] = mismatched
            phase["seconds"] = round(time.perf_counter() - t0, 1)
            phase["end_s"] = sampler.now()
            measure(phase)
            data["target_log_problems"] = log_problems(stack.log_dir)
            save()
    except BaseException as exc:   # noqa: BLE001 - SIGTERM (timeout) and failures alike: record, then re-raise
        data["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        if stack is not None:
            data["log_tail"] = stack.tail_logs(40)
            data["target_log_problems"] = log_problems(stack.log_dir)
        save()
        raise
    finally:
        if sampler is not None:
            sampler.stop()
        if stack is not None:
            stack.stop()
            if data["error"] is None and not args.log_dir:
                stack.cleanup()   # its own temporary log folder; kept (and named) after a failure
            else:
                print(f"service logs in {stack.log_dir}", flush=True)
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    print(data["verdict"], flush=True)


if __name__ == "__main__":
    main()
