"""Projections of one input fused into one GEMM by concatenating their weight rows (both model services use it:
q/k/v and gate/up of the target's and the drafter's layers)."""
from __future__ import annotations

import torch
from torch import Tensor, nn


def fuse_rows(linears: tuple[nn.Linear, ...]) -> tuple[Tensor, Tensor | None]:
    """(weight, bias or None) of the projections' rows concatenated in order, each nn.Linear re-pointed at its rows
    of them (views: no extra memory; state_dict names and values unchanged). Biases: all or none."""
    if not all(type(p) is nn.Linear for p in linears):
        raise ValueError("fuse_rows takes nn.Linear projections")
    with_bias = {p.bias is not None for p in linears}
    if len(with_bias) != 1:
        raise ValueError("fuse_rows takes projections that all have a bias or none has")
    with torch.no_grad():
        weight = torch.cat([p.weight for p in linears])
        bias = torch.cat([p.bias for p in linears]) if with_bias.pop() else None
        row = 0
        for p in linears:
            n = p.weight.shape[0]
            p.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
            if bias is not None:
                p.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
            row += n
    return weight, bias
