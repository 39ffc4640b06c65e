"""Assembles bench/results/h200.{md,json} (and a tokens/s-vs-budget plot) from one run's step-cost and speed files.

    python -m bench.h200_report --step-cost step-cost-qwen3-8b-*.json --speed speed-*.json \
        [--hybrid-step-cost step-cost-qwen3.6-27b-*.json] [--hybrid-speed speed-hybrid-*.json] \
        [--fit flagship-fit-*.json] [--quant-step-cost step-cost-qwen3-8b-*.json ...] \
        [--quality quant-quality-*.json] --out-dir bench/results

Every figure is a ratio or a time from the files named; the report restates their commands, dates and GPU.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import common
from target_svc.int8_matmul import FUSED_REDUCE_ENV, PDL_ENV
from target_svc.int8_tiles import TILES_ENV


def _load(path: str | None) -> dict | None:
    return json.loads(Path(path).read_text()) if path else None


def _row(rows: list[dict], **match) -> dict:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    raise KeyError(f"no row with {match}")


def _sized_row(rows: list[dict], batch: int, sizes: tuple[int, ...]) -> dict | None:
    """The batch's row of the first tree size in sizes that the run measured, else None."""
    for nodes in sizes:
        for r in rows:
            if r.get("batch") == batch and r.get("nodes") == nodes:
                return r
    return None


CALIBRATION_KEY = "calibrated_acceptance"  # where bench.speed records a calibrated run's profile and taus


def _run(speed: dict, mode: str, batch: int, budget: int | None = None) -> dict | None:
    """The run of mode at batch (and budget); with several budgets and none given, the fastest one."""
    runs = [r for r in speed["runs"] if r.get("mode") == mode and r.get("batch") == batch
            and (budget is None or r.get("budget") == budget) and "tokens_per_s" in r]
    return max(runs, key=lambda r: r["tokens_per_s"]) if runs else None


def _hf(speed: dict, batch: int) -> dict | None:
    for r in speed["runs"]:
        if r.get("system", "").startswith("transformers generate (greedy") and r.get("batch") == batch:
            return r
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b in (None, 0) else round(a / b, 3)


