"""The WY core of the one-pass tree Gated DeltaNet (target_svc/gdn_tree_wy.py) as one fused Triton kernel on CUDA.

PyTorch computes the core (G, the decay matrix, I + A, its triangular solve, the outputs) as dozens of small
kernels plus a batched triangular solve per layer; here it is one launch (target_svc/gdn_tree_wy_kernels.py)
returning the same (core, u, cum). This module checks what the kernel accepts, picks tile sizes from the shapes
alone and launches it. No autotuning and no host synchronisation: the first call of a shape compiles (a CUDA-graph
capture's warm-up runs do that) and a captured replay launches exactly what the warm-up ran. Triton is imported
only when the kernel is launched: this module imports on machines without it (available() then says False).

Supported: head dims Dk, Dv powers of two from 16 to 256, 1 <= T <= MAX_NODES nodes (no tile grows with T; the
cap bounds the quadratic, sequential work of one program and the sizes tested). Anything else goes through the
PyTorch reference (supports() says False).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass, replace

import torch
from torch import Tensor

# Trees larger than this take the PyTorch path: a program walks its T nodes in order (T / BT row blocks, each
# over all earlier column chunks), so its time grows as T^2; the GPU tests go to 256.
MAX_NODES = 1024
_HEAD_DIMS = (16, 32, 64, 128, 256)
# Diagonal blocks the kernel is tested at (powers of two: the doubling inversion squares log2(BT) times; larger
# blocks hold BT x Dk and BT x BT tiles in registers).
_BLOCK_T = (16, 32, 64)
# The three-launch form keeps two [T, T] float32 products per (tree, head): past this many nodes, one launch.
THREE_PHASE_MAX_NODES = 256
# The two-launch form solves every node past the root as one block (up to 64 rows, inverted by block doubling):
# past this many nodes, one launch.
TWO_PHASE_MAX_NODES = 65
# The dots' precisions (Triton's input_precision) the kernels take: IEEE float32, and tensor-core products split
# into several TF32 or bf16 parts (gdn_tree_wy_kernels.py).
PRECISIONS = ("ieee", "tf32x3", "bf16x6", "bf16x3", "tf32")
# Names the dots' precision where the caller names no TileConfig, over serving_precision's choice by model dtype.
PRECISION_ENV = "DDTREE_TREE_WY_PRECISION"
# Names the launch form (TileConfig.phases, 1, 2 or 3) where the caller names no TileConfig: an A/B switch for benches.
PHASES_ENV = "DDTREE_TREE_WY_PHASES"
# Model dtypes whose layers round their outputs to 8 significant bits: the core's bf16x3 error (~1e-5 of the
# largest output) is 300x below that rounding.
_HALF_DTYPES = (torch.bfloat16, torch.float16)
# Flat offsets inside the kernel are int32.
_MAX_ELEMENTS = 2**31 - 1


@dataclass(frozen=True)
class TileConfig:
    """One launch's tiling: BLOCK_T nodes per substitution step (the diagonal block inverted in registers, by
    `invert`: "blocks", 2 (log2(BLOCK_T) - 1) dots, or "rows", BLOCK_T - 1 row steps; the two-launch form's 64-row
    inverse also takes "blocks16": its doubling up to blocks of 16 on the diagonal 16-blocks batched, 1/16 of the
    whole dots' work), BLOCK_C ancestor columns per inner step, BLOCK_V value columns per program."""

    block_t: int = 16
    block_c: int = 32
    block_v: int = 64
    num_warps: int = 4
    num_stages: int = 2
    invert: str = "blocks"
    # 1: one program per (tree, head, value block) does everything, block after block; 3: what does not depend on
    # earlier blocks' u is made first by a program per block in parallel, the substitution runs on precomputed
    # products, the outputs are added last (gdn_tree_wy_kernels.py; trees of up to THREE_PHASE_MAX_NODES nodes);
    # 2: the key side (the whole inverse, QK) once per (tree, head), then every value block's nodes in one 64-row
    # step (trees of up to TWO_PHASE_MAX_NODES nodes; block_t is then the nodes' own power of two)
    phases: int = 1
    # The dots' precision (the diagonal inverse's aside): "ieee" float32 FMAs, "tf32x3" three TF32 tensor-core
    # products a dot (about float32's accuracy), "tf32" one (~1e-3 relative; for the sweep)
    precision: str = "ieee"
    # The two-launch form's key kernel's warps (0: num_warps): it runs one program per (tree, head), fewer than the
    # SMs at small batches, with the 64-row inverse's dependent dots on its critical path
    key_warps: int = 0


