"""What one engine step costs at real shapes, eager against CUDA-graph replay, next to the weight-read floor.

In one process on one device, with random-weight checkpoints built on the spot (bench/shapes.py):

- floors: bytes of the target's weights over the measured copy bandwidth, and the time of one 1-token GEMV over
  every weight matrix (captured, so launch gaps do not count) -- a decode step can be no faster than either;
- target: a whole `TargetRunner.verify` call (host work included: validation, packing, the walk, the commit,
  the device->host copy) for trees of 1 (`ar`), 16 (a DFlash chain) and 65 nodes (a DDTree budget 64), per
  batch size, eager and graphed; and the forward alone (device time);
- drafter: a whole `DrafterRunner.draft` call at top-K 64 (tree mode) and top-K 1 (chain mode), and with graphs
  its captured block forward and top-K alone (the drafter's forward, as the target's);
- agreement: graphed and eager forwards on the same batch (max |logit diff| / max |logit|, greedy agreement).

    python -m bench.step_cost --shape qwen3-8b --batches 1,8,32
    python -m bench.step_cost --shape qwen3-8b --batches 1,8 --quantize int8   # the weight-only int8 target
    python -m bench.step_cost --shape tiny --device cpu --batches 1,2      # checks the tool on a CPU

Writes bench/results/step-cost-<shape>-<hardware>[-int8|-int4].{md,json} (or --out-dir).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import common
from bench.shapes import SHAPES, build_drafter, build_target, target_config
from ddtree_serve.decoding.config import SamplingParams
from drafter_svc.runner import DraftItem, DrafterConfig, DrafterRunner, top_logprobs
from target_svc import int8_tiles
from target_svc.int8_matmul import FUSED_REDUCE_ENV
from target_svc.quantization import QUANTIZE_MODES, QuantizedLinear, tensor_bytes
from target_svc.runner import PrefillItem, TargetConfig, TargetRunner, VerifyItem
from target_svc.verify import VerifyBatch, VerifyShape, verify_forward


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.step_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b", choices=SHAPES)
    p.add_argument("--layers", type=int, default=None, help="cut the target to this many layers")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--quantize", default="none", choices=QUANTIZE_MODES,
                   help="weight-only quantization of the target's decoder projections (TargetConfig.quantize)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--nodes", default="1,16,65", help="tree sizes (1 = autoregressive, 16 = chain, 65 = budget 64)")
    p.add_argument("--graph-node-sizes", default="", help="verify sizes captured besides 1, 4^k + 1 and the largest "
                   "(the target's --graph-node-sizes; e.g. 64: a 64-node tree in a bucket of its own, not 65's)")
    p.add_argument("--context", type=int, default=512, help="prompt length of every sequence")
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration (median reported)")
    p.add_argument("--work-dir", default=None, help="where checkpoints are written (default: a temporary dir)")
    p.add_argument("--reuse-checkpoints", action="store_true",
                   help="load the checkpoints already in --work-dir when they have this shape (else build them)")
    p.add_argument("--profile", action="store_true",
                   help="also list the kernels of one eager forward per tree size at the first batch (torch.profiler)")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    return p.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, steps: int, device: torch.device, warmup: int = 3) -> float:
    """Median wall time of fn() in ms, synchronised around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 10, device)
    return 2 * nbytes / (ms / 1e3)


def int8_table_used(args, device: torch.device) -> str | None:
    """The int8 tile table an int8 target's projections took on this device (target_svc/int8_tiles.py), if any."""
    if args.quantize != "int8" or device.type != "cuda":
        return None
    path = int8_tiles.table_path(torch.cuda.get_device_properties(device).name)
    return None if path is None else str(path)


