"""Acceptance benchmark: mean acceptance length (tau) and tokens per verify step through the real services.

For each held-out prompt (bench/heldout_prompts.json, sent as a one-message chat, greedy) it generates with
`ar` (the baseline, tau = 1), the `dflash` chain and `ddtree` at each budget, all through one gateway/target/drafter
stack (modes and budgets are per request). Aggregates are pooled over prompts (total accepted draft tokens /
total drafted verify steps, never a mean of per-prompt means), read exactly from the gateway's Prometheus
counters (vllm:spec_decode_num_drafts / _num_accepted_tokens) between scrapes, and cross-checked against the
per-request GenerationStats. Also checks that every speculative output equals the `ar` output token for token
(greedy decoding is lossless).

    python -m bench.acceptance                                  # CPU defaults: 8 prompts x 64 tokens
    python -m bench.acceptance --device cuda --dtype bfloat16   # all prompts x the file's max_new_tokens

Writes bench/results/acceptance.{md,json} (or --out-dir).
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

from bench import common


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.acceptance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target checkpoint dir (default: SmolLM2-135M-Instruct from the packaged GGUF)")
    p.add_argument("--drafter", help="DFlash drafter dir (default: ddtree_serve/assets/smollm2-dflash)")
    p.add_argument("--prompts", help="held-out prompt file (default: bench/heldout_prompts.json)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="first N prompts (default: 8 on CPU, all on an accelerator; 0 = all)")
    p.add_argument("--offset", type=int, default=0, help="skip the first N prompts of the file")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="max new tokens per request (default: 64 on CPU, the file's max_new_tokens or 256 otherwise)")
    p.add_argument("--budgets", default="16,32,64,128,256", help="DDTree budgets (comma-separated)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--drafter-device", default=None, help="drafter service device (default: --device)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads per model service (CPU)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight at once (default: 1 on CPU, 8 otherwise); tau does not depend on it")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    return p.parse_args(argv)


def _file_max_new_tokens(path) -> int | None:
    import json
    from pathlib import Path

    p = Path(path) if path else common.HELDOUT_PROMPTS
    try:
        data = json.loads(p.read_text())
        return int(data["max_new_tokens"]) if isinstance(data, dict) and "max_new_tokens" in data else None
    except (OSError, ValueError, KeyError):
        return None


def config_key(c: dict) -> str:
    """"ar", "dflash" or "ddtree_b<budget>"."""
    return f"ddtree_b{c['budget']}" if c["mode"] == "ddtree" else c["mode"]


def run_config(stack, prompts: list[dict], mode: str, budget: int, max_tokens: int, concurrency: int) -> dict:
    """All prompts through one (mode, budget); pooled counters from the gateway's metrics."""
    reqs = [common.chat_request(p["text"], max_tokens, mode, budget) for p in prompts]
    before = common.scrape(stack.metrics_ports["gateway"])
    exact_drafts: list[int | None] = []
    if concurrency == 1:
        # One request at a time: a scrape around each gives its exact drafted-step count.
        results, wall = [], 0.0
        prev = before
        for r in reqs:
            res, w = common.run_requests(stack.gateway, [r], 1)
            cur = common.scrape(stack.metrics_ports["gateway"])
            exact_drafts.append(int(common.delta(prev, cur, "vllm:spec_decode_num_drafts_total")))
            results += res
            wall += w
            prev = cur
        after = prev
    else:
        results, wall = common.run_requests(stack.gateway, reqs, concurrency)
        after = common.scrape(stack.metrics_ports["gateway"])
        exact_drafts = [None] * len(results)
    drafts = int(common.delta(before, after, "vllm:spec_decode_num_drafts_total"))
    accepted_m = int(common.delta(before, after, "vllm:spec_decode_num_accepted_tokens_total"))
    draft_tokens_m = int(common.delta(before, after, "vllm:spec_decode_num_draft_tokens_total"))
    per_pos = {}
    for name, labels in after:
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = int(dict(labels)["position"])
            per_pos[pos] = int(common.delta(before, after, name, position=str(pos)))
    steps = sum(r.stats["steps"] for r in results)
    accepted = sum(r.stats["accepted_tokens"] for r in results)
    generated = sum(r.stats["generated_tokens"] for r in results)
    draft_tokens = sum(r.stats["draft_tokens"] for r in results)
    per_prompt = []
    for p, r, d in zip(prompts, results, exact_drafts):
        drafted = d if d is not None else r.drafted_steps
        per_prompt.append({"id": p["id"], "kind": p.get("kind", ""), "generated_tokens": r.stats["generated_tokens"],
                           "steps": r.stats["steps"], "drafted_steps": drafted,
                           "accepted_tokens": r.stats["accepted_tokens"],
                           "mean_acceptance_length": round(r.stats["mean_acceptance_length"], 4),
                           "finish_reason": r.finish_reason, "token_ids": r.token_ids})
    out = {
        "mode": mode, "budget": budget if mode == "ddtree" else None,
        "prompts": len(prompts), "generated_tokens": generated, "verify_steps": steps,
        "drafted_steps": drafts, "accepted_tokens": accepted, "draft_tokens_verified": draft_tokens,
        # Pooled: 1 + total accepted / total drafted steps (vLLM's definition; AR has no drafts -> 1).
        "tau": round(1.0 + accepted_m / drafts, 4) if drafts else 1.0,
        # Output tokens per verify step (the prefill's first token is not a step's).
        "tokens_per_step": round((generated - len(results)) / steps, 4) if steps else None,
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
        "accepted_per_depth": [per_pos.get(i, 0) for i in range(max(per_pos) + 1)] if per_pos else [],
        "wall_s": round(wall, 2), "tokens_per_s_indicative": round(generated / wall, 2) if wall else None,
        "metrics_match_stats": accepted_m == accepted and draft_tokens_m == draft_tokens
                               and (concurrency != 1 or drafts == sum(d or 0 for d in exact_drafts)),
        "per_prompt": per_prompt,
    }
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    on_cpu = args.device == "cpu"
    n_prompts = args.num_prompts if args.num_prompts is not None else (8 if on_cpu else 0)
    max_tokens = args.max_tokens or (64 if on_cpu else (_file_max_new_tokens(args.prompts) or 256))
    concurrency = args.concurrency or (1 if on_cpu else 8)
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    prompts, source = common.load_prompts(args.prompts, n_prompts or None, args.offset)
    model, drafter = common.resolve_model(args.model), common.resolve_drafter(args.drafter)
    command = common.command_line("bench.acceptance")
    date = common.now_utc()
    hw = common.hardware(args.device, args.dtype, args.threads)
    print(f"{len(prompts)} prompts from {source}; max_tokens {max_tokens}; budgets {budgets}; "
          f"concurrency {concurrency}", flush=True)

    stack = common.start_stack(model, drafter, args.device, args.dtype, args.threads,
                               budget=budgets[0] if budgets else 64, max_batch=max(8, concurrency),
                               max_seq_len=args.max_seq_len, drafter_device=args.drafter_device)
    t_start = time.perf_counter()
    configs = []
    try:
        plan = [("ar", 0), ("dflash", 0)] + [("ddtree", b) for b in budgets]
        for mode, budget in plan:
            t0 = time.perf_counter()
            c = run_config(stack, prompts, mode, budget, max_tokens, concurrency)
            configs.append(c)
            print(f"{mode:7s} budget {budget or '-':>4}: tau {c['tau']:.3f}, tokens/step {c['tokens_per_step']}, "
                  f"{c['generated_tokens']} tokens, {c['verify_steps']} steps, {time.perf_counter() - t0:.0f} s",
                  flush=True)
    finally:
        stack.stop()
    total_s = time.perf_counter() - t_start

    # Lossless check: greedy speculative outputs must equal the AR outputs, prompt by prompt.
    ar = configs[0]
    ref = {pp["id"]: pp["token_ids"] for pp in ar["per_prompt"]}
    lossless = {}
    for c in configs[1:]:
        bad = [pp["id"] for pp in c["per_prompt"] if pp["token_ids"] != ref[pp["id"]]]
        key = config_key(c)
        c["equals_ar"] = f"{len(c['per_prompt']) - len(bad)}/{len(c['per_prompt'])}"
        lossless[key] = {"equal": len(c["per_prompt"]) - len(bad), "of": len(c["per_prompt"]), "mismatches": bad}
    all_equal = all(v["equal"] == v["of"] for v in lossless.values())

    # Per prompt kind (pooled within the kind), for dflash and each ddtree budget.
    by_kind: dict[str, dict] = {}
    for c in configs[1:]:
        key = config_key(c)
        agg = defaultdict(lambda: [0, 0])
        for pp in c["per_prompt"]:
            if pp["drafted_steps"]:
                agg[pp["kind"] or "-"][0] += pp["accepted_tokens"]
                agg[pp["kind"] or "-"][1] += pp["drafted_steps"]
        by_kind[key] = {k: round(1 + a / d, 3) for k, (a, d) in sorted(agg.items()) if d}

    def tau_of(mode, budget=None):
        for c in configs:
            if c["mode"] == mode and (budget is None or c["budget"] == budget):
                return c["tau"]
        return None

    model_info, drafter_info = common.describe_checkpoint(model), common.describe_checkpoint(drafter)
    data = {
        "ddtree_b64_tau": tau_of("ddtree", 64), "dflash_tau": tau_of("dflash"), "prompts": len(prompts),
        "command": command, "date": date, "max_tokens": max_tokens, "temperature": 0.0, "chat_template": True,
        "concurrency": concurrency, "prompt_source": source, "prompt_ids": [p["id"] for p in prompts],
        "model": model_info, "drafter": drafter_info, "hardware": hw, "run_seconds": round(total_s, 1),
        "tau": {config_key(c): c["tau"] for c in configs},
        "tokens_per_step": {config_key(c): c["tokens_per_step"] for c in configs},
        "lossless_all_equal_ar": all_equal, "lossless": lossless, "tau_by_prompt_kind": by_kind,
        "configs": [{k: v for k, v in c.items() if k != "per_prompt"} for c in configs],
        "per_prompt": {config_key(c): [{k: v for k, v in pp.items() if k != "token_ids"} for pp in c["per_prompt"]]
                       for c in configs},
    }

    rows = []
    for c in configs:
        rows.append([c["mode"], c["budget"] or "–", c["tau"], c["tokens_per_step"],
                     c["acceptance_rate"], c["generated_tokens"], c["verify_steps"], c["drafted_steps"],
                     c["accepted_tokens"], c["draft_tokens_verified"], c.get("equals_ar", "(reference)"),
                     c["tokens_per_s_indicative"]])
    table = common.md_table(["mode", "budget", "tau (mean acceptance length)", "tokens / verify step",
                             "accepted / drafted nodes", "generated tokens", "verify steps", "drafted steps",
                             "accepted tokens", "draft nodes verified", "output == ar", "tok/s (indicative)"], rows)
    kinds = sorted({k for v in by_kind.values() for k in v})
    kind_table = common.md_table(["config", *kinds],
                                 [[key, *[v.get(k) for k in kinds]] for key, v in by_kind.items()]) if kinds else ""
    depth_rows = [[c["mode"] if c["mode"] != "ddtree" else f"ddtree b{c['budget']}",
                   *[round(x / c["drafted_steps"], 3) if c["drafted_steps"] else None
                     for x in (c["accepted_per_depth"] + [0] * 15)[:15]]] for c in configs[1:]]
    depth_table = common.md_table(["config", *[f"d{i}" for i in range(1, 16)]], depth_rows)
    drafter_note = ("the bundled trained drafter" if drafter_info.get("bundled_drafter")
                    else "NOT the bundled trained drafter")
    md = f"""# Acceptance length through the services

- Command: `{command}`
- Date: {date}; whole run {total_s:.0f} s
- Hardware: {hw['cpu_model']} ({hw['usable_cpus']} usable of {hw['logical_cpus']} logical CPUs){', ' + hw['gpu'] if hw.get('gpu') else ''}; device `{args.device}`{' (drafter on ' + args.drafter_device + ')' if args.drafter_device else ''}, dtype {args.dtype}, torch threads per service {args.threads or 'default'}; load average at start {hw.get('load_average_at_start')}
- Software: torch {hw['torch']}, transformers {hw['transformers']}, grpcio {hw['grpcio']}, Python {hw['python']}
- Target: `{model_info['dir']}` ({model_info.get('architectures')}, {model_info.get('num_hidden_layers')} layers)
- Drafter: `{drafter_info['dir']}` ({drafter_note}; {drafter_info.get('num_hidden_layers')} layers, block {drafter_info.get('block_size')}, target layers {drafter_info.get('target_layer_ids')}, weights sha256 {drafter_info.get('weights_sha256')}…)
- Prompts: {len(prompts)} from {source}, one user message each under the chat template; temperature 0; max_tokens {max_tokens} (EOS honoured); {concurrency} request(s) in flight

tau = 1 + accepted draft tokens / drafted verify steps, pooled over all prompts (vLLM's definition; the
bonus token counts). Tokens / verify step = output tokens after the prefill's first one / verify steps (all steps,
including the last ones where nothing is left to draft). AR is the baseline (1.0).

{table}

Lossless check (greedy): every speculative output equals the `ar` output token for token: **{'yes' if all_equal else 'NO'}**{'' if all_equal else ' — mismatches: ' + str({k: v['mismatches'] for k, v in lossless.items() if v['mismatches']})}.

## tau by prompt kind

{kind_table}

## Acceptance per draft depth (fraction of drafted steps accepting depth d)

{depth_table}

Tokens/s here are indicative only (sequential per-request scrapes, {args.device}); speed is measured by `bench.speed`.
"""
    common.write_outputs(args.out_dir, "acceptance", data, md)


if __name__ == "__main__":
    sys.exit(main())