def available(device: torch.device | str) -> bool:
    """True when the kernel can run on device: CUDA of compute capability >= 8.0 and Triton installed."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False
    return importlib.util.find_spec("triton") is not None


def supports(nodes: int, head_k_dim: int, head_v_dim: int) -> bool:
    """Whether the kernel takes trees of `nodes` nodes with these head dims (else: the PyTorch reference)."""
    return 1 <= nodes <= MAX_NODES and head_k_dim in _HEAD_DIMS and head_v_dim in _HEAD_DIMS


def choose_config(batch_heads: int, head_v_dim: int, num_sms: int = 132, phases: int = 1) -> TileConfig:
    """Tile sizes for batch_heads = B * Hv heads in the launch form `phases`: a pure function of the shape.

    From sweeps on an H200 at 27B heads (48 x 128; bench.gdn_tree_kernel --sweep, every call inside a CUDA
    graph): 64 value columns per program and one pipeline stage won for every tree shape, even with fewer
    programs than SMs; 8 warps won while the programs are fewer than two per SM (one tree: 96 programs), 4 beyond
    (eight trees); blocks of 16 nodes beat blocks of 32 (whose doubling spills); 32 ancestor columns per chunk
    beat 64; and the block-doubling inversion beat the row-by-row one at every measured shape (one 65-node tree
    of depth 16: 0.097 ms against 0.116; a 16-node chain 0.0145 against 0.0182; eight 65-node trees 0.507
    against 0.550; bench/results/gdn-tree-kernel-h200-sweep.log)."""
    if phases == 2:
        # Two launches (H100, bf16x3, 27B heads, 2026-12-06): value blocks of 32 and 4 warps won for one tree of 65
        # nodes (0.0514 ms; 64 and 4 warps 0.0570, 8 warps 0.0703 and 0.0758) and of 16 (0.0174), and were level
        # with 64 for eight trees (0.2332 against 0.2280; bench/results/h200-hybrid-2026-12-06/h100/). The inverse's
        # doubling up to 16 on the diagonal 16-blocks batched ("blocks16") took one 65-node tree from 0.0514 to
        # 0.0455 ms, agreement unchanged (H100, 2026-12-06 15:21, bench/results/h100-2026-12-06-1515/).
        return TileConfig(block_c=32, block_v=min(32, head_v_dim), num_warps=4, num_stages=1, phases=2,
                          invert="blocks16")
    block_v = min(64, head_v_dim)
    programs = batch_heads * (head_v_dim // block_v)
    return TileConfig(block_t=16, block_c=32, block_v=block_v, num_warps=8 if programs < 2 * num_sms else 4,
                      num_stages=1, invert="blocks")


def default_phases(nodes: int, precision: str) -> int:
    """The launch form for a tree of `nodes` nodes whose dots run at `precision`: two launches where they take the
    tree (2 .. TWO_PHASE_MAX_NODES nodes) on the tensor cores (any precision but "ieee"), else one.

    Timed at 27B heads in bf16x3 (H100, 2026-12-06): one 65-node tree 0.0514 ms against the one launch's 0.0581
    (its best tiling 0.0547), a 16-node chain 0.0174 against 0.0198, eight 65-node trees level (0.2332 against
    0.2327), agreement with the PyTorch core 1.1e-5 of the largest output as the one launch's. At IEEE the
    two-launch form was not timed, so float32 models keep the one launch."""
    return 2 if precision != "ieee" and 2 <= nodes <= TWO_PHASE_MAX_NODES else 1


def precision_from_env() -> str | None:
    """The dots' precision DDTREE_TREE_WY_PRECISION names (None: unset); ValueError for a name not in PRECISIONS."""
    name = os.environ.get(PRECISION_ENV, "").strip().lower() or None
    if name is not None and name not in PRECISIONS:
        raise ValueError(f"{PRECISION_ENV}={name!r}: expected one of {', '.join(PRECISIONS)}")
    return name


