"""How many operations a verify step launches, counted on the CPU: a stand-in for its GPU kernel count.

On the GPU a verify step is hundreds of small kernels, each a few microseconds even inside a CUDA graph, so the
count of what it launches is much of what it costs beyond reading the weights. This runs one verify of the tiny
test models (tests/fixtures: a 4-layer Qwen3 and a 3 GDN + 1 attention Qwen3.5) through the fused path on the CPU
and counts the top-level torch operations of each phase (forward, acceptance walk, commit) under torch.profiler,
at 1 node (a decode step) and at 65 (a budget-64 tree of depth <= 16). Functions that run as one compiled kernel
on CUDA (the HybridKernels / DenseKernels glue, the tree WY core) count as one operation each, whatever they do
on the CPU (the walk's accept_batch, compiled in the walk graphs on CUDA, is counted op by op); views count
too, so the figures are an upper bound on kernels, for comparing versions of the code.
It also times the verify handler's host work before the forward (the trees validated and packed), per call.

    python -m bench.verify_ops [--out-dir bench/results]

Writes <out-dir>/verify-ops-<hardware>.{md,json}.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench import common
from bench.common import random_parents

NODES = (1, 65)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.verify_ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    return p.parse_args(argv)


def _as_one_op(obj, names: list[str]) -> None:
    """Wraps obj's callables `names` so that the profiler sees each call as one operation."""
    for name in names:
        fn = getattr(obj, name)

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            with record_function(f"ONE:{_name}"):
                return _fn(*args, **kwargs)

        setattr(obj, name, wrapped)


def count_ops(fn) -> int:
    """Top-level operations of one call of fn: aten ops and ONE: ranges not nested in another counted one."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    total = 0
    for event in prof.events():
        if not (event.name.startswith("aten::") or event.name.startswith("ONE:")):
            continue
        parent = event.cpu_parent
        while parent is not None and not (parent.name.startswith("aten::") or parent.name.startswith("ONE:")):
            parent = parent.cpu_parent
        total += parent is None
    return total


def model(kind: str, work: Path):
    """A fused TargetModel of the tiny test checkpoint of `kind`, its compiled glue counted as one op each."""
    import target_svc.gdn_tree_wy as wy
    from target_svc.loader import load_target
    from target_svc.model import TargetModel
    from tests.fixtures import make_tiny_qwen3, make_tiny_qwen3_5

    path = make_tiny_qwen3_5(work / kind, seed=1, multimodal_wrapper=False) if kind == "hybrid" else \
        make_tiny_qwen3(work / kind, seed=1)
    m = TargetModel(load_target(str(path)), 2, 256, 65, fused=True, tree_gdn="wy")
    kernels = m.hybrid_kernels or m.kernels
    _as_one_op(kernels, [f.name for f in dataclasses.fields(kernels)])
    _as_one_op(wy, ["_wy_core_reference"])
    return m


def phases(m, nodes: int) -> dict[str, int]:
    """Top-level ops of the forward, the walk and the commit of one verify of a `nodes`-node tree."""
    from target_svc.verify import VerifyBatch, VerifyShape, commit_path, verify_forward, verify_walk

    gen = torch.Generator().manual_seed(nodes)
    parents = random_parents(nodes, 16, gen) if nodes > 1 else [-1]
    tokens = torch.randint(0, 300, (nodes,), generator=gen)
    batch = VerifyBatch.pack([(tokens, torch.tensor(parents))], [10], [0], VerifyShape(1, nodes, 64),
                             m.cache.spec.scratch_slot)
    out = verify_forward(m, batch.packed, nodes, 64, ())
    _, _, path, n_acc = verify_walk(batch.packed, nodes, out[1], None, nodes, anc=out[3])
    return {"forward": count_ops(lambda: verify_forward(m, batch.packed, nodes, 64, ())),
            "walk": count_ops(lambda: verify_walk(batch.packed, nodes, out[1], None, nodes, anc=out[3])),
            "commit": count_ops(lambda: commit_path(m, batch.packed, nodes, path, n_acc))}


def pack_us(calls: int = 3000) -> float:
    """Microseconds per call of the verify handler's host work for one 65-node tree: ids as lists (as the server
    hands them over), validated as TargetRunner._check_trees does, packed by VerifyBatch.pack."""
    from target_svc.runner import _int_list
    from target_svc.verify import VerifyBatch, VerifyShape

    gen = torch.Generator().manual_seed(0)
    parents = random_parents(65, 16, gen)
    tokens = torch.randint(0, 150000, (65,), generator=gen).tolist()

    def step() -> None:
        tok, par = _int_list(list(tokens)), _int_list(list(parents))
        assert min(tok) >= 0 and par[0] == -1 and all(0 <= p < i for i, p in enumerate(par[1:], start=1))
        assert len(set(zip(par, tok))) == len(tok)
        depth = [0] * len(tok)
        for i in range(1, len(tok)):
            depth[i] = depth[par[i]] + 1
        VerifyBatch.pack([(tok, par)], [100], [0], VerifyShape(1, 65, 512), 8)

    for _ in range(300):
        step()
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rows, data = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("dense", "hybrid"):
            m = model(kind, Path(tmp))
            for nodes in NODES:
                counts = phases(m, nodes)
                data[f"{kind}_{nodes}"] = counts
                rows.append([kind, nodes, counts["forward"], counts["walk"], counts["commit"]])
                print(" | ".join(map(str, rows[-1])), flush=True)
    pack = pack_us()
    hw = common.hardware("cpu", "float32", 1)
    md = "\n".join([
        f"# Operations a verify step launches, counted on the CPU ({common.hardware_tag(hw)})", "",
        f"- Command: `{common.command_line('bench.verify_ops')}`", f"- Date: {common.now_utc()}",
        f"- Hardware: {hw}", "- Top-level torch ops per phase of one verify of the tiny test models (fused path; "
        "compiled glue and the WY core count as one op each; views included): an upper bound on GPU kernels.", "",
        common.md_table(["model", "nodes", "forward", "walk", "commit"], rows), "",
        f"Verify handler host work for one 65-node tree (lists validated, then packed): {pack:.1f} us per call."])
    print(md, flush=True)
    common.write_outputs(args.out_dir, f"verify-ops-{common.hardware_tag(hw)}",
                         {"command": common.command_line("bench.verify_ops"), "when": common.now_utc(),
                          "hardware": hw, "ops": data, "verify_pack_us": pack}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
