"""Triton kernels of the weight-only matmul y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W stored as int8 or int4.

Imported only where Triton is installed (target_svc/int8_matmul.py imports it lazily); the launch logic and the
choice of tile sizes live there. With a decode or verify step M is small (1 to a few hundred rows), so reading
W dominates: each weight tile is loaded once per M tile, widened to x's dtype in registers and fed to tl.dot,
accumulating in float32.

Weight formats (see target_svc/quantization.py):
- BITS=8: q int8 [N, K], scales [N]; the per-row scale commutes with the sum over K, so it is applied once to
  the float32 accumulator in the epilogue.
- BITS=4: q uint8 [N, K // 2], two values per byte (even k in the low nibble), each stored + 8; scales
  [N, K // GROUP]. A K tile never straddles a group (BLOCK_K divides GROUP), and its weights enter the dot as the
  reference dequantizes them: (q * s) rounded to x's dtype.

SPLIT_K > 1 splits the K loop over grid axis 1; each split writes its float32 partial sums to a workspace
[SPLIT_K, M, N] and `splitk_reduce_kernel` adds them in a fixed order (deterministic, unlike atomic adds of the
sums). FUSED_REDUCE does that sum in the matmul kernel itself: each split counts its arrival on its output tile's
counter, and the last to arrive adds the workspace's slices in the same fixed order (the same bits as the
reduction kernel) and resets the counter to 0 for the next call -- one kernel per matmul instead of two, which
inside a captured decode step saves a dependent launch per split projection (three per dense layer).

PDL (programmatic dependent launch, Hopper on; `int8_matmul.pdl_enabled`): the launch may begin while the kernel
before it in the stream is still finishing. Each program then computes its offsets, asks L2 for the first lines of
its weight rows (the weights are constant: no kernel writes them), and waits (`griddepcontrol.wait`: the previous
kernel complete and its writes visible) before its first read of x or of a workspace and before any store. The
kernel-boundary latency and the start of the weight stream overlap the previous kernel's tail; the numbers are the
same bits as without it.

`weight_only_gemv_kernel` is the path for a few rows (decode, M <= 4), for int8 weights and (BITS=16) for plain
bf16/fp16 weights, where it stands in for cuBLAS's GEMV: no tl.dot, whose 16-row minimum
tile wastes most of its work on one row; each program widens its weight tile to float32 and reduces it against
each row of x with tl.sum, so the weight is still read once per program. Its float32 sums are added in another
order than the dot kernel's, so a decode step's rows round differently from the same rows inside a verify of a
larger tree (both are within the tolerance of the dequantized reference; the lossless tests are float32 on the
CPU, which runs the int8pack / dequant backends, not these kernels).
"""
from __future__ import annotations

import triton
import triton.language as tl


# Lines per weight row that a PDL launch asks L2 for before it waits (int8: the first 512 bytes of its K range).
PREFETCH_LINES = tl.constexpr(4)


@triton.jit
def _prefetch_then_wait(rows_q, k_begin, k_stop, PDL: tl.constexpr):
    """Under PDL: L2 prefetches of PREFETCH_LINES lines, 128 elements apart from element k_begin (before k_stop),
    of each weight row (rows_q: [BLOCK_N] pointers to the rows' starts), then the wait for the previous kernel. A
    no-op otherwise."""
    if PDL:
        cols = tl.minimum(k_begin + tl.arange(0, PREFETCH_LINES) * 128, k_stop - 1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [rows_q[:, None] + cols[None, :]], dtype=tl.int32, is_pure=False, pack=1)
        tl.extra.cuda.gdc_wait()