def summarize(step: dict, speed: dict | None, budget: int | None, prefix: str, batched: dict | None = None) -> dict:
    """The headline numbers of one model shape. batched: another run's speed file whose batched rows (batch > 1)
    stand in for speed's where speed ran batch 1 alone (each ratio within its own run; its date is recorded)."""
    floors = step["floors"]
    ar1 = _row(step["target"], batch=1, nodes=1)
    # A 64-node tree: budget 63 in a graph bucket of its own where the run measured one, else budget 64's 65 nodes.
    v64 = _sized_row(step["target"], 1, (64, 65))
    chain = _sized_row(step["target"], 1, (17, 16))   # a 16-deep chain (its root and 16 drafts), else 15 drafts
    draft = _row(step["drafter"], batch=1, mode="tree")
    out = {
        f"gemv_floor_ms_{prefix}": round(floors["gemv_floor_ms"], 3),
        f"weight_read_floor_ms_{prefix}": round(floors["weight_read_floor_ms"], 3),
        f"ar_forward_graph_ms_{prefix}": round(ar1["forward_graph_ms"], 3),
        f"ar_verify_call_graph_ms_{prefix}": round(ar1["verify_graph_ms"], 3),
        f"verify64_over_decode_{prefix}": _ratio(v64["forward_graph_ms"], ar1["forward_graph_ms"]),
        f"verify64_nodes_{prefix}": v64["nodes"],
        f"chain16_over_decode_{prefix}": _ratio(chain["forward_graph_ms"], ar1["forward_graph_ms"]) if chain else None,
        f"drafter_call_graph_ms_{prefix}": round(draft["draft_graph_ms"], 3),
        # The captured forward and top-K alone where the run measured it (2026-12-06 on), else the whole call.
        f"drafter_forward_graph_ms_{prefix}": round(draft.get("forward_graph_ms") or draft["draft_graph_ms"], 3),
    }
    if speed is None:
        return out
    ar = _run(speed, "ar", 1)
    dd = _run(speed, "ddtree", 1, budget)
    if ar:
        out[f"ar_step_ms_{prefix}"] = ar["breakdown"]["per_step_ms"]["step"]
        out[f"ar_step_over_gemv_floor_{prefix}"] = _ratio(out[f"ar_step_ms_{prefix}"], floors["gemv_floor_ms"])
        out[f"drafter_forward_over_ar_step_{prefix}"] = _ratio(out[f"drafter_forward_graph_ms_{prefix}"],
                                                               out[f"ar_step_ms_{prefix}"])
        out[f"drafter_call_over_ar_step_{prefix}"] = _ratio(draft["draft_graph_ms"], out[f"ar_step_ms_{prefix}"])
    if dd:
        out[f"overhead_fraction_{prefix}_b1"] = dd["breakdown"]["per_step_ms"].get("non_forward_share_of_step")
        out[f"ddtree_over_ar_{prefix}_b1"] = dd.get("x_vs_services_ar")
        out[f"ddtree_over_dflash_{prefix}_b1"] = dd.get("x_vs_services_dflash")
        out[f"ddtree_over_hf_{prefix}_b1"] = dd.get("x_vs_hf_generate_b1")
        out[f"ddtree_tau_{prefix}_b1"] = dd.get("tau")
        if dd.get("x_vs_services_dflash_tau_se") is not None:   # speed files of 2026-12-06 on: the draws' error
            out[f"ddtree_tau_se_{prefix}_b1"] = dd.get("tau_se")
            out[f"ddtree_over_dflash_tau_se_{prefix}_b1"] = dd["x_vs_services_dflash_tau_se"]
        out[f"ddtree_budget_{prefix}_b1"] = dd.get("budget")
    # Older speed files name one batched size ("batch"), newer ones every size ("batches").
    def batch_sizes(run: dict) -> list[int]:
        return [b for b in run.get("batches") or ([run["batch"]] if run.get("batch") else []) if b != 1]

    source = speed if batch_sizes(speed) or batched is None else batched
    for batch in batch_sizes(source):
        ddb = _run(source, "ddtree", batch, budget)
        if ddb:
            out[f"ddtree_over_ar_{prefix}_b{batch}"] = ddb.get("x_vs_services_ar")
            out[f"ddtree_budget_{prefix}_b{batch}"] = ddb.get("budget")
    if source is not speed:
        out[f"batched_from_{prefix}"] = f"{source['date']}: {source['command']}"
    return out


