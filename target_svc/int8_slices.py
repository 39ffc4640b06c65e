"""Sliced int8 projections: a weight-only int8 product run on int8 tensor cores, for a verify's many rows.

The weight-only dot kernel (int8_matmul) widens every int8 weight tile to bf16 in registers before each MMA, and at
a 64-node verify that widening, not the weight read, sets its speed (docs/MEMORY.md). Here the activations are
cut instead: each row x of a projection's input gets a power-of-two scale p (the least with max|x| <= 127 p) and
SLICES int8 digits per element,

    x / p = d0 + d1 / 128 + d2 / 128^2 + r,   |d0| <= 127, |d1|, |d2| <= 64, |r| <= 2^-(7 SLICES) / 2,

each digit rounded half to even (the Ozaki scheme's splitting of a float operand into integer slices, here with
the row's power-of-two scale). Every slice meets the same int8 weight tile in an int8 x int8 MMA with int32
accumulation, exact in any order, and the epilogue combines them in float32:

    y = ((float(A0) + float(A1) / 128) + float(A2) / 128^2) * p * s_w (+ bias),   A_i = d_i . q.

Why this keeps the model's numbers where w8a8 (one int8 slice, a scale of max / 127) does not: with three slices
every bf16 element of magnitude >= p / 128 (about max|x| / 8192) is cut exactly (its last bit is no finer than the
third slice's grid) and the rest are off by at most p * 2^-22, so the product is the weight-only one, exact
products of bf16 inputs and integer weights, with float32-sized sum errors; w8a8 rounds every input to a grid of
max / 127, whose steps a decode step and a verify of the same position hop between (docs/MEMORY.md). And a row's
output depends on that row alone: the slices and p are per row, the integer sums exact, the epilogue the same
float32 operations whatever the tiling, split or row count.

Cost: SLICES int8 MMAs per weight tile (int8 MMAs run at twice bf16's rate on Hopper: three cost 1.5 bf16 MMAs)
and one small quantizing launch per projection input, against no widening of the weight.

`DDTREE_INT8_SLICES` picks where int8 projections on CUDA take this path instead of the weight-only kernels: off
(the default until measured on the H200), `on` (every row count), or a row count (inputs of at least that many
rows: the verify, while decode steps keep the weight-only kernels).
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from target_svc import int8_matmul

SLICES_ENV = "DDTREE_INT8_SLICES"
# Three slices: the product of every bf16 input element >= max|x| / 8192 is exact (see above); two cut that to
# elements >= max|x| / 64, too coarse for rows with outlier activations.
SLICES = 3
# Activation dtypes the slicing kernel reads.
DTYPES = (torch.bfloat16, torch.float16)
_MAX_ELEMENTS = 2**31 - 1
_SLICE_BLOCK_K = 1024
_REDUCE_BLOCK_N = 512
# The base of the slices after the first: 2^7, so the digits stay within +-64 and every step is exact in float32.
SLICE_BASE = 128


@dataclass(frozen=True)
class TileConfig:
    """One product launch: output tile BLOCK_M x BLOCK_N, K step BLOCK_K, K split over SPLIT_K programs."""

    block_m: int
    block_n: int
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


# Row buckets -> (BLOCK_M, BLOCK_N). Each slice has its own int32 accumulator, so a tile holds SLICES x BLOCK_M x
# BLOCK_N of them: 64 x 64 x 3 is 96 registers a thread with 4 warps. K steps of 128 int8 (whole 128-byte lines).
_BUCKETS = ((16, (16, 64)), (32, (32, 64)), (64, (64, 64)))
_BEYOND = (64, 64)
_BLOCK_K = 128


def rows_threshold(value: str | None = None) -> int | None:
    """The least row count that takes the sliced kernels by DDTREE_INT8_SLICES (or by `value`, a setting of it):
    None (off, the default), 1 (on), or the number given."""
    value = (os.environ.get(SLICES_ENV, "") if value is None else value).strip().lower()
    if value in ("", "off", "0", "false", "no"):
        return None
    if value in ("on", "1", "true", "yes"):
        return 1
    try:
        rows = int(value)
    except ValueError:
        raise ValueError(f"{SLICES_ENV}={value!r}: off, on, or the least row count that takes the sliced kernels")
    if rows < 1:
        raise ValueError(f"{SLICES_ENV}={value!r}: a row count must be at least 1")
    return rows


def takes(x2d: Tensor, in_features: int, threshold: int | None) -> bool:
    """Whether an int8 projection of x2d [M, K] takes the sliced kernels under `threshold` (rows_threshold())."""
    return (threshold is not None and x2d.dim() == 2 and x2d.dtype in DTYPES and x2d.shape[1] == in_features
            and x2d.shape[0] >= threshold and SLICES * x2d.numel() <= _MAX_ELEMENTS)


def choose_config(m: int, n: int, k: int, num_sms: int = 132) -> TileConfig:
    """Tile sizes for an [m, k] x [k, n] sliced product: a pure function of the row bucket and the shape."""
    block_m, block_n = next((tiles for top, tiles in _BUCKETS if m <= top), _BEYOND)
    split = int8_matmul.split_k(-(-m // block_m) * -(-n // block_n), -(-k // _BLOCK_K), num_sms)
    return TileConfig(block_m, block_n, _BLOCK_K, split)


def slice_rows(x2d: Tensor, slices: int = SLICES) -> tuple[Tensor, Tensor]:
    """x2d [M, K] -> (digits int8 [slices, M, K], p float32 [M]): the PyTorch reference of the slicing kernel (the
    very same numbers). p is the least power of two with max|x_row| <= 127 p (1 for an all-zero row)."""
    xf = x2d.float()
    amax = xf.abs().amax(dim=-1)
    # 2^(e - 6) while the maximum's significand is at most 127 / 64, else 2^(e - 5); e = floor(log2(max))
    mantissa, exponent = torch.frexp(amax)   # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    p_exp = exponent - 7 + (mantissa > 127 / 128).to(exponent.dtype)
    p_bits = ((p_exp.clamp(min=-126) + 127).to(torch.int32) << 23).view(torch.float32)   # never subnormal
    p = torch.where(amax > 0, p_bits, torch.ones_like(amax))
    v = xf * (1 / p)[:, None]   # exact: a power of two
    digits = []
    for _ in range(slices):
        d = torch.round(v)   # half to even
        digits.append(d.to(torch.int8))
        v = (v - d) * SLICE_BASE
    return torch.stack(digits), p


def combine(sums: Tensor, p: Tensor, scales: Tensor, bias: Tensor | None = None) -> Tensor:
    """Each slice's exact integer sums [slices, M, N] (any integer dtype) -> float32 [M, N] with the kernels'
    epilogue: ((A0 + A1 / 128) + A2 / 128^2) * p * s_w (+ bias), in float32 in that order."""
    v = sums[0].float()
    for i in range(1, sums.shape[0]):
        v = v + sums[i].float() * (1.0 / SLICE_BASE ** i)
    y = v * p[:, None] * scales.float()[None, :]
    return y if bias is None else y + bias.float()[None, :]


# K columns per float32 product in _integer_product: |digit x weight| <= 127 x 127, so every partial sum of this many
# stays under 2^24, where float32 holds integers exactly (whatever order the BLAS adds them in).
_EXACT_F32_COLUMNS = 1024


def _integer_product(digits: Tensor, qweight: Tensor) -> Tensor:
    """digits [S, M, K] int8 times qweight [N, K]^T as exact integers in float64 [S, M, N]: float32 products over
    K chunks that cannot round, added in float64 (exact below 2^53, as int32 is on the GPU)."""
    s, m, k = digits.shape
    a = digits.reshape(s * m, k)
    total = torch.zeros(s * m, qweight.shape[0], dtype=torch.float64, device=digits.device)
    for k0 in range(0, k, _EXACT_F32_COLUMNS):
        chunk = slice(k0, k0 + _EXACT_F32_COLUMNS)
        total += (a[:, chunk].float() @ qweight[:, chunk].float().t()).double()
    return total.view(s, m, -1)


def reference(x2d: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None = None, slices: int = SLICES) -> Tensor:
    """The sliced product of x2d [M, K] and int8 weights qweight [N, K] with row scales [N] as float32 [M, N]:
    slice_rows, each slice's integer product exact, combine."""
    digits, p = slice_rows(x2d, slices)
    return combine(_integer_product(digits, qweight), p, scales, bias)


