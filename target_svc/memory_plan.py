"""Memory planning of the target: how many sequences of max_seq_len the KV cache and GDN states can hold.

The cache is one padded slot per sequence (docs/ARCHITECTURE.md), so its size is exact arithmetic:
  slot      = kv_bytes_per_token * (max_seq_len + max_tree_nodes) + state_bytes_per_sequence
  cache     = (max_batch + 1) * slot                  (+ 1: the scratch slot of padded, graph-captured batches)
  kv/token  = 2 (K, V) * full-attention layers * kv heads * head_dim * dtype bytes
  states    = per Gated DeltaNet layer: conv (2 key_dim + value_dim) x (kernel - 1) in the model dtype
              + recurrent Hv x Dk x Dv in float32
`plan_cache` turns a byte budget into the batch the cache can hold (capped at the requested --max-batch), or
refuses when not even one sequence fits. On CUDA the budget is vLLM-style: --gpu-memory-utilization x the
card's memory, minus what is in use once the weights are loaded, minus an activation workspace estimate;
--kv-cache-memory gives the cache's bytes directly. The workspace is an estimate, not a profiled peak.
--gpu-memory-cap makes the process a smaller card: the plan takes the cap as the card (utilization x cap - what this
process holds), and torch's allocator may hold at most utilization x cap, leaving the rest of the cap for what
the allocator does not see (the CUDA context, kernel images, captured graphs' executables).
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

from target_svc.gated_deltanet import LinearAttnStateShape

log = logging.getLogger(__name__)

GIB = 1024**3
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Allocator fragmentation, cuBLAS workspaces and the captured graphs' pool beyond the largest step's tensors.
WORKSPACE_FIXED_BYTES = 512 * 1024**2


def human_bytes(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (B, KiB, MiB, GiB)."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


class MemoryPlanError(ValueError):
    """The configuration cannot hold one sequence of --max-seq-len (the message is one line for the user)."""


@dataclass(frozen=True)
class CacheGeometry:
    """What one sequence's cache slot holds, from the model's layer shapes and dtype."""

    num_full_layers: int
    num_kv_heads: int
    head_dim: int
    linear_shapes: tuple[LinearAttnStateShape, ...]
    dtype_bytes: int  # K/V and conv states; recurrent states are always float32

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token over all full-attention layers."""
        return 2 * self.num_full_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def state_bytes_per_sequence(self) -> int:
        """Conv + recurrent state bytes of one sequence over all Gated DeltaNet layers."""
        fp32 = 4
        return sum(s.conv_dim * (s.conv_kernel - 1) * self.dtype_bytes
                   + s.num_v_heads * s.head_k_dim * s.head_v_dim * fp32 for s in self.linear_shapes)

    def slot_bytes(self, max_seq_len: int, max_tree_nodes: int) -> int:
        """Bytes of one slot: max_seq_len committed rows plus one verify block past them, and the states."""
        return self.kv_bytes_per_token * (max_seq_len + max_tree_nodes) + self.state_bytes_per_sequence


@dataclass(frozen=True)
class MemoryPlan:
    """The cache plan the target runs with (logged, served in Info, exported as gauges)."""

    weight_bytes: int
    kv_bytes_per_token: int
    state_bytes_per_sequence: int
    slot_bytes: int
    max_seq_len: int
    max_tree_nodes: int
    requested_batch: int
    max_batch: int            # sequences the target holds: min(requested, fit)
    fit_batch: int            # sequences of max_seq_len the budget could hold (requested_batch when unbounded)
    cache_bytes: int          # (max_batch + 1) slots
    budget_bytes: int | None  # bytes the cache may take; None: not enforced (CPU without --kv-cache-memory)
    workspace_bytes: int      # activation estimate subtracted before the budget (0 when not applicable)
    source: str               # "gpu-memory-utilization=0.9" | "kv-cache-memory" | "unbounded"
    snapshot_bytes: int = 0   # Gated DeltaNet state snapshots (--gdn-state-snapshots), taken from the budget too

    def summary(self) -> str:
        """One log line: weights, per-token and per-sequence bytes, and what the cache holds."""
        budget = "not enforced" if self.budget_bytes is None else f"{human_bytes(self.budget_bytes)} ({self.source})"
        return (f"memory plan: weights {human_bytes(self.weight_bytes)}; KV {self.kv_bytes_per_token} B/token; "
                f"GDN states {human_bytes(self.state_bytes_per_sequence)}/sequence; slot "
                f"{human_bytes(self.slot_bytes)}; cache {human_bytes(self.cache_bytes)} for {self.max_batch} x "
                f"{self.max_seq_len} tokens (+1 scratch slot; requested {self.requested_batch}, the budget fits "
                f"{self.fit_batch}); cache budget {budget}; workspace estimate {human_bytes(self.workspace_bytes)}"
                + (f"; state snapshots {human_bytes(self.snapshot_bytes)}" if self.snapshot_bytes else ""))

    def as_dict(self) -> dict:
        """Plain fields (for Info and tests)."""
        return asdict(self)


