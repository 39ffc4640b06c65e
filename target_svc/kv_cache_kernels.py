"""Triton kernel of target_svc/kv_cache.py: a block's K and V rows written into the slot cache in one launch.

Imported only where Triton is installed (kv_cache.py imports it lazily). One program per (sequence, node) copies
that node's n_kv x head_dim keys and values to row rows[b, t] of slot slots[b]: what two index_put_ calls do, in
one launch instead of two, each of which also builds its flat indices first.
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
