"""Quality of the quantized target against the unquantized one on a real pair: perplexity and DDTree tau.

In this process (TargetRunner + DrafterRunner, no services), for the first N held-out prompts (one user message
under the chat template, greedy, EOS honoured), with one target loaded at a time:

1. the unquantized target's greedy answers of --max-tokens tokens: the reference answers;
2. the perplexity of those answer tokens, teacher-forced with the prompt as context, under the unquantized target
   and under each --quantize mode, through the target's own forward (TargetModel.forward_block: the quantized
   weights and matmul backend exactly as served); pooled over all answer tokens, exp(mean NLL);
3. DDTree-budget tau (1 + accepted / drafted steps, pooled; the gateway's depth bounds) with the drafter against
   each target, each generating its own greedy answers of --max-tokens tokens.

The quantized figures relative to the unquantized ones are checked against the issue's thresholds: perplexity
within 2 % and DDTree-64 tau within 5 % (stated there for int8 against bf16 on the GPU).

    python -m bench.quant_quality                  # CPU: float32 vs int8, 16 prompts x 64 tokens
    python -m bench.quant_quality --device cuda --dtype bfloat16 --num-prompts 0 --max-tokens 256 --quantize int8,int4

Writes bench/results/quant-quality-<hardware>.{md,json} (or --out-dir).
"""
from __future__ import annotations

import argparse
import gc
import math
import sys
import time

from bench import common

PPL_TOLERANCE = 0.02  # the issue: the quantized perplexity within 2 % of the unquantized one
TAU_TOLERANCE = 0.05  # the issue: DDTree budget-64 acceptance length within 5 %


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.quant_quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target checkpoint dir (default: SmolLM2-135M-Instruct from the packaged GGUF)")
    p.add_argument("--drafter", help="DFlash drafter dir (default: ddtree_serve/assets/smollm2-dflash)")
    p.add_argument("--prompts", help="held-out prompt file (default: bench/heldout_prompts.json)")
    p.add_argument("--num-prompts", type=int, default=16, help="first N prompts (0 = all)")
    p.add_argument("--offset", type=int, default=0, help="skip the first N prompts of the file")
    p.add_argument("--max-tokens", type=int, default=64, help="answer tokens per prompt (EOS may end one earlier)")
    p.add_argument("--budget", type=int, default=64, help="DDTree budget of the tau measurement")
    p.add_argument("--quantize", default="int8", help="quantized modes to compare, comma-separated (int8, int4)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the unquantized target's dtype (and the activations and scales of the quantized ones)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: 1 on a CPU with <= 2 cores, where more threads only contend)")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    return p.parse_args(argv)


def perplexity(logprobs) -> float:
    """exp(-mean log-prob) over every token of every sequence (pooled, not a mean of per-sequence perplexities)."""
    total = sum(float(lp.double().sum()) for lp in logprobs)
    count = sum(lp.numel() for lp in logprobs)
    if count == 0:
        raise ValueError("perplexity of no tokens")
    return math.exp(-total / count)


def relative(value: float, reference: float) -> float:
    """value / reference - 1."""
    return value / reference - 1.0


