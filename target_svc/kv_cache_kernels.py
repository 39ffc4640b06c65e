"""Triton kernels of target_svc/kv_cache.py: a block's K and V rows written into the slot cache, and the accepted
rows moved down to their committed places, each in one launch.

Imported only where Triton is installed (kv_cache.py imports it lazily). write_kv_kernel: one program per
(sequence, node) copies that node's n_kv x head_dim keys and values to row rows[b, t] of slot slots[b], what two
index_put_ calls do, each of which also builds its flat indices first. move_rows_kernel: a commit's compaction
(accepted tree rows ctx + path[j] to ctx + j in every full-attention layer), which as advanced indexing was a
gather and a scatter for K and for V over all layers: four kernels, 64 us a 65-node step on the H200.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])
def write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, rows_ptr,
    T, stride_kb, stride_kt, stride_vb, stride_vt, stride_slot, stride_row, stride_sb, stride_rb, stride_rt,
    D: tl.constexpr, BLOCK: tl.constexpr,
):
    """k, v [B, T, D] (each node's D = n_kv * head_dim values dense) -> k_cache, v_cache [slots, rows, D]."""
    pid = tl.program_id(0)
    b = pid // T
    t = pid % T
    slot = tl.load(slots_ptr + b * stride_sb)
    row = tl.load(rows_ptr + b * stride_rb + t * stride_rt)
    dst = slot.to(tl.int64) * stride_slot + row.to(tl.int64) * stride_row
    for start in tl.static_range(0, D, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < D
        key = tl.load(k_ptr + b * stride_kb + t * stride_kt + offs, mask=mask)
        value = tl.load(v_ptr + b * stride_vb + t * stride_vt + offs, mask=mask)
        tl.store(k_cache_ptr + dst + offs, key, mask=mask)
        tl.store(v_cache_ptr + dst + offs, value, mask=mask)


@triton.jit(do_not_specialize=["D"])
def move_rows_kernel(
    k_ptr, v_ptr, slots_ptr, src_ptr, dst_ptr,
    D, stride_layer, stride_slot, stride_row, stride_sb, stride_srcb, stride_srcd, stride_dstb, stride_dstd,
    C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """k, v [L, slots, rows, C] (each row's C = n_kv * head_dim values dense): rows src[b, :D] of slot slots[b] ->
    rows dst[b, :D], in layer program_id(0), columns block program_id(2). A row can be one pair's source and
    another's destination (an accepted path's rows move down past each other), so the program reads every source
    row before any thread writes; pairs with src == dst (padding, a row already in place) move nothing."""
    layer = tl.program_id(0)
    b = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    src = tl.load(src_ptr + b * stride_srcb + d * stride_srcd, mask=d_ok, other=0).to(tl.int64)
    dst = tl.load(dst_ptr + b * stride_dstb + d * stride_dstd, mask=d_ok, other=0).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    move = (d_ok & (src != dst))[:, None] & (cols < C)[None, :]
    base = layer.to(tl.int64) * stride_layer + tl.load(slots_ptr + b * stride_sb).to(tl.int64) * stride_slot
    src_at = base + src[:, None] * stride_row + cols[None, :]
    dst_at = base + dst[:, None] * stride_row + cols[None, :]
    keys = tl.load(k_ptr + src_at, mask=move)
    values = tl.load(v_ptr + src_at, mask=move)
    tl.debug_barrier()   # every thread's reads of this program's rows before any thread's writes
    tl.store(k_ptr + dst_at, keys, mask=move)
    tl.store(v_ptr + dst_at, values, mask=move)
