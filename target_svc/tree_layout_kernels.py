"""Triton kernel of target_svc/tree_layout.py: a verify step's tree structure in one launch.

Imported only where Triton is installed (target_svc/tree_layout.py imports it lazily). One program per tree: the
ancestor mask by pointer doubling (as ddtree_serve.decoding.tree_mask.ancestor_mask_batch, same pointers, same
steps), the depths as each row's ancestor count less one, and optionally each node's Gated DeltaNet conv window
(as target_svc/gdn_tree_wy.gdn_tree_layout). The mask lives in registers as one BT x BT tile (BT: the node count
rounded up to a power of two); a doubling step ORs in the rows of the nodes' 2^k-th ancestors, which a program
reads back from global memory: it stores its tile into the output mask and its pointers into the depth output,
waits at a barrier (a CTA barrier orders a program's global stores before its later loads), gathers, and waits
again before the next step overwrites them. The outputs' final values are written last.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T", "STEPS"])
def tree_layout_kernel(
    parents_ptr, sizes_ptr, anc_ptr, depth_ptr, window_ptr,
    T, STEPS,
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
    # ancestor_mask_batch's pointers: the parent where it is a real, earlier node of a real node; else none (T).
    ok = (parents >= 0) & (parents < rows) & (rows < size)
    ptr = tl.where(ok, parents, T)
    anc = (rows[:, None] == cols[None, :]) | (cols[None, :] == ptr[:, None])
    anc = anc & in_tree[:, None] & (cols < T)[None, :]
    tile = anc_ptr + b * stride_ab + rows[:, None] * stride_ai + cols[None, :]
    tile_mask = in_tree[:, None] & (cols < T)[None, :]
    scratch = depth_ptr + b * stride_db
    # invariant: after k steps anc[i] holds the ancestors at distance <= 2^k and ptr[i] the 2^k-th one (T: none)
    for _ in range(STEPS):
        tl.store(tile, anc.to(tl.uint8), mask=tile_mask)
        tl.store(scratch + rows, ptr, mask=in_tree)
        tl.debug_barrier()
        has = ptr < T
        far = tl.load(anc_ptr + b * stride_ab + ptr[:, None] * stride_ai + cols[None, :],
                      mask=has[:, None] & (cols < T)[None, :], other=0)
        ptr_next = tl.load(scratch + ptr, mask=has, other=T)
        tl.debug_barrier()  # every gather done before the next step's stores
        anc = anc | (far != 0)
        ptr = tl.where(has, ptr_next, T)
    depth = tl.sum(anc.to(tl.int64), axis=1) - 1
    if KERN > 0:
        # gdn_tree_layout's conv windows: node i's own input, then its ancestors at distance 1 .. KERN-1, and past
        # the root the committed inputs (KERN-1) - (m - depth); rows of [committed KERN-1 inputs | the T nodes].
        up = tl.where((rows < size) & (parents >= 0), parents, -1)
        tl.store(scratch + rows, up, mask=in_tree)
        tl.debug_barrier()
        window = window_ptr + b * stride_wb + rows * stride_wt
        tl.store(window + (KERN - 1), rows + (KERN - 1), mask=in_tree)
        cur = up
        for m in tl.static_range(1, KERN):
            col = tl.where(cur >= 0, cur + (KERN - 1), (KERN - 1) - (m - depth))
            tl.store(window + (KERN - 1 - m), col, mask=in_tree)
            cur = tl.where(cur >= 0, tl.load(scratch + cur, mask=cur >= 0, other=-1), cur)
        tl.debug_barrier()  # the pointer reads done before the depths overwrite them
    tl.store(tile, anc.to(tl.uint8), mask=tile_mask)
    tl.store(scratch + rows, depth, mask=in_tree)
