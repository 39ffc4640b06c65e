"""Batched greedy generation for distillation: a static KV cache and a plain decode loop over the HF weights.

transformers' `generate` spends most of a step re-growing its dynamic cache and rebuilding masks, and keeps
finished rows running until the whole batch ends; distilling tens of thousands of prompts needs neither.
Here a batch is left-padded once, its K/V live in preallocated tensors, every decode step appends one
column, and finished rows are dropped from the batch as they accumulate. The math is the HF decoder's own
(its norms, projections, MLPs and rotary module); only attention and the cache are ours. Dense decoders with
standard attention (Llama, Qwen2/3, Mistral without sliding windows) are supported; anything else falls back to
`generate` (see `supports_fast_greedy`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafter_svc.dflash_model import apply_rope

FAST_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def supports_fast_greedy(model: nn.Module) -> bool:
    """True when the model is a dense decoder this module can run (else use transformers' generate)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in FAST_MODEL_TYPES:
        return False
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return False
    inner = getattr(model, "model", None)
    return inner is not None and all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))


class _GreedyBatch:
    """One left-padded batch: its K/V cache [rows, kv_heads, capacity, head_dim] per layer, and its row state."""

    def __init__(self, model: nn.Module, cos: Tensor, sin: Tensor, rows: int, capacity: int) -> None:
        cfg = model.config
        self.model = model
        self.inner = model.model
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.cos, self.sin = cos, sin  # [capacity, head_dim] by position
        shape = (rows, self.n_kv, capacity, self.head_dim)
        self.k = [torch.empty(shape, device=self.device, dtype=self.dtype) for _ in self.inner.layers]
        self.v = [torch.empty(shape, device=self.device, dtype=self.dtype) for _ in self.inner.layers]

    def keep_rows(self, rows: Tensor) -> None:
        """Drops every other row of the cache (rows: indices to keep, on the device)."""
        self.k = [t.index_select(0, rows) for t in self.k]
        self.v = [t.index_select(0, rows) for t in self.v]

    def _qkv(self, attn: nn.Module, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, H, T, D], k/v [B, KV, T, D] for normed input x [B, T, hidden] at positions pos [B, T]."""
        b, t, _ = x.shape
        q = attn.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = attn.k_proj(x).view(b, t, self.n_kv, self.head_dim)
        v = attn.v_proj(x).view(b, t, self.n_kv, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = self.cos[pos], self.sin[pos]
        return apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """Grouped-query attention without repeating K/V: a group's query heads ride in the query-length axis."""
        b, h, t, d = q.shape
        rep = h // self.n_kv
        qg = q.reshape(b, self.n_kv, rep * t, d)
        mask = mask.repeat(1, 1, rep, 1) if t > 1 else mask  # [B, 1, rep*T, K]: the same rows for each head
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=d**-0.5)
        return out.reshape(b, h, t, d)

    def _layers(self, h: Tensor, pos: Tensor, mask: Tensor, col: int | None, width: int) -> Tensor:
        """Runs the decoder stack; writes K/V at columns [0, width) (prefill, col None) or at column col."""
        b, t, _ = h.shape
        for i, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(h), pos)
            if col is None:
                self.k[i][:b, :, :width] = k
                self.v[i][:b, :, :width] = v
            else:
                self.k[i][:, :, col] = k[:, :, 0]
                self.v[i][:, :, col] = v[:, :, 0]
            keys, values = self.k[i][:b, :, :width], self.v[i][:b, :, :width]
            o = self._attend(q, keys, values, mask)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h

    def _next_token(self, h_last: Tensor) -> Tensor:
        return self.model.lm_head(self.inner.norm(h_last)).argmax(-1)

    def prefill(self, ids: Tensor, pad: Tensor, row0: int, row1: int) -> Tensor:
        """Fills cache rows [row0, row1) from left-padded ids [n, W]; returns their first new tokens [n]."""
        n, w = ids.shape
        col = torch.arange(w, device=self.device)
        pos = (col[None, :] - pad[:, None]).clamp(min=0)
        causal = col[None, :, None] >= col[None, None, :]
        real_key = col[None, None, :] >= pad[:, None, None]
        # Pad queries see only themselves (an all-False row would give NaN); real queries never see pads.
        mask = ((causal & real_key) | torch.eye(w, dtype=torch.bool, device=self.device)[None])[:, None]
        h = self.inner.embed_tokens(ids)
        k_full, v_full = self.k, self.v
        self.k = [t[row0:row1] for t in k_full]  # views: prefill writes straight into the batch cache
        self.v = [t[row0:row1] for t in v_full]
        try:
            h = self._layers(h, pos, mask, None, w)
        finally:
            self.k, self.v = k_full, v_full
        return self._next_token(h[:, -1])

    def decode(self, tokens: Tensor, pad: Tensor, col: int) -> Tensor:
        """One step for every row: token [B] sits at cache column col; returns the next tokens [B]."""
        pos = (col - pad)[:, None]
        keys = torch.arange(col + 1, device=self.device)
        mask = (keys[None, :] >= pad[:, None])[:, None, None, :]  # [B, 1, 1, col+1]
        h = self.inner.embed_tokens(tokens[:, None])
        return self._next_token(self._layers(h, pos, mask, col, col + 1)[:, -1])


