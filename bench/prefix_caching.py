"""What prefix caching gives multi-turn chats: the same conversations (a shared system prompt, then several user
turns, each turn's prompt the whole conversation so far through the chat template) through the services with the
gateway's prefix caching on and off, each a fresh stack. Greedy, so both settings must give the same text
(checked); what changes is the prompt tokens each turn runs and its time to first token.

    python -m bench.prefix_caching [--conversations 4] [--turns 3] [--max-tokens 48] [--concurrent] [--device cpu]

The default pair is the bundled SmolLM2 target and its trained DFlash drafter. Writes
<out-dir>/prefix-caching-<hardware>.{md,json}.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics

from bench import common

SYSTEM = ("You are a careful assistant for a software team. Answer in plain English, briefly, and say so when you "
          "are unsure. Prefer concrete examples to general advice, name the tools you would use, and keep code "
          "short and runnable. When a question is ambiguous, state the reading you chose before answering it. Do "
          "not repeat the question back. Use lists only where the answer is a list.")
FOLLOW_UPS = ["Can you make that shorter?", "Give one concrete example.", "What would you check first?",
              "Summarise that in one sentence."]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_pair_args(p)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--mode", default="ddtree", choices=["ddtree", "dflash", "ar"])
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--concurrent", action="store_true", help="all conversations at once (at most 4 running)")
    p.add_argument("--stagger-ms", type=float, default=300.0, help="--concurrent: start of each after the last's")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    return p.parse_args(argv)


def chat(messages: list[tuple[str, str]], max_tokens: int, mode: str, budget: int):
    """A greedy GenerateRequest over a conversation, rendered by the target's chat template."""
    from ddtree_serve.proto import gateway_pb2

    modes = {"ddtree": gateway_pb2.DECODE_MODE_DDTREE, "dflash": gateway_pb2.DECODE_MODE_DFLASH,
             "ar": gateway_pb2.DECODE_MODE_AR}
    return gateway_pb2.GenerateRequest(
        chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role=r, content=c) for r, c in messages]),
        max_tokens=max_tokens, mode=modes[mode], budget=budget if mode == "ddtree" else 0)


async def conversation(channel, c: int, first: str, start_s: float, args) -> list[dict]:
    """One conversation's turns, each sent once the answer before it is in."""
    await asyncio.sleep(start_s)
    messages, turns = [("system", SYSTEM), ("user", first)], []
    for t in range(args.turns):
        (r,) = await common.stream_many(channel, [chat(messages, args.max_tokens, args.mode, args.budget)])
        turns.append({"conversation": c, "turn": t, "prompt_tokens": r.stats["prompt_tokens"],
                      "cached_prompt_tokens": r.stats["cached_prompt_tokens"], "ttft_s": r.stats["ttft_seconds"],
                      "e2e_s": r.stats["e2e_seconds"], "text": r.text})
        messages += [("assistant", r.text), ("user", FOLLOW_UPS[t % len(FOLLOW_UPS)])]
    return turns


def run_setting(args, model: str, drafter: str, users: list[str], caching: bool) -> dict:
    """The conversations through a fresh stack: one after another, or (--concurrent) all at once, each starting
    --stagger-ms after the one before."""
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    stack = common.start_stack(model, drafter, args.device, args.dtype, None, budget=args.budget, max_batch=4,
                               gateway_args=[flag])
    try:
        with common.GatewayClient(stack.gateway) as client:
            client.run([chat([("user", "Hello.")], 4, args.mode, args.budget)])   # warm-up, not counted

            async def run_all() -> list[list[dict]]:
                if not args.concurrent:
                    return [await conversation(client.channel, c, first, 0.0, args) for c, first in enumerate(users)]
                return list(await asyncio.gather(*(conversation(client.channel, c, first, c * args.stagger_ms / 1e3,
                                                                args) for c, first in enumerate(users))))

            turns = [t for conv in client.loop.run_until_complete(run_all()) for t in conv]
    finally:
        stack.stop()
    return {"prefix_caching": caching, "turns": turns}


