"""Where device memory was when a model service ran out of it: a summary of the allocator snapshot it wrote.

A service started with DDTREE_CUDA_MEMORY_HISTORY=PATH (ddtree_serve/plumbing/cuda_memory_history.py) records its
CUDA allocations and writes torch's allocator snapshot to PATH on its first out-of-memory. This reads that
snapshot (no GPU needed) and writes the live bytes per memory pool (the default pool and each CUDA-graph pool:
live, blocks, reserved) and the lines that allocated the most live bytes (the first frame of this project's code
in each allocation's Python stack) to <out-dir>/memory-snapshot-<name>.{md,json}.

    python -m bench.memory_snapshot /tmp/target-oom.pickle --out-dir bench/results
"""
from __future__ import annotations

import argparse
import pickle
from pathlib import Path

from bench import common
from ddtree_serve.plumbing.cuda_memory_history import summarize

MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.memory_snapshot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshot", help="the pickle a service wrote (torch.cuda.memory._dump_snapshot)")
    p.add_argument("--top", type=int, default=25, help="allocating lines to list")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    return p.parse_args(argv)


def markdown(name: str, summary: dict) -> str:
    """The two tables."""
    return "\n".join([
        f"# Allocator snapshot: {name}", "",
        "Live = blocks in use when the snapshot was taken; reserved = the segments the pool holds.", "",
        common.md_table(["pool", "live MiB", "blocks", "reserved MiB"],
                        [[p["pool"], p["live_bytes"] / MIB, p["blocks"], p["reserved_bytes"] / MIB]
                         for p in summary["pools"]]), "",
        "## Lines that allocated the most live memory", "",
        common.md_table(["allocated at", "live MiB", "blocks"],
                        [[line["where"], line["bytes"] / MIB, line["blocks"]] for line in summary["lines"]]),
    ]) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    path = Path(args.snapshot)
    with path.open("rb") as f:
        snapshot = pickle.load(f)   # a file this project's service wrote: a trusted input
    summary = summarize(snapshot, args.top)
    md = markdown(path.name, summary)
    paths = common.write_outputs(args.out_dir, f"memory-snapshot-{path.stem}", {"snapshot": str(path), **summary}, md)
    print(md)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