@triton.jit
def _weight_tile(q_ptr, s_ptr, offs_n, k0, N, K, stride_qn, stride_sn, dtype: tl.constexpr, BITS: tl.constexpr,
                 GROUP: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight tile W[offs_n, k0 : k0 + BLOCK_K] in dtype ([BLOCK_N, BLOCK_K]); rows >= N and columns >= K
    read as 0. int8: the integers q themselves (exact), the row scale comes in the epilogue. int4: q * s rounded
    to dtype, as the reference's dequantized weight."""
    n_mask = offs_n[:, None] < N
    if BITS == 8:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            mask = n_mask
        else:
            mask = n_mask & (offs_k[None, :] < K)
        q = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=mask, other=0)
        # Through float32: Triton's interpreter mis-casts int8 straight to bf16, and on the H200 this was faster
        # than building the bf16 bits with integer ops.
        return q.to(tl.float32).to(dtype)
    else:
        # K is a multiple of GROUP and GROUP of BLOCK_K (checked by the launcher): no mask along K.
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_b[None, :], mask=n_mask, other=0)
        low = (packed & 0xF).to(tl.int8) - 8
        high = (packed >> 4).to(tl.int8) - 8
        q = tl.interleave(low, high)  # [BLOCK_N, BLOCK_K]: k = 2j from the low nibble, 2j + 1 from the high one
        s = tl.load(s_ptr + offs_n * stride_sn + k0 // GROUP, mask=offs_n < N, other=0).to(tl.float32)
        return (q.to(tl.float32) * s[:, None]).to(dtype)


@triton.jit
def _epilogue(acc, s_ptr, bias_ptr, offs_n, N, BITS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc [BM, BN] float32 sums over all of K -> times the int8 row scales (int4 tiles were scaled already),
    plus the bias, in float32."""
    n_ok = offs_n < N
    if BITS == 8:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_ok, other=0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0).to(tl.float32)[None, :]
    return acc


# M changes with every batch and tree size: not specialised on (M == 1, M % 16 == 0), so one compile serves all M.
@triton.jit(do_not_specialize=["M"])
def weight_only_matmul_kernel(
    x_ptr, q_ptr, s_ptr, bias_ptr, dst_ptr, out_ptr, count_ptr,
    M, N, K, stride_xm, stride_qn, stride_sn, stride_dm, stride_om,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, FUSED_REDUCE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):
    """One [BLOCK_M, BLOCK_N] output tile over one K split. SPLIT_K == 1: the finished output (scale, bias, cast
    to dst's dtype) in dst [M, N]; else the float32 partial sums in dst [SPLIT_K, M, N] (contiguous), and with
    FUSED_REDUCE the tile's last split to finish writes the finished output to out [M, N] (count_ptr: one int32
    counter per output tile, 0 between calls; out and count_ptr are unread otherwise)."""
    pid_mn = tl.program_id(0)
    pid_k = tl.program_id(1)
    # M tiles of one N tile are neighbours in launch order, so a weight tile read by one is still in L2 for the
    # others.
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid_mn % num_m
    pid_n = pid_mn // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m[:, None] < M

    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    k_stop = tl.minimum(K, k_begin + k_per_split)
    per_byte: tl.constexpr = 8 // BITS   # int4 rows pack two columns a byte
    _prefetch_then_wait(q_ptr + tl.minimum(offs_n, N - 1) * stride_qn, k_begin // per_byte, k_stop // per_byte, PDL)
    # SWAP_AB computes the transposed tile W x^T: the weight is the dot's left operand, whose rows fill the MMA's
    # large dimension when M is only a few rows.
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_stop, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x_mask = m_mask
        else:
            x_mask = m_mask & (offs_k[None, :] < K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
        w = _weight_tile(q_ptr, s_ptr, offs_n, k0, N, K, stride_qn, stride_sn, x_ptr.dtype.element_ty, BITS, GROUP,
                         EVEN_K, BLOCK_K)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if SWAP_AB:
        acc = tl.trans(acc)

    out_mask = m_mask & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        y = _epilogue(acc, s_ptr, bias_ptr, offs_n, N, BITS, HAS_BIAS)
        tl.store(dst_ptr + offs_m[:, None] * stride_dm + offs_n[None, :], y.to(dst_ptr.dtype.element_ty),
                 mask=out_mask)
    else:
        tl.store(dst_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=out_mask)
        if FUSED_REDUCE:
            # Every thread's stores before the one atomic (release at GPU scope: visible to whoever acquires the
            # count after it); the last split reads the others' sums from L2 (.cg), never a stale L1 line.
            tl.debug_barrier()
            count_at = count_ptr + pid_mn
            arrived = tl.atomic_add(count_at, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for p in tl.static_range(SPLIT_K):   # in order, from 0: splitk_reduce_kernel's sum exactly
                    total += tl.load(dst_ptr + (p * M + offs_m[:, None]) * N + offs_n[None, :], mask=out_mask,
                                     other=0.0, cache_modifier=".cg")
                y = _epilogue(total, s_ptr, bias_ptr, offs_n, N, BITS, HAS_BIAS)
                tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
                         mask=out_mask)
                tl.atomic_xchg(count_at, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["M"])
def splitk_reduce_kernel(
    ws_ptr, s_ptr, bias_ptr, out_ptr, M, N, stride_om,
    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out[m, n-block] = epilogue(sum over the splits of ws[:, m, n-block]), the splits added in order."""
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if PDL:   # the splits are the previous kernel's writes
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    for p in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + (p * M + m) * N + offs_n[None, :], mask=n_ok[None, :], other=0.0)
    y = _epilogue(acc, s_ptr, bias_ptr, offs_n, N, BITS, HAS_BIAS)
    tl.store(out_ptr + m * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def _gemv_row(acc, w, x_ptr, row, stride_xm, offs_k, K, EVEN_K: tl.constexpr):
    """acc [BLOCK_N] + sum over K of w [BLOCK_N, BLOCK_K] (float32) times x[row, offs_k], in float32."""
    if EVEN_K:
        x = tl.load(x_ptr + row * stride_xm + offs_k)
    else:
        x = tl.load(x_ptr + row * stride_xm + offs_k, mask=offs_k < K, other=0.0)
    return acc + tl.sum(w * x.to(tl.float32)[None, :], axis=1)


@triton.jit
def _gemv_store(acc, row, scale, bias, dst_ptr, offs_n, N, stride_dm, HAS_BIAS: tl.constexpr,
                PARTIAL: tl.constexpr):
    """Row `row` of the output: PARTIAL, the float32 sums as they are; else scaled, biased, cast to dst's dtype."""
    ptrs = dst_ptr + row * stride_dm + offs_n
    if PARTIAL:
        tl.store(ptrs, acc, mask=offs_n < N)
    else:
        y = acc * scale
        if HAS_BIAS:
            y = y + bias
        tl.store(ptrs, y.to(dst_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def weight_only_gemv_kernel(
    x_ptr, q_ptr, s_ptr, bias_ptr, dst_ptr,
    N, K, k_per_split, stride_xm, stride_qn, stride_dm,
    ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BITS: tl.constexpr, PDL: tl.constexpr = False,
):
    """y[r, n-block] for the ROWS (1 to 4) rows of x over one K split (grid axis 1, k_per_split columns, a
    multiple of BLOCK_K). BITS 8: int8 weights with row scales; 16: the weights as they are (s_ptr unread).
    PARTIAL: the float32 sums into the workspace dst [SPLIT_K, ROWS, N]; else the finished output (row scale,
    bias, x's dtype) into dst [ROWS, N]."""
    tl.static_assert(ROWS >= 1 and ROWS <= 4)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N load row N - 1 instead of being masked: the weight loads stay unmasked along N (their results
    # are dropped by the masked stores).
    rows_q = q_ptr + tl.minimum(offs_n, N - 1)[:, None] * stride_qn
    k_begin = pid_k * k_per_split
    k_stop = tl.minimum(K, k_begin + k_per_split)
    _prefetch_then_wait(rows_q.reshape(BLOCK_N), k_begin, k_stop, PDL)   # 16-bit rows: every other line of 1 KB
    acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_begin, k_stop, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            q = tl.load(rows_q + offs_k[None, :])
        else:
            q = tl.load(rows_q + offs_k[None, :], mask=offs_k[None, :] < K, other=0)
        w = q.to(tl.float32)  # exact (int8: the row scale commutes with the sum and comes in the epilogue)
        # One weight tile, every row of x: the unused accumulators are compiled away.
        acc0 = _gemv_row(acc0, w, x_ptr, 0, stride_xm, offs_k, K, EVEN_K)
        if ROWS > 1:
            acc1 = _gemv_row(acc1, w, x_ptr, 1, stride_xm, offs_k, K, EVEN_K)
        if ROWS > 2:
            acc2 = _gemv_row(acc2, w, x_ptr, 2, stride_xm, offs_k, K, EVEN_K)
        if ROWS > 3:
            acc3 = _gemv_row(acc3, w, x_ptr, 3, stride_xm, offs_k, K, EVEN_K)

    n_ok = offs_n < N
    if PARTIAL:  # splitk_reduce_kernel scales and biases the sums
        scale = acc0
        bias = acc0
    else:
        if BITS == 8:
            scale = tl.load(s_ptr + offs_n, mask=n_ok, other=0).to(tl.float32)
        else:
            scale = tl.full((BLOCK_N,), 1.0, dtype=tl.float32)
        bias = scale  # read only when HAS_BIAS
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0).to(tl.float32)
    dst_ptr = dst_ptr + pid_k * ROWS * stride_dm  # this split's [ROWS, N] slice (pid_k is 0 unless PARTIAL)
    _gemv_store(acc0, 0, scale, bias, dst_ptr, offs_n, N, stride_dm, HAS_BIAS, PARTIAL)
    if ROWS > 1:
        _gemv_store(acc1, 1, scale, bias, dst_ptr, offs_n, N, stride_dm, HAS_BIAS, PARTIAL)
    if ROWS > 2:
        _gemv_store(acc2, 2, scale, bias, dst_ptr, offs_n, N, stride_dm, HAS_BIAS, PARTIAL)
    if ROWS > 3:
        _gemv_store(acc3, 3, scale, bias, dst_ptr, offs_n, N, stride_dm, HAS_BIAS, PARTIAL)
