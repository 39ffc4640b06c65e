"""What the padded per-slot KV layout costs: verify time of mixed-length batches vs uniform ones.

Every sequence of a verify batch attends over max(ctx_len) + T keys (masked beyond its own), so a batch with one
long and many short contexts does the attention work of an all-long batch. This measures how much of a verify
step that is, on the given model and device, in one run:
    python -m bench.kv_layout [--model DIR] [--device cpu|cuda] [--dtype float32|bfloat16]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from ddtree_serve.decoding.config import SamplingParams
from target_svc.runner import PrefillItem, TargetConfig, TargetRunner, VerifyItem

RESULTS = Path(__file__).resolve().parent / "results"


def chain_tree(root: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain of n nodes after the root (the verify cost depends on the node count, not the shape)."""
    return torch.tensor([root] + [7] * n), torch.tensor([-1] + list(range(n)))


def time_verify(runner: TargetRunner, ctx_lens: list[int], nodes: int, repeats: int, device: str) -> float:
    """Median seconds of one verify over sequences with these context lengths (state restored between runs)."""
    times = []
    for r in range(repeats):
        ids = [f"r{r}s{i}" for i in range(len(ctx_lens))]
        outs = runner.prefill([PrefillItem(s, [11 + (j % 97) for j in range(n)], SamplingParams(), False)
                               for s, n in zip(ids, ctx_lens)])
        items = [VerifyItem(s, *chain_tree(o.next_token, nodes)) for s, o in zip(ids, outs)]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.verify(items)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        for s in ids:
            runner.release(s)
    return statistics.median(times[1:] if len(times) > 2 else times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", help="target checkpoint (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--long", type=int, default=1024)
    p.add_argument("--short", type=int, default=64)
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from ddtree_serve.default_model import ensure_default_model

        model = str(ensure_default_model())
    runner = TargetRunner(TargetConfig(model_dir=model, device=args.device, dtype=getattr(torch, args.dtype),
                                       max_batch=args.batch, max_seq_len=args.long + args.nodes + 8,
                                       max_tree_nodes=args.nodes + 1))
    b, lo, hi = args.batch, args.short, args.long
    cases = {
        f"uniform short ({b} x {lo})": [lo] * b,
        f"uniform long ({b} x {hi})": [hi] * b,
        f"mixed (1 x {hi} + {b - 1} x {lo})": [hi] + [lo] * (b - 1),
        f"long alone (1 x {hi})": [hi],
        f"shorts alone ({b - 1} x {lo})": [lo] * (b - 1),
    }
    measured = {name: time_verify(runner, lens, args.nodes, args.repeats, args.device) for name, lens in cases.items()}
    names = list(cases)
    mixed, short, long_ = measured[names[2]], measured[names[0]], measured[names[1]]
    split = measured[names[3]] + measured[names[4]]
    hardware = f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.device} {args.dtype}"
    if args.device.startswith("cuda"):
        hardware += f" ({torch.cuda.get_device_name()})"
    command = "python -m bench.kv_layout " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "model")
    lines = ["# KV layout: verify cost of padded mixed-length batches", "",
             f"- command: `{command}`", f"- date: {datetime.date.today()}", f"- hardware: {hardware}",
             f"- model: {Path(model).name}; {args.nodes} draft nodes per sequence", "",
             "| batch | median verify (ms) |", "|---|---|"]
    lines += [f"| {n} | {t * 1000:.1f} |" for n, t in measured.items()]
    lines += ["", f"- padding overhead of the mixed batch over the all-short batch: {mixed / short:.2f}x "
                  f"(all-long: {long_ / short:.2f}x)",
              f"- mixed batch vs the same work split into two verifies (long alone + shorts alone): "
              f"{mixed / split:.2f}x"]
    text = "\n".join(lines) + "\n"
    tag = "cuda" if args.device.startswith("cuda") else "cpu"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"kv_layout-{tag}.md").write_text(text)
    (RESULTS / f"kv_layout-{tag}.json").write_text(json.dumps(
        {"command": command, "date": str(datetime.date.today()), "hardware": hardware,
         "ms": {n: round(t * 1000, 3) for n, t in measured.items()},
         "mixed_over_short": mixed / short, "long_over_short": long_ / short, "mixed_over_split": mixed / split},
        indent=1))
    print(text)


if __name__ == "__main__":
    main()
