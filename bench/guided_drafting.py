"""What grammar-aware verify trees give a structured output: the same JSON-schema requests through the services with
the gateway's --guided-overdraft at 1 (the budget's tree, the target dropping the nodes the grammar refuses) and at
2 or more (a tree that many times larger, of which the target verifies the budget's worth of grammar-valid nodes),
each a fresh stack. Greedy, so every setting must give the same text (checked); what changes is the tokens per
step (tau) and the nodes each verify forward carries.

    python -m bench.guided_drafting [--overdrafts 1 2] [--budget 16] [--max-tokens 96] [--device cpu]

The default pair is the bundled SmolLM2 target and its trained DFlash drafter. Writes
<out-dir>/guided-drafting-<hardware>.{md,json}.
"""
from __future__ import annotations

import argparse
import json

from bench import common

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "hobbies": {"type": "array", "items": {"type": "string"}},
    "city": {"type": "string"}}, "required": ["name", "age", "hobbies", "city"]}
PROMPTS = [
    "Describe a fictional person as JSON with name, age, hobbies and city.",
    "Give me a JSON record of a made-up chef: name, age, hobbies, city.",
    "Invent a character and return JSON with their name, age, hobbies and city.",
    "Make up a musician and give their name, age, hobbies and home city as JSON.",
    "Return a JSON profile (name, age, hobbies, city) of an imaginary painter.",
    "Create a JSON description of a fictional teacher: name, age, hobbies and city.",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_pair_args(p)
    p.add_argument("--overdrafts", type=int, nargs="+", default=[1, 2])
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    return p.parse_args(argv)


def run_setting(args, model: str, drafter: str, overdraft: int) -> dict:
    """The prompts one after another through a fresh stack at one --guided-overdraft."""
    from ddtree_serve.client import Client

    stack = common.start_stack(model, drafter, args.device, args.dtype, None, budget=args.budget, max_batch=1,
                               gateway_args=["--guided-overdraft", str(overdraft)])
    try:
        before = common.scrape_all(stack)
        texts, tokens, steps, wall = [], 0, 0, 0.0
        with Client(stack.gateway) as client:
            for prompt in PROMPTS:
                r = client.generate(prompt, max_tokens=args.max_tokens, mode="ddtree", budget=args.budget,
                                    structured_output=("json", json.dumps(SCHEMA)))
                texts.append(r.text)
                tokens += r.stats["generated_tokens"]
                steps += r.stats["steps"]
                wall += r.stats["e2e_seconds"]
        after = common.scrape_all(stack)
    finally:
        stack.stop()
    verified = common.delta(before["target"], after["target"], "ddtree_target_forward_tokens_sum", op="verify")
    return {"overdraft": overdraft, "texts": texts, "tokens": tokens, "steps": steps,
            "tokens_per_step": round(tokens / steps, 3), "verified_nodes_per_step": round(verified / steps, 2),
            "tokens_per_s": round(tokens / wall, 2)}


def main(argv=None) -> None:
    args = parse_args(argv)
    model, drafter = common.resolve_model(args.model), common.resolve_drafter(args.drafter)
    runs = [run_setting(args, model, drafter, k) for k in args.overdrafts]
    same = all(r["texts"] == runs[0]["texts"] for r in runs)
    hw = common.hardware(args.device, args.dtype, None)
    data = {"bench": "guided_drafting", "command": common.command_line("bench.guided_drafting"),
            "date": common.now_utc(), "hardware": hw, "model": common.describe_checkpoint(model),
            "drafter": common.describe_checkpoint(drafter), "schema": SCHEMA, "prompts": PROMPTS,
            "budget": args.budget, "max_tokens": args.max_tokens, "same_text_in_every_setting": same, "runs": runs}
    rows = [[str(r["overdraft"]), f"{r['tokens_per_step']:.3f}", f"{r['verified_nodes_per_step']:.2f}",
             f"{r['tokens_per_s']:.2f}"] for r in runs]
    md = "\n".join([
        f"# Grammar-aware verify trees for structured outputs ({common.hardware_tag(hw)})", "",
        f"Command: `{data['command']}`  ", f"Date: {data['date']}  ",
        f"CPU: {hw['cpu_model']} ({hw['usable_cpus']} usable), device `{args.device}`, {args.dtype}", "",
        f"{len(PROMPTS)} chat prompts asking for a JSON record, answered under a four-field JSON schema, greedy, "
        f"ddtree budget {args.budget}, max_tokens {args.max_tokens}, one at a time, a fresh stack per setting. "
        "Overdraft 1: the budget's tree, the target dropping the nodes the grammar refuses (and their subtrees); "
        "k > 1: a tree k times the budget, of which the target verifies the budget's worth of grammar-valid nodes. "
        f"Same text in every setting: {'yes' if same else 'NO'}.", "",
        common.md_table(["--guided-overdraft", "tokens / step", "verified nodes / step", "tok/s (sum of e2e)"], rows),
        ""])
    print(md)
    common.write_outputs(args.out_dir, f"guided-drafting-{common.hardware_tag(hw)}", data, md)


if __name__ == "__main__":
    main()
