"""A new drafter for a target: its shape, config (layers, mask token) and initial weights."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from drafter_svc.dflash_config import DFlashConfig, build_target_layer_ids
from drafter_svc.dflash_model import DFlashDraftModel


@dataclass
class DrafterShape:
    """Architecture choices for a new drafter (hidden size, heads, vocab and RoPE come from the target)."""

    num_layers: int = 4
    intermediate_size: int | None = None  # None: the target's
    block_size: int = 16
    mask_token_id: int | None = None  # None: chosen from the tokenizer (see choose_mask_token_id)
    target_layer_ids: list[int] | None = None  # None: build_target_layer_ids(n_target, num_layers)


def choose_mask_token_id(target_dir: str | os.PathLike) -> int:
    """A vocabulary row to use as MASK: an existing <|MASK|>-like token, else an unused special token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    vocab = tok.get_vocab()
    for name in ("<|MASK|>", "<mask>", "<|mask|>", "[MASK]"):
        if name in vocab:
            return int(vocab[name])
    # SmolLM2-style vocabularies carry code-dataset markers that chat never produces.
    for name in ("<empty_output>", "<jupyter_script>", "<gh_stars>", "<reponame>"):
        if name in vocab:
            return int(vocab[name])
    specials = set(tok.all_special_ids)
    reserved = [i for t, i in vocab.items() if "reserved" in t.lower() and i not in specials]
    if reserved:
        return int(min(reserved))
    raise ValueError("no token to use as MASK found; pass --mask-token-id")


def new_drafter_config(target_dir: str | os.PathLike, shape: DrafterShape) -> DFlashConfig:
    """A DFlash config sized for the target at target_dir (z-lab config.json layout)."""
    target_dir = Path(target_dir)
    raw = json.loads((target_dir / "config.json").read_text())
    t = {**raw, **(raw.get("text_config") or {})}
    n_target = int(t["num_hidden_layers"])
    hidden, n_heads = int(t["hidden_size"]), int(t["num_attention_heads"])
    head_dim = int(t.get("head_dim") or hidden // n_heads)
    rope = dict(t.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", t.get("rope_theta", 10000.0)))
    if rope.get("rope_type", "default") == "default":
        rope = {}
    mask_id = shape.mask_token_id if shape.mask_token_id is not None else choose_mask_token_id(target_dir)
    ids = shape.target_layer_ids or build_target_layer_ids(n_target, shape.num_layers)
    if any(not 0 <= i < n_target for i in ids):
        raise ValueError(f"target_layer_ids {ids} out of range for a {n_target}-layer target")
    d: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": int(shape.intermediate_size or t["intermediate_size"]),
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(t.get("num_key_value_heads") or n_heads),
        "head_dim": head_dim,
        "vocab_size": int(t["vocab_size"]),
        "rms_norm_eps": float(t.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(t.get("max_position_embeddings", 40960)),
        "rope_theta": theta,
        "rope_scaling": ({"rope_type": rope.pop("rope_type"), **rope} if rope else None),
        "attention_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "block_size": shape.block_size,
        "num_target_layers": n_target,
        "dflash_config": {"mask_token_id": int(mask_id), "target_layer_ids": [int(i) for i in ids]},
    }
    return DFlashConfig.from_dict(d)


def init_drafter(cfg: DFlashConfig, seed: int, std: float = 0.02) -> DFlashDraftModel:
    """A freshly initialised float32 drafter: N(0, std) linear weights, unit norms."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DFlashDraftModel(cfg)
        for m in model.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of parameters."""
    return sum(p.numel() for p in model.parameters())
