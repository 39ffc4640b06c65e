"""Depths, ancestor masks and verify attention masks from parent arrays (vectorised, any device).

Convention (docs/ARCHITECTURE.md): node 0 is the root, `parents[0] = -1`, `0 <= parents[i] < i`.
Batched variants take padded `[B, Tmax]` parent arrays plus the number of valid nodes per row; padded
nodes (index >= size) are treated as isolated roots: depth 0, they see only themselves.

Everything uses pointer doubling (ceil(log2 T) steps), so there is no Python loop over nodes or depths and
no host synchronisation.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "depths_from_parents",
    "depths_from_parents_batch",
    "ancestor_mask",
    "ancestor_mask_batch",
    "TreeStructure",
    "tree_structure",
    "tree_attention_mask",
    "as_index_tensor",
]


def as_index_tensor(values: Tensor | Sequence[int] | int, n: int, device: torch.device | str) -> Tensor:
    """Per-sequence integers (tensor, list or one int for all) as a LongTensor[n] on `device`."""
    if isinstance(values, Tensor):
        t = values.to(device=device, dtype=torch.long)
        t = t.expand(n).contiguous() if t.dim() == 0 else t
    else:
        if isinstance(values, int):
            values = [values] * n
        # non_blocking: a pageable host->device copy is staged without waiting for the device queue
        t = torch.tensor(list(values), dtype=torch.long).to(device, non_blocking=True)
    if t.shape != (n,):
        raise ValueError(f"expected {n} per-sequence values, got shape {tuple(t.shape)}")
    return t


def _doubling_steps(t: int) -> int:
    # after k steps the pointers jump 2**k levels; a path in a T-node tree has at most T-1 edges
    return max(t - 1, 0).bit_length()


def _pointers(parents: Tensor, sizes: Tensor | None) -> Tensor:
    """Parent pointers with the root, padded nodes and out-of-range parents sent to a sentinel index T."""
    b, t = parents.shape
    idx = torch.arange(t, device=parents.device)
    ok = (parents >= 0) & (parents < idx)
    if sizes is not None:
        ok &= idx < sizes[:, None]
    sentinel = torch.full_like(parents, t)
    ptr = torch.where(ok, parents, sentinel)
    # the sentinel points to itself so repeated jumps stay there
    return torch.cat([ptr, torch.full((b, 1), t, dtype=ptr.dtype, device=ptr.device)], dim=1)


def depths_from_parents_batch(parents: Tensor, sizes: Tensor | Sequence[int] | None = None) -> Tensor:
    """LongTensor[B, Tmax] depths of padded trees (padded nodes get depth 0)."""
    b, t = parents.shape
    sz = None if sizes is None else as_index_tensor(sizes, b, parents.device)
    ptr = _pointers(parents.long(), sz)
    dist = (ptr != t).long()
    for _ in range(_doubling_steps(t)):
        dist = dist + dist.gather(1, ptr)
        ptr = ptr.gather(1, ptr)
    return dist[:, :t]


def depths_from_parents(parents: Tensor) -> Tensor:
    """LongTensor[T] depth of each node of one tree (root 0)."""
    return depths_from_parents_batch(parents.reshape(1, -1))[0]


def ancestor_mask_batch(parents: Tensor, sizes: Tensor | Sequence[int] | None = None) -> Tensor:
    """BoolTensor[B, Tmax, Tmax]: mask[b, i, j] iff node j is node i or an ancestor of i (padded: self only)."""
    b, t = parents.shape
    device = parents.device
    sz = None if sizes is None else as_index_tensor(sizes, b, device)
    ptr = _pointers(parents.long(), sz)
    # row T is the sentinel: sees nothing, so OR-ing it in is a no-op
    # (eye, not an indexed assignment of True: that copies a CPU scalar, which a CUDA graph capture refuses)
    mask = torch.eye(t + 1, dtype=torch.bool, device=device).expand(b, t + 1, t + 1).clone()
    mask.scatter_(2, ptr[:, :, None], True)
    mask[:, t, :] = False
    # invariant: after k steps mask[i] holds the ancestors at distance <= 2**k and ptr[i] the 2**k-th one
    for _ in range(_doubling_steps(t)):
        mask = mask | mask.gather(1, ptr[:, :, None].expand(b, t + 1, t + 1))
        ptr = ptr.gather(1, ptr)
    return mask[:, :t, :t]


def ancestor_mask(parents: Tensor) -> Tensor:
    """BoolTensor[T, T]: mask[i, j] iff node j is node i or an ancestor of i."""
    return ancestor_mask_batch(parents.reshape(1, -1))[0]


@dataclass(frozen=True)
class TreeStructure:
    """What a verify step needs of its padded trees' shape, made once per step: the attention layers, the Gated
    DeltaNet layers and the acceptance walk share it (each used to rebuild it, ~30 small kernels a time)."""

    anc: Tensor  # BoolTensor[B, Tmax, Tmax], contiguous: ancestor_mask_batch
    depth: Tensor  # LongTensor[B, Tmax]: depths_from_parents_batch (padded nodes 0)
    # LongTensor[B, Tmax, k]: each node's Gated DeltaNet conv window (target_svc/gdn_tree_wy.conv_windows), where the
    # target's tree-layout kernel made it with the rest; None otherwise
    conv_windows: Tensor | None = None


def tree_structure(parents: Tensor, sizes: Tensor | Sequence[int] | None = None) -> TreeStructure:
    """The TreeStructure of padded trees: the ancestor mask, and each node's depth read off it (its ancestors)."""
    b, t = parents.shape
    if t == 1:  # one-node trees (decode steps): nothing to walk
        return TreeStructure(torch.ones(b, 1, 1, dtype=torch.bool, device=parents.device),
                             torch.zeros(b, 1, dtype=torch.long, device=parents.device))
    anc = ancestor_mask_batch(parents, sizes).contiguous()
    return TreeStructure(anc, anc.sum(2) - 1)


def tree_attention_mask(
    ctx_lens: Tensor | Sequence[int],
    parents: Tensor,
    tree_sizes: Tensor | Sequence[int],
    key_len: int,
    anc: Tensor | None = None,
) -> Tensor:
    """BoolTensor[B, Tmax, key_len]: which cache rows each tree node attends to during verify.

    Node i of sequence b sits in cache row ctx_len_b + i. It sees every committed row j < ctx_len_b and the
    rows of its ancestors-or-self. Padded nodes (i >= tree_sizes[b]) see the context and their own row only,
    so no query row is empty (an all-masked row would make SDPA produce NaN, which then leaks through V).
    anc: ancestor_mask_batch(parents, tree_sizes) when the caller has it already.
    """
    b, t = parents.shape
    device = parents.device
    ctx = as_index_tensor(ctx_lens, b, device)
    if anc is None:
        anc = ancestor_mask_batch(parents, tree_sizes)  # [B, T, T]
    rel = torch.arange(key_len, device=device)[None, :] - ctx[:, None]  # [B, key_len]: node index of row j
    in_tree = (rel >= 0) & (rel < t)
    tree_part = anc.gather(2, rel.clamp(0, max(t - 1, 0))[:, None, :].expand(b, t, key_len))
    return (rel < 0)[:, None, :] | (tree_part & in_tree[:, None, :])