def summarize_quantized(runs: list[dict]) -> dict:
    """Weight-only quantization at the 8B shape, from step-cost runs of one session (bf16, int8, int4 on one
    checkpoint): each format's 1-token forward, its ratio to bf16's, and its 65-node verify (and 64-node, where
    measured) over its own 1-token forward (CUDA-graph replays, device time). A run's kernel switches extend its
    mode's name: the fused split-K reduction on "fused" (int8fused), no tile table "untuned" (int8untuned),
    programmatic dependent launch "pdl" (int8pdl: DDTREE_INT8_PDL and inductor's TORCHINDUCTOR_ENABLE_PDL on, or
    the latter alone), "pdlk" for the int8 kernels' alone (int8pdlk)."""
    def name(run: dict) -> str:
        switches = run.get("switches", {})
        out = run.get("quantize", "none") + ("fused" if switches.get(FUSED_REDUCE_ENV) == "on" else "")
        out += "untuned" if switches.get(TILES_ENV, "").strip().lower() == "off" else ""
        kernels = switches.get(PDL_ENV, "").strip().lower() == "on"
        glue = switches.get("TORCHINDUCTOR_ENABLE_PDL") == "1"
        return out + ("pdl" if glue else "pdlk" if kernels else "")

    by_mode = {name(r): r for r in runs}
    out = {}
    base = by_mode.get("none")
    base_ar = _row(base["target"], batch=1, nodes=1)["forward_graph_ms"] if base else None
    for mode, run in sorted(by_mode.items()):
        name = "bf16" if mode == "none" else mode
        ar = _row(run["target"], batch=1, nodes=1)
        out[f"{name}_ar_forward_graph_ms_8b"] = round(ar["forward_graph_ms"], 3)
        out[f"{name}_weight_read_floor_ms_8b"] = round(run["floors"]["weight_read_floor_ms"], 3)
        out[f"{name}_gemv_floor_ms_8b"] = round(run["floors"]["gemv_floor_ms"], 3)
        # verify64: a budget-64 tree (65 nodes) where measured, else a 64-node one (budget 63, in a bucket of its
        # own: --graph-node-sizes 64); the _verify_64_nodes_ key keeps the 64-node figure whenever there is one.
        by_nodes = {r.get("nodes"): r for r in run["target"] if r.get("batch") == 1}
        verify = by_nodes.get(65) or by_nodes.get(64)
        if verify is None:
            raise KeyError(f"{mode}: no 64- or 65-node verify at batch 1")
        out[f"{name}_verify64_over_ar_8b"] = _ratio(verify["forward_graph_ms"], ar["forward_graph_ms"])
        out[f"{name}_verify64_nodes_8b"] = verify["nodes"]
        if 64 in by_nodes:
            out[f"{name}_verify_64_nodes_over_ar_8b"] = _ratio(by_nodes[64]["forward_graph_ms"], ar["forward_graph_ms"])
        if mode != "none" and base_ar:
            out[f"{name}_ar_over_bf16_8b"] = _ratio(ar["forward_graph_ms"], base_ar)
    return out


def summarize_quality(quality: dict) -> dict:
    """bench.quant_quality's comparison: each format's perplexity and DDTree tau relative to the reference."""
    out = {"quality_setting": f"{quality['reference']} reference, {quality['prompts']} held-out prompts x "
                              f"{quality['max_tokens']} tokens, DDTree budget {quality['budget']}"}
    for mode, c in quality["comparison"].items():
        out[f"quality_{mode}_perplexity_relative"] = c["perplexity_relative"]
        out[f"quality_{mode}_tau_relative"] = c["tau_relative"]
    return out


