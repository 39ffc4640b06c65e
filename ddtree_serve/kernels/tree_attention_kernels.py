"""Triton kernels of tree attention over the slot cache: a verify block's queries against its sequence's cached
keys, split over the keys (flash-decoding), for the few query rows of a decode or verify step.

Imported only where Triton is installed (ddtree_serve/kernels/tree_attention.py imports it lazily and owns the launch
logic). Why not SDPA: the reference path gathers each sequence's rows out of the cache (two copies per layer), and
cuDNN's flash kernel gives a 1-token decode one program per KV head, which walks all keys alone (~27 us per layer at
the 8B shape on the H200, against ~1 us of reading). Here each program takes one KV head, one block of stacked
query rows and one slice of the keys, straight from the cache; a second kernel merges the slices' partial results
by their log-sum-exp, or (FUSED_MERGE) the last slice of a row block to finish does, counted by an atomic.

Query rows of one KV head are stacked as row = g * T + t (g: the query head within the KV head's group, t: the
block node), so the REP heads that share a KV head share every key tile. Key p of sequence b is visible to node t
when p < ctx_len[b] (committed context) or when p - ctx_len[b] is t or an ancestor of t (anc[b, t, p - ctx_len]);
keys from ctx_len + T on are never read.
"""
from __future__ import annotations

import triton
import triton.language as tl