def kernel_switches() -> dict[str, str]:
    """The DDTREE_* environment switches this run was given (the kernels' opt-ins and fallbacks) and inductor's PDL
    switch, by name."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("DDTREE_") or k == "TORCHINDUCTOR_ENABLE_PDL"}


def gemv_floor_ms(runner: TargetRunner, device: torch.device) -> float:
    """One token through every weight matrix of the target (layers + LM head) in its served format (quantized
    projections through their matmul backend), captured when on CUDA."""
    mods = [m for layer in runner.target.layers for m in layer.modules()
            if isinstance(m, (torch.nn.Linear, QuantizedLinear))]
    mods.append(runner.target.lm_head)
    dtype = runner.target.dtype
    xs = {m.in_features: torch.randn(1, m.in_features, device=device, dtype=dtype) for m in mods}

    def all_gemv():
        for m in mods:
            m(xs[m.in_features])

    if device.type != "cuda":
        return median_ms(all_gemv, 5, device)
    all_gemv()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        all_gemv()
    return median_ms(graph.replay, 20, device)


def random_tree(nodes: int, root: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree of `nodes` nodes shaped like a DDTree (parents among the few previous nodes), distinct tokens; 16 or
    17 nodes: a chain (dflash's block, its root and 15 or 16 drafted tokens)."""
    parents = [-1] + [int(torch.randint(max(0, i - 4), i, (1,), generator=gen)) for i in range(1, nodes)]
    if nodes in (16, 17):  # the chain
        parents = [-1] + list(range(nodes - 1))
    tokens = torch.randperm(vocab - 2, generator=gen)[:nodes] + 2
    tokens[0] = root
    return tokens, torch.tensor(parents)


def target_costs(runner: TargetRunner, batches: list[int], nodes_list: list[int], context: int, steps: int,
                 device: torch.device, profiles: list[dict] | None = None) -> tuple[list[dict], list[dict]]:
    """Verify-call and forward times per (batch, nodes, eager|graph), and graph/eager agreement rows; with
    profiles given, the kernel lists of the first batch size's forwards are appended to it."""
    gen = torch.Generator().manual_seed(0)
    vocab = runner.vocab_size
    rows, agreement = [], []
    graphs = runner.graphs
    for batch in batches:
        ids = [f"b{batch}-{i}" for i in range(batch)]
        runner.prefill([PrefillItem(s, torch.randint(2, vocab, (context,), generator=gen).tolist(), SamplingParams())
                        for s in ids])
        for nodes in nodes_list:
            # Trees drawn before the clock runs (drawing distinct tokens from a 150k vocabulary costs ~1 ms);
            # each step only puts the pending bonus token at the root.
            pool = [random_tree(nodes, 0, vocab, gen) for _ in range(16)]
            turn = iter(range(1 << 30))

            def step():
                items = []
                for s in ids:
                    tokens, parents = pool[next(turn) % len(pool)]
                    tokens = tokens.clone()
                    tokens[0] = runner.seqs[s].pending_token
                    items.append(VerifyItem(s, tokens, parents))
                runner.verify(items)

            row = {"batch": batch, "nodes": nodes}
            for mode in ("eager", "graph"):
                if mode == "graph" and graphs is None:
                    continue
                runner.graphs = graphs if mode == "graph" else None
                row[f"verify_{mode}_ms"] = median_ms(step, steps, device)
            runner.graphs = graphs
            fwd, agree = forward_costs(runner, ids, nodes, gen, steps, device)
            row.update(fwd)
            if profiles is not None and batch == batches[0]:
                try:
                    profiles.append({"batch": batch, "nodes": nodes,
                                     **profile_forward(runner, ids, nodes, gen, device)})
                    if graphs is not None:   # the whole captured step: both graphs' kernels and those around them
                        profiles.append({"batch": batch, "nodes": nodes, "what": "one captured verify call",
                                         **kernel_profile(step, device)})
                except Exception as exc:  # noqa: BLE001 - a profiler failure must not cost the timings
                    print(f"profile of {nodes} nodes failed: {type(exc).__name__}: {exc}", flush=True)
            if agree:
                agreement.append({"batch": batch, "nodes": nodes, **agree})
            rows.append(row)
            print(row, flush=True)
        for s in ids:
            runner.release(s)
    return rows, agreement


