"""Speed benchmark: tokens/s as ratios measured in one run, and where the time of a speculative step goes.

Through one gateway/target/drafter stack (modes and budgets are per request): `ar`, `dflash` and `ddtree`
(--budget, one or several) at batch 1 (the prompts one at a time) and at batch N (chunks of N prompts in flight
at once). In this same process and on the same device/dtype/threads: transformers' own greedy `generate()` (batch
1, and left-padded batches of N), and its assisted generation by prompt lookup (`prompt_lookup_num_tokens`, needs
no extra model; batch 1). Same prompts (the gateway's own chat rendering, sent as token ids), same max_tokens,
EOS honoured, temperature 0, so every system produces the same text. The systems are interleaved: each chunk of
prompts goes through every system (in an order that rotates per chunk) before the next chunk, so that background
load drifting during the run spreads over all of them alike.

The per-step breakdown comes from the services' Prometheus metrics, as deltas between scrapes around each
request set: gateway step/draft/tree-build/verify times, gateway-side (client) vs server-side latency of the Verify and
Draft RPCs (the difference is the gRPC hop), the target's and drafter's forward times and the feature transport.

    python -m bench.speed                                   # CPU defaults: 4 prompts x 64 tokens, batch 4
    python -m bench.speed --device cuda --dtype bfloat16    # GPU defaults: 16 prompts x 256 tokens, batch 8

    python -m bench.speed --calibrated bench/results/calibration-profile-smollm2.steps.npz --calibrate-chain-tau 7.79
        # BENCH-ONLY calibrated acceptance (bench/calibrated.py): random-weight checkpoints at real shapes

Writes bench/results/speed-<hardware>.{md,json} (or --out-dir); calibrated runs speed-calibrated-<hardware>.*
"""
from __future__ import annotations

import argparse
import re
import shlex
import sys
import time

from bench import common
from bench.hf_baseline import HFModel, HFSystem

MODES = ("ar", "dflash", "ddtree")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target checkpoint dir (default: SmolLM2-135M-Instruct from the packaged GGUF)")
    p.add_argument("--drafter", help="DFlash drafter dir (default: ddtree_serve/assets/smollm2-dflash)")
    p.add_argument("--prompts", help="prompt file (default: bench/heldout_prompts.json)")
    p.add_argument("--num-prompts", type=int, default=None, help="first N prompts (default: 4 on CPU, 16 otherwise)")
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=None, help="max new tokens (default: 64 on CPU, 256 otherwise)")
    p.add_argument("--budget", default="64", help="DDTree budget, or several comma-separated (each its own run)")
    p.add_argument("--batch", default=None, help="requests in flight for the batched runs, one or a comma list "
                                                "(e.g. 8,32; default: 4 on CPU, 8 otherwise)")
    p.add_argument("--modes", default=",".join(MODES), help="service modes to run (comma-separated)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--drafter-device", default=None, help="drafter service device (default: --device)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per model service, and for transformers in this process")
    p.add_argument("--prompt-lookup", type=int, default=10, help="prompt_lookup_num_tokens for assisted generation")
    p.add_argument("--no-hf", action="store_true", help="skip transformers generate() entirely")
    p.add_argument("--no-assisted", action="store_true", help="skip prompt-lookup assisted generation")
    p.add_argument("--no-hf-batch", action="store_true", help="skip transformers' batched generate()")
    p.add_argument("--hf-prompts", type=int, default=None,
                   help="transformers runs only the first N prompts (its tok/s over those; default: all): at the "
                        "GPU's long generations its eager generate() would take most of the run")
    p.add_argument("--warmup-tokens", type=int, default=8)
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no new chunk of prompts after this many seconds of the run: a run that would outlast "
                        "its time limit reports the chunks every system finished instead of nothing (the report "
                        "says so); default: every chunk")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--max-batch", type=int, default=None,
                   help="the target's cache slots (default: max(8, the largest --batch)); a batch-1 run at --max-batch 1 "
                        "captures a quarter of the verify graphs, so a short device call spends its time timing")
    p.add_argument("--target-args", default="",
                   help="extra flags of the target service, one string (e.g. "
                        "--target-args=\"--graph-node-sizes 64,129\": each budget's verify in a graph bucket of "
                        "its exact size)")
    p.add_argument("--transport", default="inline", choices=["inline", "shm", "cuda-ipc"],
                   help="how the target sends context features to the drafter")
    p.add_argument("--step-transport", default="grpc", choices=["grpc", "socket"],
                   help="the step calls on gRPC streams or on the services' step sockets (bare Unix sockets)")
    p.add_argument("--kernel-warmup-passes", type=int, default=None,
                   help="the target's kernel warm-up passes before it loads (default: the target's own; 0 skips them: "
                        "they bound device memory outside the allocator, which a speed run does not need)")
    p.add_argument("--step-spin-us", type=int, default=None,
                   help="the gateway's --step-spin-us (default: the gateway's, 0: the step answers are awaited in "
                        "the event loop only)")
    p.add_argument("--pin-cpus", action="store_true",
                   help="each service on CPUs of its own (`up --pin-cpus`)")
    p.add_argument("--no-early-push", action="store_true",
                   help="the target pushes a verify's features after its results reach the host (the comparison for "
                        "the default early pushes over cuda-ipc/shm; target --no-early-push)")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    p.add_argument("--log-dir", default="", help="keep the services' logs here (default: a temporary folder)")
    p.add_argument("--calibrated", metavar="PROFILE",
                   help="BENCH-ONLY calibrated acceptance: the gateway rewrites drafts so that acceptance follows this "
                        "profile (bench/calibration_profile.py: a step-replay .steps.npz or a rank-table .json); an ar "
                        "reference run of the prompts comes first")
    p.add_argument("--calibrate-chain-tau", type=float, default=None,
                   help="with --calibrated: rescale the profile so that its chain tau is this (e.g. 7.79, the DFlash "
                        "paper's Qwen3-8B MATH-500 chain)")
    args = p.parse_args(argv)
    if args.calibrate_chain_tau and not args.calibrated:
        p.error("--calibrate-chain-tau needs --calibrated")
    return args


