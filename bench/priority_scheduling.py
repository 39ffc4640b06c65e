"""What priority scheduling gives urgent requests in a queue: one stack with --scheduling-policy priority and few
slots, the same burst of chat requests sent twice (the urgent ones, every --urgent-every'th, --urgent-delay-ms
after the others: they arrive at a busy server), first with every priority 0 (arrival order, as fcfs) and then
with the urgent ones at priority -1; with --preemption, a third pass of the marked burst
on a stack that also has --priority-scheduling-preemption-threshold 0, where an urgent request takes a running
one's slot at once (the preempted one resumes later from its prompt and outputs). Greedy, so every pass must give
the same text (checked); what changes is each class's time to first token.

    python -m bench.priority_scheduling [--requests 12] [--urgent-every 4] [--urgent-delay-ms 500] [--slots 2]
                                        [--max-tokens 32] [--preemption]

The default pair is the bundled SmolLM2 target and its trained DFlash drafter. Writes
<out-dir>/priority-scheduling-<hardware>.{md,json}.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics

from bench import common


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_pair_args(p)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--urgent-every", type=int, default=4, help="every N'th request of the burst is urgent")
    p.add_argument("--urgent-delay-ms", type=float, default=500.0,
                   help="the urgent requests are sent this long after the others (0: all at once)")
    p.add_argument("--slots", type=int, default=2, help="the services' --max-batch: the rest of the burst waits")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--preemption", action="store_true",
                   help="a third pass: the marked burst on a stack that preempts for urgent requests")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    return p.parse_args(argv)


def request(text: str, max_tokens: int, budget: int, priority: int):
    """A greedy DDTree chat request of one user message at `priority`."""
    from ddtree_serve.proto import gateway_pb2

    return gateway_pb2.GenerateRequest(
        chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content=text)]),
        max_tokens=max_tokens, ignore_eos=True, mode=gateway_pb2.DECODE_MODE_DDTREE, budget=budget,
        priority=priority)


def summary(results: list, urgent: list[bool]) -> dict:
    """Mean and worst TTFT (ms, the gateway's: arrival to first token) of the urgent and the other requests."""
    out = {}
    for name, want in (("urgent", True), ("others", False)):
        ttfts = [1e3 * r.stats["ttft_seconds"] for r, u in zip(results, urgent) if u == want]
        out[name] = {"requests": len(ttfts), "mean_ttft_ms": round(statistics.fmean(ttfts), 1),
                     "max_ttft_ms": round(max(ttfts), 1)}
    return out


async def send(channel, reqs: list, urgent: list[bool], delay_s: float) -> list:
    """The requests not urgent at once, the urgent ones delay_s later (all at once too) -> results in request
    order."""
    async def part(want: bool, wait_s: float) -> list:
        await asyncio.sleep(wait_s)
        return await common.stream_many(channel, [r for r, u in zip(reqs, urgent) if u == want],
                                        concurrency=len(reqs))

    others, urgents = await asyncio.gather(part(False, 0.0), part(True, delay_s))
    others, urgents = iter(others), iter(urgents)
    return [next(urgents) if u else next(others) for u in urgent]


def preemptions(stack) -> int:
    """Running requests the stack's gateway has preempted so far."""
    return int(common.total(common.scrape(stack.metrics_ports["gateway"]), "vllm:num_preemptions_total"))


def main(argv=None) -> None:
    args = parse_args(argv)
    model, drafter = common.resolve_model(args.model), common.resolve_drafter(args.drafter)
    prompts, source = common.load_prompts(None, args.requests)
    texts = [p["text"] for p in prompts]
    urgent = [(i + 1) % args.urgent_every == 0 for i in range(len(texts))]
    policy = ["--scheduling-policy", "priority"]
    stacks = [(policy, (("all priority 0", False), ("urgent at -1", True)))]
    if args.preemption:
        stacks.append(([*policy, "--priority-scheduling-preemption-threshold", "0"],
                       (("urgent at -1, preempting", True),)))
    passes = {}
    for gateway_args, runs in stacks:
        stack = common.start_stack(model, drafter, args.device, args.dtype, None, budget=args.budget,
                                   max_batch=args.slots, gateway_args=gateway_args)
        try:
            with common.GatewayClient(stack.gateway) as client:
                client.run([request("Hello.", 4, args.budget, 0)])   # warm-up, not counted
                for name, marked in runs:
                    before = preemptions(stack)
                    reqs = [request(t, args.max_tokens, args.budget, -1 if marked and u else 0)
                            for t, u in zip(texts, urgent)]
                    results = client.loop.run_until_complete(
                        send(client.channel, reqs, urgent, args.urgent_delay_ms / 1e3))
                    preempted = preemptions(stack) - before
                    passes[name] = {"summary": summary(results, urgent), "texts": [r.text for r in results],
                                    "preemptions": preempted}
        finally:
            stack.stop()
    same = all(p["texts"] == passes["all priority 0"]["texts"] for p in passes.values())
    hw = common.hardware(args.device, args.dtype, None)
    data = {"bench": "priority_scheduling", "command": common.command_line("bench.priority_scheduling"),
            "date": common.now_utc(), "hardware": hw, "model": common.describe_checkpoint(model),
            "drafter": common.describe_checkpoint(drafter), "prompts": source, "requests": len(texts),
            "urgent_every": args.urgent_every, "urgent_delay_ms": args.urgent_delay_ms, "slots": args.slots,
            "max_tokens": args.max_tokens,
            "budget": args.budget, "same_text_in_every_pass": same, "passes": passes}
    rows = []
    for name, p in passes.items():
        for cls in ("urgent", "others"):
            s = p["summary"][cls]
            rows.append([name, cls, str(s["requests"]), f"{s['mean_ttft_ms']:.1f}", f"{s['max_ttft_ms']:.1f}",
                         str(p["preemptions"]) if cls == "urgent" else ""])
    base = passes["all priority 0"]["summary"]
    for name in list(passes)[1:]:
        marked = passes[name]["summary"]
        for cls in ("urgent", "others"):
            rows.append([f"{name} / all 0", cls, "",
                         f"{marked[cls]['mean_ttft_ms'] / base[cls]['mean_ttft_ms']:.3f}",
                         f"{marked[cls]['max_ttft_ms'] / base[cls]['max_ttft_ms']:.3f}", ""])
    md = "\n".join([
        f"# Priority scheduling on a burst ({common.hardware_tag(hw)})", "",
        f"Command: `{data['command']}`  ", f"Date: {data['date']}  ",
        f"CPU: {hw['cpu_model']} ({hw['usable_cpus']} usable), device `{args.device}`, {args.dtype}", "",
        f"{len(texts)} chat requests ({source}) sent to one stack with `--scheduling-policy priority` and "
        f"{args.slots} slots, greedy DDTree budget {args.budget}, {args.max_tokens} tokens each; every "
        f"{args.urgent_every}th is urgent and sent {args.urgent_delay_ms:.0f} ms after the others. "
        "Pass 1: every priority 0 (arrival order); pass 2: the urgent ones at -1"
        + ("; pass 3: the same on a second stack that preempts running requests for them "
           "(`--priority-scheduling-preemption-threshold 0`)" if args.preemption else "") + ". "
        "TTFT is the gateway's (arrival to first token). Same text in every pass: "
        f"{'yes' if same else 'NO'}.", "",
        common.md_table(["pass", "class", "requests", "mean TTFT ms", "max TTFT ms", "preemptions in the pass"],
                        rows), ""])
    print(md)
    common.write_outputs(args.out_dir, f"priority-scheduling-{common.hardware_tag(hw)}", data, md)


if __name__ == "__main__":
    main()