def summary(run: dict, first_turns: bool) -> dict:
    """Means over first turns (a new conversation; only the system prompt can be cached) or over follow-ups."""
    rows = [t for t in run["turns"] if (t["turn"] == 0) == first_turns]
    prompt = sum(t["prompt_tokens"] for t in rows)
    cached = sum(t["cached_prompt_tokens"] for t in rows)
    return {"turns": len(rows), "mean_prompt_tokens": round(prompt / len(rows), 1),
            "cached_share": round(cached / prompt, 3),
            "mean_ttft_ms": round(1e3 * statistics.fmean(t["ttft_s"] for t in rows), 2),
            "mean_e2e_ms": round(1e3 * statistics.fmean(t["e2e_s"] for t in rows), 2)}


def main(argv=None) -> None:
    args = parse_args(argv)
    model, drafter = common.resolve_model(args.model), common.resolve_drafter(args.drafter)
    prompts, source = common.load_prompts(None, args.conversations)
    users = [p["text"] for p in prompts]
    off = run_setting(args, model, drafter, users, caching=False)
    on = run_setting(args, model, drafter, users, caching=True)
    same = [t["text"] for t in on["turns"]] == [t["text"] for t in off["turns"]]
    kinds = ("first turns", "follow-up turns") if args.turns > 1 else ("first turns",)
    table = {kind: {name: summary(run, kind == "first turns") for name, run in (("off", off), ("on", on))}
             for kind in kinds}
    hw = common.hardware(args.device, args.dtype, None)
    data = {"bench": "prefix_caching", "command": common.command_line("bench.prefix_caching"),
            "date": common.now_utc(), "hardware": hw, "model": common.describe_checkpoint(model),
            "drafter": common.describe_checkpoint(drafter), "prompts": source, "system_prompt": SYSTEM,
            "follow_ups": FOLLOW_UPS, "concurrent": args.concurrent, "stagger_ms": args.stagger_ms,
            "mode": args.mode, "budget": args.budget, "max_tokens": args.max_tokens,
            "same_text_in_both_settings": same, "summary": table, "runs": [off, on]}
    rows = []
    for kind, by in table.items():
        for name in ("off", "on"):
            s = by[name]
            rows.append([kind, name, f"{s['mean_prompt_tokens']:.1f}", f"{s['cached_share']:.3f}",
                         f"{s['mean_ttft_ms']:.1f}", f"{s['mean_e2e_ms']:.1f}"])
        rows.append([kind, "on / off", "", "", f"{by['on']['mean_ttft_ms'] / by['off']['mean_ttft_ms']:.3f}",
                     f"{by['on']['mean_e2e_ms'] / by['off']['mean_e2e_ms']:.3f}"])
    md = "\n".join([
        f"# Prefix caching on multi-turn chats ({common.hardware_tag(hw)})", "",
        f"Command: `{data['command']}`  ", f"Date: {data['date']}  ",
        f"CPU: {hw['cpu_model']} ({hw['usable_cpus']} usable), device `{args.device}`, {args.dtype}", "",
        f"{len(users)} conversations of {args.turns} turns ({source}; one shared system prompt; follow-ups from a "
        f"fixed list), each turn's prompt the whole conversation so far, greedy, {args.mode}"
        f"{f' budget {args.budget}' if args.mode == 'ddtree' else ''}, max_tokens {args.max_tokens}, "
        + (f"the conversations at once (each {args.stagger_ms:.0f} ms after the last), " if args.concurrent
           else "one request at a time, ")
        + "a fresh stack (4 slots) per setting; times are the gateway's (ttft: arrival to first token). "
        f"Same text in both settings: {'yes' if same else 'NO'}.", "",
        common.md_table(["turns", "prefix caching", "prompt tokens", "cached share", "ttft ms", "e2e ms"], rows),
        ""])
    print(md)
    stem = (f"prefix-caching{'-concurrent' if args.concurrent else ''}"
            f"{'-at-once' if args.concurrent and args.stagger_ms == 0 else ''}-{common.hardware_tag(hw)}")
    common.write_outputs(args.out_dir, stem, data, md)


if __name__ == "__main__":
    main()
