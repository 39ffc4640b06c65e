"""Soak: many concurrent streams for a long time, with cancellations and drafter/target kills and restarts.

    python -m bench.soak --duration 600 --streams 64            # the issue's run (GPU host or patient CPU)
    python -m bench.soak --duration 120 --streams 16 --tiny     # what fits a 2-core CPU box

Every completed greedy response must equal the pair's autoregressive output for its prompt (computed before the
chaos starts): none may be lost (a stream that neither finishes nor errors within its deadline) or corrupted.
Requests in flight when the target is killed fail with UNAVAILABLE; that is expected and counted separately.
Memory (RSS) of the three services is sampled and must stay flat. Results go to bench/results/soak-<hw>.md.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench import common
from ddtree_serve.proto import gateway_pb2_grpc


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MiB (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return 0.0


@dataclass
class Tally:
    """What happened to the requests."""

    completed: int = 0
    corrupted: int = 0
    cancelled: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    kills: list[str] = field(default_factory=list)
    cached_tokens: int = 0   # prompt tokens the completed requests took from the prefix cache


async def _one(stub, prompt, reference, max_tokens, mode, cancel_after, tally: Tally, deadline_s: float) -> None:
    ids = []
    call = stub.GenerateStream(common.ids_request(prompt, max_tokens, mode), timeout=deadline_s)
    try:
        final = None
        async for msg in call:
            ids.extend(msg.token_ids)
            final = msg
            if cancel_after is not None and len(ids) >= cancel_after:
                call.cancel()
                tally.cancelled += 1
                return
        if final is None or not final.finished:
            tally.lost += 1
        elif ids == reference:
            tally.completed += 1
            tally.cached_tokens += final.stats.cached_prompt_tokens
        else:
            tally.corrupted += 1
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            tally.lost += 1
        elif exc.code() != grpc.StatusCode.CANCELLED:
            tally.failed[exc.code().name] = tally.failed.get(exc.code().name, 0) + 1


async def soak(stack, prompts, references, args) -> tuple[Tally, list[tuple[float, dict]]]:
    """Runs the streams and the chaos until the duration is up."""
    rng = random.Random(args.seed)
    tally = Tally()
    memory: list[tuple[float, dict]] = []
    t0 = time.perf_counter()
    stop_at = t0 + args.duration

    async def chaos():
        victims = ["drafter", "target"] if args.kill_target else ["drafter"]
        i = 0
        while time.perf_counter() + args.kill_every < stop_at:
            await asyncio.sleep(args.kill_every)
            name = victims[i % len(victims)]
            i += 1
            stack.kill(name)
            tally.kills.append(f"{time.perf_counter() - t0:.0f}s {name}")
            await asyncio.sleep(1.0)
            stack.spawn(name)

    async def sampler():
        while time.perf_counter() < stop_at:
            memory.append((time.perf_counter() - t0, {n: rss_mb(p.pid) for n, p in stack.procs.items()}))
            await asyncio.sleep(5)

    async with grpc.aio.insecure_channel(stack.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def worker():
            while time.perf_counter() < stop_at:
                k = rng.randrange(len(prompts))
                mode = rng.choice(["ddtree", "ddtree", "dflash", "ar"])
                cancel_after = rng.randint(1, 8) if rng.random() < args.cancel_rate else None
                await _one(stub, prompts[k], references[k], args.max_tokens, mode, cancel_after, tally,
                           deadline_s=args.request_deadline)

        tasks = [asyncio.create_task(chaos()), asyncio.create_task(sampler())]
        await asyncio.gather(*(worker() for _ in range(args.streams)))
        for t in tasks:
            t.cancel()
    return tally, memory


async def references_of(stack, prompts, max_tokens) -> list[list[int]]:
    """Greedy autoregressive outputs, before any chaos: the oracle of every later response."""
    async with grpc.aio.insecure_channel(stack.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        out = []
        for p in prompts:
            reply = await stub.Generate(common.ids_request(p, max_tokens, "ar"), timeout=300)
            out.append(list(reply.token_ids))
        return out


def main(argv=None) -> Tally:
    """CLI entry; returns the tally (exits 1 on a lost or corrupted response)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--drafter")
    ap.add_argument("--tiny", action="store_true", help="the test suite's tiny Qwen3 pair (CPU-friendly)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--duration", type=float, default=600)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--cancel-rate", type=float, default=0.1)
    ap.add_argument("--kill-every", type=float, default=30)
    ap.add_argument("--no-kill-target", dest="kill_target", action="store_false")
    ap.add_argument("--request-deadline", type=float, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(common.RESULTS_DIR))
    args = ap.parse_args(argv)

    from launch.local_stack import LocalStack

    if args.tiny:
        import tempfile

        from tests.fixtures import make_tiny_qwen3
        from tests.fixtures.tiny_drafter import make_tiny_drafter

        root = Path(tempfile.mkdtemp(prefix="ddtree-soak-"))
        model = str(make_tiny_qwen3(root / "qwen3", seed=1))
        drafter = str(make_tiny_drafter(root / "drafter", Path(model), seed=7))
    else:
        model, drafter = common.resolve_model(args.model), common.resolve_drafter(args.drafter)
    rng = random.Random(args.seed)
    # Every other prompt starts with one shared 24-token "system prompt": prefix caching's copies from running
    # sequences and adoptions of parked ones run under the cancellations and kills too.
    system = [rng.randrange(5, 300) for _ in range(24)]
    prompts = [(system if i % 2 else []) + [rng.randrange(5, 300) for _ in range(rng.randint(4, 40))]
               for i in range(args.prompts)]
    stack = LocalStack(model=model, drafter=drafter, device=args.device, dtype=args.dtype, threads=args.threads,
                       extra={"gateway": ["--draft-timeout-s", "5"]}).start(timeout_s=600)
    try:
        references = asyncio.run(references_of(stack, prompts, args.max_tokens))
        t0 = time.perf_counter()
        tally, memory = asyncio.run(soak(stack, prompts, references, args))
        wall = time.perf_counter() - t0
    finally:
        stack.stop()
    hw = common.hardware(args.device, args.dtype, args.threads)
    first = next((m for _, m in memory if all(m.values())), memory[0][1] if memory else {})
    last = memory[-1][1] if memory else {}
    rows = [[n, f"{first.get(n, 0):.0f}", f"{last.get(n, 0):.0f}"] for n in ("gateway", "target", "drafter")]
    md = "\n".join([
        f"# Soak ({'tiny Qwen3 pair' if args.tiny else Path(model).name}), {common.now_utc()}", "",
        f"`{common.command_line('bench.soak')}`", "",
        f"{args.streams} concurrent streams for {wall:.0f} s, cancel rate {args.cancel_rate}, kills: "
        f"{', '.join(tally.kills) or 'none'}", "",
        common.md_table(["outcome", "requests"], [
            ["completed, output checked equal to the greedy reference", tally.completed],
            ["corrupted (completed but differs)", tally.corrupted],
            ["lost (no final message within the deadline)", tally.lost],
            ["cancelled by the client", tally.cancelled],
            ["(prompt tokens the completed ones took from the prefix cache)", tally.cached_tokens],
            *[[f"failed {code}", n] for code, n in sorted(tally.failed.items())]]), "",
        "RSS in MiB (first sample after start / last sample; a killed service restarts fresh):", "",
        common.md_table(["service", "first", "last"], rows), "",
        f"Hardware: {hw}", ""])
    out = Path(args.out) / f"soak-{common.hardware_tag(hw)}.md"
    out.write_text(md)
    print(md)
    if tally.corrupted or tally.lost:
        raise SystemExit(1)
    return tally


if __name__ == "__main__":
    main()