def phases_from_env() -> int | None:
    """The launch form DDTREE_TREE_WY_PHASES names (None: unset); ValueError for anything but 1, 2 or 3."""
    name = os.environ.get(PHASES_ENV, "").strip() or None
    if name is not None and name not in ("1", "2", "3"):
        raise ValueError(f"{PHASES_ENV}={name!r}: expected 1, 2 or 3")
    return None if name is None else int(name)


def serving_precision(model_dtype: torch.dtype) -> str:
    """The dots' precision for a model of model_dtype: DDTREE_TREE_WY_PRECISION where set, else "bf16x3" for bf16
    and fp16 models and "ieee" (float32 to its rounding) for float32 ones.

    bf16x3 (three bf16 tensor-core products a dot) is ~1e-5 of the largest output, far below the 2^-8 to which a
    bf16 layer rounds what the core gives it, and faster: on an H100 (2026-12-06) one 65-node tree's core took
    0.059 ms against IEEE's 0.081, eight trees 0.23 against 0.65 (where IEEE lost to the PyTorch core's 0.55), the
    16-layer 27B layout's 65-node verify 8.48 ms against 8.78, with every answer through the services equal to
    `ar`'s (bench/results/h100-hybrid-fix-2026-12-06/)."""
    return precision_from_env() or ("bf16x3" if model_dtype in _HALF_DTYPES else "ieee")


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the Triton interpreter (tests on a CPU): any count will do
    return torch.cuda.get_device_properties(device).multi_processor_count  # torch caches the properties


