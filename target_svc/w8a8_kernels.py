"""Triton kernels of the w8a8 projections (target_svc/w8a8_matmul.py launches them): int8 activations x int8 weights.

Imported only where Triton is installed. Each computes exactly what its PyTorch reference in
target_svc/quantization.py computes (quantize_rows, w8a8_reference), operation for operation in float32:

- quantize_rows_kernel: one program per row; max|x| over the row (exact in any order), s = max / 127 with IEEE
  division (1 for an all-zero row), then q = clamp(round_half_even(x / s), -127, 127) as int8.
- w8a8_matmul_kernel: int8 tiles into tl.dot with int32 accumulation: every partial sum is an exact integer, so
  neither the tiling nor a split of K changes a single bit of the result. Unsplit, its epilogue is
  float(acc) * s_x * s_w in float32, rounded once to the output dtype; split, each split stores its int32 sums.
- w8a8_reduce_kernel: a split launch's int32 sums added (exact), then the same epilogue.
"""
from __future__ import annotations

import triton
import triton.language as tl

# 1.5 * 2^23: for |v| < 2^22, (v + this) - this rounds v to the nearest integer, ties to even, in float32 (the
# addition's own rounding does it), as torch.round does; no fast-math flag lets the compiler fold the two away.
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def quantize_rows_kernel(x_ptr, xq_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr):
    """Row program_id(0) of x [M, K] (16-bit) -> xq [M, K] int8 and s [M] float32."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    top = tl.max(amax, axis=0)
    scale = tl.where(top > 0, tl.math.div_rn(top, 127.0), 1.0)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + cols < K
        x = tl.load(x_row + k0 + cols, mask=mask, other=0.0).to(tl.float32)
        v = tl.math.div_rn(x, scale)
        r = (v + _ROUND_MAGIC) - _ROUND_MAGIC
        r = tl.minimum(tl.maximum(r, -127.0), 127.0)
        tl.store(xq_ptr + row * stride_qm + k0 + cols, r.to(tl.int8), mask=mask)


@triton.jit
def _epilogue(acc, sx_ptr, sw_ptr, y_ptr, rows, cols, M, N, stride_ym):
    """float(acc) * s_x[row] * s_w[col] in float32, stored in y's dtype."""
    sx = tl.load(sx_ptr + rows, mask=rows < M, other=0.0)
    sw = tl.load(sw_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = acc.to(tl.float32) * sx[:, None] * sw[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def w8a8_matmul_kernel(xq_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr, part_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """Output tile (program_id(1), program_id(0)) of xq [M, K] @ w [N, K]^T over split program_id(2)'s K steps."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(steps, SPLIT_K)
    first = pid_k * per_split
    last = tl.minimum(first + per_split, steps)
    a_ptrs = xq_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    b_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for step in range(first, last):
        k0 = step * BLOCK_K
        a = tl.load(a_ptrs + k0, mask=(rows[:, None] < M) & (k0 + ks[None, :] < K), other=0)
        b = tl.load(b_ptrs + k0, mask=(cols[None, :] < N) & (k0 + ks[:, None] < K), other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    if SPLIT_K == 1:
        _epilogue(acc, sx_ptr, sw_ptr, y_ptr, rows, cols, M, N, stride_ym)
    else:
        part = part_ptr + pid_k.to(tl.int64) * M * N
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(part + rows[:, None].to(tl.int64) * N + cols[None, :], acc, mask=mask)


@triton.jit
def w8a8_reduce_kernel(part_ptr, sx_ptr, sw_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """Row program_id(0), columns block program_id(1): the SPLIT_K int32 partial sums added, then the epilogue."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([1, BLOCK_N], dtype=tl.int32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + row).to(tl.int64) * N + cols[None, :], mask=cols[None, :] < N, other=0)
    rows = row + tl.arange(0, 1)
    _epilogue(acc, sx_ptr, sw_ptr, y_ptr, rows, cols, M, N, stride_ym)