def forward_costs(runner: TargetRunner, ids: list[str], nodes: int, gen: torch.Generator, steps: int,
                  device: torch.device) -> tuple[dict, dict]:
    """Device time of the forward alone, eager vs replay, and how closely their outputs agree."""
    model, scratch = runner.model, runner.model.cache.spec.scratch_slot
    trees = [random_tree(nodes, runner.seqs[s].pending_token, runner.vocab_size, gen) for s in ids]
    ctx = [model.cache.ctx_len[runner.seqs[s].slot] for s in ids]
    slots = [runner.seqs[s].slot for s in ids]
    key_len = max(ctx) + nodes
    exact = VerifyBatch.pack(trees, ctx, slots, VerifyShape(len(ids), nodes, key_len), scratch)
    packed = exact.packed.to(device)
    out = {"forward_eager_ms": median_ms(
        lambda: verify_forward(model, packed, nodes, key_len, runner.feature_layers), steps, device)}
    eager_logits = verify_forward(model, packed, nodes, key_len, runner.feature_layers)[0].clone()
    model.pending_traces = None
    if runner.graphs is None:
        return out, {}
    shape = runner.graphs.shape_for(len(ids), nodes, key_len)
    bucketed = VerifyBatch.pack(trees, ctx, slots, shape, scratch)
    packed_b = bucketed.packed.to(device)
    out["forward_graph_ms"] = median_ms(lambda: runner.graphs.forward(bucketed, packed_b, runner.feature_layers),
                                        steps, device)
    graph_logits = runner.graphs.forward(bucketed, packed_b, runner.feature_layers)[0][: len(ids), :nodes]
    model.pending_traces = None
    scale = eager_logits.abs().max().item()
    agree = {
        "max_abs_logit_diff_over_max_logit": (graph_logits.float() - eager_logits.float()).abs().max().item() / scale,
        "greedy_agreement": (graph_logits.argmax(-1) == eager_logits.argmax(-1)).float().mean().item(),
        # A NaN in either (a wrong kernel, garbage memory) makes the diff NaN and argmax meaningless: say which.
        "eager_finite": bool(torch.isfinite(eager_logits).all().item()),
        "graph_finite": bool(torch.isfinite(graph_logits).all().item()),
    }
    if not (agree["eager_finite"] and agree["graph_finite"]):
        print(f"WARNING: non-finite logits at batch {len(ids)}, {nodes} nodes (eager finite {agree['eager_finite']}, "
              f"graph finite {agree['graph_finite']})", flush=True)
    return out, agree


def profile_forward(runner: TargetRunner, ids: list[str], nodes: int, gen: torch.Generator, device: torch.device,
                    top: int = 40) -> dict:
    """The kernels of one eager verify forward (see kernel_profile)."""
    model, scratch = runner.model, runner.model.cache.spec.scratch_slot
    trees = [random_tree(nodes, runner.seqs[s].pending_token, runner.vocab_size, gen) for s in ids]
    ctx = [model.cache.ctx_len[runner.seqs[s].slot] for s in ids]
    key_len = max(ctx) + nodes
    packed = VerifyBatch.pack(trees, ctx, [runner.seqs[s].slot for s in ids], VerifyShape(len(ids), nodes, key_len),
                              scratch).packed.to(device)
    out = kernel_profile(lambda: verify_forward(model, packed, nodes, key_len, runner.feature_layers), device, top)
    model.pending_traces = None
    return out


def kernel_profile(fn, device: torch.device, top: int = 25, warmup: bool = True,
                   trace_path: str | None = None) -> dict:
    """The kernels of one eager call of fn (device time per kernel name, summed, with call counts): where a step's
    device time goes. Eager, so every kernel is attributed; a graph replays the same kernels minus launch gaps.
    warmup=False when fn cannot run twice (its kernels must then have run before). trace_path: also a Chrome
    trace of the call with Python stacks (which line launched each kernel; chrome://tracing or perfetto)."""
    from torch.profiler import ProfilerActivity, profile

    if warmup:
        fn()   # lazy inits and autotuning outside the profile
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, with_stack=trace_path is not None) as prof:
        fn()
        sync(device)
    if trace_path is not None:
        prof.export_chrome_trace(trace_path)
    kernels: dict[str, list[float]] = {}
    families: dict[str, float] = {}
    for ev in prof.events():
        if device.type == "cuda" and ev.device_type.name != "CUDA":
            continue
        us = ev.device_time if device.type == "cuda" else ev.cpu_time
        entry = kernels.setdefault(ev.name[:90], [0.0, 0])
        entry[0] += us / 1e3
        entry[1] += 1
        family = kernel_family(ev.name)   # the whole name: templates say ArgMax past the 90 characters kept
        families[family] = families.get(family, 0.0) + us / 1e3
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return {"kernel_ms_total": round(sum(v[0] for v in kernels.values()), 3),
            "kernel_launches": int(sum(v[1] for v in kernels.values())),
            "families": {f: round(ms, 4) for f, ms in sorted(families.items())},
            "top": [{"kernel": name, "ms": round(ms, 4), "calls": calls} for name, (ms, calls) in ranked[:top]]}