def plan_cache(budget_bytes: int | None, geometry: CacheGeometry, max_seq_len: int, max_tree_nodes: int,
               requested_batch: int, *, weight_bytes: int = 0, workspace_bytes: int = 0,
               source: str = "", snapshot_bytes: int = 0) -> MemoryPlan:
    """The batch a cache budget holds (capped at requested_batch); MemoryPlanError when not one sequence fits.

    budget_bytes: bytes the cache may take before workspace_bytes is subtracted; None = unbounded (reported,
    not enforced).
    """
    if requested_batch < 1 or max_seq_len < 1 or max_tree_nodes < 1:
        raise ValueError("requested_batch, max_seq_len and max_tree_nodes must be >= 1")
    slot = geometry.slot_bytes(max_seq_len, max_tree_nodes)
    if budget_bytes is None:
        fit = requested_batch
    else:
        usable = budget_bytes - workspace_bytes - snapshot_bytes
        fit = max(0, usable // slot - 1) if slot > 0 else requested_batch  # - 1: the scratch slot
        if fit < 1:
            need = 2 * slot + workspace_bytes + snapshot_bytes
            snapshots = f", + {human_bytes(snapshot_bytes)} of state snapshots" if snapshot_bytes else ""
            raise MemoryPlanError(
                f"not enough memory for one sequence of --max-seq-len {max_seq_len}: the cache needs "
                f"{human_bytes(need)} (2 slots of {human_bytes(slot)} incl. the scratch slot, + "
                f"{human_bytes(workspace_bytes)} workspace{snapshots}) but {source or 'the budget'} leaves "
                f"{human_bytes(budget_bytes)} with {human_bytes(weight_bytes)} of weights loaded; lower --max-seq-len, "
                f"use --quantize int8, or raise the budget")
    batch = min(requested_batch, fit)
    return MemoryPlan(weight_bytes=weight_bytes, kv_bytes_per_token=geometry.kv_bytes_per_token,
                      state_bytes_per_sequence=geometry.state_bytes_per_sequence, slot_bytes=slot,
                      max_seq_len=max_seq_len, max_tree_nodes=max_tree_nodes, requested_batch=requested_batch,
                      max_batch=batch, fit_batch=fit, cache_bytes=(batch + 1) * slot, budget_bytes=budget_bytes,
                      workspace_bytes=workspace_bytes if budget_bytes is not None else 0,
                      source=source or ("unbounded" if budget_bytes is None else "budget"),
                      snapshot_bytes=snapshot_bytes)


def workspace_estimate(vocab_size: int, hidden_size: int, widest_projection: int, dtype_bytes: int, max_batch: int,
                       max_tree_nodes: int, prefill_chunk: int,
                       linear_shapes: tuple[LinearAttnStateShape, ...] = ()) -> int:
    """Activation bytes of the largest step (estimate): fp32 logits of a full verify batch twice (logits and the
    sampling copy), plus the rows of the widest forward times a few hidden-and-projection widths, plus the Gated
    DeltaNet traces a verify keeps for its commit (every linear layer, every node), plus a fixed allowance.
    Checked against torch.cuda.max_memory_allocated on the GPU (bench/flagship_fit.py reports both)."""
    logits = 2 * max_batch * max_tree_nodes * vocab_size * 4
    rows = max_batch * max(max_tree_nodes, prefill_chunk or max_tree_nodes)
    activations = rows * (4 * hidden_size + 3 * widest_projection) * dtype_bytes
    tree_rows = max_batch * max_tree_nodes
    # per layer: the conv inputs (the committed window and one row per node, model dtype) and per node the fp32
    # key, new value and cumulative gate of every value head (gdn_tree_wy.GdnTreeWYTrace)
    traces = sum(max_batch * (max_tree_nodes + g.conv_kernel - 1) * g.conv_dim * dtype_bytes
                 + tree_rows * g.num_v_heads * (g.head_k_dim + g.head_v_dim + 1) * 4 for g in linear_shapes)
    return logits + activations + traces + WORKSPACE_FIXED_BYTES


def gpu_cache_budget(total_bytes: int, free_bytes: int, utilization: float) -> int:
    """vLLM-style: this process may use utilization x the card; what is in use now (weights, context, other
    processes) is already spent."""
    return capped_cache_budget(total_bytes, total_bytes - free_bytes, utilization)


def capped_cache_budget(cap_bytes: int, held_bytes: int, utilization: float) -> int:
    """utilization x cap_bytes minus held_bytes: the cache budget of a card of cap_bytes on which held_bytes are
    already spent (with --gpu-memory-cap: what this process's allocator holds, weights included)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    return int(utilization * cap_bytes) - held_bytes


def memory_cap_fraction(cap_bytes: int, card_bytes: int) -> float:
    """The share of a card of card_bytes that a cap of cap_bytes is; MemoryPlanError unless 0 < cap <= card."""
    if cap_bytes <= 0:
        raise MemoryPlanError(f"--gpu-memory-cap must be > 0, got {human_bytes(cap_bytes)}")
    if cap_bytes > card_bytes:
        raise MemoryPlanError(f"--gpu-memory-cap {human_bytes(cap_bytes)} is larger than the card "
                              f"({human_bytes(card_bytes)}); a cap can only make the card smaller")
    return cap_bytes / card_bytes


def cap_gpu_memory(device: torch.device, cap_bytes: int, utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION) -> float:
    """Makes this process a card of cap_bytes: torch's CUDA allocator may hold utilization x cap_bytes
    (set_per_process_memory_fraction); returns the fraction. MemoryPlanError off CUDA or for a cap outside (0, card]."""
    if device.type != "cuda":
        # Refused, not ignored: the cap exists to bound memory, and silently serving unbounded on the CPU would
        # let a configuration look like it fits a card when nothing was checked (vLLM also rejects GPU-only
        # settings that cannot take effect rather than dropping them).
        raise MemoryPlanError(f"--gpu-memory-cap needs a CUDA device; the target runs on {device} "
                              "(on the CPU, --kv-cache-memory bounds the cache)")
    if not 0 < utilization <= 1:
        raise MemoryPlanError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    card = torch.cuda.mem_get_info(index)[1]   # the total the allocator's fraction is taken of
    fraction = memory_cap_fraction(cap_bytes, card) * utilization
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    # The allocator's limit covers tensors, caches and graph pools, not the CUDA context, kernel images and the
    # captured graphs' executables (measured at the 27B: 1.0 GiB with all 160 graphs captured), nor whatever
    # kernels and libraries hold beside it (a long-prompt prefill of the 27B added 2.6 GiB, not yet explained):
    # the (1 - utilization) share of the cap is left for them, as on a real card of that size.
    log.info("GPU memory capped at %s of cuda:%d's %s: torch's allocator may hold %s (--gpu-memory-utilization "
             "%.2f, fraction %.4f); the memory plan treats the cap as the card", human_bytes(cap_bytes), index,
             human_bytes(card), human_bytes(int(cap_bytes * utilization)), utilization, fraction)
    return fraction


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of a floating dtype."""
    return torch.empty((), dtype=dtype).element_size()


# ---- the plan of a loaded target, and of a config (no weights: arithmetic on the shapes) ------------------------

def geometry_of(target) -> CacheGeometry:
    """The cache geometry of a LoadedTarget (target_svc/loader.py)."""
    return CacheGeometry(
        num_full_layers=len(target.full_attention_layers), num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        linear_shapes=tuple(LinearAttnStateShape.from_module(target.layers[i].linear_attn)
                            for i in target.linear_attention_layers),
        dtype_bytes=dtype_bytes(target.dtype))


def geometry_of_config(text_config, dtype: torch.dtype) -> CacheGeometry:
    """The cache geometry of a transformers text config."""
    n = text_config.num_hidden_layers
    types = list(getattr(text_config, "layer_types", None) or ["full_attention"] * n)
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    n_linear = types.count("linear_attention")
    return CacheGeometry(
        num_full_layers=types.count("full_attention"), num_kv_heads=text_config.num_key_value_heads,
        head_dim=head_dim, linear_shapes=(LinearAttnStateShape.from_config(text_config),) * n_linear if n_linear
        else (), dtype_bytes=dtype_bytes(dtype))


def weight_bytes_of_config(text_config, dtype: torch.dtype, quantize: str = "none") -> int:
    """Bytes of the served weights (embedding, layers, final norm, LM head) of a config, built on the meta device."""
    from transformers import AutoModelForCausalLM

    from target_svc.quantization import BITS, quantized_placeholder, quantizes_head, replace_linears

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text_config)
    if quantize in BITS:
        replace_linears(model.model.layers, "model.layers.", dtype, "dequant", BITS[quantize])
        if quantizes_head(quantize):
            model.lm_head = quantized_placeholder(model.lm_head, dtype, "dequant", BITS[quantize])
    size = dtype_bytes(dtype)
    seen, total = set(), 0
    for m in (model.model.embed_tokens, model.model.layers, model.model.norm, model.lm_head):
        for t in [*m.parameters(), *m.buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * size if t.is_floating_point() else t.nbytes
    return total


def plan_for_config(text_config, dtype: torch.dtype, quantize: str, card_bytes: int, utilization: float,
                    max_batch: int, max_seq_len: int, max_tree_nodes: int, prefill_chunk: int) -> MemoryPlan:
    """The plan a target of this config would make on an empty card of card_bytes (CUDA context not counted)."""
    weights = weight_bytes_of_config(text_config, dtype, quantize)
    geometry = geometry_of_config(text_config, dtype)
    widest = max(text_config.intermediate_size, 2 * text_config.num_attention_heads * geometry.head_dim)
    workspace = workspace_estimate(text_config.vocab_size, text_config.hidden_size, widest, dtype_bytes(dtype),
                                   max_batch, max_tree_nodes, prefill_chunk, geometry.linear_shapes)
    budget = gpu_cache_budget(card_bytes, card_bytes - weights, utilization)
    return plan_cache(budget, geometry, max_seq_len, max_tree_nodes, max_batch, weight_bytes=weights,
                      workspace_bytes=workspace, source=f"gpu-memory-utilization={utilization}")


def qwen36_27b_text_config():
    """The Qwen3.6-27B text layout (64 layers: 48 GDN + 16 gated attention; shapes as in bench/shapes.py)."""
    from transformers import Qwen3_5TextConfig

    n = 64
    return Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=n,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        max_position_embeddings=262144, tie_word_embeddings=False)


