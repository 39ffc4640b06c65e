"""Rotary position embedding helpers that both model services' forwards use (one definition for target and drafter)."""
from __future__ import annotations

import torch
from torch import Tensor


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim, the HF/NeoX rotary layout."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