# Kernel names -> what part of a step they are, first match wins (cuBLAS's nvjet / xmma / split-K kernels are the
# projections and the LM head; the commit's float32 product is one of them too).
KERNEL_FAMILIES = (
    ("tree WY core", re.compile(r"tree_wy")),
    ("GDN recurrence (fla)", re.compile(r"gated_delta|chunk_|fused_recurrent")),
    ("attention", re.compile(r"tree_attention|flash|fmha|attention")),
    ("GEMM", re.compile(r"nvjet|gemm|xmma|splitKreduce|cutlass|int8_|dot_kernel|gemv|aten::(addmm|mm|bmm|linear)\b")),
    ("sampling (argmax, top-k)", re.compile(r"ArgMax|argmax|topk|TopK|[Ss]ort")),
)


def kernel_family(name: str) -> str:
    """The part of a step a kernel belongs to (KERNEL_FAMILIES; everything else is elementwise glue, copies,
    norms and gathers)."""
    return next((family for family, pattern in KERNEL_FAMILIES if pattern.search(name)), "glue")


def tree_profiles(profiles: list[dict]) -> list[dict]:
    """The batch-1 profiles of trees (over one node) by size: the captured verify calls, else (no graphs: a CPU)
    the eager forwards."""
    trees = [p for p in profiles if p.get("batch") == 1 and p.get("nodes", 0) > 1 and "families" in p]
    captured = [p for p in trees if p.get("what") == "one captured verify call"]
    return sorted(captured or [p for p in trees if "what" not in p], key=lambda p: p["nodes"])


def tree_extra_rows(profiles: list[dict]) -> list[list]:
    """Per kernel family: ms of the smallest tree's profile (tree_profiles) and the largest's, and the
    difference: where a larger tree's extra time goes. [] without two tree sizes."""
    calls = tree_profiles(profiles)
    if len(calls) < 2:
        return []
    small, large = calls[0], calls[-1]
    names = sorted(set(small["families"]) | set(large["families"]),
                   key=lambda f: -(large["families"].get(f, 0.0) - small["families"].get(f, 0.0)))
    rows = [[f, small["families"].get(f, 0.0), large["families"].get(f, 0.0),
             round(large["families"].get(f, 0.0) - small["families"].get(f, 0.0), 4)] for f in names]
    return rows + [["all", small["kernel_ms_total"], large["kernel_ms_total"],
                    round(large["kernel_ms_total"] - small["kernel_ms_total"], 4)]]


def captured_draft(drafter: DrafterRunner, items: list[DraftItem], top_k: int):
    """The device part of drafter.draft(items, top_k, 15) alone, as the target's "forward graph" column: the
    captured block forward's replay and the top-K, its packed rows already on the device (no checks, packing or
    host-to-device copy)."""
    batch, keys = drafter.graphs.shape_for(len(items), max(it.context_len for it in items))
    rows = [(it.bonus_token, it.context_len, drafter._slot[it.seq_id]) for it in items]
    packed = drafter._pack(rows, batch).to(drafter.device)
    forward = drafter._block_graph(batch, keys)
    return lambda: top_logprobs(*forward(packed), len(items), 15, top_k)