# A "48 GB" card (RTX 6000 Ada, L40S, A6000) reports 46068 MiB in nvidia-smi.
CARD_48GB_BYTES = 46068 * 2**20
PLAN_27B = dict(card_bytes=CARD_48GB_BYTES, utilization=0.9, max_batch=8, max_seq_len=8192, max_tree_nodes=65,
                prefill_chunk=512)


def qwen36_27b_plan_table() -> str:
    """The computed (not measured) plan of Qwen3.6-27B on one 48 GB card, bf16 and int8, as a Markdown table."""
    config = qwen36_27b_text_config()
    p = PLAN_27B
    rows = ["| | bf16 | int8 (weight-only) |", "|---|---|---|"]
    cells: dict[str, list[str]] = {}
    for quantize in ("none", "int8"):
        weights = weight_bytes_of_config(config, torch.bfloat16, quantize)
        geometry = geometry_of_config(config, torch.bfloat16)
        try:
            plan = plan_for_config(config, torch.bfloat16, quantize, p["card_bytes"], p["utilization"], p["max_batch"],
                                   p["max_seq_len"], p["max_tree_nodes"], p["prefill_chunk"])
            fit, cache, budget, work = (f"{plan.max_batch} (budget fits {plan.fit_batch})",
                                        f"{plan.cache_bytes / GIB:.2f}", f"{plan.budget_bytes / GIB:.2f}",
                                        f"{plan.workspace_bytes / GIB:.2f}")
        except MemoryPlanError:
            budget_left = gpu_cache_budget(p["card_bytes"], p["card_bytes"] - weights, p["utilization"])
            fit, cache, budget, work = "refused: 0", "-", f"{budget_left / GIB:.2f}", "-"
        slot = geometry.slot_bytes(p["max_seq_len"], p["max_tree_nodes"])
        for key, value in (("weights (GiB)", f"{weights / GIB:.2f}"),
                           ("KV per token (KiB)", f"{geometry.kv_bytes_per_token / 1024:.0f}"),
                           ("GDN states per sequence (MiB)", f"{geometry.state_bytes_per_sequence / 2**20:.1f}"),
                           (f"slot: {p['max_seq_len']} + {p['max_tree_nodes']} rows + states (MiB)",
                            f"{slot / 2**20:.1f}"),
                           ("0.9 x card - weights (GiB)", budget),
                           ("workspace estimate (GiB)", work),
                           (f"sequences of {p['max_seq_len']} held (requested {p['max_batch']})", fit),
                           ("cache incl. scratch slot (GiB)", cache)):
            cells.setdefault(key, []).append(value)
    rows += [f"| {k} | {' | '.join(v)} |" for k, v in cells.items()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(qwen36_27b_plan_table())
