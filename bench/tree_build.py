"""The gateway's per-step tree build on the host: build_step_trees before (build_ddtree_reference), the Python
heap (build_ddtree_host(native=False)) and now (its heap in C where a compiler is, ddtree_native.py).

Each engine step the gateway turns the drafter's top-k into one DDTree per sequence, on the critical path. This
times `gateway.step_trees.build_step_trees` against the code it replaced (the drafts stacked, then
`build_ddtree_reference` per sequence), on the same drafts, at batch sizes x budgets with top-k = budget. Drafts
are shaped like a drafter's: per position the sorted top-k of log_softmax(randn(vocab) * s), s uniform in [4, 9]
(top-1 probability ~0.5 on average, trees 2-10 deep). Every config first checks that both give identical trees.

Two ways of timing, the builders taking turns (ratios within one run):
- in a step (turns at every step): each timed build is preceded by the step's other host work in the gateway, the
  drafts read from a serialized DraftResponse with the gateway's draft_arrays (numpy), and followed by the
  VerifyRequest built from the trees (tokens.tolist(), parents.tolist(), serialized; timed as "lists");
- back to back (turns every --block steps): the build alone, called again and again (caches as warm as they get).

    python -m bench.tree_build [--steps 3000] [--batches 1 8] [--budgets 16 64] [--depth 15]

Writes <out-dir>/tree-build-<hardware>.{md,json}.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from bench import common
from ddtree_serve.decoding.config import SamplingParams
from ddtree_serve.decoding import ddtree_native
from ddtree_serve.decoding.ddtree import DraftTree, build_ddtree_reference
from ddtree_serve.decoding.ddtree_host import build_ddtree_host
from ddtree_serve.plumbing.messages import draft_arrays, draft_result
from ddtree_serve.proto import drafter_pb2, target_pb2
from gateway.sequence import Sequence
from gateway.step_trees import build_step_trees

Drafts = dict[str, tuple[torch.Tensor, torch.Tensor]]
Builder = Callable[[list[Sequence], Drafts, dict[str, int]], dict[str, DraftTree]]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.tree_build", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3000, help="timed steps per config, builder and way of timing")
    p.add_argument("--warmup", type=int, default=200, help="untimed steps before them")
    p.add_argument("--block", type=int, default=50, help="back to back: calls of one builder before the other's")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    p.add_argument("--depth", type=int, default=15, help="draft positions (the block size less one)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--draft-sets", type=int, default=32, help="distinct drafts per config, cycled through")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sharpness", default="4,9",
                   help="LO,HI: each position's logits are randn x s, s uniform in [LO, HI]; e.g. 40,120 for a sharp "
                        "drafter whose top log-probs sit within 2**-17 of 0 (the fixed-point scores; outputs named "
                        "...-sharp<LO>-<HI>)")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    return p.parse_args(argv)


def drafter_like(gen: torch.Generator, n_pos: int, k: int, vocab: int,
                 sharpness_range: tuple[float, float] = (4.0, 9.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 log-probs and int64 ids [n_pos, k], sorted descending per position."""
    lo, hi = sharpness_range
    sharpness = lo + (hi - lo) * torch.rand(n_pos, 1, generator=gen)
    top = torch.log_softmax(torch.randn(n_pos, vocab, generator=gen) * sharpness, dim=-1).topk(k, dim=-1)
    return top.values.contiguous(), top.indices.contiguous()


def _sharpness(text: str) -> tuple[float, float]:
    lo, hi = (float(x) for x in text.split(","))
    return lo, hi


def make_sequences(batch: int, budget: int) -> list[Sequence]:
    seqs = []
    for i in range(batch):
        s = Sequence(request_id=f"r{i}", prompt_ids=[1], max_tokens=1024, sampling=SamplingParams(), mode="ddtree",
                     budget=budget, stop_token_ids=frozenset(), detokenizer=None, seq_id=f"s{i}")
        s.bonus = 100 + i
        seqs.append(s)
    return seqs


def draft_response(seqs: list[Sequence], drafts: Drafts) -> bytes:
    """The drafts as the drafter service sends them (a serialized DraftResponse)."""
    results = [draft_result(s.seq_id, *drafts[s.seq_id]) for s in seqs]
    return drafter_pb2.DraftResponse(results=results).SerializeToString()


