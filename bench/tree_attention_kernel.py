"""The tree-attention kernel's tiling and key split, swept on the GPU at the shapes a step attends with.

A verify step's attention layers run ddtree_serve/kernels/tree_attention.py's split kernel (and its merge). On the
H200 at the 8B shape (bench/results/step-cost-qwen3-8b-cuda-nvidia-h200.md, 20:42) the split kernel cost ~5 us a
layer for a 1-token decode and ~22 us for a 65-node tree, whose work is a few 64 x 64 x 128 dots per program: this
measures which tiling and split a block of each size wants (the H100 sweep of 2026-12-05 is in
bench/results/h100-tree-attention-2026-12-05/). Cases (bf16): Qwen3-8B's heads (32 query / 8 KV, head dim 128)
and the Qwen3.6-27B's gated attention (24 / 4, 256); blocks of 1, 17, 65 and 129 nodes (random trees of depth
<= 16) after a 512-token context, in the key bucket a captured graph uses (1024); batch 1 and 8. Each config:
--calls calls captured in one CUDA graph, median of --replays replays per call (bench/gdn_kernels.time_per_call),
and its agreement with SDPA over the gathered, masked rows (max |diff| / max |ref|).

    python -m bench.tree_attention_kernel                 # the default tiling per case
    python -m bench.tree_attention_kernel --sweep         # and every tiling of the grid

Prints a markdown table (and writes it with --out-dir).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys

import torch

from bench import common
from bench.common import random_parents
from bench.gdn_kernels import agreement, finish_sweep, sweep_parser, sweep_row

CONTEXT = 512
KEY_BUCKET = 1024
SHAPES = {"8b": (32, 8, 128), "27b": (24, 4, 256)}   # query heads, KV heads, head dim


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = sweep_parser("bench.tree_attention_kernel", __doc__, "tree-attention-kernel")
    p.add_argument("--shapes", default="8b,27b", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--nodes", default="1,17,65,129", help="block sizes")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--block-ms", default="16,32,64,128", help="the sweep's row tiles")
    p.add_argument("--warps", default="4,8", help="the sweep's warps per program")
    p.add_argument("--stages", default="1,2", help="the sweep's pipeline stages")
    p.add_argument("--context-loop", default="1", help="0, 1 or 0,1: the committed keys in the main loop, in a "
                   "loop of their own (SplitConfig.context_loop), or both")
    p.add_argument("--max-registers", default="0", help="register caps a thread to try (0: ptxas's choice), "
                   "e.g. 0,96 (SplitConfig.max_registers)")
    p.add_argument("--balanced", default="0", help="0, 1 or 0,1: key slices of the bucket, of each sequence's own "
                   "keys (SplitConfig.balanced), or both")
    p.add_argument("--fused-merge", default="0", help="0, 1 or 0,1: split launches merge in a second kernel, in "
                   "their last slice (SplitConfig.fused_merge; the default tiling too), or both")
    return p.parse_args(argv)


def case_inputs(batch: int, nodes: int, heads: int, kv_heads: int, head_dim: int, seed: int, device: str = "cuda"):
    """(q, k_cache, v_cache, slots, parents, TreeKeys) of one case: slot b holds CONTEXT rows, then the block."""
    from ddtree_serve.decoding.tree_mask import ancestor_mask_batch
    from ddtree_serve.kernels.tree_attention import TreeKeys

    gen = torch.Generator().manual_seed(seed)
    shape = (batch + 1, KEY_BUCKET + 128, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).bfloat16().to(device)
    v_cache = torch.randn(shape, generator=gen).bfloat16().to(device)
    q = torch.randn(batch, nodes, heads, head_dim, generator=gen).bfloat16().to(device)
    parents = torch.tensor([random_parents(nodes, 16, gen) for _ in range(batch)], device=device)
    sizes = torch.full((batch,), nodes, device=device)
    ctx = torch.full((batch,), CONTEXT, device=device)
    slots = torch.arange(batch, device=device)
    return q, k_cache, v_cache, slots, parents, TreeKeys(ctx, ancestor_mask_batch(parents, sizes).contiguous())


def sdpa_reference(q, k_cache, v_cache, slots, parents, keys) -> torch.Tensor:
    """SDPA over each sequence's gathered rows with the dense tree mask (the model's CPU path), in float32."""
    import torch.nn.functional as F

    from ddtree_serve.decoding.tree_mask import tree_attention_mask

    batch, nodes, heads, head_dim = q.shape
    rep = heads // k_cache.shape[2]
    key_len = CONTEXT + nodes
    sizes = torch.full((batch,), nodes, device=q.device)
    mask = tree_attention_mask(keys.ctx_lens, parents, sizes, key_len, keys.ancestors)
    kk = k_cache[slots, :key_len].float().repeat_interleave(rep, 2).transpose(1, 2)
    vv = v_cache[slots, :key_len].float().repeat_interleave(rep, 2).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.float().transpose(1, 2), kk, vv, attn_mask=mask[:, None],
                                         scale=head_dim**-0.5)
    return out.transpose(1, 2)


def sweep_grid(rows: int, head_dim: int, block_ms=(16, 32, 64, 128), warps=(4, 8), stages=(1, 2),
               context_loops=(1,), balanced=(0,), max_registers=(0,)):
    """Tilings of the stacked query rows and the keys, key splits of the 1024-key bucket, and the kernel's variants."""
    from ddtree_serve.kernels.tree_attention import SplitConfig

    block_ns = (32, 64) if head_dim <= 128 else (32,)
    for block_m, block_n, splits, num_warps, num_stages, context_loop, fair, regs in itertools.product(
            block_ms, block_ns, (1, 2, 3, 4, 6, 8, 12, 16), warps, stages, context_loops, balanced, max_registers):
        if block_m > 16 and block_m >= 2 * rows or block_m * head_dim > 128 * 128:
            continue   # a tile mostly padding, or one past the registers
        tiles = -(-KEY_BUCKET // block_n)
        if splits > tiles or fair and splits == 1:
            continue
        per_split = -(-tiles // splits)
        yield SplitConfig(block_m, block_n, -(-tiles // per_split), per_split * block_n, num_warps, num_stages,
                          bool(context_loop), bool(fair), regs or None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ddtree_serve.kernels import tree_attention

    if not torch.cuda.is_available() or not tree_attention.available(torch.device("cuda"), 128, torch.bfloat16):
        print("needs a CUDA device of sm_80+ and triton", file=sys.stderr)
        return 2
    table = []
    for shape, nodes, batch in itertools.product(args.shapes.split(","), map(int, args.nodes.split(",")),
                                                 map(int, args.batches.split(","))):
        heads, kv_heads, head_dim = SHAPES[shape]
        q, k_cache, v_cache, slots, parents, keys = case_inputs(batch, nodes, heads, kv_heads, head_dim,
                                                                seed=nodes + batch)
        want = sdpa_reference(q, k_cache, v_cache, slots, parents, keys)
        scale = head_dim**-0.5
        rows = heads // kv_heads * nodes
        name = f"{shape} b{batch} {nodes} nodes"
        default = tree_attention.choose_config(batch, kv_heads, rows, KEY_BUCKET, head_dim)
        grid = sweep_grid(rows, head_dim, *(tuple(map(int, v.split(","))) for v in (
            args.block_ms, args.warps, args.stages, args.context_loop, args.balanced, args.max_registers)))
        configs = [("default", default)] + ([("", c) for c in grid] if args.sweep else [])
        fused = sorted({bool(int(v)) for v in args.fused_merge.split(",")})
        configs = [(tag, dataclasses.replace(c, fused_merge=f)) for tag, c in configs for f in fused
                   if not f or c.splits > 1]
        # As in a forward: the fused merges' counts made once, outside the timed calls (each launch leaves them 0).
        keys = dataclasses.replace(keys, merge_counts=torch.zeros(batch * kv_heads * -(-rows // 16),
                                                                  dtype=torch.int32, device="cuda"))
        for tag, cfg in configs:
            label = (f"{tag + ' ' if tag else ''}BM {cfg.block_m} BN {cfg.block_n} splits {cfg.splits} "
                     f"warps {cfg.num_warps} stages {cfg.num_stages}{' context loop' if cfg.context_loop else ''}"
                     f"{' balanced' if cfg.balanced else ''}"
                     f"{f' max {cfg.max_registers} registers' if cfg.max_registers else ''}"
                     f"{' fused merge' if cfg.fused_merge else ''}")
            def call(cfg=cfg):
                return tree_attention.tree_attention(q, k_cache, v_cache, slots, keys, KEY_BUCKET, scale, cfg)

            table.append(sweep_row(name, label, call, lambda got: agreement((got,), (want,)), args.calls,
                                   args.replays, unit=1000.0, digits=1))
    finish_sweep("bench.tree_attention_kernel", "tree-attention-kernel",
                 ["case", "tiling", "us per call", "agreement", "mode"], table, "bfloat16", args.out_dir)
    print(common.md_table(["case", "default us", "fastest us", "fastest tiling"], fastest_per_case(table)))
    return 0


def fastest_per_case(table: list[list[str]]) -> list[list[str]]:
    """[case, the default tiling's us, the fastest us, its tiling] per case of the sweep's rows."""
    out: dict[str, list[str]] = {}
    for case, label, us, _err, _mode in table:
        if not us:
            continue
        row = out.setdefault(case, [case, "", us, label])
        if label.startswith("default"):
            row[1] = us
        if float(us) < float(row[2]):
            row[2:] = [us, label]
    return list(out.values())


if __name__ == "__main__":
    sys.exit(main())