def plot(speed: dict, path: Path, gpu: str = "H200") -> bool:
    """tokens/s against budget at batch 1 (ddtree), with ar and dflash as lines; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    dd = sorted((r["budget"], r["tokens_per_s"]) for r in speed["runs"] if r.get("mode") == "ddtree" and r["batch"] == 1)
    fig, ax = plt.subplots(figsize=(6, 4))
    if dd:
        ax.plot([b for b, _ in dd], [t for _, t in dd], "o-", label="ddtree")
    for mode, style in (("ar", "--"), ("dflash", ":")):
        r = _run(speed, mode, 1)
        if r:
            ax.axhline(r["tokens_per_s"], linestyle=style, label=mode, color="gray" if mode == "ar" else "black")
    hf = _hf(speed, 1)
    if hf:
        ax.axhline(hf["tokens_per_s"], linestyle="-.", label="transformers generate", color="red")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("DDTree budget (nodes)")
    ax.set_ylabel("tokens/s (batch 1)")
    calibrated = " (calibrated acceptance, bench-only)" if speed.get(CALIBRATION_KEY) else ""
    ax.set_title(f"Qwen3-8B shape, {gpu}, bf16" + calibrated, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.h200_report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step-cost", help="the Qwen3-8B step costs (the 8B figures; optional with another input)")
    p.add_argument("--speed")
    p.add_argument("--batched-speed", help="an earlier 8B speed file whose batch > 1 rows stand in where --speed ran "
                   "batch 1 alone (its ratios are within its own run; the report names it)")
    p.add_argument("--hybrid-step-cost")
    p.add_argument("--hybrid-speed")
    p.add_argument("--hybrid-batched-speed", help="--batched-speed for the hybrid shape")
    p.add_argument("--fit", help="bench.flagship_fit's JSON: the Qwen3.6-27B-within-48-GB figures (fit_*)")
    p.add_argument("--quant-step-cost", action="append", default=[],
                   help="bench.step_cost JSON at the 8B shape, one per --quantize mode of one session (none too)")
    p.add_argument("--quality", help="bench.quant_quality's JSON (bf16 vs quantized on the GPU)")
    p.add_argument("--budget", type=int, default=None,
                   help="the budget the headline ratios use (default: the fastest measured budget per batch size)")
    p.add_argument("--note", action="append", default=[], help="a line for the report's Notes section")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    p.add_argument("--stem", default="h200",
                   help="names the outputs <stem>.{md,json} and <stem>-tokens-per-s.png (another GPU's run: h100)")
    args = p.parse_args(argv)
    step, speed = _load(args.step_cost), _load(args.speed)
    hstep, hspeed = _load(args.hybrid_step_cost), _load(args.hybrid_speed)
    batched, hbatched = _load(args.batched_speed), _load(args.hybrid_batched_speed)
    fit, quality = _load(args.fit), _load(args.quality)
    quant = [_load(f) for f in args.quant_step_cost]
    first = step or hstep or fit or (quant[0] if quant else None)
    if first is None:
        p.error("give --step-cost, --hybrid-step-cost, --fit or --quant-step-cost")
    data = {"date": first["date"], "gpu": first["hardware"].get("gpu"), "command": first["command"],
            "commands": [x["command"] for x in (step, speed, batched, hstep, hspeed, hbatched, fit, *quant, quality)
                         if x],
            **(summarize(step, speed, args.budget, "8b", batched) if step else {})}
    if hstep:
        h = summarize(hstep, hspeed, args.budget, "hybrid", hbatched)
        data.update(h)
        data["hybrid_ar_step_ms"] = h.get("ar_step_ms_hybrid", h["ar_verify_call_graph_ms_hybrid"])
        data["hybrid_floor_ms"] = h["gemv_floor_ms_hybrid"]
        data["hybrid_verify64_over_decode"] = h["verify64_over_decode_hybrid"]
        data["hybrid_chain16_over_decode"] = h["chain16_over_decode_hybrid"]
        data["hybrid_ddtree_over_ar_b1"] = h.get("ddtree_over_ar_hybrid_b1")
    if fit:
        from bench.flagship_fit import headline

        data.update(headline(fit))
    if quant:
        data.update(summarize_quantized(quant))
    if quality:
        data.update(summarize_quality(quality))
    if speed and speed.get(CALIBRATION_KEY):
        data["calibration"] = speed[CALIBRATION_KEY]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.stem
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    lines = [f"# {stem.upper()} results ({data['gpu']}, bf16, random weights at real shapes)", "",
             f"Date: {data['date']}", "", "Commands:", *[f"- `{c}`" for c in data["commands"]], ""]
    if speed and speed.get(CALIBRATION_KEY):
        lines += ["**Acceptance is calibrated (bench-only)**: the drafter runs its real forward, and its top-K lists "
                  f"are rewritten from a profile measured on a real pair (see `calibration` in {stem}.json).", ""]
    lines += [common.md_table(["figure", "value"], [[k, v] for k, v in data.items()
                                                    if k not in ("commands", "calibration", "command")])]
    if speed and plot(speed, out / f"{stem}-tokens-per-s.png", stem.upper()):
        lines += ["", f"![tokens/s against budget]({stem}-tokens-per-s.png)"]
    if args.note:
        lines += ["", "## Notes", "", *[f"- {n}" for n in args.note]]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