# ---- services ---------------------------------------------------------------------------------------------------
# A step's segments between the processes (gateway/step_timeline.py), in the order of the critical path.
SEGMENTS = ("feature_push", "push_staging", "push_trip", "drafter_store_and_draft", "verify_done_to_draft",
            "draft_request", "draft_handler", "draft_reply", "draft_answer", "gateway_tree", "verify_request", "target_handler",
            "verify_answer", "gateway_between_steps")


def breakdown(before: dict, after: dict) -> dict:
    """Per-step times (ms) of one phase from the three services' metric deltas. Series are summed over every
    label value (the gateway labels its step histograms by mode, but one phase runs one mode only)."""
    g0, g1 = before["gateway"], after["gateway"]
    t0, t1 = before["target"], after["target"]
    d0, d1 = before["drafter"], after["drafter"]
    H = common.hist_delta
    b = {
        "step": H(g0, g1, "ddtree_step_seconds"),
        "draft_phase": H(g0, g1, "ddtree_draft_seconds"),
        "tree_build": H(g0, g1, "ddtree_tree_build_seconds"),
        "verify_phase": H(g0, g1, "ddtree_verify_seconds"),
        "verify_rpc_client": H(g0, g1, "ddtree_rpc_client_latency_seconds", service="gateway",
                               method="TargetService/Verify"),
        "verify_rpc_server": H(t0, t1, "ddtree_rpc_server_latency_seconds", method="TargetService/Verify"),
        "target_verify_forward": H(t0, t1, "ddtree_target_forward_seconds", op="verify"),
        "draft_rpc_client": H(g0, g1, "ddtree_rpc_client_latency_seconds", service="gateway",
                              method="DrafterService/Draft"),
        "draft_rpc_server": H(d0, d1, "ddtree_rpc_server_latency_seconds", method="DrafterService/Draft"),
        "drafter_forward": H(d0, d1, "ddtree_drafter_forward_seconds"),
        "prefill_rpc_client": H(g0, g1, "ddtree_rpc_client_latency_seconds", service="gateway",
                                method="TargetService/Prefill"),
        "target_prefill_forward": H(t0, t1, "ddtree_target_forward_seconds", op="prefill"),
        "push_features_rpc_client": H(t0, t1, "ddtree_rpc_client_latency_seconds", method="DrafterService/PushFeatures"),
        "push_features_rpc_server": H(d0, d1, "ddtree_rpc_server_latency_seconds",
                                      method="DrafterService/PushFeatures"),
        "transport_send": H(t0, t1, "ddtree_transport_seconds", direction="send"),
        "prefetch_hits": common.delta(d0, d1, "ddtree_drafter_prefetched_drafts_total", outcome="hit"),
        "prefetch_misses": common.delta(d0, d1, "ddtree_drafter_prefetched_drafts_total", outcome="miss"),
        "batch_size": H(g0, g1, "ddtree_step_batch_size"),
        **{f"segment_{name}": H(g0, g1, "ddtree_step_segment_seconds", segment=name) for name in SEGMENTS},
        "tree_size": H(g0, g1, "ddtree_tree_size_nodes"),
    }
    steps = b["step"]["count"]
    for k in ("batch_size", "tree_size"):  # means of counts, not times
        h = b[k]
        h["mean"] = round(h.pop("sum_s") / h["count"], 2) if h["count"] else None
        h.pop("mean_ms")

    def per_step(name: str) -> float | None:
        """Total time of a family over the phase / engine steps, ms (0 when the family never ran)."""
        return round(1000 * b[name]["sum_s"] / steps, 3) if steps else None

    ps = {k: per_step(k) for k in ("step", "draft_phase", "tree_build", "verify_phase", "verify_rpc_client",
                                   "verify_rpc_server", "target_verify_forward", "draft_rpc_client",
                                   "draft_rpc_server", "drafter_forward", "push_features_rpc_client",
                                   "transport_send")}
    if steps:
        ps["gateway_other"] = round(ps["step"] - ps["draft_phase"] - ps["tree_build"] - ps["verify_phase"], 3)
        ps["verify_hop"] = round(ps["verify_rpc_client"] - ps["verify_rpc_server"], 3)
        ps["draft_hop"] = round(ps["draft_rpc_client"] - ps["draft_rpc_server"], 3)
        ps["verify_server_non_forward"] = round(ps["verify_rpc_server"] - ps["target_verify_forward"], 3)
        # Drafts made on push run their forward outside the Draft handler: this is the handler's time (waiting for
        # the features, slicing a prefetched draft or drafting on request), not "handler minus forward".
        ps["draft_server"] = ps["draft_rpc_server"]
        asked = b["prefetch_hits"] + b["prefetch_misses"]
        ps["prefetch_hit_share"] = round(b["prefetch_hits"] / asked, 3) if asked else None
        ps["forward_total"] = round(ps["target_verify_forward"] + ps["drafter_forward"], 3)
        ps["non_forward"] = round(ps["step"] - ps["forward_total"], 3)
        ps["hop_share_of_step"] = round((ps["verify_hop"] + ps["draft_hop"]) / ps["step"], 4) if ps["step"] else None
        ps["non_forward_share_of_step"] = round(ps["non_forward"] / ps["step"], 4) if ps["step"] else None
    return {"engine_steps": steps, "per_step_ms": ps, "histograms": b}