def drafter_costs(drafter: DrafterRunner, batches: list[int], context: int, steps: int,
                  device: torch.device, profiles: list[dict] | None = None) -> list[dict]:
    """Draft-call times per batch: tree mode (top-64) and chain mode (top-1), eager and graphed; with profiles
    given, the kernels of one eager tree-mode draft at the first batch size are appended to it."""
    rows = []
    graphs = drafter.graphs
    for batch in batches:
        ids = [f"d{batch}-{i}" for i in range(batch)]
        for s in ids:
            drafter.add_context(s, 0, torch.randn(context, drafter.feature_dim, device=device, dtype=drafter.dtype))
        items = [DraftItem(s, 5, context) for s in ids]
        for top_k, mode in ((64, "tree"), (1, "chain")):
            row = {"batch": batch, "mode": mode, "top_k": top_k}
            for run in ("eager", "graph"):
                if run == "graph" and graphs is None:
                    continue
                drafter.graphs = graphs if run == "graph" else None
                row[f"draft_{run}_ms"] = median_ms(lambda: drafter.draft(items, top_k, 15), steps, device)
            drafter.graphs = graphs
            if graphs is not None:
                row["forward_graph_ms"] = median_ms(captured_draft(drafter, items, top_k), steps, device)
            rows.append(row)
            print(row, flush=True)
            if profiles is not None and batch == batches[0] and mode == "tree":
                drafter.graphs = None
                try:
                    profiles.append({"batch": batch, "drafter": f"draft, depth 15, top-{top_k}",
                                     **kernel_profile(lambda: drafter.draft(items, top_k, 15), device)})
                except Exception as exc:  # noqa: BLE001 - a profiler failure must not cost the timings
                    print(f"drafter profile failed: {type(exc).__name__}: {exc}", flush=True)
                drafter.graphs = graphs
        for s in ids:
            drafter.release(s)
    return rows


def checkpoint_matches(work: Path, shape: str, layers: int | None) -> bool:
    """Whether work holds a target and drafter built for (shape, layers) by an earlier run."""
    import json

    paths = [work / "target" / "config.json", work / "drafter" / "config.json"]
    if not all(p.is_file() for p in paths):
        return False
    saved = json.loads(paths[0].read_text())
    wanted = target_config(shape, layers).to_dict()
    return all(saved.get(k) == wanted.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers",
                                                       "intermediate_size", "vocab_size"))


