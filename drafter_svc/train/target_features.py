"""The frozen target of training (a transformers causal LM) and the context features it produces."""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn



def load_frozen_target(model_dir: str | os.PathLike, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """The target as a frozen transformers causal LM (eval mode, no grad)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model.to(device).eval()
    model.requires_grad_(False)
    return model


@torch.no_grad()
def target_features(target: nn.Module, input_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """Context features [B, L, len(ids)*H]: outputs of layers layer_ids (HF hidden_states[i + 1]), concatenated.

    Right padding needs no mask: the target is causal, so padded tail positions never reach real ones.
    """
    out = target(input_ids=input_ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)
    hs = out.hidden_states
    return torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
