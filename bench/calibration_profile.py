"""Measures a calibration profile (for calibrated-acceptance benchmarks, bench-only) on a real target/drafter pair.

In this process (TargetRunner + DrafterRunner, no services), for each held-out prompt (one-message chat, greedy):
prefill, then real DDTree steps — draft top-K at every depth 1..D, build the DDTree (--budget), verify, commit
what the target accepts — until the output holds --max-tokens + D tokens (or EOS). Verification is lossless, so
the committed tokens are the target's own greedy continuation: the reference. Afterwards, for every step that
started inside the first --max-tokens tokens, it records per depth the rank of the reference token in the
drafter's top-K list (or "absent") and the sorted top-K log-probs. The profile is the per-depth rank frequencies
and mean log-probs (gateway/calibrated_drafts.py CalibrationProfile).

Also reported: the chain tau and DDTree-`budget` tau measured on these very steps, and those the profile implies
for a calibrated run (chain: 1 + sum_k prod_{d<=k} P_d(rank 0), depths independent; DDTree: Monte Carlo over the
profile). The gap between measured and implied is the cost of treating depths as independent.

    python -m bench.calibration_profile                       # SmolLM2 pair, 8 prompts x 96 tokens, K 64, depth 15

Writes bench/results/calibration-profile-smollm2.{json,md} (or --out).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench import common

LABEL = "calibration profile (bench-only: for calibrated-acceptance benchmarks)"
PAPER_CHAIN_TAU = 7.79  # DFlash's Qwen3-8B MATH-500 chain (the DDTree paper: DDTree tau 10.73 at its best budget)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.calibration_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target checkpoint dir (default: SmolLM2-135M-Instruct from the packaged GGUF)")
    p.add_argument("--drafter", help="DFlash drafter dir (default: ddtree_serve/assets/smollm2-dflash)")
    p.add_argument("--prompts", help="held-out prompt file (default: bench/heldout_prompts.json)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=96, help="steps starting inside this many output tokens count")
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--depth", type=int, default=15, help="draft depths (at most the drafter's block size - 1)")
    p.add_argument("--budget", type=int, default=64, help="DDTree budget of the steps that advance the sequence")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: 1 on a CPU with <= 2 cores, where more threads only contend)")
    p.add_argument("--sim-trials", type=int, default=20000, help="Monte Carlo trials for the implied DDTree tau")
    p.add_argument("--out", default=str(common.RESULTS_DIR / "calibration-profile-smollm2.json"),
                   help="profile JSON path (a .md beside it, and the measured steps as a .steps.npz beside it)")
    return p.parse_args(argv)


def eos_ids(model_dir: str, tokenizer) -> set[int]:
    import transformers

    eos = transformers.GenerationConfig.from_pretrained(model_dir).eos_token_id
    out = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        out.add(tokenizer.eos_token_id)
    return out


def run_prompt(target, drafter, seq_id: str, prompt: list[int], args, eos: set[int]):
    """Real DDTree decoding of one prompt; returns (output tokens, steps [(output length at draft, lp, ids,
    accepted)]) where the step's bonus is output[length - 1]."""
    import torch

    from ddtree_serve.decoding.config import SamplingParams
    from ddtree_serve.decoding.ddtree import build_ddtree_reference
    from drafter_svc.runner import DraftItem
    from target_svc.runner import PrefillItem, VerifyItem

    (out,) = target.prefill([PrefillItem(seq_id, prompt, SamplingParams(), True)])
    drafter.add_context(seq_id, 0, out.features)
    tokens, ctx, steps = [out.next_token], out.context_len, []
    want = args.max_tokens + args.depth
    try:
        while len(tokens) < want and tokens[-1] not in eos:
            lp, ids = drafter.draft([DraftItem(seq_id, tokens[-1], ctx)], top_k=args.top_k, max_depth=args.depth)
            tree = build_ddtree_reference(lp[0], ids[0], args.budget, args.depth, tokens[-1])
            (r,) = target.verify([VerifyItem(seq_id, tree.tokens, tree.parents)])
            drafter.add_context(seq_id, ctx, r.features)
            steps.append((len(tokens), lp[0].to(torch.float32), ids[0], len(r.accepted_tokens)))
            tokens += r.accepted_tokens + [r.next_token]
            ctx = r.context_len
    finally:
        target.release(seq_id)
        drafter.release(seq_id)
    return tokens, steps


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    import transformers

    from gateway.calibrated_drafts import CalibrationProfile, simulated_tree_tau
    from gateway.replay_profile import NO_REFERENCE, ReplayProfile
    from drafter_svc.runner import DrafterConfig, DrafterRunner
    from target_svc.runner import TargetConfig, TargetRunner

    args.threads = common.in_process_threads(args.device, args.threads)
    model, drafter_dir = common.resolve_model(args.model), common.resolve_drafter(args.drafter)
    prompts, source = common.load_prompts(args.prompts, args.num_prompts or None, args.offset)
    command, date = common.command_line("bench.calibration_profile"), common.now_utc()
    hw = common.hardware(args.device, args.dtype, args.threads)
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    target = TargetRunner(TargetConfig(model_dir=model, device=args.device, dtype=dtype, max_batch=1,
                                       max_seq_len=2048, max_tree_nodes=args.budget + 1))
    drafter = DrafterRunner(DrafterConfig(drafter_dir=drafter_dir, target_model_dir=model, device=args.device,
                                          dtype=dtype, max_batch=1, max_seq_len=2048))
    if not 1 <= args.depth <= drafter.block_size - 1:
        raise SystemExit(f"--depth must be in [1, {drafter.block_size - 1}]")
    target.set_feature_layers(drafter.target_layer_ids)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    eos = eos_ids(model, tokenizer)
    print(f"{LABEL}: {len(prompts)} prompts from {source}; runners loaded in {time.perf_counter() - t0:.1f} s",
          flush=True)

    D, K = args.depth, args.top_k
    rank_counts = [[0] * (K + 1) for _ in range(D)]
    # given depth d - 1's reference token was at rank 0 (hit) or not (miss): the depths' correlation
    hit_counts = [[0] * (K + 1) for _ in range(D)]
    miss_counts = [[0] * (K + 1) for _ in range(D)]
    lp_sums = [torch.zeros(K, dtype=torch.float64) for _ in range(D)]
    chain_acc, tree_acc, n_steps, n_tokens = 0, 0, 0, 0
    step_ranks, step_logprobs = [], []  # every measured step whole: what step replay draws from
    t_run = time.perf_counter()
    for i, p in enumerate(prompts):
        tokens, steps = run_prompt(target, drafter, f"p{i}", common.chat_ids(tokenizer, p["text"]), args, eos)
        used = 0
        for start, lp, ids, accepted in steps:
            if start > args.max_tokens:  # this step's bonus lies past the measured window
                continue
            used += 1
            tree_acc += accepted
            ids_rows, lead, prev = ids.tolist(), True, None
            step_ranks.append([NO_REFERENCE] * D)
            step_logprobs.append(lp[:D].to(torch.float16))
            for d in range(D):
                pos = start + d  # index in `tokens` of the depth-(d+1) token (the bonus is tokens[start - 1])
                if pos >= len(tokens):
                    break  # EOS came first: deeper depths have no reference
                row = ids_rows[d]
                rank = row.index(tokens[pos]) if tokens[pos] in row else K
                rank_counts[d][rank] += 1
                step_ranks[-1][d] = rank
                if prev is not None:
                    (hit_counts if prev == 0 else miss_counts)[d][rank] += 1
                prev = rank
                lp_sums[d] += lp[d].to(torch.float64)
                lead = lead and rank == 0
                chain_acc += lead
        n_steps += used
        n_tokens += min(len(tokens), args.max_tokens)
        print(f"  prompt {i + 1}/{len(prompts)} {p['id']}: {len(tokens)} tokens, {used} steps measured "
              f"({time.perf_counter() - t_run:.0f} s)", flush=True)

    samples = [sum(c) for c in rank_counts]
    rank_probs = [[c / n for c in counts] for counts, n in zip(rank_counts, samples)]

    def conditional(table: list[list[int]]) -> list[list[float]]:
        # a row never observed (e.g. no miss at depth 1) falls back to the marginal
        return [[c / sum(row) for c in row] if sum(row) else list(m) for row, m in zip(table, rank_probs)]
    mean_lp = [(s / n).tolist() for s, n in zip(lp_sums, samples)]
    measured_chain, measured_tree = 1 + chain_acc / n_steps, 1 + tree_acc / n_steps
    meta = {"label": LABEL, "command": command, "date": date, "hardware": hw,
            "target": common.describe_checkpoint(model), "drafter": common.describe_checkpoint(drafter_dir),
            "prompts": len(prompts), "prompt_source": source, "prompt_ids": [p["id"] for p in prompts],
            "max_tokens": args.max_tokens, "top_k": K, "depth": D, "budget": args.budget,
            "steps_measured": n_steps, "tokens": n_tokens,
            "measured_chain_tau": round(measured_chain, 4),
            f"measured_ddtree{args.budget}_tau": round(measured_tree, 4),
            "run_seconds": round(time.perf_counter() - t0, 1)}
    meta["samples_after_hit"] = [sum(r) for r in hit_counts]
    meta["samples_after_miss"] = [sum(r) for r in miss_counts]
    profile = CalibrationProfile(rank_probs, mean_lp, samples, meta, conditional(hit_counts),
                                 conditional(miss_counts))
    marginal = CalibrationProfile(rank_probs, mean_lp)
    implied_chain = profile.chain_tau()
    implied_tree = simulated_tree_tau(profile, args.budget, trials=args.sim_trials)
    indep_chain, indep_tree = marginal.chain_tau(), simulated_tree_tau(marginal, args.budget, trials=args.sim_trials)
    meta.update({"implied_chain_tau": round(implied_chain, 4),
                 f"implied_ddtree{args.budget}_tau": round(implied_tree, 4),
                 "independent_depths_chain_tau": round(indep_chain, 4),
                 f"independent_depths_ddtree{args.budget}_tau": round(indep_tree, 4),
                 "implied_note": "implied = what a calibrated run with this profile expects: ranks drawn depth by "
                                 "depth given the previous depth's hit/miss (chain: closed form; DDTree: Monte Carlo "
                                 "over the profile's ranks with its mean log-probs); independent_depths = the same "
                                 "from the per-depth marginals alone"})
    for budget in (16, 32, 128, 256):
        if budget != args.budget:
            meta.setdefault("implied_ddtree_tau_other_budgets", {})[budget] = round(
                simulated_tree_tau(profile, budget, trials=args.sim_trials // 4), 3)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    replay = ReplayProfile(torch.stack(step_logprobs).float(), torch.tensor(step_ranks), 1.0,
                           {k: v for k, v in meta.items() if not k.startswith(("implied", "independent"))})
    replay_path = out.with_suffix(".steps.npz")
    replay.save(replay_path)
    replay_chain, replay_tree = replay.chain_tau(), replay.simulated_tree_tau(args.budget, trials=8)
    paper = replay.rescaled_to_chain_tau(PAPER_CHAIN_TAU)
    paper_trees = {b: round(paper.simulated_tree_tau(b, trials=2), 2) for b in (16, 64, 256, 512)}
    top1 = ", ".join(f"{x:.2f}" for x in profile.p_top1())
    chain1 = ", ".join(f"{x:.2f}" for x in profile.chain_p_top1())
    in_k = ", ".join(f"{1 - r[-1]:.2f}" for r in rank_probs)
    md = f"""# Calibration profile (bench-only: for calibrated-acceptance benchmarks)

- Command: `{command}`
- Date: {date}; run {meta['run_seconds']:.0f} s
- Hardware: {hw['cpu_model']} ({hw['usable_cpus']} usable CPUs), device `{args.device}`, dtype {args.dtype}, torch {hw['torch']}
- Target: `{meta['target']['dir']}`; drafter: `{meta['drafter']['dir']}` (weights sha256 {meta['drafter'].get('weights_sha256')}…)
- Work: {len(prompts)} prompts from {source}, chat template, greedy; real DDTree-{args.budget} steps (top-{K}, depth {D}) in
  process; {n_steps} steps whose bonus lies in the first {args.max_tokens} output tokens measured
- Profile: `{out.name}` — per depth, P(reference token at rank r), r < {K}, + P(absent), and mean sorted log-probs

| | chain tau | DDTree-{args.budget} tau |
|---|---|---|
| measured on these steps | {measured_chain:.3f} | {measured_tree:.3f} |
| implied by the profile (ranks given the previous depth's hit/miss; what a calibrated run gets) | {implied_chain:.3f} | {implied_tree:.3f} |
| implied by the per-depth marginals alone (depths independent) | {indep_chain:.3f} | {indep_tree:.3f} |
| implied by step replay (`{replay_path.name}`: every measured step's rows, ranks drawn from them) | {replay_chain:.3f} | {replay_tree:.3f} |

Step replay (gateway/replay_profile.py) is what calibrated benchmarks use: the rank tables above give every draft
the same log-probs, hence the same tree, and lose what a tree exploits (a drafter that knows when it is unsure).
Rescaled to chain tau {PAPER_CHAIN_TAU} (every row sharpened at temperature {paper.temperature:.3f}), it implies DDTree tau
{paper_trees} by budget; the DDTree paper reports tau 10.73 for that pair at its best budget, so at large budgets
this model is the more optimistic of the two.

Rank tables: implied DDTree tau at other budgets: {meta['implied_ddtree_tau_other_budgets']}

P(rank 0) per depth 1..{D}: {top1}

P(rank 0 | depth d - 1 at rank 0) per depth 1..{D} (the chain's factors): {chain1}

P(in top-{K}) per depth 1..{D}: {in_k}

Use: `python -m bench.speed --calibrated {common._display_path(replay_path)} [--calibrate-chain-tau 7.79]` (step
replay; or the rank tables, `{out.name}`): the gateway rewrites drafts so that the reference tokens sit at drawn
ranks; outputs stay the target's, acceptance is synthetic: bench-only. Rank tables: Marginals alone underestimate tau: a drafter right at depth d tends to be right at d + 1, so the
profile also holds each depth's rank distribution given the previous depth's hit or miss (first order); what
remains between measured and implied is the longer-range correlation.
"""
    md_path = out.with_suffix(".md")
    md_path.write_text(md)
    print(f"measured chain tau {measured_chain:.3f}, DDTree-{args.budget} {measured_tree:.3f}; implied chain "
          f"{implied_chain:.3f}, DDTree-{args.budget} {implied_tree:.3f}; wrote {out} and {md_path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
