"""Tree attention over the slot cache through Triton (CUDA): what the target's verify and decode blocks and the
drafter's block attend with, instead of gathering each sequence's rows and calling SDPA with a dense mask.

The kernels are in tree_attention_kernels.py beside this module (see there for the split over keys and the merge);
this module checks what they take, picks the split from the shape alone (no autotuning: a captured graph replays
what its warm-up compiled), and launches them. The PyTorch path (model._attend with SDPA and
ddtree_serve.decoding.tree_mask.tree_attention_mask) stays the CPU path and the reference of the GPU tests.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree_serve import switches

ENV_VAR = "DDTREE_TREE_ATTENTION"   # "off": SDPA over gathered rows even where the kernel runs
# "on": split launches merge in their last slice (SplitConfig.fused_merge) instead of a merge kernel. Off by default
# until timed on a GPU (interpreter-tested; saves a launch a layer).
FUSED_MERGE_ENV = "DDTREE_ATTENTION_FUSED_MERGE"
HEAD_DIMS = (64, 128, 256)
# Blocks up to this many nodes take the kernel (decode, verify trees up to budget 128, prompts as verify chains);
# longer prompt chunks keep cuDNN's flash attention, whose tensor-core pipeline wins once the queries are many.
# tests/test_gpu.py checks the kernel up to 257 nodes (all passed on an H100, 2026-12-05); past 129 nodes whether it
# beats SDPA over gathered rows is not measured, so those blocks keep SDPA.
MAX_BLOCK_NODES = 129
DTYPES = (torch.bfloat16, torch.float16)
# Programs in flight the split aims at, per SM: a decode step has one program per KV head without a split.
_PROGRAMS_PER_SM = 2
# A block is a tree block of a few sequences (narrower tiles, balanced slices) while its 16-row blocks number at
# most this many an SM; past it the grid is full without a split, and the wide tiles are the faster.
_TREE_PROGRAMS_PER_SM = 5
_MAX_SPLITS = 64
# Rows per merge program: the merge reads every live slice's partial rows, so small blocks spread those reads over
# the SMs (at the split's 64-row blocks a 16-node chain's merge ran on 8 programs, ~9 us a layer on the H200).
MERGE_BLOCK_M = 16


@dataclass(frozen=True)
class TreeKeys:
    """Which cache rows each block node sees, in the kernel's terms: the committed context [0, ctx_lens[b]) and,
    past it, the node's ancestors-or-self (ancestors[b, t, j]: block node j is t or an ancestor of t)."""

    ctx_lens: Tensor    # [B] int64
    ancestors: Tensor   # [B, T, T] bool
    # The fused merge's arrival counts (int32 zeros, merge_counts(); each launch leaves them zero, so one buffer
    # serves every layer of a forward). Given, launches without a config fuse their merge; None: they do not (and
    # one given a config that fuses makes its own).
    merge_counts: Tensor | None = None


@dataclass(frozen=True)
class SplitConfig:
    """One launch: BLOCK_M stacked query rows and BLOCK_N keys per tile; the keys split into `splits` slices of
    split_len rows (a multiple of BLOCK_N). context_loop: the committed keys in loops of their own, without the
    ancestor mask's loads, layout shuffle and compares, whole tiles without bounds either (compiled for sm_90 at
    16 x 32 tiles: 185 SASS instructions a warp per whole key tile against 310 in the masked loop). balanced:
    each sequence's own keys [0, ctx_len + T) cut into `splits` slices of whole tiles, instead of slices of
    split_len keys of the launch's key bucket (which leave the slices past a short sequence's keys idle).
    max_registers: a cap on registers a thread, so that more programs fit on an SM at once. fused_merge: the last
    slice of each row block to finish merges the slices (counted by an atomic), instead of a second launch."""

    block_m: int
    block_n: int
    splits: int
    split_len: int
    num_warps: int = 4
    num_stages: int = 2
    context_loop: bool = True
    balanced: bool = False
    max_registers: int | None = None   # ptxas's cap a thread (Triton's maxnreg); None: ptxas's own choice
    fused_merge: bool = False


def switched_off() -> bool:
    """True when DDTREE_TREE_ATTENTION turns the kernel off (SDPA over gathered rows in both services)."""
    return switches.switched_off(ENV_VAR)


def fused_merge_on() -> bool:
    """True when DDTREE_ATTENTION_FUSED_MERGE=on: launches that split their keys merge in their last slice."""
    return switches.switched_on(FUSED_MERGE_ENV)


