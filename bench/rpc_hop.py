"""What one gRPC hop costs between the services: round trips of the cheapest real RPCs of each service.

Starts the three services (tiny random checkpoints by default: the model's work is not what is measured) and
times, per call kind, health checks, Info, a one-node Verify, a one-row PushFeatures and a depth-1 top-1 Draft
(bench/rpc_hop_client.py), over TCP and, where the services listen on one, over their Unix sockets; the step
calls also as gRPC stream messages and as frames on the services' step sockets (--step-socket). Verify and
Draft replies carry the server's own handler time, so their hop is the round trip less it.

With --baseline NAME=DIR (another checkout of this project, e.g. `git worktree add /tmp/base main`; repeatable)
a stack runs from each DIR, timed by DIR's own client code, in alternating rounds with this tree's: ratios within
one run, so one run can attribute a series of commits (one checkout per commit) over TCP.
    python -m bench.rpc_hop [--calls 130] [--rounds 3] [--baseline main=DIR ...] [--model DIR --drafter DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench import common

CLIENT = Path(__file__).resolve().with_name("rpc_hop_client.py")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.rpc_hop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target checkpoint dir (default: a tiny random Qwen3 built in a temporary dir)")
    p.add_argument("--drafter", help="drafter dir (default: a tiny random drafter for the tiny target)")
    p.add_argument("--baseline", action="append", default=[], metavar="NAME=DIR",
                   help="another checkout of ddtree-serve, its services and client timed alongside over TCP "
                        "(repeatable; the first is the reference of the ratios)")
    p.add_argument("--event-loops", default="auto",
                   help="comma-separated event loops of this tree's stacks (auto, uvloop, asyncio), e.g. "
                        "asyncio,uvloop: one stack per loop, services and client on it, timed in alternating rounds")
    p.add_argument("--calls", type=int, default=130, help="timed calls per call kind and round")
    p.add_argument("--warmup", type=int, default=30, help="untimed calls before each kind")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each round times every variant once")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per model service")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    return p.parse_args(argv)


@dataclass
class Variant:
    """One way of reaching the services: a stack (this tree's or the baseline's) over TCP or Unix sockets."""

    label: str
    tree: Path
    stack: object
    unix: bool
    event_loop: str = ""   # this tree's stacks: the loop of its services and client ("" = an older checkout's)

    def address(self, name: str) -> str:
        return self.stack.link_address(name) if self.unix else self.stack.address(name)

    def commit(self) -> str:
        """The checkout's commit (short hash and subject), '' outside git."""
        out = subprocess.run(["git", "-C", str(self.tree), "log", "-1", "--format=%h %s"], capture_output=True,
                             text=True)
        return out.stdout.strip()[:100] if out.returncode == 0 else ""


def baselines(specs: list[str]) -> list[tuple[str, Path]]:
    """(name, checkout) of each --baseline NAME=DIR (a bare DIR is named after its folder)."""
    out = []
    for spec in specs:
        name, _, folder = spec.rpartition("=")
        path = Path(folder).resolve()
        if not (path / "ddtree_serve").is_dir():
            raise SystemExit(f"--baseline {spec}: {path} is not a checkout of ddtree-serve")
        out.append((name or path.name, path))
    return out


def tiny_checkpoints(root: Path) -> tuple[str, str]:
    """A tiny random Qwen3 target and a drafter for it, as the tests build them."""
    sys.path.insert(0, str(common.REPO))
    from tests.fixtures import make_tiny_qwen3
    from tests.fixtures.tiny_drafter import make_tiny_drafter

    target = make_tiny_qwen3(root / "target", seed=1)
    return str(target), str(make_tiny_drafter(root / "drafter", target, seed=7))


