"""DFlash block-diffusion draft model in the z-lab checkpoint format: config, weights I/O, forward.

A drafter is a small Qwen3-style decoder stack with no embedding and no LM head of its own: it embeds with the
target's `embed_tokens` and reads logits through the target's `lm_head` (`load_target_embeddings`). It is
conditioned on *context features*, the target's hidden states at `target_layer_ids` (output of layer i, i.e. HF
`hidden_states[i + 1]`), concatenated in id order: `F = len(ids) * hidden_size` per token.

Forward contract (training and inference):

    h = model(noise_embedding,   # [B, Lq, H]  embedded query tokens (block(s) of [token, MASK, MASK, ...])
              target_hidden,     # [B, Lc, F]  raw context features, or None; fused inside by hidden_norm(fc(.))
              position_ids,      # [B, Lc + Lq] (or [Lc + Lq]) positions of the new context rows, then the queries
              attention_mask,    # optional bool, broadcastable to [B, 1, Lq, Lp + Lc + Lq]; True = may attend
              past)              # optional ContextKV: per-layer context K/V already projected, normed and roped
    -> [B, Lq, H] hidden states after the final norm; logits = model.compute_logits(h, lm_head).

Keys/values of every layer are `[past | k_proj/v_proj(fused context) | k_proj/v_proj(queries)]` in that order;
`k_norm` is applied to all keys, `q_norm` to the queries, values are not normed; RoPE uses each key's and query's
own position. Attention masking, per layer:
  * the optional `attention_mask` (padding, block structure, "context strictly before the anchor" in training);
  * sliding_attention layers: only keys with |q_pos - k_pos| < window (a window of w keys ending at the query,
    as HF/flash-attention count it; the forward half only matters for blocks longer than the window);
  * causality: none by default (bidirectional inside the block, as the z-lab reference runs every layer with
    `is_causal=False`); a checkpoint that says `is_causal` (top level) or `dflash_config.causal` / `is_causal`
    gets `k_pos <= q_pos` on all layers.
With no mask and no sliding layer the forward is plain bidirectional attention over context + queries, which is
the reference decode step. Training with many anchors: concatenate all blocks in Lq, pass the whole sequence as
context, and a 4D mask where block b sees context positions < anchor_b and only its own block.

The cached inference path (drafter_svc/runner.py) calls `project_context` once per context row and stores the
result; `ContextKV` hands it back to `forward` as `past`. On CUDA, for a drafter whose every layer is full and
bidirectional, `past` is a `SlotContext` instead: each layer writes the block's K/V into the rows just past each
sequence's context in the runner's cache and attends in place with the Triton tree-attention kernel
(ddtree_serve/kernels/tree_attention.py; every block row sees the context and the whole block), so no draft copies
the context's K/V (a gather and a concatenation a layer, which grow with the context).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddtree_serve.fused_rows import fuse_rows
from ddtree_serve.kernels.tree_attention import TreeKeys, tree_attention
from ddtree_serve.plumbing.compiled import compile_all, static_widths
from ddtree_serve.rope import rotate_half
from drafter_svc.dflash_config import CONFIG_NAME, DFlashConfig, rope_inv_freq

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

# Checkpoints sometimes bundle a copy of the target's embedding/head; the drafter always uses the target's own.
_IGNORED_WEIGHTS = ("embed_tokens.weight", "lm_head.weight", "model.embed_tokens.weight")

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm: normalise in float32, scale in the input dtype."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Per-head RMSNorm of x [B, L, heads, D], as [B, heads, L, D], rotated by cos/sin [B, L, D]."""
    return apply_rope(rms_norm(x, weight, eps).transpose(1, 2), cos, sin)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum h + delta and its RMSNorm (one kernel once compiled, in place of an add and a norm)."""
    h = h + delta
    return h, rms_norm(h, weight, eps)


def log_normalizer(logits: torch.Tensor) -> torch.Tensor:
    """float32 logsumexp over the last dim: log-probs are logits - log_normalizer(logits), without writing a
    float32 copy of the whole [.., vocab] row first."""
    return torch.logsumexp(logits.float(), dim=-1)


@static_widths
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's SiLU(gate) * up."""
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm (rms_norm; `fn` is the compiled function after DFlashDraftModel.compile_glue)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fn = rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.weight, self.eps)