def merge_counts(batch: int, num_kv: int, rows: int, device: torch.device) -> Tensor | None:
    """The arrival counts a forward's fused merges share (enough for any tiling of `rows` stacked query rows per KV
    head), or None where the fused merge is off."""
    if not fused_merge_on():
        return None
    return torch.zeros(batch * num_kv * -(-rows // 16), dtype=torch.int32, device=device)


def available(device: torch.device, head_dim: int, dtype: torch.dtype) -> bool:
    """True when the kernels can run: CUDA of compute capability >= 8.0, Triton installed, a head_dim and dtype
    they take."""
    if device.type != "cuda" or not torch.cuda.is_available() or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    return head_dim in HEAD_DIMS and dtype in DTYPES and importlib.util.find_spec("triton") is not None


def choose_config(batch: int, num_kv: int, rows: int, key_len: int, head_dim: int, num_sms: int = 132,
                  fused_merge: bool = False) -> SplitConfig:
    """The tiling and split for `rows` stacked query rows per KV head over key_len keys: a pure function of the
    shape. The keys are split (each slice whole tiles, at least one) while the grid stays under a budget of
    programs per SM.

    A tree block of a few sequences (more than 16 rows, head_dim <= 128, its 16-row blocks at most
    _TREE_PROGRAMS_PER_SM per SM unsplit) takes 32-row, 64-key tiles, its committed keys in loops of their own and
    slices balanced on each sequence's own keys, 2 to _PROGRAMS_PER_SM programs an SM: the sweep on an H100 at the
    8B heads (bench/results/h100-tree-attention-2026-12-05-2130/) found that 1.2-1.3x faster at 17 and 65 nodes
    than the 16 x 32 tiles at 5 programs an SM (with or without a register cap). Wide batches keep the 64-row
    tiles (their grids are full anyway). fused_merge: a split launch merges in its last slice
    (SplitConfig.fused_merge)."""
    tree_tiles = 16 < rows and head_dim <= 128 and batch * num_kv * -(-rows // 16) <= _TREE_PROGRAMS_PER_SM * num_sms
    if tree_tiles:
        block_m, block_n = 32, 64
    else:
        block_m = 16 if rows <= 16 else 32 if rows <= 32 or head_dim > 128 else 64
        block_n = 64 if head_dim <= 128 else 32
    base = batch * num_kv * -(-rows // block_m)
    tiles = max(1, -(-key_len // block_n))
    if tree_tiles:   # any count (not only powers of two); at least two tiles of the bucket a slice
        splits = max(1, min(max(2, _PROGRAMS_PER_SM * num_sms // base), tiles // 2, _MAX_SPLITS))
    else:
        splits = 1
        while splits * 2 <= min(tiles, _MAX_SPLITS) and base * splits * 2 <= _PROGRAMS_PER_SM * num_sms:
            splits *= 2
    per_split = -(-tiles // splits)
    splits = -(-tiles // per_split)   # no slice that starts past the keys
    split_len = per_split * block_n
    num_warps = 8 if block_m * head_dim >= 64 * 128 else 4
    return SplitConfig(block_m, block_n, splits, split_len, num_warps, balanced=tree_tiles and splits > 1,
                       fused_merge=fused_merge and splits > 1)


def tree_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, keys: TreeKeys, key_len: int,
                   scale: float, config: SplitConfig | None = None, heads_first: bool = False) -> Tensor:
    """q [B, T, n_heads, D] (the block's queries, RoPE applied; any strides but the last) against rows
    [0, ctx_len + T) of each sequence's slot in k_cache / v_cache [slots, capacity, n_kv, D] (the target's
    layout; heads_first: [slots, n_kv, capacity, D], the drafter's), the block's own K/V written there already
    -> [B, T, n_heads, D] in q's dtype. key_len >= every ctx_len + T (it sizes the split, so a captured graph keeps
    its key bucket's)."""
    kernels = importlib.import_module("ddtree_serve.kernels.tree_attention_kernels")
    bsz, tmax, n_heads, head_dim = q.shape
    row_dim, head_dim_at = (2, 1) if heads_first else (1, 2)
    num_kv = k_cache.shape[head_dim_at]
    if n_heads % num_kv or k_cache.shape[-1] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"tree_attention: q {tuple(q.shape)} against k {tuple(k_cache.shape)}, "
                         f"v {tuple(v_cache.shape)}")
    rep = n_heads // num_kv
    rows = rep * tmax
    if q.stride(-1) != 1:
        q = q.contiguous()
    # Without a config, the caller's counts say whether to fuse the merge (merge_counts(): read once a forward).
    cfg = config or choose_config(bsz, num_kv, rows, key_len, head_dim, _num_sms(q.device),
                                  keys.merge_counts is not None)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    anc = keys.ancestors.contiguous().view(torch.uint8)
    grid = (bsz * num_kv, -(-rows // cfg.block_m), cfg.splits)
    split_len = -cfg.block_n if cfg.balanced else cfg.split_len   # the kernels' code for balanced slices
    fused = cfg.fused_merge and cfg.splits > 1
    if cfg.splits > 1:
        acc = torch.empty(bsz, num_kv, cfg.splits, rows, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(bsz, num_kv, cfg.splits, rows, dtype=torch.float32, device=q.device)
    else:
        acc = lse = out   # not written: the single slice stores the output itself
    counts = keys.merge_counts
    if fused and (counts is None or counts.numel() < grid[0] * grid[1]):
        counts = torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=q.device)
    kernels.tree_attention_split_kernel[grid](
        q, k_cache, v_cache, slots, keys.ctx_lens, anc, acc, lse, out, counts if fused else out,
        tmax, rows, cfg.splits, split_len, scale, slots.stride(0), keys.ctx_lens.stride(0),
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(row_dim), k_cache.stride(head_dim_at),
        v_cache.stride(0), v_cache.stride(row_dim), v_cache.stride(head_dim_at),
        anc.stride(0), anc.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        REP=rep, NUM_KV=num_kv, SPLIT=cfg.splits > 1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        HEAD_DIM=head_dim, CONTEXT_LOOP=cfg.context_loop, FUSED_MERGE=fused, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **({} if cfg.max_registers is None else {"maxnreg": cfg.max_registers}),
    )
    if cfg.splits > 1 and not fused:
        kernels.tree_attention_merge_kernel[(bsz * num_kv, -(-rows // MERGE_BLOCK_M))](
            acc, lse, keys.ctx_lens, out, tmax, rows, cfg.splits, split_len, keys.ctx_lens.stride(0),
            out.stride(0), out.stride(1), out.stride(2),
            REP=rep, NUM_KV=num_kv, BLOCK_M=MERGE_BLOCK_M, HEAD_DIM=head_dim, num_warps=4,
        )
    return out


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the Triton interpreter (tests on a CPU): any count will do
    return torch.cuda.get_device_properties(device).multi_processor_count  # torch caches the properties