class ServiceSystem:
    """One (mode, budget) through the services; accumulates client timings and metric deltas over chunks."""

    def __init__(self, stack, client: common.GatewayClient, mode: str, budget: int, batch: int, max_tokens: int):
        self.stack, self.client = stack, client
        self.mode, self.budget, self.batch, self.max_tokens = mode, budget, batch, max_tokens
        self.name = f"services {mode}" + (f" b{budget}" if mode == "ddtree" else "")
        self.results: dict[int, common.Result] = {}
        self.wall = 0.0
        self.deltas: dict[str, dict] = {}

    def warmup(self, chunk: list[tuple[int, list[int]]], tokens: int) -> None:
        self.client.run([common.ids_request(ids, tokens, self.mode, self.budget) for _, ids in chunk], len(chunk))

    def run(self, chunk: list[tuple[int, list[int]]]) -> None:
        reqs = [common.ids_request(ids, self.max_tokens, self.mode, self.budget) for _, ids in chunk]
        before = common.scrape_all(self.stack)
        results, wall = self.client.run(reqs, len(reqs))
        after = common.scrape_all(self.stack)
        self.wall += wall
        for (i, _), r in zip(chunk, results):
            self.results[i] = r
        for svc, samples in after.items():
            acc = self.deltas.setdefault(svc, {})
            for k, v in samples.items():
                acc[k] = acc.get(k, 0.0) + v - before[svc].get(k, 0.0)

    def summary(self) -> dict:
        if not self.results:   # --deadline-s came before its first chunk
            return {"system": self.name, "mode": self.mode, "batch": self.batch, "error": "never run"}
        results = [self.results[i] for i in sorted(self.results)]
        zero = {svc: {} for svc in self.deltas}
        g = self.deltas["gateway"]
        drafts = common.total(g, "vllm:spec_decode_num_drafts_total")
        accepted = common.total(g, "vllm:spec_decode_num_accepted_tokens_total")
        per_depth = {int(dict(labels)["position"]): v for (name, labels), v in g.items()
                     if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
        tokens = sum(r.stats["generated_tokens"] for r in results)
        steps = sum(r.stats["steps"] for r in results)
        bd = breakdown(zero, self.deltas)
        return {
            "system": self.name, "mode": self.mode, "budget": self.budget if self.mode == "ddtree" else None,
            "batch": self.batch, "requests": len(results), "tokens": tokens, "wall_s": round(self.wall, 3),
            "tokens_per_s": round(tokens / self.wall, 3),
            "mean_latency_s": round(sum(r.client_latency_s for r in results) / len(results), 3),
            "mean_ttft_s": round(sum(r.client_ttft_s for r in results) / len(results), 4),
            "tau": round(1 + accepted / drafts, 3) if drafts else 1.0,
            # the sampling error of tau over this run's drafts (what a calibrated run's ratios carry from its draws)
            "tau_se": (None if not drafts else round(common.tau_standard_error(drafts, per_depth), 3)),
            "tokens_per_seq_step": round((tokens - len(results)) / steps, 3) if steps else None,
            "engine_steps": bd["engine_steps"],
            # prefill, release, streaming and gaps between the engine's steps
            "outside_steps_s": round(self.wall - bd["histograms"]["step"]["sum_s"], 3),
            "breakdown": bd, "outputs": [r.token_ids for r in results],
        }


def past_deadline(args, t_run: float) -> bool:
    """True once the run has used --deadline-s seconds (never without one)."""
    return args.deadline_s is not None and time.perf_counter() - t_run >= args.deadline_s


# ---- transformers -----------------------------------------------------------------------------------------------
def main(argv=None) -> None:
    args = parse_args(argv)
    on_cpu = args.device == "cpu"
    n_prompts = args.num_prompts if args.num_prompts is not None else (4 if on_cpu else 16)
    max_tokens = args.max_tokens or (64 if on_cpu else 256)
    batches = batch_sizes(args.batch, on_cpu)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "ar" not in modes:
        modes.insert(0, "ar")  # the baseline of every ratio
    budgets = [int(b) for b in str(args.budget).split(",") if b.strip()]
    plan = [(m, 0) for m in modes if m != "ddtree"] + ([("ddtree", b) for b in budgets] if "ddtree" in modes else [])
    prompts, source = common.load_prompts(args.prompts, n_prompts or None, args.offset)
    if args.max_batch is not None and args.max_batch < max(batches):
        raise SystemExit(f"--max-batch {args.max_batch} is below --batch {max(batches)}")
    if max(batches) > len(prompts):
        print(f"batch {max(batches)} > {len(prompts)} prompts: at most {len(prompts)} instead", flush=True)
        batches = sorted({min(b, len(prompts)) for b in batches})
    model, drafter = common.resolve_model(args.model), common.resolve_drafter(args.drafter)
    command, date = common.command_line("bench.speed"), common.now_utc()
    hw = common.hardware(args.device, args.dtype, args.threads)
    tag = common.hardware_tag(hw)
    print(f"{len(prompts)} prompts from {source}; max_tokens {max_tokens}; batch 1 and {batches}; "
          f"runs {plan}; hardware tag {tag}", flush=True)

    calib = None
    if args.calibrated:
        from bench import calibrated

        calib = calibrated.prepare(args.calibrated, args.calibrate_chain_tau, budgets)
        print(f"{calib.info['label'].upper()}: profile {calib.info['profile']}, implied chain tau "
              f"{calib.info['implied_chain_tau']}, DDTree {calib.info['implied_ddtree_tau']}", flush=True)

    t_run = time.perf_counter()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    hf = None if args.no_hf else HFModel(model, args.device, args.dtype)
    stack = common.start_stack(model, drafter, args.device, args.dtype, args.threads, budget=budgets[0],
                               max_batch=args.max_batch or max(8, *batches), max_seq_len=args.max_seq_len,
                               drafter_device=args.drafter_device,
                               gateway_args=(calib.gateway_args if calib else [])
                               + ([] if args.step_spin_us is None else ["--step-spin-us", str(args.step_spin_us)]),
                               transport=args.transport,
                               step_sockets=args.step_transport == "socket", log_dir=args.log_dir,
                               pin_cpus=args.pin_cpus,
                               target_args=([] if args.kernel_warmup_passes is None
                                            else ["--kernel-warmup-passes", str(args.kernel_warmup_passes)])
                               + (["--no-early-push"] if args.no_early_push else [])
                               + shlex.split(args.target_args))
    runs: list[dict] = []
    stopped: list[str] = []   # where --deadline-s cut the run short
    client = None
    try:
        common.wait_for_graphs(stack)   # nothing timed, the reference run included, while graphs capture
        client = common.GatewayClient(stack.gateway)   # one connection for every timed request
        prompt_ids = common.tokenize_chat(stack.gateway, [p["text"] for p in prompts])
        indexed = list(enumerate(prompt_ids))
        # The references must exist before any speculative request, warm-ups included. Where they are collected at
        # batch 1 and ar runs at batch 1, that timed ar run is the reference run (all its prompts first, not
        # interleaved with the others): the same requests, run once instead of twice.
        reference_ar = None
        if calib and max(batches) == 1 and ("ar", 0) in plan:
            reference_ar = ServiceSystem(stack, client, "ar", 0, 1, max_tokens)
            reference_ar.warmup(indexed[:1], args.warmup_tokens)
            for item in indexed:
                reference_ar.run([item])
            calibrated.save_references(calib, indexed, [reference_ar.results[i].token_ids for i, _ in indexed],
                                       reference_ar.wall)
            calib.info["reference_is_timed_ar"] = True
        elif calib:
            calibrated.collect_references(calib, stack.gateway, indexed, max_tokens, max(batches))
        for b in [1] + [b for b in batches if b > 1]:
            systems: list = [reference_ar if reference_ar is not None and b == 1 and mode == "ar"
                             else ServiceSystem(stack, client, mode, budget, b, max_tokens) for mode, budget in plan]
            if calib:
                for sys_ in systems:
                    sys_.name += " [calibrated]" if sys_.mode != "ar" else ""
            if hf is not None:
                if b == 1:
                    systems.append(HFSystem(hf, "transformers generate (greedy)", 1, max_tokens))
                    if not args.no_assisted:
                        systems.append(HFSystem(hf, f"transformers prompt-lookup (n={args.prompt_lookup})", 1,
                                                max_tokens, prompt_lookup_num_tokens=args.prompt_lookup))
                elif not args.no_hf_batch:
                    systems.append(HFSystem(hf, "transformers generate (greedy, left-padded)", b, max_tokens))
            # Every system but a reference run already timed (transformers' too: a list made before they join
            # left them unrun, 2026-12-07).
            interleaved = [sys_ for sys_ in systems if sys_ is not reference_ar]
            # Warm-up, excluded from every figure: each system once on a short generation.
            for sys_ in interleaved:
                sys_.warmup(indexed[:b], args.warmup_tokens)
            # Interleaved: every chunk of b prompts goes through every system before the next chunk, the order
            # rotating per chunk, so that drifting background load spreads over all systems alike.
            chunks = [indexed[i:i + b] for i in range(0, len(indexed), b)]
            for c, chunk in enumerate(chunks):
                if past_deadline(args, t_run):   # checked between chunks: every system has run the same prompts
                    stopped.append(f"batch {b}: {c} of {len(chunks)} chunks ({min(c * b, len(indexed))} of "
                                   f"{len(indexed)} prompts) before the {args.deadline_s:.0f} s deadline")
                    print(f"deadline: {stopped[-1]}", flush=True)
                    break
                k = c % len(interleaved)
                for sys_ in interleaved[k:] + interleaved[:k]:
                    if isinstance(sys_, HFSystem) and args.hf_prompts is not None and c * b >= args.hf_prompts:
                        continue
                    sys_.run(chunk)
            for sys_ in systems:
                r = sys_.summary()
                runs.append(r)
                if "error" in r:
                    continue
                msg = f"{r['system']:44s} batch {b}: {r['tokens']} tokens in {r['wall_s']:.2f} s = " \
                      f"{r['tokens_per_s']:.2f} tok/s"
                if "breakdown" in r:
                    ps = r["breakdown"]["per_step_ms"]
                    msg += f", tau {_tau_cell(r)}, step {ps.get('step')} ms (draft {ps.get('draft_phase')}, " \
                           f"tree {ps.get('tree_build')}, verify {ps.get('verify_phase')})"
                    segments = {n: r["breakdown"]["histograms"].get(f"segment_{n}", {}).get("mean_ms") for n in SEGMENTS}
                    if any(v is not None for v in segments.values()):   # printed now: a run cut short keeps them
                        msg += "\n    segments (mean ms): " + ", ".join(f"{n} {v}" for n, v in segments.items()
                                                                       if v is not None)
                print(msg, flush=True)
            # Written after each batch size and before the services stop: a run cut short by its time limit
            # (stopping three services takes seconds) keeps the report of what it finished.
            report(args, runs, prompts, source, model, drafter, command, date, hw, tag, max_tokens, batches,
                   time.perf_counter() - t_run, _loadavg(), budgets, calibration=calib.info if calib else None,
                   stopped=stopped)
            if stopped:
                break
    finally:
        if client is not None:
            client.close()
        stack.stop()


def batch_sizes(arg: str | int | None, on_cpu: bool) -> list[int]:
    """The batched runs' sizes from --batch ("8" or "8,32"; default 4 on CPU, 8 otherwise), ascending, >= 1."""
    sizes = sorted({int(b) for b in str(arg).split(",") if b.strip()}) if arg else [4 if on_cpu else 8]
    if not sizes or sizes[0] < 1:
        raise SystemExit(f"--batch takes sizes >= 1, got {arg!r}")
    return sizes


def _loadavg():
    try:
        import os

        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def report(args, runs, prompts, source, model, drafter, command, date, hw, tag, max_tokens, batches, total_s,
           load_after_services, budgets, calibration: dict | None = None, stopped: list[str] | None = None) -> None:
    def find(system_prefix: str, b: int) -> dict | None:
        for r in runs:
            if r.get("system", "").startswith(system_prefix) and r.get("batch") == b and "tokens_per_s" in r:
                return r
        return None

    # Output agreement: every system against services-ar at batch 1 (greedy: all should match).
    ref = (find("services ar", 1) or {}).get("outputs", [])
    for r in runs:
        if "outputs" in r:
            same = sum(a == b for a, b in zip(r["outputs"], ref))   # a subset (--hf-prompts): the first prompts
            r["outputs_equal_services_ar"] = f"{same}/{min(len(r['outputs']), len(ref))}"

    hf1 = find("transformers generate (greedy)", 1)
    rows = []
    for r in runs:
        if "tokens_per_s" not in r:
            rows.append([r["system"], r["batch"], None, None, None, None, None, None, None, None, None,
                         r.get("error")])
            continue
        ar = find("services ar", r["batch"])
        hf_same = find("transformers generate (greedy" + (", left-padded)" if r["batch"] > 1 else ")"), r["batch"])
        chain = find("services dflash", r["batch"])
        r["x_vs_services_ar"] = round(r["tokens_per_s"] / ar["tokens_per_s"], 3) if ar else None
        r["x_vs_services_dflash"] = round(r["tokens_per_s"] / chain["tokens_per_s"], 3) if chain else None
        if chain and r.get("mode") == "ddtree" and r.get("tau_se") is not None and chain.get("tau_se") is not None:
            r["x_vs_services_dflash_tau_se"] = round(common.ratio_standard_error(
                r["x_vs_services_dflash"], r["tau"], r["tau_se"], chain["tau"], chain["tau_se"]), 3)
        r["x_vs_hf_generate_b1"] = round(r["tokens_per_s"] / hf1["tokens_per_s"], 3) if hf1 else None
        r["x_vs_hf_generate_same_batch"] = round(r["tokens_per_s"] / hf_same["tokens_per_s"], 3) if hf_same else None
        rows.append([r["system"], r["batch"], r["tokens"], r["wall_s"], r["tokens_per_s"], r["x_vs_services_ar"],
                     r["x_vs_services_dflash"] if r["mode"] == "ddtree" else None, r["x_vs_hf_generate_b1"], r["x_vs_hf_generate_same_batch"], _tau_cell(r),
                     r.get("mean_latency_s"), r.get("outputs_equal_services_ar")])
    table = common.md_table(["system", "batch", "tokens", "wall s", "tok/s", "× services ar (same batch)",
                             "× services dflash (same batch)", "× HF generate b1", "× HF generate (same batch)", "tau", "mean latency s",
                             "output == services ar b1"], rows)

    bd_rows = []
    for r in runs:
        if "breakdown" not in r:
            continue
        ps = r["breakdown"]["per_step_ms"]
        if not r["breakdown"]["engine_steps"]:
            continue
        bd_rows.append([r["system"], r["batch"], r["breakdown"]["engine_steps"],
                        r["breakdown"]["histograms"]["batch_size"]["mean"], ps["step"], ps["draft_phase"],
                        ps["drafter_forward"], ps["prefetch_hit_share"], ps["draft_server"], ps["draft_hop"],
                        ps["tree_build"],
                        ps["verify_phase"], ps["target_verify_forward"], ps["verify_server_non_forward"],
                        ps["verify_hop"], ps["gateway_other"], ps["non_forward"], ps["hop_share_of_step"],
                        r["outside_steps_s"]])
    bd_table = common.md_table(
        ["system", "batch", "engine steps", "seqs/step", "step ms", "draft phase ms", "drafter fwd ms",
         "drafts made on push", "Draft server ms", "Draft hop ms", "tree build ms", "verify phase ms", "target fwd ms",
         "Verify server − fwd ms", "Verify hop ms", "gateway other ms", "step − forwards ms",
         "hops / step", "wall outside steps s"], bd_rows)

    push_rows = []
    for r in runs:
        if "breakdown" in r and r["mode"] != "ar":
            h = r["breakdown"]["histograms"]
            push_rows.append([r["system"], r["batch"], h["push_features_rpc_client"]["count"],
                              h["push_features_rpc_client"]["mean_ms"], h["push_features_rpc_server"]["mean_ms"],
                              h["transport_send"]["mean_ms"], h["prefill_rpc_client"]["mean_ms"],
                              h["target_prefill_forward"]["mean_ms"]])
    segment_rows = [[r["system"], r["batch"], *(r["breakdown"]["histograms"].get(f"segment_{n}", {}).get("mean_ms")
                                                for n in SEGMENTS)]
                    for r in runs if "breakdown" in r and r["breakdown"]["engine_steps"]]
    segment_table = common.md_table(["system", "batch", *(n.replace("_", " ") for n in SEGMENTS)], segment_rows)
    push_table = common.md_table(["system", "batch", "PushFeatures calls", "PushFeatures client ms",
                                  "PushFeatures server ms", "transport send ms", "Prefill RPC (gateway) ms",
                                  "prefill forward ms"], push_rows)

    model_info, drafter_info = common.describe_checkpoint(model), common.describe_checkpoint(drafter)
    summary = {}
    for r in runs:
        if "tokens_per_s" in r:
            key = re.sub(r"[^a-z0-9]+", "_", r["system"].lower()).strip("_") + f"_batch{r['batch']}"
            summary[key] = {"tokens_per_s": r["tokens_per_s"], "x_vs_services_ar": r.get("x_vs_services_ar"),
                            "x_vs_services_dflash": r.get("x_vs_services_dflash") if r.get("mode") == "ddtree" else None,
                            "x_vs_hf_generate_b1": r.get("x_vs_hf_generate_b1"),
                            "x_vs_hf_generate_same_batch": r.get("x_vs_hf_generate_same_batch")}
    data = {
        **({"label": calibration["label"], "calibrated_acceptance": calibration} if calibration else {}),
        "command": command, "date": date, "hardware": hw, "hardware_tag": tag, "model": model_info,
        "drafter": drafter_info, "prompts": len(prompts), "prompt_source": source,
        "prompt_ids": [p["id"] for p in prompts], "max_tokens": max_tokens, "batch": batches[0], "batches": batches,
        "budgets": budgets, "stopped_at_deadline": stopped or None,
        "temperature": 0.0, "run_seconds": round(total_s, 1), "load_average_after_services": load_after_services,
        "summary": summary,
        "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs],
    }
    ar_first = ("" if not (calibration or {}).get("reference_is_timed_ar") else
                " (services ar at batch 1 excepted: its run, every prompt in order before the others, was also the "
                "calibration's reference run)")
    hf_subset = (f"; transformers on the first {args.hf_prompts} prompts only, its tok/s over those"
                 if args.hf_prompts is not None and args.hf_prompts < len(prompts) else "")
    drafter_note = ("the bundled trained drafter" if drafter_info.get("bundled_drafter")
                    else "NOT the bundled trained drafter")
    gpu = f", {hw['gpu']} (CUDA {hw.get('cuda')})" if hw.get("gpu") else ""
    stopped_note = ("\n\n**Stopped at its deadline (--deadline-s)**: " + "; ".join(stopped) + ". Every system's figures "
                    "at that batch cover those prompts only (a timed reference ar run: all of them)." if stopped else "")
    md = f"""# Speed: services vs transformers, one run ({tag}){' — ' + calibration['label'].upper() if calibration else ''}
{chr(10) + calibrated_md(calibration) if calibration else ''}
- Command: `{command}`
- Date: {date}; whole run {total_s:.0f} s
- Hardware: {hw['cpu_model']} ({hw['usable_cpus']} usable of {hw['logical_cpus']} logical CPUs){gpu}; device `{args.device}`{' (drafter on ' + args.drafter_device + ')' if args.drafter_device else ''}, dtype {args.dtype}; torch threads per service and for transformers: {args.threads or 'default'}; load average at start {hw.get('load_average_at_start')}, at the end {load_after_services}
- Software: torch {hw['torch']}, transformers {hw['transformers']}, grpcio {hw['grpcio']}, Python {hw['python']}
- Target: `{model_info['dir']}` ({model_info.get('architectures')}, {model_info.get('num_hidden_layers')} layers)
- Drafter: `{drafter_info['dir']}` ({drafter_note}; {drafter_info.get('num_hidden_layers')} layers, block {drafter_info.get('block_size')}, weights sha256 {drafter_info.get('weights_sha256')}…)
- Work: {len(prompts)} prompts from {source} (chat template, sent as token ids), greedy, max_tokens {max_tokens}, EOS honoured; DDTree budget(s) {', '.join(map(str, budgets))}; batch 1 = one prompt at a time, batch N (N = {', '.join(map(str, batches))}) = chunks of N requests in flight (transformers: left-padded batches of N){hf_subset}; systems interleaved chunk by chunk in a rotating order{ar_first}; one client connection for every request; warm-up excluded

tok/s = generated tokens (first token included) / wall time of the whole set, measured by the client.
Ratios are within this run only.{stopped_note}

{table}

## Where a step goes (services, ms per engine step, from Prometheus deltas)

An engine step is one Draft + tree build + one Verify for the whole running batch. *Draft/Verify hop* = the
gateway's client-side RPC latency minus the serving process's server-side latency (serialisation, HTTP/2, event
loops, loopback): the cost of the split. *Verify server − fwd* = handler time outside the model forward.
*Drafts made on push* = share of the drafts asked for that the drafter had already made when the target's features
(carrying the next bonus token) arrived; their forward ran while the Verify answer and the Draft request were on
the wire. *Draft server* = the Draft handler's whole time (waiting for features, then slicing a ready draft or
drafting on request). *Step − forwards* = step time minus the target and drafter forwards (a drafter forward that
overlapped the hops counts as a forward). *Wall outside steps* = prefill, release and idle time.

{bd_table}

## A step's segments between the processes (mean ms where the step had one; wall-clock stamps of one host)

*feature push* = the last Verify forward done on the target -> its features' push at the drafter, split into *push
staging* (-> the push sent: the target's event loop, the staging copy, the message) and *push trip* (sent ->
arrived: the socket, the drafter's event loop); *drafter store
and draft* = those features arrived -> the draft made from them; *draft request / answer*, *verify request /
answer* = one-way trips; *draft handler* = the Draft waiting for features or slicing the ready draft; *target
handler* = the Verify handler, forward included; *gateway tree* = the Draft answer -> the Verify sent (unpacking,
tree build); *gateway between steps* = the Verify answer -> the next Draft (post-processing, a prefill when
newcomers join). The critical path of a drafted step is feature push + drafter store and draft + draft answer +
gateway tree + verify request + target handler, when the Draft request arrives before its draft is made.

{segment_table}

## Feature transport (target → drafter) and prefill, mean ms per call

{push_table}
"""
    common.write_outputs(args.out_dir, f"speed-calibrated-{tag}" if calibration else f"speed-{tag}", data, md)
    if calibration:
        headline(runs, calibration)


def _tau_cell(run: dict) -> str | float | None:
    """tau, with its standard error where the run measured one."""
    return run.get("tau") if run.get("tau_se") is None else f"{run['tau']} ± {run['tau_se']}"


def calibrated_md(info: dict) -> str:
    from bench.calibrated import markdown

    return markdown(info)


def headline(runs: list[dict], info: dict) -> None:
    """One line per service run of a calibrated benchmark, labelled."""
    print(f"== {info['label'].upper()} (profile {info['profile']}, chain tau "
          f"{info.get('calibrate_chain_tau') or 'as measured'}; implied chain {info['implied_chain_tau']}, "
          f"DDTree {info['implied_ddtree_tau']}) ==", flush=True)
    for r in runs:
        if r.get("mode") and "tokens_per_s" in r:
            vs_chain = ("" if r.get("x_vs_services_dflash_tau_se") is None else
                        f" x{r['x_vs_services_dflash']} ± {r['x_vs_services_dflash_tau_se']} (the taus' draws) vs dflash,")
            print(f"  {r['system']:36s} batch {r['batch']}: {r['tokens_per_s']:.2f} tok/s, x{r['x_vs_services_ar']} "
                  f"vs ar,{vs_chain} tau {_tau_cell(r)}, outputs == ar {r.get('outputs_equal_services_ar')}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
