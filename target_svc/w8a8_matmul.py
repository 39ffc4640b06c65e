"""w8a8 projections on CUDA through Triton: y = (xq q^T) * s_x * s, xq the per-row int8 of x, q int8 weights.

The kernels are in target_svc/w8a8_kernels.py; this module checks what they accept, picks tile sizes from the
shape alone (no autotuning: a CUDA-graph capture's warm-up compiles what its replay launches) and launches them:
the row quantizer, then the int8 product with int32 accumulation, then (K split) the int32 reduction.

Why int8 activations at all: the weight-only kernels widen every int8 weight tile to bf16 in registers before
each MMA, and at a verify's 64 rows that widening, not the weight read, sets their speed (docs/MEMORY.md). Here
both operands go to the tensor cores as int8 (twice bf16's MMA rate on Hopper), nothing is widened, and the
integer sums are exact: a row's output depends on that row alone, whatever the row count, tiling or split.
A bench-only mode (quantization.SERVED_QUANTIZE_MODES says why; docs/MEMORY.md has the measurements).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import Tensor

from target_svc import int8_matmul

# Activation dtypes the row quantizer reads.
DTYPES = (torch.bfloat16, torch.float16)
# Flat offsets into one split's partial sums and row strides are int64, the rest int32.
_MAX_ELEMENTS = 2**31 - 1
_QUANTIZE_BLOCK_K = 1024
_REDUCE_BLOCK_N = 512
# Row buckets -> (BLOCK_M, BLOCK_N); K steps of 128 int8 (128 bytes a row: whole 128-byte lines). Not yet swept on
# a GPU: a first guess after the weight-only dot kernel's buckets, whose int8 weight tiles are read the same way.
_BUCKETS = ((16, (16, 64)), (32, (32, 64)), (64, (64, 128)), (128, (128, 128)))
_BEYOND = (128, 128)
_BLOCK_K = 128


@dataclass(frozen=True)
class TileConfig:
    """One product launch: output tile BLOCK_M x BLOCK_N, K step BLOCK_K, K split over SPLIT_K programs."""

    block_m: int
    block_n: int
    block_k: int = _BLOCK_K
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


def available(device: torch.device | str) -> bool:
    """True where the kernels run: as the weight-only kernels (CUDA >= 8.0, which has int8 MMAs; Triton)."""
    return int8_matmul.available(device)


def supports(x2d: Tensor, in_features: int) -> bool:
    """Whether the kernels take activations x2d [M, K] for a weight of in_features columns."""
    return (x2d.dim() == 2 and x2d.dtype in DTYPES and x2d.shape[1] == in_features and x2d.shape[0] >= 1
            and x2d.numel() <= _MAX_ELEMENTS)


def choose_config(m: int, n: int, k: int, num_sms: int = 132) -> TileConfig:
    """Tile sizes for an [m, k] x [k, n] int8 product: a pure function of the row bucket and the shape."""
    block_m, block_n = next((tiles for top, tiles in _BUCKETS if m <= top), _BEYOND)
    # K split as the weight-only kernel splits it
    split = int8_matmul.split_k(-(-m // block_m) * -(-n // block_n), -(-k // _BLOCK_K), num_sms)
    return TileConfig(block_m, block_n, _BLOCK_K, split)


def _kernels():
    return importlib.import_module("target_svc.w8a8_kernels")


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def quantize_rows(x2d: Tensor) -> tuple[Tensor, Tensor]:
    """x2d [M, K] -> (xq int8 [M, K], scales float32 [M]) by the row-quantizing kernel (quantization.quantize_rows's
    numbers)."""
    m, k = x2d.shape
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    xq = torch.empty(m, k, dtype=torch.int8, device=x2d.device)
    scales = torch.empty(m, dtype=torch.float32, device=x2d.device)
    _kernels().quantize_rows_kernel[(m,)](x2d, xq, scales, k, x2d.stride(0), xq.stride(0),
                                          BLOCK_K=min(_QUANTIZE_BLOCK_K, max(16, 1 << (k - 1).bit_length())),
                                          num_warps=4)
    return xq, scales


def matmul(x2d: Tensor, qweight: Tensor, scales: Tensor, cfg: TileConfig | None = None) -> Tensor:
    """x2d [M, K] (bf16/fp16) through int8 weights qweight [N, K] with row scales [N] -> [M, N] in x2d's dtype."""
    m, k = x2d.shape
    n = qweight.shape[0]
    if qweight.shape[1] != k:
        raise ValueError(f"activations have {k} columns, the weight {qweight.shape[1]}")
    cfg = cfg or choose_config(m, n, k, _num_sms(x2d.device))
    kernels = _kernels()
    xq, sx = quantize_rows(x2d)
    y = torch.empty(m, n, dtype=x2d.dtype, device=x2d.device)
    parts = (torch.empty(cfg.split_k, m, n, dtype=torch.int32, device=x2d.device) if cfg.split_k > 1
             else torch.empty(1, dtype=torch.int32, device=x2d.device))
    grid = (-(-n // cfg.block_n), -(-m // cfg.block_m), cfg.split_k)
    kernels.w8a8_matmul_kernel[grid](xq, sx, qweight, scales, y, parts, m, n, k, xq.stride(0), qweight.stride(0),
                                     y.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                     SPLIT_K=cfg.split_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.split_k > 1:
        kernels.w8a8_reduce_kernel[(m, -(-n // _REDUCE_BLOCK_N))](parts, sx, scales, y, m, n, y.stride(0),
                                                                  SPLIT_K=cfg.split_k, BLOCK_N=_REDUCE_BLOCK_N,
                                                                  num_warps=4)
    return y