def reference_step_trees(seqs: list[Sequence], drafts: Drafts, max_depths: dict[str, int]) -> dict[str, DraftTree]:
    """The DDTree part of build_step_trees as it was: drafts stacked, then the reference heap per sequence."""
    logprobs = torch.stack([torch.as_tensor(drafts[s.seq_id][0]) for s in seqs])
    ids = torch.stack([torch.as_tensor(drafts[s.seq_id][1]) for s in seqs])
    return {s.seq_id: build_ddtree_reference(lp, tk, s.budget, max_depths[s.seq_id], s.bonus)
            for s, lp, tk in zip(seqs, logprobs, ids)}


def python_heap_step_trees(seqs: list[Sequence], drafts: Drafts, max_depths: dict[str, int]
                           ) -> dict[str, DraftTree]:
    """The DDTree part of build_step_trees with the Python heap (as before the C one)."""
    return {s.seq_id: build_ddtree_host(*drafts[s.seq_id], s.budget, max_depths[s.seq_id], s.bonus, native=False)
            for s in seqs}


def assert_same_trees(a: dict[str, DraftTree], b: dict[str, DraftTree]) -> None:
    for sid, ta in a.items():
        tb = b[sid]
        for name in ("tokens", "parents", "depths", "log_probs"):
            x, y = getattr(ta, name), getattr(tb, name)
            if x.dtype != y.dtype or x.numpy().tobytes() != y.numpy().tobytes():
                raise AssertionError(f"{sid}: {name} differ between the builders")


def in_a_step(builder: Builder, blob: bytes, seqs: list[Sequence], max_depths: dict[str, int]) -> tuple[float, float]:
    """One gateway step's host work around the build; µs of the build and of the VerifyRequest's lists."""
    response = drafter_pb2.DraftResponse.FromString(blob)
    drafts = {r.seq_id: draft_arrays(r) for r in response.results}   # numpy, as the gateway reads them
    t0 = time.perf_counter_ns()
    trees = builder(seqs, drafts, max_depths)
    t1 = time.perf_counter_ns()
    lists = [(trees[s.seq_id].tokens.tolist(), trees[s.seq_id].parents.tolist()) for s in seqs]
    t2 = time.perf_counter_ns()
    target_pb2.VerifyRequest(items=[target_pb2.TreeItem(seq_id=s.seq_id, tokens=tok, parents=par)
                                    for s, (tok, par) in zip(seqs, lists)]).SerializeToString()
    return (t1 - t0) / 1e3, (t2 - t1) / 1e3


def summary(values: list[float]) -> dict[str, float]:
    """Median and p90 in µs."""
    return {"median_us": round(statistics.median(values), 1), "p90_us": round(statistics.quantiles(values, n=10)[-1], 1)}


