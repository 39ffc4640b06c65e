"""Weight-only int8 / int4 matmul on CUDA through Triton: y = x @ (q * s)^T (+ bias), for the few rows of a step.

The kernels are in target_svc/weight_only_kernels.py; this module checks what they accept, picks tile sizes
from the shape alone, and launches them. Tile sizes are a fixed function of (M, N, K): no autotuning, so the
first call of a shape compiles the kernel (a CUDA-graph capture's warm-up runs do that) and a captured replay
launches exactly what the warm-up ran. Triton is imported only when a kernel is launched: this module imports
on machines without it (available() then says False).
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

# Activation dtypes the kernels take (tl.dot of two 16-bit operands, float32 accumulate).
DTYPES = (torch.bfloat16, torch.float16)
# Flat offsets inside a kernel are int32.
_MAX_ELEMENTS = 2**31 - 1
# Columns of the split-K reduction's row blocks.
_REDUCE_BLOCK_N = 1024


@dataclass(frozen=True)
class TileConfig:
    """One launch's tiling: output tile BLOCK_M x BLOCK_N, K step BLOCK_K, K split over SPLIT_K programs."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    swap_ab: bool = False
    num_warps: int = 4
    num_stages: int = 4


def available(device: torch.device | str) -> bool:
    """True when the Triton kernels can run on device: a CUDA device of compute capability >= 8.0 and Triton
    installed."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):  # bf16 tensor-core dots
        return False
    return importlib.util.find_spec("triton") is not None


def supports(x: Tensor, bits: int, in_features: int, group: int = 0) -> bool:
    """Whether the kernel takes activations like x for a weight of in_features columns (else: dequantize)."""
    if x.dtype not in DTYPES or x.shape[-1] != in_features:
        return False
    if bits == 4:
        # A K tile must sit inside one scale group and hold at least one 16-deep dot step.
        return group >= 16 and in_features % group == 0
    return bits == 8


def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, 1 << max(0, n - 1).bit_length())


def choose_config(m: int, n: int, k: int, bits: int = 8, group: int = 0, num_sms: int = 132) -> TileConfig:
    """Tile sizes for an [m, k] x [k, n] product (pure; M-bucketed rather than autotuned).

    Few rows: the weight read is the whole cost, so tiles are narrow in N (many programs in flight on every SM)
    and the weight is the dot's left operand (swap_ab); when N alone gives too few programs, K is split too.
    More rows: square-ish tiles, one M tile per N tile up to 64 rows, so each weight byte is read once.
    """
    block_k = 256 if bits == 8 else 128
    if bits == 4:
        block_k = min(block_k, group)
    if m <= 16:
        cfg = TileConfig(block_m=16, block_n=32, block_k=block_k, swap_ab=True, num_warps=4, num_stages=4)
    elif m <= 32:
        cfg = TileConfig(block_m=32, block_n=64, block_k=block_k, swap_ab=True, num_warps=4, num_stages=4)
    elif m <= 64:
        cfg = TileConfig(block_m=64, block_n=64, block_k=min(block_k, 128), num_warps=4, num_stages=4)
    else:
        cfg = TileConfig(block_m=64, block_n=128, block_k=min(block_k, 128), num_warps=8, num_stages=3)
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    k_steps = -(-k // cfg.block_k)
    split = 1
    # Split K until there are about two programs per SM, keeping at least 4 K steps per split.
    while tiles * split * 2 <= 2 * num_sms and k_steps // (split * 2) >= 4:
        split *= 2
    return TileConfig(cfg.block_m, cfg.block_n, cfg.block_k, split, cfg.swap_ab, cfg.num_warps, cfg.num_stages)


@lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the Triton interpreter (tests on a CPU): any count will do
    return torch.cuda.get_device_properties(device).multi_processor_count


def matmul(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None = None, bits: int = 8,
           config: TileConfig | None = None) -> Tensor:
    """x [..., K] @ dequantized(qweight, scales)^T (+ bias) -> [..., N] in x's dtype.

    bits=8: qweight int8 [N, K], scales [N]. bits=4: qweight uint8 [N, K // 2] (see weight_only_kernels),
    scales [N, K // group]. The caller checks supports() first.
    """
    kernels = importlib.import_module("target_svc.weight_only_kernels")
    k = x.shape[-1]
    n = qweight.shape[0]
    x2d = x.reshape(-1, k)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    m = x2d.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    if max(m * k, n * k, m * n) > _MAX_ELEMENTS:
        raise ValueError(f"weight-only matmul of [{m}, {k}] x [{n}, {k}] exceeds int32 offsets")
    if qweight.stride(-1) != 1:
        qweight = qweight.contiguous()
    group = k // scales.shape[1] if bits == 4 else 0
    if scales.dim() == 2 and scales.stride(-1) != 1:
        scales = scales.contiguous()
    cfg = config or choose_config(m, n, k, bits, group, _num_sms(x.device))
    dst = out if cfg.split_k == 1 else torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (-(-m // cfg.block_m) * -(-n // cfg.block_n), cfg.split_k)
    has_bias = bias is not None
    bias_arg = bias if has_bias else scales  # never read when HAS_BIAS is False
    kernels.weight_only_matmul_kernel[grid](
        x2d, qweight, scales, bias_arg, dst,
        m, n, k, x2d.stride(0), qweight.stride(0), scales.stride(0), dst.stride(-2),
        BITS=bits, GROUP=max(group, 1), HAS_BIAS=has_bias, SPLIT_K=cfg.split_k, SWAP_AB=cfg.swap_ab,
        EVEN_K=k % cfg.block_k == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if cfg.split_k > 1:
        kernels.splitk_reduce_kernel[(m, -(-n // _REDUCE_BLOCK_N))](
            dst, scales, bias_arg, out, m, n, out.stride(0),
            BITS=bits, HAS_BIAS=has_bias, SPLIT_K=cfg.split_k, BLOCK_N=_REDUCE_BLOCK_N, num_warps=4,
        )
    return out.view(*x.shape[:-1], n)