def _kernels():
    return importlib.import_module("target_svc.int8_slices_kernels")


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def slice_rows_gpu(x2d: Tensor, slices: int = SLICES) -> tuple[Tensor, Tensor]:
    """slice_rows by the slicing kernel (Triton; on the GPU or under the interpreter)."""
    m, k = x2d.shape
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    digits = torch.empty(slices, m, k, dtype=torch.int8, device=x2d.device)
    p = torch.empty(m, dtype=torch.float32, device=x2d.device)
    _kernels().slice_rows_kernel[(m,)](x2d, digits, p, m, k, x2d.stride(0), SLICES=slices,
                                       BLOCK_K=min(_SLICE_BLOCK_K, max(16, 1 << (k - 1).bit_length())), num_warps=4)
    return digits, p


def matmul(x2d: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None = None, cfg: TileConfig | None = None,
           slices: int = SLICES) -> Tensor:
    """x2d [M, K] (bf16/fp16) through int8 weights qweight [N, K] with row scales [N] (+ bias [N]) -> [M, N] in
    x2d's dtype: the slicing launch, the sliced product, and (K split) the int32 reduction."""
    m, k = x2d.shape
    n = qweight.shape[0]
    if qweight.shape[1] != k:
        raise ValueError(f"activations have {k} columns, the weight {qweight.shape[1]}")
    if not 1 <= slices <= 3:
        raise ValueError(f"1 to 3 slices, not {slices}")
    y = torch.empty(m, n, dtype=x2d.dtype, device=x2d.device)
    if m == 0:
        return y
    cfg = cfg or choose_config(m, n, k, _num_sms(x2d.device))
    if max(slices * m * k, n * k, cfg.split_k * slices * m * n) > _MAX_ELEMENTS:
        raise ValueError(f"sliced matmul of [{m}, {k}] x [{n}, {k}] exceeds int32 offsets")
    kernels = _kernels()
    digits, p = slice_rows_gpu(x2d, slices)
    qweight, scales = qweight.contiguous(), scales.contiguous()
    has_bias = bias is not None
    bias_arg = bias.contiguous() if has_bias else scales   # never read when HAS_BIAS is False
    parts = (torch.empty(cfg.split_k, slices, m, n, dtype=torch.int32, device=x2d.device) if cfg.split_k > 1
             else p)   # unread unsplit
    grid = (-(-n // cfg.block_n), -(-m // cfg.block_m), cfg.split_k)
    kernels.sliced_matmul_kernel[grid](digits, p, qweight, scales, bias_arg, y, parts, m, n, k, qweight.stride(0),
                                       y.stride(0), SLICES=slices, HAS_BIAS=has_bias, BLOCK_M=cfg.block_m,
                                       BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
                                       num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.split_k > 1:
        kernels.sliced_reduce_kernel[(m, -(-n // _REDUCE_BLOCK_N))](
            parts, p, scales, bias_arg, y, m, n, y.stride(0), SLICES=slices, HAS_BIAS=has_bias,
            SPLIT_K=cfg.split_k, BLOCK_N=_REDUCE_BLOCK_N, num_warps=4)
    return y
