"""The tree WY core on the GPU: the PyTorch core of gdn_tree_wy.py against the fused Triton kernel, 27B GDN heads.

48 value heads of 128 (keys repeated from 16), fp32, per tree shape (a 65-node tree of depth 16, a 16-node chain,
eight 65-node trees, a 256-node tree), the kernel under its default tiles and under each --sweep tiling. Each
timing: --calls calls captured in one CUDA graph and replayed --replays times (median per call, as
bench/gdn_kernels.py times). The agreement column is max |kernel - reference| / max |reference| over core and u.

    python -m bench.gdn_tree_kernel                 # on the GPU machine, triton installed
    python -m bench.gdn_tree_kernel --sweep         # also every tiling of the sweep grid (and the 3-launch form)
    python -m bench.gdn_tree_kernel --sweep --block-t 16,32,64   # with 64-node diagonal blocks too (slow to build)

Prints a markdown table (and writes it with --out-dir).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys

import torch

from bench.common import random_parents
from bench.gdn_kernels import agreement, finish_sweep, sweep_parser, sweep_row, time_per_call

KEY_HEADS, VALUE_HEADS, HEAD_DIM = 16, 48, 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = sweep_parser("bench.gdn_tree_kernel", __doc__, "gdn-tree-kernel")
    # 64-node blocks at Dk 128: ptxas (sm_90) spills 64 KB and more per thread and takes about a minute per
    # variant (several at 4 warps), so they are swept only when asked for.
    p.add_argument("--block-t", default="16,32", help="diagonal block sizes of the sweep grid (of 16, 32, 64)")
    p.add_argument("--precision", default="ieee", help="the dots' precisions to time (TileConfig.precision), e.g. "
                   "ieee,bf16x3,tf32x3,tf32: the default tiles at each, and with --sweep every tiling at each")
    p.add_argument("--phases", default="1,2,3",
                   help="the launch forms the sweep times (TileConfig.phases), e.g. 2 for the two-launch form alone")
    return p.parse_args(argv)




def core_inputs(trees: list[list[int]], seed: int) -> tuple[torch.Tensor, ...]:
    """(qh, kh, vh, g, beta, anc, s0) as gdn_tree_forward_wy hands them to the core (heads-first views)."""
    from ddtree_serve.decoding.tree_mask import ancestor_mask_batch
    from target_svc.gated_deltanet import _l2norm

    bsz, t = len(trees), max(len(p) for p in trees)
    parents = torch.full((bsz, t), -1, dtype=torch.long)
    for b, p in enumerate(trees):
        parents[b, : len(p)] = torch.tensor(p)
    anc = ancestor_mask_batch(parents.cuda(), torch.tensor([len(p) for p in trees]).cuda())
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    rep = VALUE_HEADS // KEY_HEADS
    q = (_l2norm(randn(bsz, t, KEY_HEADS, HEAD_DIM)) * HEAD_DIM**-0.5).repeat_interleave(rep, dim=2)
    k = _l2norm(randn(bsz, t, KEY_HEADS, HEAD_DIM)).repeat_interleave(rep, dim=2)
    v = randn(bsz, t, VALUE_HEADS, HEAD_DIM)
    rate = torch.linspace(-4.0, 1.0, VALUE_HEADS, device="cuda").exp()
    g = -rate * torch.nn.functional.softplus(randn(bsz, t, VALUE_HEADS))
    beta = torch.sigmoid(randn(bsz, t, VALUE_HEADS))
    s0 = randn(bsz, VALUE_HEADS, HEAD_DIM, HEAD_DIM) * 0.1
    return (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2), anc,
            s0)


def cases() -> list[tuple[str, list[list[int]]]]:
    gen = torch.Generator().manual_seed(0)
    return [("65-node tree, depth 16", [random_parents(65, 16, gen)]), ("16-node chain", [list(range(-1, 15))]),
            ("8 x 65-node trees", [random_parents(65, 16, gen) for _ in range(8)]),
            ("256-node tree, depth 16", [random_parents(256, 16, gen)])]


def sweep_grid(block_ts: tuple[int, ...] = (16, 32)):
    """Diagonal blocks of block_ts nodes inverted by block doubling, and the row-by-row inversion at 16 nodes
    (at 32 or 64 it takes 31 or 63 dependent steps per block: more than 16's 15 per block times the blocks
    saved); 64 value columns and one stage, the earlier sweep's winners."""
    from target_svc.gdn_tree_kernel import TileConfig

    for bt, invert, bc, warps in itertools.product(block_ts, ("blocks", "rows"), (32, 64), (4, 8)):
        if invert == "rows" and bt > 16:
            continue
        yield TileConfig(block_t=bt, block_c=bc, block_v=64, num_warps=warps, num_stages=1, invert=invert)
    # The three-launch form (products first, in parallel over blocks), block doubling only.
    for bt, bc, warps in itertools.product(block_ts, (32, 64), (4, 8)):
        yield TileConfig(block_t=bt, block_c=bc, block_v=64, num_warps=warps, num_stages=1, phases=3)
    # The two-launch form (the key side once per head, then all nodes past the root as one block; trees of up to
    # 65 nodes, larger ones run the one launch): its block is the tree's, so block_t does not vary.
    # blocks16: its inverse's doubling up to 16 on the diagonal 16-blocks batched.
    # key_warps: the key kernel's own warps (one program per tree and head: fewer than the SMs at batch 1).
    for bv, warps, invert in itertools.product((32, 64), (4, 8), ("blocks", "blocks16")):
        yield TileConfig(block_c=32, block_v=bv, num_warps=warps, num_stages=1, phases=2, invert=invert)
    for invert, key_warps in itertools.product(("blocks", "blocks16"), (2, 8)):
        yield TileConfig(block_c=32, block_v=32, num_warps=4, num_stages=1, phases=2, invert=invert,
                         key_warps=key_warps)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from target_svc import gdn_tree_kernel
    from target_svc.gdn_tree_wy import _wy_core_reference

    if not gdn_tree_kernel.available("cuda"):
        print("needs a CUDA device of sm_80+ and triton", file=sys.stderr)
        return 2
    rows = []
    for name, trees in cases():
        inputs = core_inputs(trees, seed=len(name))
        want = _wy_core_reference(*inputs)
        ref_ms, mode = time_per_call(lambda: _wy_core_reference(*inputs), args.calls, args.replays)
        rows.append([name, "PyTorch core", f"{ref_ms:.4f}", "", mode])
        print(" | ".join(rows[-1]), flush=True)
        forms = {int(x) for x in args.phases.split(",")}
        grid = [cfg for cfg in sweep_grid(tuple(int(x) for x in args.block_t.split(","))) if cfg.phases in forms] \
            if args.sweep else []
        default = gdn_tree_kernel.choose_config(len(trees) * VALUE_HEADS, HEAD_DIM,
                                                torch.cuda.get_device_properties(0).multi_processor_count)
        configs = [None] + [dataclasses.replace(cfg, precision=precision) for precision in args.precision.split(",")
                            for cfg in [default, *grid] if (cfg, precision) != (default, "ieee")]
        for cfg in configs:
            label = "kernel, default tiles" if cfg is None else (
                f"kernel BT {cfg.block_t} {cfg.invert} BC {cfg.block_c} BV {cfg.block_v} warps {cfg.num_warps} "
                f"stages {cfg.num_stages}" + (f" {cfg.phases} launches" if cfg.phases > 1 else "")
                + (f" key warps {cfg.key_warps}" if cfg.key_warps else "")
                + (" (one launch: too many nodes)" if cfg.phases == 2 and max(map(len, trees))
                   > gdn_tree_kernel.TWO_PHASE_MAX_NODES else "")
                + ("" if cfg.precision == "ieee" else f" {cfg.precision}"))
            rows.append(sweep_row(name, label, lambda cfg=cfg: gdn_tree_kernel.tree_wy_core(*inputs, config=cfg),
                                  lambda got: agreement(got[:2], want[:2]), args.calls, args.replays))
    finish_sweep("bench.gdn_tree_kernel", "gdn-tree-kernel", ["case", "core", "ms per call", "agreement", "mode"], rows,
                 "float32", args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