def measure(batch: int, budget: int, args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(args.seed + 1000 * batch + budget)
    seqs = make_sequences(batch, budget)
    sharpness = _sharpness(args.sharpness)
    draft_sets = [{s.seq_id: drafter_like(gen, args.depth, budget, args.vocab, sharpness) for s in seqs}
                  for _ in range(args.draft_sets)]
    blobs = [draft_response(seqs, d) for d in draft_sets]
    max_depths = {s.seq_id: args.depth for s in seqs}
    builders: dict[str, Builder] = {"reference": reference_step_trees, "python heap": python_heap_step_trees,
                                    "host": build_step_trees}
    for d in draft_sets:
        want = reference_step_trees(seqs, d, max_depths)
        assert_same_trees(want, build_step_trees(seqs, d, max_depths))
        assert_same_trees(want, python_heap_step_trees(seqs, d, max_depths))
    n_sets, names = len(draft_sets), list(builders)

    step: dict[str, list[float]] = {f"{kind} {name}": [] for kind in ("build", "lists") for name in names}
    for i in range(-args.warmup, args.steps):
        for name in (names if i % 2 == 0 else reversed(names)):
            build_us, lists_us = in_a_step(builders[name], blobs[i % n_sets], seqs, max_depths)
            if i >= 0:
                step[f"build {name}"].append(build_us)
                step[f"lists {name}"].append(lists_us)

    back: dict[str, list[float]] = {name: [] for name in names}
    for r in range(-1, args.steps // args.block):  # round -1: warm-up
        for name in (names if r % 2 == 0 else reversed(names)):
            f = builders[name]
            for i in range(args.block):
                drafts = draft_sets[(r * args.block + i) % n_sets]
                t0 = time.perf_counter_ns()
                f(seqs, drafts, max_depths)
                if r >= 0:
                    back[name].append((time.perf_counter_ns() - t0) / 1e3)

    trees = [build_step_trees(seqs, d, max_depths) for d in draft_sets]
    out = {"batch": batch, "budget": budget, "top_k": budget, "depth": args.depth,
           "mean_draft_nodes": round(statistics.mean(t.size - 1 for d in trees for t in d.values()), 1),
           "mean_tree_depth": round(statistics.mean(int(t.depths.max()) for d in trees for t in d.values()), 2),
           "in_a_step": {k: summary(v) for k, v in step.items()},
           "back_to_back": {f"build {k}": summary(v) for k, v in back.items()}}
    for kind in ("in_a_step", "back_to_back"):
        r = out[kind]
        r["build_speedup"] = round(r["build reference"]["median_us"] / r["build host"]["median_us"], 2)
        r["c_heap_speedup"] = round(r["build python heap"]["median_us"] / r["build host"]["median_us"], 2)
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    results = []
    for batch in args.batches:
        for budget in args.budgets:
            res = measure(batch, budget, args)
            print(res, flush=True)
            results.append(res)
    hw = common.hardware("cpu", "-", torch.get_num_threads())
    data = {"bench": "tree_build", "command": common.command_line("bench.tree_build"), "date": common.now_utc(),
            "hardware": hw, "steps": args.steps, "warmup": args.warmup, "block": args.block,
            "draft_sets": args.draft_sets, "vocab": args.vocab, "sharpness": list(_sharpness(args.sharpness)),
            "results": results}

    def cell(r: dict, key: str) -> str:
        return f"{r[key]['median_us']} / {r[key]['p90_us']}"

    rows = [[r["batch"], r["budget"], r["mean_draft_nodes"], r["mean_tree_depth"],
             cell(r["in_a_step"], "build reference"), cell(r["in_a_step"], "build python heap"),
             cell(r["in_a_step"], "build host"), r["in_a_step"]["build_speedup"], r["in_a_step"]["c_heap_speedup"],
             cell(r["back_to_back"], "build python heap"), cell(r["back_to_back"], "build host"),
             r["back_to_back"]["c_heap_speedup"], cell(r["in_a_step"], "lists host")]
            for r in results]
    lines = ["# The gateway's per-step DDTree build on the host: build_step_trees (C heap where built), its Python "
             "heap, and the reference heap",
             "", f"- Command: `{data['command']}`", f"- Date: {data['date']}",
             f"- Hardware: {hw['cpu_model']} ({hw['usable_cpus']} usable CPUs); torch {hw['torch']} "
             f"({hw['torch_threads_per_service']} threads), Python {hw['python']}",
             f"- Work: per config {args.draft_sets} drafter-like draft sets (top-k = budget, {args.depth} positions, "
             f"vocab {args.vocab}, logits randn x s, s in [{args.sharpness.replace(',', ', ')}]) cycled; both builders' trees checked identical first. In a step: {args.warmup} "
             f"untimed then {args.steps} timed steps, each running the gateway's host work around one build of each "
             f"builder in turn (DraftResponse -> draft_arrays, build, VerifyRequest). Back to back: {args.steps} "
             f"timed builds per builder in blocks of {args.block}, builders alternating",
             "- C heap: " + ("built" if ddtree_native.library() is not None
                             else "NOT built (no compiler): host = the Python heap"),
             "- Cells: median / p90 µs per step (all sequences of the batch); speedups = reference / host and "
             "Python heap / host medians; lists = tokens.tolist() and parents.tolist() of every tree (the "
             "VerifyRequest's), in a step", "",
             common.md_table(["batch", "budget", "nodes/tree", "depth", "in a step: reference", "python heap",
                              "host", "x reference", "x python heap", "back to back: python heap", "host",
                              "x python heap", "lists"], rows)]
    print("\n".join(lines))
    suffix = "" if _sharpness(args.sharpness) == (4.0, 9.0) else "-sharp" + args.sharpness.replace(",", "-")
    common.write_outputs(args.out_dir, f"tree-build-{common.hardware_tag(hw)}{suffix}", data, "\n".join(lines))


if __name__ == "__main__":
    main()