@torch.inference_mode()
def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    batches = [int(x) for x in args.batches.split(",")]
    nodes_list = [int(x) for x in args.nodes.split(",")]
    sizes = tuple(int(x) for x in args.graph_node_sizes.split(",") if x.strip())
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="ddtree-step-cost-"))
    t0 = time.perf_counter()
    if args.reuse_checkpoints and checkpoint_matches(work, args.shape, args.layers):
        target_dir, drafter_dir = work / "target", work / "drafter"
    else:
        target_dir = build_target(args.shape, work / "target", args.layers, device=args.device, dtype=dtype)
        drafter_dir = build_drafter(target_dir, work / "drafter", device=args.device, dtype=dtype)
    build_s = time.perf_counter() - t0
    max_batch = max(batches)
    runner = TargetRunner(TargetConfig(str(target_dir), device=args.device, dtype=dtype, max_batch=max_batch,
                                       max_seq_len=2048, max_tree_nodes=max(nodes_list), quantize=args.quantize,
                                       graph_node_sizes=sizes))
    drafter = DrafterRunner(DrafterConfig(str(drafter_dir), str(target_dir), device=args.device, dtype=dtype,
                                          max_batch=max_batch, max_seq_len=2048))
    runner.set_feature_layers(drafter.target_layer_ids)
    # Buffers too: quantized projections keep their weights and scales as buffers.
    weights = tensor_bytes(runner.target.layers)
    weights += tensor_bytes(runner.target.lm_head)   # a tied head's tensor is the embedding's, read as the head
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else float("nan")
    # The drafter's block forward reads its own layers and the target's LM head (its embedding rows are gathered).
    drafter_weights = tensor_bytes(drafter.model) + drafter.lm_head_weight.numel() * drafter.lm_head_weight.element_size()
    floors = {"weight_bytes": weights, "copy_bandwidth_gb_s": bandwidth / 1e9,
              "weight_read_floor_ms": weights / bandwidth * 1e3, "gemv_floor_ms": gemv_floor_ms(runner, device),
              "drafter_weight_bytes": drafter_weights,
              "drafter_weight_read_floor_ms": drafter_weights / bandwidth * 1e3}
    print(floors, flush=True)
    profiles: list[dict] | None = [] if args.profile else None
    target_rows, agreement = target_costs(runner, batches, nodes_list, args.context, args.steps, device, profiles)
    drafter_rows = drafter_costs(drafter, batches, args.context, args.steps, device, profiles)
    hw = common.hardware(args.device, args.dtype, None)
    data = {"command": common.command_line("bench.step_cost"), "date": common.now_utc(), "hardware": hw,
            "shape": args.shape, "quantize": args.quantize, "layers": runner.num_layers, "context": args.context,
            "build_s": build_s, "switches": kernel_switches(), "int8_tile_table": int8_table_used(args, device),
            "floors": floors, "target": target_rows, "agreement": agreement, "drafter": drafter_rows,
            "profiles": profiles,
            "graph_capture_s": {"target": runner.graphs.capture_seconds if runner.graphs else 0.0,
                                "drafter": drafter.graphs.cache.capture_seconds if drafter.graphs else 0.0}}
    fmt = args.dtype if args.quantize == "none" else f"{args.dtype}, weight-only {args.quantize} target"
    switches = ", ".join(f"{k}={v}" for k, v in data["switches"].items()) or "none (the defaults)"
    if data["int8_tile_table"]:
        switches += f"; int8 tiles from {data['int8_tile_table']}"
    md = [f"# Step cost: {args.shape} ({runner.num_layers} layers), {hw.get('gpu', hw['cpu_model'])}, {fmt}",
          "", f"Command: `{data['command']}`  ", f"Date: {data['date']}  ", f"Kernel switches: {switches}  ",
          f"Random weights at the real shape; every sequence holds a {args.context}-token prompt.", "",
          f"Floors: weights {weights / 1e9:.2f} GB, copy bandwidth {floors['copy_bandwidth_gb_s']:.0f} GB/s -> "
          f"weight-read floor {floors['weight_read_floor_ms']:.2f} ms; one-token GEMV over every matrix "
          f"(captured) {floors['gemv_floor_ms']:.2f} ms. Drafter: its layers and the target's LM head, "
          f"{drafter_weights / 1e9:.2f} GB -> {floors['drafter_weight_read_floor_ms']:.2f} ms.", "",
          "## Target: one `TargetRunner.verify` call (host work included) and the forward alone (ms, median)", "",
          common.md_table(["batch", "nodes", "verify eager", "verify graph", "forward eager", "forward graph"],
                          [[r["batch"], r["nodes"], r.get("verify_eager_ms"), r.get("verify_graph_ms"),
                            r.get("forward_eager_ms"), r.get("forward_graph_ms")] for r in target_rows]),
          "", "## Drafter: one `DrafterRunner.draft` call, depth 15 (host work included), and the captured forward and "
          "top-K alone (ms, median)", "",
          common.md_table(["batch", "mode", "top-K", "call eager", "call graph", "forward graph"],
                          [[r["batch"], r["mode"], r["top_k"], r.get("draft_eager_ms"), r.get("draft_graph_ms"),
                            r.get("forward_graph_ms")] for r in drafter_rows]),
          "", "## Graph vs eager forward on the same batch", "",
          common.md_table(["batch", "nodes", "max |diff| / max |logit|", "greedy agreement", "eager finite",
                           "graph finite"],
                          [[a["batch"], a["nodes"], a["max_abs_logit_diff_over_max_logit"], a["greedy_agreement"],
                            a.get("eager_finite"), a.get("graph_finite")] for a in agreement])]
    for prof in profiles or []:
        what = f"{prof['nodes']} nodes" if "nodes" in prof else f"the drafter's {prof['drafter']}"
        call = prof.get("what", "one eager forward")
        md += ["", f"## Kernels of {call}, batch {prof['batch']}, {what}: "
                   f"{prof['kernel_launches']} kernels, {prof['kernel_ms_total']} ms of device time", "",
               common.md_table(["kernel", "ms", "calls"], [[k["kernel"], k["ms"], k["calls"]] for k in prof["top"]])]
    extra = tree_extra_rows(profiles or [])
    if extra:
        trees = tree_profiles(profiles)
        small, large = trees[0]["nodes"], trees[-1]["nodes"]
        md += ["", f"## Where a larger tree's time goes: {trees[-1].get('what', 'one eager forward')}, batch 1, "
                   f"{large} against {small} nodes (ms per kernel family)", "",
               common.md_table(["family", f"{small} nodes", f"{large} nodes", "extra"], extra)]
    stem = f"step-cost-{args.shape}-{common.hardware_tag(hw)}"
    if args.quantize != "none":
        stem += f"-{args.quantize}"
    if data["switches"].get(FUSED_REDUCE_ENV) == "on":
        stem += "-fused"
    paths = common.write_outputs(args.out_dir, stem, data, "\n".join(md) + "\n")
    print("\n".join(md))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