# Finite stand-in for -inf as the running maximum: exp(m_old - m_new) then never computes inf - inf.
_NEG_BIG = tl.constexpr(-1.0e30)
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _row_block(T, ROWS, NUM_KV: tl.constexpr, REP: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's sequence b, KV head, its BLOCK_M stacked rows (row = g * T + t), which of them exist, and each
    row's block node t and query head -> (b, kvh, rows, row_ok, t, head)."""
    pid_bh = tl.program_id(0)
    b = pid_bh // NUM_KV
    kvh = pid_bh % NUM_KV
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    return b, kvh, rows, rows < ROWS, rows % T, kvh * REP + rows // T


@triton.jit
def _slice_len(split_len, keys, num_splits):
    """Keys per slice: split_len when > 0 (slices of the launch's key bucket), else balanced on this sequence's
    `keys`: its tiles of -split_len keys shared out over the num_splits slices."""
    tile = tl.abs(split_len)
    balanced = tl.cdiv(tl.cdiv(keys, tile), num_splits) * tile
    return tl.where(split_len > 0, split_len, balanced)


@triton.jit
def _live_slices(ctx, T, num_splits, split_len):
    """How many slices of a sequence with ctx + T keys start before its last key (the ones the split kernel runs)."""
    return tl.minimum(tl.cdiv(ctx + T, _slice_len(split_len, ctx + T, num_splits)), num_splits)


@triton.jit
def _merged_rows(acc_ptr, lse_ptr, first, live, ROWS, rows, row_ok, offs_d, BLOCK_M: tl.constexpr,
                 HEAD_DIM: tl.constexpr, CACHE: tl.constexpr):
    """The rows' output: the live slices' partial outputs (slices first .. first + live - 1 of acc / lse) weighted
    by exp(lse - max lse), in a fixed order. CACHE: the loads' cache modifier (".cg" for partials other programs
    of the same launch wrote: read from L2, where their release left them, not from a stale L1 line)."""
    top = tl.full((BLOCK_M,), _NEG_BIG, dtype=tl.float32)
    for s in range(live):
        top = tl.maximum(top, tl.load(lse_ptr + (first + s) * ROWS + rows, mask=row_ok, other=float("-inf"),
                                      cache_modifier=CACHE))
    num = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    den = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for s in range(live):
        w = tl.exp(tl.load(lse_ptr + (first + s) * ROWS + rows, mask=row_ok, other=float("-inf"),
                           cache_modifier=CACHE) - top)
        part = tl.load(acc_ptr + ((first + s) * ROWS + rows[:, None]) * HEAD_DIM + offs_d[None, :],
                       mask=row_ok[:, None], other=0.0, cache_modifier=CACHE)
        num += w[:, None] * part
        den += w
    return num / tl.where(den > 0, den, 1.0)[:, None]


@triton.jit
def _attend_tile(q, k_base, v_base, offs_n, offs_d, n_ok, visible, stride_kr, stride_vr, scale2, m_i, l_i, acc,
                 MASKED: tl.constexpr = True):
    """One key tile of the online softmax in base 2: scores of the visible keys ([BLOCK_M, BLOCK_N] mask) times
    scale2 (the softmax scale times log2(e); the multiply fuses into the exponent's subtraction), the running
    maximum (of scaled scores), normaliser and output updated -> (m_i, l_i, acc). Not MASKED: a whole tile of
    keys every row sees (n_ok and visible unused)."""
    if MASKED:
        k = tl.load(k_base + offs_n[:, None] * stride_kr + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        s = tl.where(visible, tl.dot(q, tl.trans(k)), float("-inf"))
        v = tl.load(v_base + offs_n[:, None] * stride_vr + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    else:
        k = tl.load(k_base + offs_n[:, None] * stride_kr + offs_d[None, :])
        s = tl.dot(q, tl.trans(k))
        v = tl.load(v_base + offs_n[:, None] * stride_vr + offs_d[None, :])
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale2)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * scale2 - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def tree_attention_split_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, ctx_ptr, anc_ptr, acc_ptr, lse_ptr, out_ptr, count_ptr,
    T, ROWS, num_splits, split_len, scale, stride_slot, stride_ctx,
    stride_qb, stride_qt, stride_qh,
    stride_ks, stride_kr, stride_kh,
    stride_vs, stride_vr, stride_vh,
    stride_ab, stride_at,
    stride_ob, stride_ot, stride_oh,
    REP: tl.constexpr, NUM_KV: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CONTEXT_LOOP: tl.constexpr,
    FUSED_MERGE: tl.constexpr = False,
):
    """One (sequence, KV head), one block of stacked query rows, one slice of keys (_slice_len). Not SPLIT (one
    slice): the normalised output into out [B, T, n_heads, D]; else the slice's normalised output (float32) and
    log-sum-exp into acc [B, NUM_KV, num_splits, ROWS, D] and lse [B, NUM_KV, num_splits, ROWS] (-inf: no visible
    key); a slice that starts past the sequence's keys returns at once and writes nothing. The slice count is a
    runtime argument, not a constant: every key length then shares one compiled kernel (as a constant, each count
    compiled its own pair, and a cold start spent minutes compiling them). CONTEXT_LOOP: the slice's committed
    keys (visible to every row) in loops of their own, without the ancestor mask's loads and compares (whole tiles
    without bounds, then the partial one); the block's keys after them. FUSED_MERGE (with SPLIT): each live slice
    of a row block adds one to its count (count_ptr, int32 per (sequence, KV head, row block), zero at launch)
    after storing its partials; the last to arrive merges them into out and sets the count back to zero, so the
    next launch (or graph replay) finds it so."""
    pid_s = tl.program_id(2)
    b, kvh, rows, row_ok, t, head = _row_block(T, ROWS, NUM_KV, REP, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    ctx = tl.load(ctx_ptr + b * stride_ctx).to(tl.int32)   # slots and ctx_lens may be columns of a packed batch
    slice_len = _slice_len(split_len, ctx + T, num_splits)
    start = pid_s * slice_len
    if SPLIT and start >= ctx + T:
        return   # a slice past this sequence's keys (its key bucket is longer): the merge skips it
    slot = tl.load(slots_ptr + b * stride_slot).to(tl.int64)
    stop = tl.minimum(start + slice_len, ctx + T)
    k_base = k_ptr + slot * stride_ks + kvh * stride_kh
    v_base = v_ptr + slot * stride_vs + kvh * stride_vh
    anc_base = anc_ptr + b * stride_ab + t[:, None] * stride_at

    scale2 = scale * _LOG2E
    m_i = tl.full((BLOCK_M,), _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    first = start
    if CONTEXT_LOOP:
        context_stop = tl.minimum(stop, ctx)
        whole_stop = start + tl.maximum(context_stop - start, 0) // BLOCK_N * BLOCK_N
        for n0 in range(start, whole_stop, BLOCK_N):   # whole tiles: no masks at all
            offs_n = n0 + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _attend_tile(q, k_base, v_base, offs_n, offs_d, offs_n, offs_n, stride_kr, stride_vr,
                                         scale2, m_i, l_i, acc, MASKED=False)
        for n0 in range(whole_stop, context_stop, BLOCK_N):   # the last, partial one
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < context_stop
            m_i, l_i, acc = _attend_tile(q, k_base, v_base, offs_n, offs_d, n_ok, n_ok[None, :], stride_kr,
                                         stride_vr, scale2, m_i, l_i, acc)
        first = tl.maximum(start, ctx)
    for n0 in range(first, stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        j = offs_n - ctx   # position inside the block (negative: committed context)
        in_block = j >= 0
        anc = tl.load(anc_base + j[None, :], mask=row_ok[:, None] & in_block[None, :] & n_ok[None, :], other=0)
        visible = n_ok[None, :] & ((j < 0)[None, :] | (anc != 0))
        m_i, l_i, acc = _attend_tile(q, k_base, v_base, offs_n, offs_d, n_ok, visible, stride_kr, stride_vr, scale2,
                                     m_i, l_i, acc)

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if not SPLIT:
        tl.store(out_ptr + b * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = (b * NUM_KV + kvh) * num_splits + pid_s
        tl.store(acc_ptr + (part * ROWS + rows[:, None]) * HEAD_DIM + offs_d[None, :], out, mask=row_ok[:, None])
        lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * _LN2, float("-inf"))   # natural log
        tl.store(lse_ptr + part * ROWS + rows, lse, mask=row_ok)
        if FUSED_MERGE:
            # Every thread's stores before the one atomic (release at GPU scope: they are visible to whoever
            # acquires the count after it), and the acquire before the last slice reads the others' partials.
            tl.debug_barrier()
            count_at = count_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            arrived = tl.atomic_add(count_at, 1, sem="acq_rel", scope="gpu")
            live = _live_slices(ctx, T, num_splits, split_len)
            if arrived == live - 1:
                merged = _merged_rows(acc_ptr, lse_ptr, (b * NUM_KV + kvh) * num_splits, live, ROWS, rows, row_ok,
                                      offs_d, BLOCK_M, HEAD_DIM, ".cg")
                tl.store(out_ptr + b * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh
                         + offs_d[None, :], merged.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
                tl.atomic_xchg(count_at, 0, sem="relaxed", scope="gpu")


@triton.jit
def tree_attention_merge_kernel(
    acc_ptr, lse_ptr, ctx_ptr, out_ptr, T, ROWS, num_splits, split_len, stride_ctx,
    stride_ob, stride_ot, stride_oh,
    REP: tl.constexpr, NUM_KV: tl.constexpr,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """out rows of one (sequence, KV head) = its live slices' outputs (those that start before ctx_len + T, the ones
    the split kernel wrote) weighted by exp(lse - max lse), in a fixed order."""
    b, kvh, rows, row_ok, t, head = _row_block(T, ROWS, NUM_KV, REP, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ctx = tl.load(ctx_ptr + b * stride_ctx).to(tl.int32)
    out = _merged_rows(acc_ptr, lse_ptr, (b * NUM_KV + kvh) * num_splits, _live_slices(ctx, T, num_splits, split_len),
                       ROWS, rows, row_ok, offs_d, BLOCK_M, HEAD_DIM, "")
    tl.store(out_ptr + b * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