def _unit_last(t: Tensor) -> Tensor:
    """t itself when its last dim is dense (the kernel's assumption), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def tree_wy_core(qh: Tensor, kh: Tensor, vh: Tensor, g: Tensor, beta: Tensor, anc: Tensor, s0: Tensor,
                 config: TileConfig | None = None, s0_index: Tensor | None = None,
                 precision: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The fused WY core: (core [B, Hv, T, Dv], u [B, Hv, T, Dv], cum [B, Hv, T]), all float32, as the reference.

    qh, kh [B, Hv, T, Dk], vh [B, Hv, T, Dv], g, beta [B, Hv, T], s0 [B, Hv, Dk, Dv]: float32, any strides (views
    of transposes need no copy); anc [B, T, T] bool, ancestors-or-self with parents before children. s0_index [B]:
    s0 is a pool of states [N, Hv, Dk, Dv] and tree b starts from s0[s0_index[b]], read in place (the reference's
    s0[s0_index] without its gather). The caller checks supports() first. config None: choose_config's tiles at
    `precision` (None: DDTREE_TREE_WY_PRECISION, else IEEE float32; the serving path passes serving_precision's)
    in the launch form DDTREE_TREE_WY_PHASES names, else default_phases'."""
    bsz, heads, t, dk = kh.shape
    dv = vh.shape[-1]
    s0_rows = (bsz,) if s0_index is None else (s0.shape[0],)
    if (qh.shape != kh.shape or vh.shape[:3] != (bsz, heads, t) or g.shape != (bsz, heads, t)
            or beta.shape != g.shape or anc.shape != (bsz, t, t) or s0.shape != (*s0_rows, heads, dk, dv)
            or (s0_index is not None and tuple(s0_index.shape) != (bsz,))):
        raise ValueError(f"bad shapes: q {tuple(qh.shape)} k {tuple(kh.shape)} v {tuple(vh.shape)} g {tuple(g.shape)} "
                         f"beta {tuple(beta.shape)} anc {tuple(anc.shape)} s0 {tuple(s0.shape)}")
    if any(x.dtype != torch.float32 for x in (qh, kh, vh, g, beta, s0)) or anc.dtype != torch.bool:
        raise ValueError("q, k, v, g, beta, s0 must be float32 and anc bool")
    if not supports(t, dk, dv):
        raise ValueError(f"unsupported tree: {t} nodes (1..{MAX_NODES}), head dims {dk}, {dv} (powers of two 16..256)")
    if s0_index is not None and s0_index.dtype not in (torch.int32, torch.int64):
        raise ValueError("s0_index must be an integer tensor")
    if bsz * heads * t * max(dk, dv) > _MAX_ELEMENTS:
        raise ValueError("tree WY core exceeds int32 offsets")
    if bsz * heads > 65535:  # the grid's second axis
        raise ValueError(f"tree WY core of {bsz} x {heads} heads exceeds the launch grid")
    cfg = config
    if cfg is None:
        dots = precision or precision_from_env() or "ieee"
        cfg = replace(choose_config(bsz * heads, dv, _num_sms(vh.device), phases_from_env() or default_phases(t, dots)),
                      precision=dots)
    if (dv % cfg.block_v or cfg.block_t not in _BLOCK_T or cfg.block_c < 16
            or cfg.invert not in ("blocks", "rows", "blocks16") or (cfg.invert == "blocks16" and cfg.phases != 2)
            or cfg.phases not in (1, 2, 3) or cfg.key_warps not in (0, 1, 2, 4, 8, 16)
            or cfg.precision not in PRECISIONS):
        raise ValueError(f"bad tiles for Dv {dv}: {cfg}")
    qh, kh, vh, s0 = _unit_last(qh), _unit_last(kh), _unit_last(vh), _unit_last(s0)
    # Same bytes, loaded as 0/1; dense, because Triton specialises on strides divisible by 16 and the variants
    # sum G in different orders: a sliced mask (ancestor_mask_batch's) and its copy would differ in the last bit.
    anc_u8 = anc.contiguous().view(torch.uint8)
    core = torch.empty(bsz, heads, t, dv, dtype=torch.float32, device=vh.device)
    u = torch.empty_like(core)
    cum = torch.empty(bsz, heads, t, dtype=torch.float32, device=vh.device)
    if core.numel() == 0:
        return core, u, cum.zero_()
    kernels = importlib.import_module("target_svc.gdn_tree_wy_kernels")  # Triton: only once a launch is certain
    if cfg.phases == 2 and 2 <= t <= TWO_PHASE_MAX_NODES:
        _two_launches(kernels, qh, kh, vh, g, beta, anc_u8, s0, s0_index, core, u, cum, cfg)
        return core, u, cum
    if cfg.phases == 3 and 2 <= t <= THREE_PHASE_MAX_NODES:
        _three_launches(kernels, qh, kh, vh, g, beta, anc_u8, s0, s0_index, core, u, cum, cfg)
        return core, u, cum
    # Value blocks of one head are neighbours in launch order: they share the head's keys in L2.
    grid = (dv // cfg.block_v, bsz * heads)
    kernels.tree_wy_core_kernel[grid](
        qh, kh, vh, g, beta, anc_u8, s0, s0 if s0_index is None else s0_index, core, u, cum,
        t, heads,
        qh.stride(0), qh.stride(1), qh.stride(2), kh.stride(0), kh.stride(1), kh.stride(2),
        vh.stride(0), vh.stride(1), vh.stride(2), g.stride(0), g.stride(1), g.stride(2),
        beta.stride(0), beta.stride(1), beta.stride(2), anc_u8.stride(0), anc_u8.stride(1), anc_u8.stride(2),
        s0.stride(0), s0.stride(1), s0.stride(2), 0 if s0_index is None else s0_index.stride(0),
        DK=dk, DV=dv, BT=cfg.block_t, BC=cfg.block_c, BV=cfg.block_v, INVERT=cfg.invert,
        INDEXED=s0_index is not None, PRECISION=cfg.precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return core, u, cum


def _two_launches(kernels, qh: Tensor, kh: Tensor, vh: Tensor, g: Tensor, beta: Tensor, anc_u8: Tensor, s0: Tensor,
                  s0_index: Tensor | None, core: Tensor, u: Tensor, cum: Tensor, cfg: TileConfig) -> None:
    """TileConfig.phases == 2: the key side per (tree, head), then the values per (tree, head, value block)."""
    bsz, heads, t, dk = kh.shape
    dv = vh.shape[-1]
    rows = max(16, 1 << (t - 2).bit_length())   # nodes 1 .. t-1 in one power-of-two block (t <= 65: at most 64)
    inv = torch.empty(bsz * heads, rows, rows, dtype=torch.float32, device=vh.device)
    qkd = torch.empty_like(inv)
    strides = (qh.stride(0), qh.stride(1), qh.stride(2), kh.stride(0), kh.stride(1), kh.stride(2))
    gates = (g.stride(0), g.stride(1), g.stride(2), beta.stride(0), beta.stride(1), beta.stride(2),
             anc_u8.stride(0), anc_u8.stride(1), anc_u8.stride(2))
    kernels.tree_wy_keys_kernel[(bsz * heads,)](
        qh, kh, g, beta, anc_u8, inv, qkd, t, heads, *strides, *gates,
        DK=dk, NP=rows, BC=cfg.block_c, KC=min(32, dk), PRECISION=cfg.precision,
        INVERT="blocks16" if cfg.invert == "blocks16" else "blocks", num_warps=cfg.key_warps or cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    kernels.tree_wy_values_kernel[(dv // cfg.block_v, bsz * heads)](
        qh, kh, vh, g, beta, anc_u8, s0, s0 if s0_index is None else s0_index, core, u, cum, inv, qkd,
        t, heads, *strides, vh.stride(0), vh.stride(1), vh.stride(2), *gates,
        s0.stride(0), s0.stride(1), s0.stride(2), 0 if s0_index is None else s0_index.stride(0),
        DK=dk, DV=dv, NP=rows, BC=cfg.block_c, KC=min(32, dk), BV=cfg.block_v, INDEXED=s0_index is not None,
        PRECISION=cfg.precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _three_launches(kernels, qh: Tensor, kh: Tensor, vh: Tensor, g: Tensor, beta: Tensor, anc_u8: Tensor, s0: Tensor,
                    s0_index: Tensor | None, core: Tensor, u: Tensor, cum: Tensor, cfg: TileConfig) -> None:
    """TileConfig.phases == 3: prepare (per block, in parallel), solve (per value block), outputs (per block)."""
    bsz, heads, t, dk = kh.shape
    dv = vh.shape[-1]
    bt = cfg.block_t
    blocks = -(-(t - 1) // bt)   # nodes 1 .. t-1; the root is a step of its own
    dev = vh.device
    rhs = torch.empty(bsz * heads, t, dv, dtype=torch.float32, device=dev)
    inv = torch.empty(bsz * heads, blocks, bt, bt, dtype=torch.float32, device=dev)
    akk = torch.empty(bsz * heads, t, t, dtype=torch.float32, device=dev)
    aqk = torch.empty_like(akk)
    index = s0 if s0_index is None else s0_index
    index_stride = 0 if s0_index is None else s0_index.stride(0)
    value_blocks = dv // cfg.block_v
    kernels.tree_wy_prepare_kernel[(value_blocks, blocks, bsz * heads)](
        qh, kh, vh, g, beta, anc_u8, s0, index, core, cum, rhs, inv, akk, aqk,
        t, heads, blocks,
        qh.stride(0), qh.stride(1), qh.stride(2), kh.stride(0), kh.stride(1), kh.stride(2),
        vh.stride(0), vh.stride(1), vh.stride(2), g.stride(0), g.stride(1), g.stride(2),
        beta.stride(0), beta.stride(1), beta.stride(2), anc_u8.stride(0), anc_u8.stride(1), anc_u8.stride(2),
        s0.stride(0), s0.stride(1), s0.stride(2), index_stride,
        DK=dk, DV=dv, BT=bt, BC=cfg.block_c, BV=cfg.block_v, INVERT=cfg.invert, INDEXED=s0_index is not None,
        PRECISION=cfg.precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    kernels.tree_wy_solve_kernel[(value_blocks, bsz * heads)](
        qh, kh, vh, g, beta, s0, index, core, u, cum, rhs, inv, akk,
        t, heads, blocks,
        qh.stride(0), qh.stride(1), kh.stride(0), kh.stride(1), vh.stride(0), vh.stride(1), g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1), s0.stride(0), s0.stride(1), s0.stride(2), index_stride,
        DK=dk, DV=dv, BT=bt, BC=cfg.block_c, BV=cfg.block_v, INDEXED=s0_index is not None,
        PRECISION=cfg.precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    kernels.tree_wy_output_kernel[(value_blocks, blocks, bsz * heads)](
        core, u, aqk, t, DV=dv, BT=bt, BC=cfg.block_c, BV=cfg.block_v, PRECISION=cfg.precision,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
