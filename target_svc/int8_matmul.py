"""Weight-only int8 / int4 matmul on CUDA through Triton: y = x @ (q * s)^T (+ bias), for the few rows of a step.

The kernels are in target_svc/weight_only_kernels.py; this module checks what they accept, picks tile sizes
from the shape and the GPU model, and launches them. Tile sizes are a fixed function of (M, N, K) on a given GPU
(a rule, or the GPU's table of measured winners, target_svc/int8_tiles.py): no autotuning at run time, so the
first call of a shape compiles the kernel (a CUDA-graph capture's warm-up runs do that) and a captured replay
launches exactly what the warm-up ran. Triton is imported only when a kernel is launched: this module imports
on machines without it (available() then says False).

int8 with at most GEMV_MAX_ROWS rows (decode steps) takes the GEMV kernel (GemvConfig), which sums in another
order than the dot kernel (TileConfig) that a larger verify takes: see weight_only_kernels.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree_serve.switches import switched_on
from target_svc import int8_tiles

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


@dataclass(frozen=True)
class GemvConfig:
    """One launch of the few-row int8 GEMV: BLOCK_N output columns per program, K step BLOCK_K, K split over
    SPLIT_K programs."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2


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
# (At 64 rows on an H100 the swapped dot won every 8B projection, 2026-12-07: that card's tile table holds it.)
_BUCKETS = ((16, (16, 64, 128)), (32, (32, 64, 128)), (64, (64, 128, 64)), (128, (128, 64, 64)))
_BEYOND = (64, 128, 64)  # more rows: several M tiles per N tile, the weight re-read from L2
# Long reductions at the 64-row bucket (a 64-node verify's down_proj): 128-deep K steps on 64-column tiles. H100 sweep
# at 64 rows (2026-12-06, bench/results/h100-2026-12-06-0830/int8/): the 8B down_proj (K 12288) 0.0328 ms against
# 0.0420 for (64, 128, 64), both split 4; at K 4096 the same tiles did not win (fused qkv 0.0254 against 0.0205).
_LONG_K = 8192
_LONG_K_TILES = (64, 64, 128)
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
    if 32 < m <= 64 and k >= _LONG_K:
        block_m, block_n, block_k = _LONG_K_TILES
    if bits == 4:
        block_k = min(block_k, group)
    split = split_k(-(-m // block_m) * -(-n // block_n), -(-k // block_k), num_sms)
    return TileConfig(block_m, block_n, block_k, split, swap_ab=False, num_warps=4, num_stages=3)


def row_bucket(m: int) -> tuple[int, int]:
    """The rows (lo, hi) that share m's tile bucket (hi 2**31 - 1 past the last bucket)."""
    lo = 1
    for top, _ in _BUCKETS:
        if m <= top:
            return lo, top
        lo = top + 1
    return lo, _MAX_ELEMENTS


def split_k(tiles: int, k_steps: int, num_sms: int) -> int:
    """Programs per output tile for `tiles` output tiles of `k_steps` K steps: doubled while the programs stay under
    _PROGRAMS_PER_SM per SM and each split keeps _MIN_K_STEPS_PER_SPLIT steps, up to _MAX_SPLIT."""
    split = 1
    while (split < _MAX_SPLIT and tiles * split * 2 <= _PROGRAMS_PER_SM * num_sms
           and k_steps // (split * 2) >= _MIN_K_STEPS_PER_SPLIT):
        split *= 2
    return split


# The GEMV path: int8 weights and at most this many rows (its kernel keeps one accumulator per row).
GEMV_MAX_ROWS = 4
GEMV_ENV = "DDTREE_INT8_GEMV"
# Its defaults (to be confirmed by `python -m bench.int8_kernel --gemv-sweep` on the H200). At M <= 4 the call is a
# read of the weight, N x K bytes, at ~4.8 TB/s, so the tiles aim at keeping enough bytes in flight:
# - BLOCK_K 512: a warp's 32 lanes each load 16 contiguous int8 (one 16-byte vector), which covers 512 columns of
#   one weight row, so every load instruction is a fully coalesced 512-byte row segment; with 4 warps each thread
#   holds BLOCK_N x 512 / 128 = 128 weights of a tile (8 vector loads in flight per step).
# - BLOCK_N 32: a K step reads 32 x 512 = 16 KB per program; by Little's law 4.8 TB/s x ~1 us of loaded DRAM
#   latency is ~4.8 MB in flight, ~36 KB per SM of 132, i.e. two or three resident programs each with a step in
#   flight (the 128 float32 weights per thread allow about three programs of 4 warps per SM by registers).
# - split K (powers of 2 up to 8, each split keeping at least one K step) while the grid has fewer than
#   _GEMV_PROGRAMS_PER_SM programs per SM: 4096 x 4096 -> 128 N tiles x 4 = 512 programs (3.9 per SM), 4096 x 12288
#   -> 128 x 4 (6 K steps each), 6144 x 4096 -> 192 x 2, 1024 x 4096 -> 32 x 8; 24576 x 4096 (768 tiles) and
#   17408 x 5120 (544) need no split. The reduction re-reads SPLIT_K x M x N float32 (256 KB at most for 4096
#   rows), small against the 16 MB weight.
_GEMV_BLOCK_N = 32
_GEMV_BLOCK_K = 512
_GEMV_PROGRAMS_PER_SM = 2
_GEMV_MAX_SPLIT = 8


def choose_gemv_config(m: int, n: int, k: int, num_sms: int = 132) -> GemvConfig:
    """Tile sizes of the int8 GEMV for m <= GEMV_MAX_ROWS rows: a pure function of the shape (see above)."""
    block_k = min(_GEMV_BLOCK_K, max(16, 1 << (k - 1).bit_length()))  # no wider than K needs
    tiles = -(-n // _GEMV_BLOCK_N)
    k_steps = -(-k // block_k)
    split = 1
    while split < _GEMV_MAX_SPLIT and tiles * split < _GEMV_PROGRAMS_PER_SM * num_sms and split * 2 <= k_steps:
        split *= 2
    return GemvConfig(_GEMV_BLOCK_N, block_k, split, num_warps=4, num_stages=2)


def gemv_enabled() -> bool:
    """Whether int8 decode rows take the GEMV kernel: DDTREE_INT8_GEMV=on. Off by default: on the H200 (2026-12-04,
    bench/results/gemv-sweep-h200-2026-12-04.log, one row) its best tiling per shape was within -10 % to +6 % of
    the dot kernel's time and the default tiling 4-29 % slower; on bf16 weights it was within 10 % of cuBLAS."""
    return switched_on(GEMV_ENV)


def kernel_config(m: int, n: int, k: int, bits: int = 8, group: int = 0, num_sms: int = 132,
                  gemv: bool | None = None, tuned: tuple[int8_tiles.TunedTile, ...] = ()) -> TileConfig | GemvConfig:
    """What matmul launches for this shape by default: int8's entry in the GPU's tuned table (int8_tiles) where it
    has one, else the GEMV for int8 with few rows when enabled (gemv, or gemv_enabled() when None), else the dot
    kernel by choose_config's rule."""
    hit = int8_tiles.lookup(tuned, m, n, k) if bits == 8 else None
    if hit is not None:
        return TileConfig(*hit.config) if hit.kernel == "dot" else GemvConfig(*hit.config)
    if gemv is None:
        gemv = gemv_enabled()
    if gemv and bits == 8 and m <= GEMV_MAX_ROWS:
        return choose_gemv_config(m, n, k, num_sms)
    return choose_config(m, n, k, bits, group, num_sms)


# The fused split-K reduction (weight_only_kernels, FUSED_REDUCE): one int32 counter per output tile of a split
# launch. choose_config splits only grids of at most _PROGRAMS_PER_SM x SMs / 2 tiles (330 on an H200), so this
# many counters serve every default launch; a larger grid (a tiling asked for by hand) takes the reduction kernel.
SPLIT_COUNTERS = 1024
FUSED_REDUCE_ENV = "DDTREE_INT8_FUSED_REDUCE"


def fused_reduce_enabled() -> bool:
    """Whether quantized weights get split_counters (their split-K dots then reduce in one kernel):
    DDTREE_INT8_FUSED_REDUCE=on."""
    return switched_on(FUSED_REDUCE_ENV)


PDL_ENV = "DDTREE_INT8_PDL"
# Products of more rows launch without PDL even where it is on. On an H100 (2026-12-08) PDL made the 8B's 1-token
# int8 step 2.5 % faster and its 64-node verify 4.4 % slower, likely because the early-launched programs of a
# many-row tile (up to ~100 KB of shared memory each) sit waiting on SMs the previous kernel's last programs could
# use (bench/results/h100-int8-pdl-2026-12-08-0114/).
PDL_MAX_ROWS = 16


def pdl_enabled(device: torch.device, rows: int = 1) -> bool:
    """Whether a weight-only product of `rows` rows launches with programmatic dependent launch
    (weight_only_kernels: each kernel may begin while the previous one finishes, prefetching its weights, and waits
    before reading x): DDTREE_INT8_PDL=on, at most PDL_MAX_ROWS rows, on a CUDA device of compute capability 9 or
    more (off until timed on the H200)."""
    return (switched_on(PDL_ENV) and rows <= PDL_MAX_ROWS and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def _pdl_launch(pdl: bool) -> dict:
    """The launch keywords for `pdl`: the kernel's PDL switch and, where on, Triton's launch attribute."""
    return {"PDL": True, "launch_pdl": True} if pdl else {}


def split_counters(device: torch.device | str) -> Tensor | None:
    """Zeroed tile counters for matmul's fused split-K reduction on device; None where the kernels do not run or
    the fused reduction is off (the reduction kernel then adds the splits)."""
    if not (fused_reduce_enabled() and available(device)):
        return None
    return torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the Triton interpreter (tests on a CPU): any count will do
    return torch.cuda.get_device_properties(device).multi_processor_count  # torch caches the properties


def tuned_table(device: torch.device) -> tuple[int8_tiles.TunedTile, ...]:
    """The int8 tile table of device's GPU model (int8_tiles; none off CUDA, where the interpreter runs)."""
    if device.type != "cuda":
        return int8_tiles.device_table("cpu")  # only DDTREE_INT8_TILES can name one: the interpreter tests
    return int8_tiles.device_table(torch.cuda.get_device_properties(device).name)


def matmul(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None = None, bits: int = 8,
           config: TileConfig | GemvConfig | None = None, counters: Tensor | None = None,
           pdl: bool | None = None) -> Tensor:
    """x [..., K] @ dequantized(qweight, scales)^T (+ bias) -> [..., N] in x's dtype.

    bits=8: qweight int8 [N, K], scales [N]. bits=4: qweight uint8 [N, K // 2] (see weight_only_kernels),
    scales [N, K // group]. The caller checks supports() first. config: kernel_config's choice when None; a
    GemvConfig takes int8 and at most GEMV_MAX_ROWS rows. counters: split_counters() of this weight's device
    (zero, int32, used by one stream at a time): a split-K dot kernel then adds its splits itself instead of
    launching the reduction kernel (the same bits), where the grid has at most counters.numel() output tiles.
    pdl: launch with programmatic dependent launch (pdl_enabled(x.device, rows) when None; the same bits either
    way).
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
    cfg = config or kernel_config(m, n, k, bits, group, _num_sms(x.device), tuned=tuned_table(x.device))
    launch = _pdl_launch(pdl_enabled(x.device, m) if pdl is None else pdl)
    if isinstance(cfg, GemvConfig):
        if bits != 8 or m > GEMV_MAX_ROWS:
            raise ValueError(f"the GEMV kernel takes int8 and at most {GEMV_MAX_ROWS} rows: {bits} bits, {m} rows")
        _gemv(kernels, x2d, qweight, scales, bias, out, cfg, launch=launch)
        return out.view(*x.shape[:-1], n)
    if bits == 4 and (group % cfg.block_k or k % group):
        raise ValueError(f"int4 tiles must sit inside a scale group: K {k}, group {group}, BLOCK_K {cfg.block_k}")
    if max(m * k, n * k, cfg.split_k * m * n) > _MAX_ELEMENTS:
        raise ValueError(f"weight-only matmul of [{m}, {k}] x [{n}, {k}] exceeds int32 offsets")
    dst = out if cfg.split_k == 1 else torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (-(-m // cfg.block_m) * -(-n // cfg.block_n), cfg.split_k)
    fused = cfg.split_k > 1 and counters is not None and grid[0] <= counters.numel()
    has_bias = bias is not None
    bias_arg = bias if has_bias else scales  # never read when HAS_BIAS is False
    kernels.weight_only_matmul_kernel[grid](
        x2d, qweight, scales, bias_arg, dst, out, counters if fused else scales,
        m, n, k, x2d.stride(0), qweight.stride(0), scales.stride(0), dst.stride(-2), out.stride(0),
        BITS=bits, GROUP=max(group, 1), HAS_BIAS=has_bias, SPLIT_K=cfg.split_k, SWAP_AB=cfg.swap_ab,
        EVEN_K=k % cfg.block_k == 0, FUSED_REDUCE=fused, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch,
    )
    if cfg.split_k > 1 and not fused:
        kernels.splitk_reduce_kernel[(m, -(-n // _REDUCE_BLOCK_N))](
            dst, scales, bias_arg, out, m, n, out.stride(0),
            BITS=bits, HAS_BIAS=has_bias, SPLIT_K=cfg.split_k, BLOCK_N=_REDUCE_BLOCK_N, num_warps=4, **launch,
        )
    return out.view(*x.shape[:-1], n)


def dense_gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, config: GemvConfig | None = None) -> Tensor:
    """F.linear(x, weight, bias) for at most GEMV_MAX_ROWS rows of x through the GEMV kernel (BITS=16: the 16-bit
    weight read as it is, summed in float32), in x's dtype. For bench.int8_kernel's sweep against cuBLAS: the
    model does not call it (on the H200 it was within 10 % of cuBLAS's GEMV either way)."""
    kernels = importlib.import_module("target_svc.weight_only_kernels")
    k, n = x.shape[-1], weight.shape[0]
    x2d = x.reshape(-1, k)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    m = x2d.shape[0]
    if m > GEMV_MAX_ROWS or weight.dtype != x.dtype or weight.shape[1] != k:
        raise ValueError(f"dense_gemv takes at most {GEMV_MAX_ROWS} rows and a weight of x's dtype and width: "
                         f"{m} rows, weight {tuple(weight.shape)} {weight.dtype}, x {x.dtype}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        weight = weight.contiguous()
        bias = None if bias is None else bias.contiguous()
        cfg = config or choose_gemv_config(m, n, k, _num_sms(x.device))
        _gemv(kernels, x2d, weight, weight, bias, out, cfg, bits=16)   # the weight stands in for the unread scales
    return out.view(*x.shape[:-1], n)


def _gemv(kernels, x2d: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None, out: Tensor,
          cfg: GemvConfig, bits: int = 8, launch: dict | None = None) -> None:
    """Launches the GEMV (and its split-K reduction) writing out [M, N]: int8 weights with row scales (bits 8) or
    16-bit weights (bits 16); launch: _pdl_launch's keywords."""
    launch = launch or {}
    (m, k), n = x2d.shape, qweight.shape[0]
    if max(m * k, n * k, cfg.split_k * m * n) > _MAX_ELEMENTS:
        raise ValueError(f"weight-only matmul of [{m}, {k}] x [{n}, {k}] exceeds int32 offsets")
    # Whole K steps per split; a split past K (only asked for by hand) writes zeros.
    k_per_split = -(-(-(-k // cfg.block_k)) // cfg.split_k) * cfg.block_k
    partial = cfg.split_k > 1
    dst = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=out.device) if partial else out
    has_bias = bias is not None
    bias_arg = bias if has_bias else scales  # never read when HAS_BIAS is False
    kernels.weight_only_gemv_kernel[(-(-n // cfg.block_n), cfg.split_k)](
        x2d, qweight, scales, bias_arg, dst,
        n, k, k_per_split, x2d.stride(0), qweight.stride(0), dst.stride(-2),
        ROWS=m, HAS_BIAS=has_bias, PARTIAL=partial, EVEN_K=k % cfg.block_k == 0,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BITS=bits, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch,
    )
    if partial:
        kernels.splitk_reduce_kernel[(m, -(-n // _REDUCE_BLOCK_N))](
            dst, scales, bias_arg, out, m, n, out.stride(0),
            BITS=bits, HAS_BIAS=has_bias, SPLIT_K=cfg.split_k, BLOCK_N=_REDUCE_BLOCK_N, num_warps=4, **launch,
        )