def _cos_sin(model: nn.Module, n: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin [n, head_dim] by position from the model's own rotary module (covers its scaling variants)."""
    positions = torch.arange(n, device=device)[None, :]
    cos, sin = model.model.rotary_emb(torch.zeros(1, device=device, dtype=dtype), positions)
    return cos[0], sin[0]


@torch.inference_mode()
def generate_greedy_batch(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    prefill_tokens: int = 65536,
    compact_every: int = 16,
) -> list[list[int]]:
    """Greedy continuations of one batch of prompts (EOS kept; at most max_new_tokens each)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    n = len(prompts)
    width = max(len(p) for p in prompts)
    capacity = width + max_new_tokens
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
    pad = torch.tensor([width - len(p) for p in prompts], device=device)
    ids = ids.to(device)
    cos, sin = _cos_sin(model, capacity, device, dtype)
    batch = _GreedyBatch(model, cos, sin, n, capacity)
    step = max(1, prefill_tokens // width)
    first = torch.cat([batch.prefill(ids[i : i + step], pad[i : i + step], i, min(n, i + step))
                       for i in range(0, n, step)])
    eos = torch.tensor(sorted(set(int(e) for e in eos_token_ids)), device=device)
    out = torch.full((n, max_new_tokens), -1, dtype=torch.long, device=device)
    rows = torch.arange(n, device=device)  # original index of each live row
    tokens = first
    done = torch.zeros(n, dtype=torch.bool, device=device)
    for t in range(max_new_tokens):
        out[rows, t] = tokens
        done = done | torch.isin(tokens, eos)
        if t + 1 == max_new_tokens:
            break
        if (t + 1) % compact_every == 0:
            live = (~done).nonzero().squeeze(1)
            if live.numel() == 0:
                break
            if live.numel() < rows.numel():
                rows, tokens, pad, done = rows[live], tokens[live], pad[live], done[live]
                batch.keep_rows(live)
        tokens = batch.decode(tokens, pad, width + t)
    eos_set = set(eos.tolist())
    result = []
    for row in out.tolist():
        toks = [x for x in row if x >= 0]
        cut = next((k + 1 for k, x in enumerate(toks) if x in eos_set), len(toks))
        result.append(toks[:cut])
    return result


def generate_greedy_fast(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    max_batch_tokens: int = 2_000_000,
    max_batch: int = 4096,
    time_budget_s: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[list[int] | None]:
    """Greedy continuations of many prompts, length-sorted batches of at most max_batch_tokens cache tokens.

    Batches run in a shuffled order (a time cut keeps a fair sample of lengths) until time_budget_s is spent;
    prompts left over get None.
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches: list[list[int]] = []
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and j - i < max_batch and \
                (j + 1 - i) * (len(prompts[order[j]]) + max_new_tokens) <= max_batch_tokens:
            j += 1
        batches.append(order[i:j])
        i = j
    random.Random(len(prompts)).shuffle(batches)
    out: list[list[int] | None] = [None] * len(prompts)
    t0 = time.perf_counter()
    done = 0
    for chunk in batches:
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            break
        for idx, toks in zip(chunk, generate_greedy_batch(model, [prompts[k] for k in chunk], max_new_tokens,
                                                          eos_token_ids, pad_token_id)):
            out[idx] = toks
        done += len(chunk)
        if progress is not None:
            progress(done, len(prompts))
    return out
