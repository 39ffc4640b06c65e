"""Triton kernel of target_svc/tree_layout.py: a verify step's tree structure in one launch.

Imported only where Triton is installed (target_svc/tree_layout.py imports it lazily). One program per tree: the
ancestor mask (as ddtree_serve.decoding.tree_mask.ancestor_mask_batch), the depths as each row's ancestor count
less one, and optionally each node's Gated DeltaNet conv window (as target_svc/gdn_tree_wy.gdn_tree_layout). The
mask lives in registers as one BT x BT tile (BT: the node count rounded up to a power of two), built by pointer
jumping: each round ORs into every row the row of its current far ancestor (a gather of whole rows in registers,
warp shuffles) and doubles the jump, so a tree of depth d takes ceil(log2(d + 1)) rounds with no memory traffic.
Earlier forms, and why they went: pointer doubling through global memory (log2 T steps, each storing and
gathering the whole tile) took ~79 us at 65 nodes on an H100; a walk one level a step (a pointer table in global
memory, a load and a barrier a level) ~47 us on the H200 at the step-cost bench's 65-node trees (~26 deep), ~5 %
of that verify forward's premium over a 16-node chain's. Compiled for sm_90 (bench.kernel_sass) the 65-node walk
was 746 instructions a warp per level with 255 registers and a spill; the jumping is 974 a round, ~5 rounds at that
depth, with 128 registers and none.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])
def tree_layout_kernel(
    parents_ptr, sizes_ptr, anc_ptr, depth_ptr, window_ptr,
    T,
    stride_pb, stride_pt, stride_sb, stride_ab, stride_ai, stride_db, stride_wb, stride_wt,
    BT: tl.constexpr, KERN: tl.constexpr,
):
    """anc [B, T, T] (uint8 0/1), depth [B, T] int64 and, when KERN > 0, window [B, T, KERN] int64 of tree b;
    parents [B, T] int64 (-1: root / padding), sizes [B] int64 (nodes past sizes[b] are padding)."""
    b = tl.program_id(0)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BT)
    in_tree = rows < T
    size = tl.load(sizes_ptr + b * stride_sb)
    parents = tl.load(parents_ptr + b * stride_pb + rows * stride_pt, mask=in_tree, other=-1)
    # ancestor_mask_batch's pointers: the parent where it is a real, earlier node of a real node; else none (-1).
    up = tl.where((parents >= 0) & (parents < rows) & (rows < size), parents, -1)
    # Pointer jumping in registers: after round r, row i holds i's ancestors-or-self up to distance 2^r - 1 and
    # jump[i] is its ancestor at distance 2^r (-1 past the root). A round ORs in the row of jump[i] (a gather of
    # whole rows) and doubles the jump: ceil(log2(depth + 1)) rounds, 4 for a 16-deep DDTree tree.
    anc = ((rows[:, None] == cols[None, :]) & in_tree[:, None]).to(tl.int8)
    jump = up
    while tl.max(jump, axis=0) >= 0:   # some node still has an ancestor to add
        at = tl.maximum(jump, 0)
        far = tl.gather(anc, tl.broadcast_to(at[:, None], (BT, BT)), 0)
        anc = anc | tl.where((jump >= 0)[:, None], far, 0).to(tl.int8)
        jump = tl.where(jump >= 0, tl.gather(jump, at, 0), -1)
    depth = tl.sum(anc.to(tl.int64), axis=1) - 1
    if KERN > 0:
        # gdn_tree_layout's conv windows: node i's own input, then its ancestors at distance 1 .. KERN-1, and past
        # the root the committed inputs (KERN-1) - (m - depth); rows of [committed KERN-1 inputs | the T nodes].
        up = tl.where((rows < size) & (parents >= 0), parents, -1)
        window = window_ptr + b * stride_wb + rows * stride_wt
        tl.store(window + (KERN - 1), rows + (KERN - 1), mask=in_tree)
        cur = up
        for m in tl.static_range(1, KERN):
            col = tl.where(cur >= 0, cur + (KERN - 1), (KERN - 1) - (m - depth))
            tl.store(window + (KERN - 1 - m), col, mask=in_tree)
            cur = tl.where(cur >= 0, tl.gather(up, tl.minimum(tl.maximum(cur, 0), BT - 1), 0), cur)
    tile = anc_ptr + b * stride_ab + rows[:, None] * stride_ai + cols[None, :]
    tl.store(tile, anc.to(tl.uint8), mask=in_tree[:, None] & (cols < T)[None, :])
    tl.store(depth_ptr + b * stride_db + rows, depth, mask=in_tree)
