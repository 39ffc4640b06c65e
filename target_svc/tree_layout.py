"""A verify step's tree structure in one launch on CUDA: the ancestor mask, the depths and the GDN conv windows.

In PyTorch (ddtree_serve.decoding.tree_mask.tree_structure, gdn_tree_wy.conv_windows: the reference and the CPU
path) the pointer doubling is three small kernels per step, seven steps for a 65-node tree, and the conv windows
another ~15: ~50 launches of a few microseconds each in every verify forward, for a few kilobytes of integers.
The Triton kernel (target_svc/tree_layout_kernels.py) does it all in one program per tree and gives the very same
integers. Trees of 2 to MAX_NODES nodes; one-node trees (decode steps) need no walk, longer blocks (prefill chunks)
keep the PyTorch path. DDTREE_TREE_LAYOUT_KERNEL=off turns the kernel off.
"""
from __future__ import annotations

import importlib
import importlib.util

import torch
from torch import Tensor

from ddtree_serve.decoding.tree_mask import TreeStructure
from ddtree_serve.switches import switched_off

ENV_VAR = "DDTREE_TREE_LAYOUT_KERNEL"
# The mask is one BT x BT tile in registers (BT = the node count rounded up to a power of two): 128 x 128 bytes.
MAX_NODES = 128


def available(device: torch.device | str) -> bool:
    """True when the kernel can run on device: CUDA, Triton installed, not turned off by DDTREE_TREE_LAYOUT_KERNEL."""
    if switched_off(ENV_VAR):
        return False
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return importlib.util.find_spec("triton") is not None


def supports(nodes: int) -> bool:
    """Whether the kernel takes trees of `nodes` nodes."""
    return 2 <= nodes <= MAX_NODES


def tree_layout(parents: Tensor, sizes: Tensor, conv_kernel: int = 0) -> TreeStructure:
    """The TreeStructure of padded trees (parents [B, T] int64, -1 past each tree; sizes [B]), with conv windows
    [B, T, conv_kernel] when conv_kernel > 0; the caller checks supports(T). No host synchronisation."""
    bsz, t = parents.shape
    if not supports(t):
        raise ValueError(f"tree layout kernel takes 2..{MAX_NODES} nodes, not {t}")
    parents, sizes = parents.long(), sizes.long()   # views of the packed batch: read through their strides
    dev = parents.device
    anc = torch.empty(bsz, t, t, dtype=torch.bool, device=dev)
    depth = torch.empty(bsz, t, dtype=torch.long, device=dev)
    window = torch.empty(bsz, t, max(conv_kernel, 1), dtype=torch.long, device=dev)
    if bsz == 0:
        return TreeStructure(anc, depth, window if conv_kernel > 0 else None)
    kernels = importlib.import_module("target_svc.tree_layout_kernels")  # Triton: only once a launch is certain
    anc_u8 = anc.view(torch.uint8)
    block = max(16, 1 << (t - 1).bit_length())
    kernels.tree_layout_kernel[(bsz,)](
        parents, sizes, anc_u8, depth, window, t,
        parents.stride(0), parents.stride(1), sizes.stride(0), anc_u8.stride(0), anc_u8.stride(1), depth.stride(0),
        window.stride(0), window.stride(1),
        BT=block, KERN=conv_kernel, num_warps=4 if block <= 64 else 8,
    )
    return TreeStructure(anc, depth, window if conv_kernel > 0 else None)