def rope_tables(position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, L, head_dim] in dtype of position_ids [B, L], from float32 frequencies."""
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for arbitrary position ids; frequencies stay float32 whatever the module dtype."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        inv_freq, self.attention_scaling = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.fn = rope_tables   # compiled by DFlashDraftModel.compile_glue

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        super()._apply(fn, recurse)
        # .to(bfloat16) would round the frequencies, dephasing RoPE at large positions: recompute in float32.
        if self.inv_freq.dtype != torch.float32 and not self.inv_freq.is_meta:
            self.inv_freq = rope_inv_freq(self.cfg)[0].to(self.inv_freq.device)
        return self

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, L] -> cos, sin [B, L, head_dim] in dtype."""
        return self.fn(position_ids, self.inv_freq.to(position_ids.device), self.attention_scaling, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, L, D] rotated by cos/sin [B, L, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


@dataclass
class ContextKV:
    """Per-layer context keys/values already through k_norm + RoPE, and the key positions (for windows)."""

    keys: list[torch.Tensor]  # per layer [B, n_kv, Lp, head_dim]
    values: list[torch.Tensor]  # per layer [B, n_kv, Lp, head_dim]
    positions: torch.Tensor  # [B, Lp]


@dataclass(frozen=True)
class SlotLayerKV:
    """One layer's view of a SlotContext: its K/V cache [slots, n_kv, capacity, head_dim] and the block's rows."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor   # [B] int64
    rows: torch.Tensor    # [B, Lq] int64: the block's rows in each slot, right after its context
    keys: TreeKeys        # ctx_lens [B], ancestors [B, Lq, Lq] all True: every block row sees the whole block
    key_len: int          # >= every ctx_len + Lq (the kernel's split; fixed per captured graph)


@dataclass(frozen=True)
class SlotContext:
    """The cached context read in place (see the module docstring): per-layer caches and the block's placement."""

    k_cache: list[torch.Tensor]
    v_cache: list[torch.Tensor]
    slots: torch.Tensor
    rows: torch.Tensor
    keys: TreeKeys
    key_len: int

    def layer(self, i: int) -> SlotLayerKV:
        """Layer i's caches with the shared placement."""
        return SlotLayerKV(self.k_cache[i], self.v_cache[i], self.slots, self.rows, self.keys, self.key_len)


class DFlashAttention(nn.Module):
    """Queries from the block only; keys/values from [context | block] with the same k_proj/v_proj."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.norm_rope = norm_rope   # compiled by DFlashDraftModel.compile_glue
        # q, k, v rows in one tensor once fuse_projections ran (inference): one GEMM in place of three.
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None

    def fuse_projections(self) -> None:
        """q/k/v through one GEMM from now on (k/v through one for the context), on views of the same weights."""
        self.qkv_weight, self.qkv_bias = fuse_rows((self.q_proj, self.k_proj, self.v_proj))

    def _projections(self, x: torch.Tensor, queries: bool
                     ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(q or None, k, v) projections of x [B, L, H], each [B, L, heads * head_dim], before norms and RoPE."""
        if self.qkv_weight is None:
            return (self.q_proj(x) if queries else None), self.k_proj(x), self.v_proj(x)
        nq, nkv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        if queries:
            q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split([nq, nkv, nkv], dim=-1)
            return q, k, v
        bias = None if self.qkv_bias is None else self.qkv_bias[nq:]
        k, v = F.linear(x, self.qkv_weight[nq:], bias).split([nkv, nkv], dim=-1)
        return None, k, v

    def _key_heads(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected k, v [B, L, n_kv * head_dim] -> k (k_norm + RoPE), v (raw), each [B, n_kv, L, head_dim]."""
        k = self.norm_rope(k.unflatten(-1, (self.n_kv, self.head_dim)), self.k_norm.weight, self.k_norm.eps, cos, sin)
        return k, v.unflatten(-1, (self.n_kv, self.head_dim)).transpose(1, 2)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, L, H] -> k (k_norm + RoPE), v (raw), each [B, n_kv, L, head_dim]."""
        _, k, v = self._projections(x, queries=False)
        return self._key_heads(k, v, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        ctx_k: torch.Tensor | None,
        ctx_v: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        slot: SlotLayerKV | None = None,
    ) -> torch.Tensor:
        """x [B, Lq, H] (normed block), context K/V [B, n_kv, Lk, D] or None, cos/sin of the queries; or, with
        slot, the context read in place from the cache (the block's K/V written there first; no mask)."""
        b, lq, _ = x.shape
        q, k, v = self._projections(x, queries=True)
        q = self.norm_rope(q.unflatten(-1, (self.n_heads, self.head_dim)), self.q_norm.weight, self.q_norm.eps, cos,
                           sin)
        k, v = self._key_heads(k, v, cos, sin)
        if slot is not None:
            slot.k_cache[slot.slots[:, None], :, slot.rows] = k.transpose(1, 2)
            slot.v_cache[slot.slots[:, None], :, slot.rows] = v.transpose(1, 2)
            out = tree_attention(q.transpose(1, 2), slot.k_cache, slot.v_cache, slot.slots, slot.keys, slot.key_len,
                                 self.head_dim**-0.5, heads_first=True)
            return self.o_proj(out.reshape(b, lq, self.n_heads * self.head_dim))
        if ctx_k is not None:
            k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        n_rep = self.n_heads // self.n_kv
        if n_rep > 1 and mask is not None and lq > self.head_dim:
            # SDPA runs masked GQA on its math kernel (a full fp32 score matrix): fine for a 16-token draft
            # block, too big for training-sized query sets, where repeated K/V keep the fused kernels.
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
            n_rep = 1
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5, enable_gqa=n_rep > 1)
        return self.o_proj(out.transpose(1, 2).reshape(b, lq, self.n_heads * self.head_dim))


class DFlashMLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.silu_mul = silu_mul   # compiled by DFlashDraftModel.compile_glue
        self.gate_up_weight: torch.Tensor | None = None   # gate and up rows in one tensor once fused

    def fuse_projections(self) -> None:
        """gate/up through one GEMM from now on, on views of the same weights."""
        self.gate_up_weight, _ = fuse_rows((self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return self.down_proj(self.silu_mul(gate, up))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm block: attention over [context | block], then SwiGLU, each with a residual."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = DFlashMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, ctx_k, ctx_v, cos, sin, mask, slot: SlotLayerKV | None = None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx_k, ctx_v, cos, sin, mask, slot)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(nn.Module):
    """The DFlash drafter; parameter names match the published safetensors exactly."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.feature_dim, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg)
        self.gradient_checkpointing = False
        self.log_normalizer = log_normalizer   # compiled by compile_glue
        self.add_rms_norm = add_rms_norm         # compiled by compile_glue

    def compile_glue(self) -> None:
        """The norms, norm + RoPE, SiLU x up, residual sum + norm, the RoPE tables and the logits' normalizer through
        torch.compile (one Triton kernel each, in place of ~6, ~10, 2, ~7, ~7 and a float32 copy plus two
        reductions), for inference on CUDA; the plain functions stay the reference (training, the CPU)."""
        norm, qk, swiglu, self.add_rms_norm, self.rotary.fn, self.log_normalizer = compile_all(
            (rms_norm, norm_rope, silu_mul, add_rms_norm, rope_tables, log_normalizer), True)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.fn = norm
            elif isinstance(module, DFlashAttention):
                module.norm_rope = qk
            elif isinstance(module, DFlashMLP):
                module.silu_mul = swiglu

    def fuse_projections(self) -> None:
        """q/k/v and gate/up of every layer through one GEMM each, for inference (the modules keep their weights as
        views: names, values and the reference forward unchanged; not for training, the views need no grad)."""
        for layer in self.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int | None:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    def fuse_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Raw features [..., F] -> fused context [..., H] = hidden_norm(fc(x))."""
        return self.hidden_norm(self.fc(target_hidden))

    def project_context(self, target_hidden: torch.Tensor, position_ids: torch.Tensor) -> ContextKV:
        """Context K/V of every layer for raw features [B, L, F] at positions [B, L] (what the cache stores)."""
        fused = self.fuse_context(target_hidden)
        cos, sin = self.rotary(position_ids, fused.dtype)
        keys, values = [], []
        for layer in self.layers:
            k, v = layer.self_attn.project_kv(fused, cos, sin)
            keys.append(k)
            values.append(v)
        return ContextKV(keys, values, position_ids)

    def layer_masks(
        self, q_pos: torch.Tensor, k_pos: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> list[torch.Tensor | None]:
        """Per-layer boolean masks [B, 1, Lq, Lk] (None = attend everywhere): user mask & window & causality."""
        cache: dict[tuple[int | None, bool], torch.Tensor | None] = {}
        out = []
        for i in range(self.config.num_hidden_layers):
            key = (self.config.layer_window(i), self.config.layer_is_causal(i))
            if key not in cache:
                window, causal = key
                mask = attention_mask
                if window is not None or causal:
                    dist = q_pos[:, None, :, None] - k_pos[:, None, None, :]  # query pos - key pos
                    cond = torch.ones_like(dist, dtype=torch.bool)
                    if causal:
                        cond = cond & (dist >= 0)
                    if window is not None:
                        cond = cond & (dist < window) & (-dist < window)
                    mask = cond if mask is None else mask & cond
                cache[key] = mask
            out.append(cache[key])
        return out

    def forward(
        self,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor | None,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past: ContextKV | SlotContext | None = None,
    ) -> torch.Tensor:
        """Normed hidden states [B, Lq, H] of the query tokens (see the module docstring for the contract)."""
        b, lq, _ = noise_embedding.shape
        lc = 0 if target_hidden is None else target_hidden.shape[1]
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(b, -1)
        if position_ids.shape[-1] != lc + lq:
            raise ValueError(f"position_ids cover {position_ids.shape[-1]} positions, expected {lc + lq}")
        dtype = noise_embedding.dtype
        cos, sin = self.rotary(position_ids, dtype)
        if isinstance(past, SlotContext):
            if lc or attention_mask is not None:
                raise ValueError("a SlotContext forward takes neither new context rows nor a mask")
            return self._slot_forward(noise_embedding, cos, sin, past)
        ctx = self.fuse_context(target_hidden) if lc else None
        q_pos = position_ids[:, lc:]
        k_pos = position_ids if past is None else torch.cat([past.positions.to(position_ids), position_ids], dim=1)
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            raise ValueError("attention_mask must be boolean (True = may attend)")
        masks = self.layer_masks(q_pos, k_pos, attention_mask)
        h = noise_embedding
        for i, layer in enumerate(self.layers):
            ctx_k = ctx_v = None
            if ctx is not None:
                ctx_k, ctx_v = layer.self_attn.project_kv(ctx, cos[:, :lc], sin[:, :lc])
            if past is not None:
                ctx_k = past.keys[i] if ctx_k is None else torch.cat([past.keys[i], ctx_k], dim=2)
                ctx_v = past.values[i] if ctx_v is None else torch.cat([past.values[i], ctx_v], dim=2)
            args = (h, ctx_k, ctx_v, cos[:, lc:], sin[:, lc:], masks[i])
            if self.gradient_checkpointing and self.training:
                h = checkpoint(layer, *args, use_reentrant=False)
            else:
                h = layer(*args)
        return self.norm(h)

    def _slot_forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: SlotContext) -> torch.Tensor:
        """The layers over a SlotContext, as DFlashDecoderLayer computes them, with each residual sum fused into
        the norm after it (the next layer's input norm, or the final one)."""
        if not len(self.layers):
            return self.norm(h)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        x = self.layers[0].input_layernorm(h)
        for i, (layer, next_norm) in enumerate(zip(self.layers, norms)):
            mid = layer.post_attention_layernorm
            h, x = self.add_rms_norm(h, layer.self_attn(x, None, None, cos, sin, None, past.layer(i)), mid.weight,
                                     mid.eps)
            h, x = self.add_rms_norm(h, layer.mlp(x), next_norm.weight, next_norm.eps)
        return x

    def embed(self, token_ids: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        """Embeds ids with the target's table (times input_embedding_scale, 1 for Qwen targets)."""
        e = F.embedding(token_ids, embed_weight)
        scale = self.config.input_embedding_scale
        return e if scale == 1.0 else e * scale

    def compute_logits(self, hidden: torch.Tensor, lm_head: torch.Tensor | nn.Module) -> torch.Tensor:
        """Logits through the target's head (weight [V, H] or module), with the optional output transforms."""
        logits = lm_head(hidden) if isinstance(lm_head, nn.Module) else F.linear(hidden, lm_head)
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ---------------------------------------------------------------------------------------------------------
    # I/O
    # ---------------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> "DFlashDraftModel":
        """Loads a z-lab-format drafter (single or sharded safetensors); every weight must be present."""
        model_dir = Path(model_dir)
        cfg = DFlashConfig.load(model_dir)
        with torch.device("meta"):
            model = cls(cfg)
        expected = dict(model.state_dict())
        state = _read_safetensors(model_dir)
        unexpected = []
        for name in list(state):
            if name in expected:
                continue
            if name in _IGNORED_WEIGHTS:
                logger.warning("drafter checkpoint carries %s; the target's own is used instead", name)
                state.pop(name)
            else:
                unexpected.append(name)
        if unexpected:
            raise ValueError(f"drafter checkpoint {model_dir} has weights this model does not know: {unexpected[:8]}")
        missing = sorted(set(expected) - set(state))
        if missing:
            raise ValueError(f"drafter checkpoint {model_dir} lacks weights: {missing[:8]}")
        for name, t in state.items():
            if tuple(t.shape) != tuple(expected[name].shape):
                want = tuple(expected[name].shape)
                raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != config shape {want}")
            state[name] = t.to(device=device, dtype=dtype)
        model.load_state_dict(state, assign=True, strict=True)
        model.rotary.inv_freq = rope_inv_freq(cfg)[0].to(device)
        return model.eval()

    def save_pretrained(self, model_dir: str | Path) -> None:
        """Writes config.json and model.safetensors in the published format."""
        model_dir = Path(model_dir)
        model_dir.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        dtype = next(iter(state.values())).dtype
        cfg = self.config
        cfg.raw = cfg.to_dict()
        key = "torch_dtype" if "torch_dtype" in cfg.raw and "dtype" not in cfg.raw else "dtype"
        cfg.raw[key] = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
        cfg.save(model_dir)
        save_file(state, str(model_dir / WEIGHTS_NAME), metadata={"format": "pt"})


def _safetensors_files(model_dir: Path) -> dict[str, list[str]]:
    """file name -> tensor names to read, from the shard index when there is one."""
    index = model_dir / WEIGHTS_INDEX_NAME
    if index.is_file():
        files: dict[str, list[str]] = {}
        for name, fname in json.loads(index.read_text())["weight_map"].items():
            files.setdefault(fname, []).append(name)
        return files
    if (model_dir / WEIGHTS_NAME).is_file():
        return {WEIGHTS_NAME: []}
    found = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return {f: [] for f in found}


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) checkpoint, loaded to CPU."""
    state: dict[str, torch.Tensor] = {}
    for fname, names in _safetensors_files(model_dir).items():
        with safe_open(str(model_dir / fname), framework="pt", device="cpu") as f:
            for name in names or list(f.keys()):
                state[name] = f.get_tensor(name)
    return state


# --------------------------------------------------------------------------------------------------------------
# Target embedding / LM head
# --------------------------------------------------------------------------------------------------------------

_EMBED_NAMES = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",  # Qwen3.5/3.6 multimodal wrapper
    "language_model.model.embed_tokens.weight",  # older multimodal wrappers
    "embed_tokens.weight",
)
_LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.language_model.lm_head.weight")


def _target_tied(target_dir: Path) -> bool:
    """tie_word_embeddings of the target (top level or its text_config); False when unsaid."""
    path = target_dir / CONFIG_NAME
    if not path.is_file():
        return False
    cfg = json.loads(path.read_text())
    text = cfg.get("text_config") or {}
    return bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def load_target_embeddings(
    target_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_weight [V, H], lm_head_weight [V, H]) read alone from the target's safetensors (same tensor if tied)."""
    target_dir = Path(target_dir)
    files = _safetensors_files(target_dir)
    # name -> file, from the index or from the headers (safe_open reads only the header, tensors on demand)
    where: dict[str, str] = {}
    for fname, names in files.items():
        if names:
            where.update({n: fname for n in names})
        else:
            with safe_open(str(target_dir / fname), framework="pt", device="cpu") as f:
                where.update({n: fname for n in f.keys()})

    def read(name: str) -> torch.Tensor:
        with safe_open(str(target_dir / where[name]), framework="pt", device="cpu") as f:
            return f.get_tensor(name).to(device=device, dtype=dtype)

    embed_name = next((n for n in _EMBED_NAMES if n in where), None)
    if embed_name is None:
        raise ValueError(f"target checkpoint {target_dir} has no embed_tokens weight (looked for {_EMBED_NAMES})")
    embed = read(embed_name)
    head_name = next((n for n in _LM_HEAD_NAMES if n in where), None)
    if _target_tied(target_dir) or head_name is None:
        return embed, embed
    head = read(head_name)
    if head.shape != embed.shape:
        raise ValueError(f"target lm_head {tuple(head.shape)} and embed_tokens {tuple(embed.shape)} differ in shape")
    return embed, head
