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


# Row buckets -> (BLOCK_M, BLOCK_N, BLOCK_K), from sweeps on an H200 (torch 2.11, Triton 3.6) over the Qwen3-8B
# and Qwen3.6-27B projection shapes, each call inside a CUDA graph: one M tile per N tile up to 128 rows, so each
# weight tile is read and widened once; narrow N tiles for few rows (more programs in flight to pull the weight
# through); the plain x W^T dot won over the swapped one, 3 stages and 4 warps were best or within a few %.
_BUCKETS = ((16, (16, 64, 128)), (32, (32, 64, 128)), (64, (64, 128, 64)), (128, (128, 64, 64)))
_BEYOND = (64, 128, 64)  # more rows: several M tiles per N tile, the weight re-read from L2
# K is split while the programs stay under this many per SM: a projection with few output tiles (o_proj, down
# at 4096 columns) then still spreads its weight read over every SM (about 2x faster there), while one with many
# (gate_up at 24576) loses to the split's extra reduction pass.
_PROGRAMS_PER_SM = 5
_MAX_SPLIT = 4  # the sweeps went no further
_MIN_K_STEPS_PER_SPLIT = 4


def choose_config(m: int, n: int, k: int, bits: int = 8, group: int = 0, num_sms: int = 132) -> TileConfig:
    """Tile sizes for an [m, k] x [k, n] product: a pure function of the row bucket and the shape (no autotuning,
    so a captured graph replays exactly what its warm-up compiled). int4 tiles fit inside a scale group."""
    block_m, block_n, block_k = next((tiles for top, tiles in _BUCKETS if m <= top), _BEYOND)
    if bits == 4:
        block_k = min(block_k, group)
    tiles = -(-m // block_m) * -(-n // block_n)
    k_steps = -(-k // block_k)
    split = 1
    while (split < _MAX_SPLIT and tiles * split * 2 <= _PROGRAMS_PER_SM * num_sms
           and k_steps // (split * 2) >= _MIN_K_STEPS_PER_SPLIT):
        split *= 2
    return TileConfig(block_m, block_n, block_k, split, swap_ab=False, num_warps=4, num_stages=3)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the Triton interpreter (tests on a CPU): any count will do
    return torch.cuda.get_device_properties(device).multi_processor_count  # torch caches the properties


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
    # The kernels index rows by stride and everything else densely (no-ops for the usual contiguous tensors and
    # row slices of fused weights).
    qweight, scales = qweight.contiguous(), scales.contiguous()
    bias = None if bias is None else bias.contiguous()
    group = k // scales.shape[1] if bits == 4 else 0
    cfg = config or choose_config(m, n, k, bits, group, _num_sms(x.device))
    if bits == 4 and (group % cfg.block_k or k % group):
        raise ValueError(f"int4 tiles must sit inside a scale group: K {k}, group {group}, BLOCK_K {cfg.block_k}")
    if max(m * k, n * k, cfg.split_k * m * n) > _MAX_ELEMENTS:
        raise ValueError(f"weight-only matmul of [{m}, {k}] x [{n}, {k}] exceeds int32 offsets")
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