def start_stack(model: str, drafter: str, args, tree: Path | None, event_loop: str = ""):
    """The three services with metrics on (as the other benches run them); from `tree` when given, else this tree's
    on `event_loop`."""
    from launch.local_stack import LocalStack

    stack_class = LocalStack
    if tree is not None:
        stack_class = checkout_stack_class(tree)
        # Its stubs are generated on first import: once here, not by three services racing at start-up.
        subprocess.run([sys.executable, "-P", "-c", "import ddtree_serve.proto"], env=dict(os.environ,
                       PYTHONPATH=tree_pythonpath(tree)), check=True)
    model_args = ["--max-batch", "4", "--max-seq-len", "512"]
    loop = ["--event-loop", event_loop] if event_loop else []
    stack = stack_class(model=model, drafter=drafter, mode="ddtree", budget=16, device=args.device, dtype=args.dtype,
                        metrics=True, threads=args.threads, unix_sockets=tree is None, step_sockets=tree is None,
                        extra={"target": model_args + loop, "drafter": model_args + loop, "gateway": loop})
    stack.start(timeout_s=600)
    return stack


def checkout_stack_class(tree: Path):
    """A LocalStack whose services run from another checkout (`python -P`: the working directory is not on the
    path, PYTHONPATH picks the tree)."""
    from launch.local_stack import LocalStack

    class CheckoutStack(LocalStack):
        def commands(self) -> dict[str, list[str]]:
            return {name: [cmd[0], "-P", *cmd[1:]] for name, cmd in super().commands().items()}

        def env(self) -> dict[str, str]:
            return dict(super().env(), PYTHONPATH=tree_pythonpath(tree))

    return CheckoutStack


def tree_pythonpath(tree: Path) -> str:
    """PYTHONPATH that picks `tree`'s code, keeping the caller's other entries (packages installed with --target,
    as on the GPU machine) but no other checkout of this project."""
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and not (Path(p) / "ddtree_serve").is_dir()]
    return os.pathsep.join([str(tree), *kept])


def feature_dim(stack) -> int:
    """The drafter's feature width (its feature layers x the target's hidden size)."""
    import asyncio

    from ddtree_serve.proto import drafter_pb2, drafter_pb2_grpc

    async def info():
        async with stack.internal_channel("drafter") as channel:
            return await drafter_pb2_grpc.DrafterServiceStub(channel).Info(drafter_pb2.DrafterInfoRequest(),
                                                                           timeout=30)

    reply = asyncio.run(info())
    return len(reply.target_layer_ids) * reply.hidden_size


