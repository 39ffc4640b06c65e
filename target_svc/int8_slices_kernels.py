"""Triton kernels of the sliced int8 projections (target_svc/int8_slices.py launches them and holds their PyTorch
reference, which computes the very same numbers):

- slice_rows_kernel: one program per row of x [M, K] (16-bit): the row's power-of-two scale p (the least one with
  max|x_row| <= 127 p; 1 for an all-zero row) and SLICES int8 digits per element, x / p = d0 + d1 / 128 +
  d2 / 128^2 + a remainder under 2^-(7 SLICES) / 2, each digit rounded half to even.
- sliced_matmul_kernel: each slice's int8 tile times the int8 weight tile in tl.dot with int32 accumulation (exact,
  whatever the tiling or split), one accumulator per slice. Unsplit, its epilogue combines them in float32:
  ((float(a0) + float(a1) / 128) + float(a2) / 128^2) * p * s_w (+ bias), rounded once to the output dtype; split,
  each split stores its int32 sums.
- sliced_reduce_kernel: a split launch's int32 sums added per slice (exact), then the same epilogue.
"""
from __future__ import annotations

import triton
import triton.language as tl

from target_svc.w8a8_kernels import output_tile_and_k_steps, round_half_even, row_abs_max

# float32 bits of 127 / 64 = 1.984375 below the exponent: a row maximum whose significand is at most this takes
# the scale 2^(e - 6), a larger one 2^(e - 5) (e: the maximum's exponent), so max / p <= 127 without a clamp.
_SIGNIFICAND_127_64 = tl.constexpr(0x7E0000)


@triton.jit
def slice_rows_kernel(x_ptr, xs_ptr, p_ptr, M, K, stride_xm, SLICES: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row program_id(0) of x -> xs [SLICES, M, K] int8 (slice-major) and p [M] float32."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    cols = tl.arange(0, BLOCK_K)
    top = row_abs_max(x_row, K, BLOCK_K)
    bits = top.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    p_exponent = exponent - 6 + ((bits & 0x7FFFFF) > _SIGNIFICAND_127_64).to(tl.int32)
    # p = 1 for an all-zero row; never subnormal, so 1 / p is a normal power of two too
    p_exponent = tl.where(top > 0, tl.maximum(p_exponent, 1), 127)
    p = (p_exponent << 23).to(tl.float32, bitcast=True)
    inv_p = ((254 - p_exponent) << 23).to(tl.float32, bitcast=True)
    tl.store(p_ptr + row, p)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + cols < K
        v = tl.load(x_row + k0 + cols, mask=mask, other=0.0).to(tl.float32) * inv_p   # exact: a power of two
        out = xs_ptr + row * K + k0 + cols
        for s in tl.static_range(SLICES):
            d = round_half_even(v)
            tl.store(out + s * M * K, d.to(tl.int8), mask=mask)
            v = (v - d) * 128.0   # exact: the part of v below its nearest integer, |v - d| <= 1/2


@triton.jit
def _combine(a0, a1, a2, p_ptr, sw_ptr, bias_ptr, y_ptr, rows, cols, M, N, stride_ym, SLICES: tl.constexpr,
             HAS_BIAS: tl.constexpr):
    """The slices' int32 sums -> ((a0 + a1 / 128) + a2 / 128^2) * p[row] * s_w[col] (+ bias) in float32, stored in
    y's dtype."""
    v = a0.to(tl.float32)
    if SLICES >= 2:
        v = v + a1.to(tl.float32) * (1.0 / 128.0)
    if SLICES >= 3:
        v = v + a2.to(tl.float32) * (1.0 / 16384.0)
    p = tl.load(p_ptr + rows, mask=rows < M, other=0.0)
    sw = tl.load(sw_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = v * p[:, None] * sw[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sliced_matmul_kernel(xs_ptr, p_ptr, w_ptr, sw_ptr, bias_ptr, y_ptr, part_ptr, M, N, K, stride_wn, stride_ym,
                         SLICES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """Output tile (program_id(1), program_id(0)) of the SLICES products xs[s] [M, K] @ w [N, K]^T over split
    program_id(2)'s K steps; every slice's tile is multiplied by the same weight tile, read once."""
    pid_k = tl.program_id(2)
    rows, cols, ks, first, last = output_tile_and_k_steps(K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    slice_size = M * K   # the launcher keeps SLICES x M x K under 2^31
    a_ptrs = xs_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
    b_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    a0 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    a1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    a2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for step in range(first, last):
        k0 = step * BLOCK_K
        a_mask = (rows[:, None] < M) & (k0 + ks[None, :] < K)
        b = tl.load(b_ptrs + k0, mask=(cols[None, :] < N) & (k0 + ks[:, None] < K), other=0)
        a0 = tl.dot(tl.load(a_ptrs + k0, mask=a_mask, other=0), b, a0, out_dtype=tl.int32)
        if SLICES >= 2:
            a1 = tl.dot(tl.load(a_ptrs + slice_size + k0, mask=a_mask, other=0), b, a1, out_dtype=tl.int32)
        if SLICES >= 3:
            a2 = tl.dot(tl.load(a_ptrs + 2 * slice_size + k0, mask=a_mask, other=0), b, a2, out_dtype=tl.int32)
    if SPLIT_K == 1:
        _combine(a0, a1, a2, p_ptr, sw_ptr, bias_ptr, y_ptr, rows, cols, M, N, stride_ym, SLICES, HAS_BIAS)
    else:
        # parts [SPLIT_K, SLICES, M, N]
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        at = part_ptr + (pid_k.to(tl.int64) * SLICES * M + rows[:, None]) * N + cols[None, :]
        tl.store(at, a0, mask=mask)
        if SLICES >= 2:
            tl.store(at + M * N, a1, mask=mask)
        if SLICES >= 3:
            tl.store(at + 2 * M * N, a2, mask=mask)


@triton.jit
def sliced_reduce_kernel(part_ptr, p_ptr, sw_ptr, bias_ptr, y_ptr, M, N, stride_ym, SLICES: tl.constexpr,
                         HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row program_id(0), column block program_id(1): each slice's SPLIT_K int32 partial sums added, then the
    epilogue."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    a0 = tl.zeros([1, BLOCK_N], dtype=tl.int32)
    a1 = tl.zeros([1, BLOCK_N], dtype=tl.int32)
    a2 = tl.zeros([1, BLOCK_N], dtype=tl.int32)
    col_ok = cols[None, :] < N
    for s in tl.static_range(SPLIT_K):
        at = part_ptr + ((s * SLICES) * M + row).to(tl.int64) * N + cols[None, :]
        a0 += tl.load(at, mask=col_ok, other=0)
        if SLICES >= 2:
            a1 += tl.load(at + M * N, mask=col_ok, other=0)
        if SLICES >= 3:
            a2 += tl.load(at + 2 * M * N, mask=col_ok, other=0)
    rows = row + tl.arange(0, 1)
    _combine(a0, a1, a2, p_ptr, sw_ptr, bias_ptr, y_ptr, rows, cols, M, N, stride_ym, SLICES, HAS_BIAS)