def shared_prefix(a: list[int], b: list[int]) -> int:
    """Leading tokens a and b have in common."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def matmul_backend(target) -> str | None:
    """The loaded quantized projections' matmul backend (None when unquantized); int4 has no int8pack kernel, and
    w8a8 runs its Triton kernels or else its PyTorch reference."""
    from target_svc.quantization import QuantizedLinear

    for m in target.layers.modules():
        if isinstance(m, QuantizedLinear):
            if m.act_bits:
                return "triton" if m.backend == "triton" else "reference"
            return "dequant" if m.bits == 4 and m.backend == "int8pack" else m.backend
    return None


def measure_target(runner, drafter, prompts: list[dict], prompt_ids: list[list[int]], answers: list[list[int]] | None,
                   max_tokens: int, budget: int) -> tuple[dict, list[list[int]]]:
    """Greedy answers, teacher-forced log-probs of the reference answers (its own when answers is None) and DDTree
    decoding on one loaded target; returns (summary, its greedy answers)."""
    from bench.offline_decode import decode, next_token_gap, teacher_forced_logprobs

    t0 = time.perf_counter()
    greedy = [decode(runner, None, f"ar{i}", ids, max_tokens).tokens for i, ids in enumerate(prompt_ids)]
    t_ar = time.perf_counter()
    reference = greedy if answers is None else answers
    logprobs = [teacher_forced_logprobs(runner, f"tf{i}", ids, ans)
                for i, (ids, ans) in enumerate(zip(prompt_ids, reference))]
    t_tf = time.perf_counter()
    trees = [decode(runner, drafter, f"dd{i}", ids, max_tokens, budget) for i, ids in enumerate(prompt_ids)]
    t_dd = time.perf_counter()
    drafted, accepted = sum(d.drafted_steps for d in trees), sum(d.accepted for d in trees)
    generated, steps = sum(len(d.tokens) for d in trees), sum(d.steps for d in trees)
    per_prompt = []
    for p, ids, g, ref, lp, d in zip(prompts, prompt_ids, greedy, reference, logprobs, trees):
        per_prompt.append({
            "id": p["id"], "kind": p.get("kind", ""), "prompt_tokens": len(ids), "answer_tokens": len(ref),
            "nll_sum": round(-float(lp.double().sum()), 5), "perplexity": round(perplexity([lp]), 5),
            "ddtree_tau": round(1 + d.accepted / d.drafted_steps, 4) if d.drafted_steps else None,
            "ddtree_equals_greedy": d.tokens == g, "greedy_equals_reference": g == ref,
            "greedy_shared_prefix": shared_prefix(g, ref),
        })
        if d.tokens != g:  # where DDTree and greedy part, and how near a tie the target's choice there was
            at = shared_prefix(d.tokens, g)
            gap, top1, top2 = next_token_gap(runner, f"gap{len(per_prompt)}", ids + g[:at])
            per_prompt[-1]["ddtree_divergence"] = {
                "position": at, "greedy_token": g[at] if at < len(g) else None,
                "ddtree_token": d.tokens[at] if at < len(d.tokens) else None,
                "top1_top2_logprob_gap": round(gap, 5), "top1": top1, "top2": top2}
    tokens = sum(lp.numel() for lp in logprobs)
    summary = {
        "answer_tokens": tokens,
        "mean_nll": round(-sum(float(lp.double().sum()) for lp in logprobs) / tokens, 6),
        "perplexity": round(perplexity(logprobs), 6),
        "ddtree": {"budget": budget, "generated_tokens": generated, "verify_steps": steps, "drafted_steps": drafted,
                   "accepted_tokens": accepted,
                   # Pooled: 1 + total accepted / total drafted steps (as bench.acceptance and the gateway count).
                   "tau": round(1 + accepted / drafted, 4) if drafted else None,
                   "tokens_per_step": round((generated - len(trees)) / steps, 4) if steps else None},
        # Lossless check: DDTree's output is this target's own greedy answer, prompt by prompt.
        "ddtree_equals_greedy": sum(pp["ddtree_equals_greedy"] for pp in per_prompt),
        "greedy_equals_reference": sum(pp["greedy_equals_reference"] for pp in per_prompt),
        "greedy_shared_prefix_mean": round(sum(pp["greedy_shared_prefix"] for pp in per_prompt) / len(per_prompt), 2),
        # Where DDTree's answer left greedy's: the target's top-1 - top-2 log-prob gap there (near 0: a near-tie
        # that the 1-row and many-row forwards round to different sides).
        "ddtree_divergence_gaps": [pp["ddtree_divergence"]["top1_top2_logprob_gap"] for pp in per_prompt
                                   if "ddtree_divergence" in pp],
        "seconds": {"greedy": round(t_ar - t0, 1), "perplexity": round(t_tf - t_ar, 1),
                    "ddtree": round(t_dd - t_tf, 1)},
        "per_prompt": per_prompt,
    }
    return summary, greedy


def compare(results: dict[str, dict], reference: str) -> dict[str, dict]:
    """Each quantized target's perplexity and tau relative to the reference's, with the issue's thresholds."""
    ref = results[reference]
    out = {}
    for label, r in results.items():
        if label == reference:
            continue
        ppl_rel = relative(r["perplexity"], ref["perplexity"])
        tau, ref_tau = r["ddtree"]["tau"], ref["ddtree"]["tau"]
        tau_rel = relative(tau, ref_tau) if tau and ref_tau else None
        out[label] = {"perplexity_relative": round(ppl_rel, 5), "tau_relative": None if tau_rel is None
                      else round(tau_rel, 5),
                      "perplexity_within_2pct": abs(ppl_rel) <= PPL_TOLERANCE,
                      "tau_within_5pct": tau_rel is not None and abs(tau_rel) <= TAU_TOLERANCE}
    return out


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:+.2f} %"


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    import transformers

    from drafter_svc.runner import DrafterConfig, DrafterRunner
    from target_svc.quantization import QUANTIZE_MODES, tensor_bytes
    from target_svc.runner import TargetConfig, TargetRunner

    modes = [m.strip() for m in args.quantize.split(",") if m.strip()]
    bad = [m for m in modes if m not in QUANTIZE_MODES or m == "none"]
    if bad or not modes:
        raise SystemExit(f"--quantize: one or more of {', '.join(QUANTIZE_MODES[1:])}, got {args.quantize!r}")
    args.threads = common.in_process_threads(args.device, args.threads)
    model, drafter_dir = common.resolve_model(args.model), common.resolve_drafter(args.drafter)
    prompts, source = common.load_prompts(args.prompts, args.num_prompts or None, args.offset)
    command, date = common.command_line("bench.quant_quality"), common.now_utc()
    hw = common.hardware(args.device, args.dtype, args.threads)
    dtype = getattr(torch, args.dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    prompt_ids = [common.chat_ids(tokenizer, p["text"]) for p in prompts]
    # The drafter reads the target's embedding and LM head, which no quantize mode touches: one serves them all.
    drafter = DrafterRunner(DrafterConfig(drafter_dir=drafter_dir, target_model_dir=model, device=args.device,
                                          dtype=dtype, max_batch=1, max_seq_len=args.max_seq_len))
    print(f"{len(prompts)} prompts from {source}; {args.max_tokens} tokens; {args.dtype} vs {', '.join(modes)} on "
          f"{args.device}", flush=True)

    t_start = time.perf_counter()
    results: dict[str, dict] = {}
    answers = None
    for mode in ["none", *modes]:
        label = args.dtype if mode == "none" else mode
        t0 = time.perf_counter()
        runner = TargetRunner(TargetConfig(model_dir=model, device=args.device, dtype=dtype, max_batch=1,
                                           max_seq_len=args.max_seq_len, max_tree_nodes=args.budget + 1,
                                           quantize=mode))
        runner.set_feature_layers(drafter.target_layer_ids)
        load_s = time.perf_counter() - t0
        summary, greedy = measure_target(runner, drafter, prompts, prompt_ids, answers, args.max_tokens, args.budget)
        if answers is None:
            answers = greedy  # the unquantized target's greedy answers: what every target is scored on
        t = runner.target
        summary.update(quantize=mode, load_seconds=round(load_s, 1),
                       weight_bytes=tensor_bytes(t.embed_tokens, t.layers, t.norm, t.lm_head),
                       matmul_backend=matmul_backend(t))
        results[label] = summary
        print(f"{label:9s}: perplexity {summary['perplexity']:.4f} over {summary['answer_tokens']} answer tokens, "
              f"DDTree-{args.budget} tau {summary['ddtree']['tau']}, ddtree == greedy "
              f"{summary['ddtree_equals_greedy']}/{len(prompts)}, {time.perf_counter() - t0:.0f} s", flush=True)
        # One target at a time: the next one loads into the memory this one held.
        del runner, t
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    total_s = time.perf_counter() - t_start
    comparison = compare(results, args.dtype)
    write_report(args, results, comparison, prompts, source, command, date, hw, model, drafter_dir, total_s)


def write_report(args, results: dict, comparison: dict, prompts: list[dict], source: str, command: str, date: str,
                 hw: dict, model: str, drafter_dir: str, total_s: float) -> None:
    """bench/results/quant-quality-<hardware>.{json,md}."""
    model_info, drafter_info = common.describe_checkpoint(model), common.describe_checkpoint(drafter_dir)
    issue_setting = args.device.startswith("cuda") and args.dtype == "bfloat16"
    caveat = ("" if issue_setting else
              f"\n**This is {args.dtype} vs {', '.join(comparison)} on `{args.device}`, not the issue's bf16 vs int8 "
              "on the GPU**: the reference here is the unquantized target in "
              f"{args.dtype}; the thresholds are applied as stated for the GPU setting.\n")
    data = {
        "command": command, "date": date, "hardware": hw, "run_seconds": round(total_s, 1),
        "setting": "issue (bf16 vs quantized on CUDA)" if issue_setting
        else f"{args.dtype} vs quantized on {args.device} (not the issue's bf16-on-GPU setting)",
        "reference": args.dtype, "quantize": list(comparison), "prompts": len(prompts), "prompt_source": source,
        "prompt_ids": [p["id"] for p in prompts], "max_tokens": args.max_tokens, "budget": args.budget,
        "chat_template": True, "temperature": 0.0, "model": model_info, "drafter": drafter_info,
        "thresholds": {"perplexity_relative": PPL_TOLERANCE, "tau_relative": TAU_TOLERANCE},
        "comparison": comparison,
        "targets": {k: {kk: vv for kk, vv in v.items() if kk != "per_prompt"} for k, v in results.items()},
        "per_prompt": {k: v["per_prompt"] for k, v in results.items()},
    }
    ref = args.dtype
    rows = []
    for label, r in results.items():
        c = comparison.get(label, {})
        d = r["ddtree"]
        rows.append([label, round(r["weight_bytes"] / 2**20, 1), r["matmul_backend"] or "–", r["answer_tokens"],
                     r["mean_nll"], round(r["perplexity"], 4),
                     _pct(c.get("perplexity_relative")) if c else "(reference)",
                     d["tau"], _pct(c.get("tau_relative")) if c else "(reference)", d["tokens_per_step"],
                     f"{r['ddtree_equals_greedy']}/{len(prompts)}",
                     "(reference)" if not c else f"{r['greedy_equals_reference']}/{len(prompts)}",
                     "–" if not c else r["greedy_shared_prefix_mean"]])
    table = common.md_table(["target", "weights MiB", "matmul", "answer tokens", "mean NLL", "perplexity",
                             f"ppl vs {ref}", f"DDTree-{args.budget} tau", f"tau vs {ref}", "tokens / step",
                             "ddtree == own greedy", f"greedy == {ref}'s", "shared prefix (mean tokens)"], rows)
    verdicts = "\n".join(
        f"- **{label}**: perplexity {_pct(c['perplexity_relative'])} "
        f"({'within' if c['perplexity_within_2pct'] else 'OUTSIDE'} 2 %); DDTree-{args.budget} tau "
        f"{_pct(c['tau_relative'])} ({'within' if c['tau_within_5pct'] else 'OUTSIDE'} 5 %)"
        for label, c in comparison.items())
    kinds = sorted({pp["kind"] or "-" for pp in next(iter(results.values()))["per_prompt"]})
    kind_rows = []
    for label, r in results.items():
        row = [label]
        for k in kinds:
            pps = [pp for pp in r["per_prompt"] if (pp["kind"] or "-") == k]
            n = sum(pp["answer_tokens"] for pp in pps)
            row.append(round(math.exp(sum(pp["nll_sum"] for pp in pps) / n), 4) if n else None)
        kind_rows.append(row)
    kind_table = common.md_table(["target", *kinds], kind_rows)
    parted = [f"- {label}: " + ", ".join(f"token {pp['ddtree_divergence']['position']} (gap "
                                         f"{pp['ddtree_divergence']['top1_top2_logprob_gap']:.3g})"
                                         for pp in r["per_prompt"] if "ddtree_divergence" in pp)
              for label, r in results.items() if any("ddtree_divergence" in pp for pp in r["per_prompt"])]
    divergence = ("\n\nWhere a DDTree answer left the same target's greedy answer, and the target's top-1 minus top-2 "
                  "log-prob there (near 0: a near-tie that forwards of different shapes round apart):\n\n"
                  + "\n".join(parted)) if parted else ""
    gpu = f", {hw['gpu']}" if hw.get("gpu") else ""
    md = f"""# Quantized target quality: perplexity and DDTree acceptance ({common.hardware_tag(hw)})
{caveat}
- Command: `{command}`
- Date: {date}; whole run {total_s:.0f} s
- Hardware: {hw['cpu_model']} ({hw['usable_cpus']} usable of {hw['logical_cpus']} logical CPUs){gpu}; device `{args.device}`, reference dtype {args.dtype}, torch threads {args.threads or 'default'}; load average at start {hw.get('load_average_at_start')}
- Software: torch {hw['torch']}, transformers {hw['transformers']}, Python {hw['python']}
- Target: `{model_info['dir']}` ({model_info.get('architectures')}, {model_info.get('num_hidden_layers')} layers); drafter: `{drafter_info['dir']}` ({'the bundled trained drafter' if drafter_info.get('bundled_drafter') else 'NOT the bundled trained drafter'}, weights sha256 {drafter_info.get('weights_sha256')}…)
- Prompts: {len(prompts)} from {source}, one user message each under the chat template; greedy; {args.max_tokens} answer tokens (EOS honoured)
- In process (TargetRunner + DrafterRunner, no services), one target loaded at a time

Perplexity = exp(mean NLL) of the **{ref} target's greedy answers** ({results[ref]['answer_tokens']} tokens), teacher-forced with
the prompt as context, through each target's own forward (the quantized weights and matmul backend as served).
tau = 1 + accepted draft tokens / drafted verify steps, pooled, each target generating its own greedy answers
with DDTree budget {args.budget} (the gateway's depth bounds). "ddtree == own greedy" is the lossless check against the
same target's autoregressive output; "greedy == {ref}'s" counts the prompts whose greedy answer is unchanged by
quantization.

{table}{divergence}

The issue's thresholds (perplexity within {100 * PPL_TOLERANCE:.0f} %, DDTree-64 tau within {100 * TAU_TOLERANCE:.0f} %, both relative to the unquantized target; the issue states them for int8):

{verdicts}

## Perplexity by prompt kind

{kind_table}
"""
    common.write_outputs(args.out_dir, f"quant-quality-{common.hardware_tag(hw)}", data, md)


if __name__ == "__main__":
    sys.exit(main())