def run_client(variant: Variant, calls: int, warmup: int, dim: int) -> dict:
    """One client process from the variant's tree; returns its {call: {rtt_s, server_s}}."""
    spec = {"target": variant.address("target"), "drafter": variant.address("drafter"),
            "gateway": "" if variant.unix else variant.stack.gateway, "secret": variant.stack.secret,
            "feature_dim": dim, "calls": calls, "warmup": warmup,
            **({"event_loop": variant.event_loop} if variant.event_loop else {})}
    env = dict(os.environ, PYTHONPATH=tree_pythonpath(variant.tree))
    out = subprocess.run([sys.executable, "-P", str(CLIENT), json.dumps(spec)], env=env, capture_output=True,
                         text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"{variant.label}: client failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def summarize(samples: list[float]) -> dict:
    """Median and p90 in microseconds."""
    xs = sorted(samples)
    return {"n": len(xs), "median_us": statistics.median(xs) * 1e6, "p90_us": xs[int(0.9 * (len(xs) - 1))] * 1e6}


def main(argv=None) -> None:
    """Times every call kind on every variant; writes bench/results/rpc-hop-<hw>.{md,json}."""
    args = parse_args(argv)
    if not args.model and 3 * (args.calls + args.warmup) > 480:
        # One sequence per round takes a position per Verify, over TCP, a stream and the step socket.
        raise SystemExit("the tiny checkpoints hold 512 positions: keep 3 x (--calls + --warmup) <= 480")
    hw = common.hardware(args.device, args.dtype, args.threads)
    date = common.now_utc()
    tmp = Path(tempfile.mkdtemp(prefix="rpc-hop-"))
    if args.model:
        model, drafter = common.resolve_model(args.model), common.resolve_drafter(args.drafter)
    else:
        model, drafter = tiny_checkpoints(tmp)
    stacks, variants = [], []
    try:
        for name, base in baselines(args.baseline):
            stacks.append(start_stack(model, drafter, args, base))
            variants.append(Variant(f"{name} tcp", base, stacks[-1], unix=False))
        loops = [x.strip() for x in args.event_loops.split(",") if x.strip()]
        for loop in loops:
            stacks.append(start_stack(model, drafter, args, None, loop))
            suffix = f" {loop}" if len(loops) > 1 else ""
            variants += [Variant(f"head tcp{suffix}", common.REPO, stacks[-1], unix=False, event_loop=loop),
                         Variant(f"head unix{suffix}", common.REPO, stacks[-1], unix=True, event_loop=loop)]
        dim = feature_dim(stacks[-1])
        raw: dict[str, dict[str, dict[str, list[float]]]] = {v.label: {} for v in variants}
        for r in range(args.rounds):
            for v in variants:
                for call, t in run_client(v, args.calls, args.warmup, dim).items():
                    for key, xs in t.items():
                        raw[v.label].setdefault(call, {}).setdefault(key, []).extend(xs)
                print(f"round {r + 1}/{args.rounds} {v.label}: done", flush=True)
    finally:
        for s in stacks:
            s.stop()
    report(args, hw, date, model, drafter, variants, raw)


def report(args, hw: dict, date: str, model: str, drafter: str, variants: list[Variant], raw: dict) -> None:
    """The Markdown table (round trip and, for Verify/Draft, the hop outside the handler) and the JSON."""
    labels = [v.label for v in variants]
    ref = labels[0]
    calls = list(raw[ref])
    rows, table = [], []
    for call in calls:
        row = {"call": call}
        for label in labels:
            t = raw[label].get(call)
            if t is None:
                continue
            row[label] = summarize(t["rtt_s"])
            if t["server_s"]:
                row[label]["handler_median_us"] = statistics.median(t["server_s"]) * 1e6
                row[label]["hop_median_us"] = row[label]["median_us"] - row[label]["handler_median_us"]
        rows.append(row)
        cells = [call]
        for label in labels:
            s = row.get(label)
            cells.append(None if s is None else f"{s['median_us']:.0f} / {s['p90_us']:.0f}"
                         + (f" (hop {s['hop_median_us']:.0f})" if "hop_median_us" in s else ""))
        for label in labels[1:]:
            s = row.get(label)
            cells.append(None if s is None else round(s["median_us"] / row[ref]["median_us"], 3))
        table.append(cells)
    command = common.command_line("bench.rpc_hop")
    md = [f"# One gRPC hop between the services ({common.hardware_tag(hw)})", "",
          f"- Command: `{command}`", f"- Date: {date}",
          f"- Hardware: {hw['cpu_model']} ({hw['usable_cpus']} usable CPUs); device `{args.device}`, dtype "
          f"{args.dtype}, torch threads per service {args.threads}",
          f"- Software: torch {hw['torch']}, grpcio {hw['grpcio']}, Python {hw['python']}",
          f"- Checkpoints: `{Path(model).name}` / `{Path(drafter).name}`"
          + (" (tiny random ones: the model's work is not what is measured)" if not args.model else ""),
          f"- Work: per variant, round and call kind {args.warmup} untimed then {args.calls} timed calls from a "
          f"client process as the gateway makes them (secret, session, client metrics interceptors); "
          f"{args.rounds} rounds, variants alternating; services with metrics on",
          "- Variants: " + "; ".join(
              f"`{v.label}` = {'the checkout ' + str(v.tree) if v.tree != common.REPO else 'this tree'}"
              f" ({v.commit()}) over {'Unix sockets' if v.unix else 'TCP loopback'}"
              + (f", {v.event_loop} event loop" if v.event_loop else "") for v in variants),
          "- Cells: median / p90 round trip in µs; (hop) = median round trip less the server's median handler time "
          "(Verify, Draft report it); the gateway listens on TCP only", "",
          common.md_table(["call", *labels, *(f"{lb} / {ref}" for lb in labels[1:])], table)]
    data = {"command": command, "date": date, "hardware": hw, "model": model, "drafter": drafter,
            "calls": args.calls, "warmup": args.warmup, "rounds": args.rounds,
            "variants": [{"label": v.label, "tree": str(v.tree), "commit": v.commit(), "unix": v.unix,
                          "event_loop": v.event_loop}
                         for v in variants], "rows": rows}
    common.write_outputs(args.out_dir, f"rpc-hop-{common.hardware_tag(hw)}", data, "\n".join(md))


if __name__ == "__main__":
    main()
