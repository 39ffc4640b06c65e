"""Which functions launch a profile's kernels: a torch profiler Chrome trace (recorded with Python stacks, e.g.
`bench.device_memory --trace`) summed per launching function.

Each CUDA kernel is tied to the runtime call that launched it (the trace's correlation ids), that call to the
Python frames open on its thread at that moment, and the kernel to the innermost frame whose file matches
`--match` (this project's packages and fla by default). A trace without kernels (a CPU profile) attributes its
top-level operators instead. Per function: kernels (or ops), their device (or CPU) time, the most frequent names.

    python -m bench.trace_lines device-memory-trace.json [--top 25] [--match target_svc/ fla/]
"""
from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MATCH = ("target_svc/", "drafter_svc/", "ddtree_serve/", "gateway/", "bench/", "fla/")


@dataclass
class Launcher:
    """What one Python function launched: a count, a time and the names."""

    count: int = 0
    us: float = 0.0
    names: Counter = field(default_factory=Counter)


def _launch_points(events: list[dict]) -> list[tuple[tuple, float, str, float]]:
    """(thread, launch time, name, duration) per kernel, via its runtime call; per top-level CPU op without kernels."""
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    if kernels:
        runtime = {e["args"]["correlation"]: e for e in events
                   if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
        out = []
        for k in kernels:
            call = runtime.get(k.get("args", {}).get("correlation"))
            if call is not None:
                out.append(((call["pid"], call["tid"]), call["ts"], k["name"], float(k.get("dur", 0.0))))
        return out
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"), key=lambda e: e["ts"])
    out, open_until = [], {}
    for e in ops:   # top level only: an op inside another op's span is part of it
        thread = (e["pid"], e["tid"])
        if e["ts"] >= open_until.get(thread, float("-inf")):
            out.append((thread, e["ts"], e["name"], float(e.get("dur", 0.0))))
            open_until[thread] = e["ts"] + e.get("dur", 0.0)
    return out


def attribute(events: list[dict], match: tuple[str, ...] = DEFAULT_MATCH) -> dict[str, Launcher]:
    """Launch points summed per innermost matching Python frame ('(no matching frame)' where none is open)."""
    frames: dict[tuple, list[tuple[float, float, str]]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "python_function" and e.get("ph") == "X":
            frames[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e.get("dur", 0.0), e["name"]))
    launches: dict[tuple, list[tuple[float, str, float]]] = defaultdict(list)
    for thread, ts, name, dur in _launch_points(events):
        launches[thread].append((ts, name, dur))
    out: dict[str, Launcher] = defaultdict(Launcher)
    for thread, points in launches.items():
        fs = sorted(frames.get(thread, []))
        i, stack = 0, []   # the frames open at the current time, outermost first (a thread's frames nest)
        for ts, name, dur in sorted(points):
            while i < len(fs) and fs[i][0] <= ts:
                while stack and stack[-1][1] < fs[i][0]:
                    stack.pop()
                stack.append(fs[i])
                i += 1
            while stack and stack[-1][1] < ts:
                stack.pop()
            frame = next((f[2] for f in reversed(stack) if any(m in f[2] for m in match)), "(no matching frame)")
            entry = out[frame]
            entry.count += 1
            entry.us += dur
            entry.names[name[:70]] += 1
    return dict(out)


def markdown(summary: dict[str, Launcher], top: int, kernels: bool) -> str:
    """The per-function table, most launches first."""
    what = "kernels" if kernels else "ops"
    rows = sorted(summary.items(), key=lambda kv: (-kv[1].count, kv[0]))[:top]
    lines = [f"| launching function | {what} | {'device' if kernels else 'CPU'} ms | most frequent |", "|---|---|---|---|"]
    for frame, e in rows:
        common = ", ".join(f"{n} x{c}" for n, c in e.names.most_common(2))
        lines.append(f"| {frame} | {e.count} | {e.us / 1e3:.3f} | {common} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.trace_lines", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="a Chrome trace from torch.profiler (with_stack=True)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--match", nargs="+", default=list(DEFAULT_MATCH), help="file path parts of the frames to keep")
    args = p.parse_args(argv)
    events = json.loads(Path(args.trace).read_text())["traceEvents"]
    kernels = any(e.get("cat") == "kernel" for e in events)
    print(markdown(attribute(events, tuple(args.match)), args.top, kernels))


if __name__ == "__main__":
    main()
