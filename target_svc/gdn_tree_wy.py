"""Gated DeltaNet over whole draft trees in one pass: the chunked (WY) delta rule with the ancestor mask.

The reference tree pass (gated_deltanet.gdn_tree_forward) walks the tree depth by depth, one state update per
depth, and decides the depths on the host. Here every node is handled at once, with no host synchronisation and
static shapes, so a verify step of a hybrid model can be captured as a CUDA graph.

Why it is exact: a node's state depends only on the path root -> node, and along a path the gated delta rule is
the chain rule of the chunked form. With G_i = sum of g over the ancestors-or-self of node i, and the new value
of node s, u_s = beta_s (v_s - e^{g_s} S_parent(s)^T k_s):

    S_i = e^{G_i} S_0 + sum_{r in anc(i)} e^{G_i - G_r} k_r u_r^T            (anc(i): ancestors and i itself)
    (I + A) U = beta V - (beta e^G K) S_0,   A[s, r] = beta_s (k_s . k_r) e^{G_s - G_r}  for r a strict ancestor
    o_i = e^{G_i} S_0^T q_i + sum_{r in anc(i)} e^{G_i - G_r} (q_i . k_r) u_r

Parents precede children, so I + A is unit lower triangular in node order: one triangular solve per head. The
state after the accepted path's last node l needs no replay: S_l = e^{G_l} S_0 + K^T diag(anc(l) e^{G_l - G}) U.
Padded nodes are isolated roots with k = 0, beta = 0, g = 0: their u is 0 and they touch nothing.

On CUDA the core (G, U, the outputs) runs as one fused Triton kernel (target_svc/gdn_tree_kernel.py); the PyTorch
core (_wy_core_reference) is the reference and the CPU path.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ddtree_serve.decoding.tree_mask import TreeStructure, tree_structure
from ddtree_serve.plumbing.compiled import static_widths
from target_svc import gdn_kernels, gdn_tree_kernel
from target_svc.gated_deltanet import (
    LinearAttnStateShape,
    _glue,
    _model_dtype,
    _output,
    _project,
    tree_inputs,
)

log = logging.getLogger(__name__)
# Set on a GDN layer whose tree WY kernel failed to build or launch: it keeps to the PyTorch core from then on.
_KERNEL_FAILED = "_ddtree_tree_wy_kernel_failed"


@dataclass
class GdnTreeWYTrace:
    """What the commit of an accepted path needs: the conv inputs and windows, keys, new values, cumulative gates."""

    # The conv state after a node is the last k-1 inputs of its window: kept as the inputs themselves and the
    # windows' row indices (a third of per-node conv states; at the 27B's 8 x 65 nodes, 1 GiB less over 48 layers).
    conv_inputs: Tensor  # [B, k-1+T, conv_dim] model dtype: the committed conv window, then each node's input
    window_idx: Tensor  # [B, T, k] rows of conv_inputs in each node's conv window, oldest first
    key: Tensor  # [B, Hv, T, Dk] fp32, normalised keys repeated to value heads
    u: Tensor  # [B, Hv, T, Dv] fp32, the nodes' new values
    cum_g: Tensor  # [B, Hv, T] fp32, G_i
    anc: Tensor  # [B, T, T] bool, ancestors-or-self


def _wy_core_reference(qh: Tensor, kh: Tensor, vh: Tensor, g: Tensor, beta: Tensor, anc: Tensor,
                       s0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The WY core in PyTorch (reference; CPU path): (core [B, Hv, T, Dv], u [B, Hv, T, Dv], cum [B, Hv, T])."""
    # In the inputs' float dtype: float32 on the serving path, float64 where tests measure rounding errors.
    t = kh.shape[2]
    ancf = anc.to(kh.dtype)
    cum = torch.einsum("bij,bhj->bhi", ancf, g)  # G_i
    path = anc[:, None]  # [B, 1, T, T]
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~path, float("-inf")).exp()  # [B, Hv, i, r]
    k_beta = kh * beta.unsqueeze(-1)
    eye = torch.eye(t, dtype=kh.dtype, device=kh.device)
    system = (k_beta @ kh.transpose(-1, -2)) * decay * (1.0 - eye) + eye  # I + A (strict ancestors only)
    rhs = vh * beta.unsqueeze(-1) - (k_beta * cum.exp().unsqueeze(-1)) @ s0
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [B, Hv, T, Dv]
    core = (qh * cum.exp().unsqueeze(-1)) @ s0 + ((qh @ kh.transpose(-1, -2)) * decay) @ u
    return core, u, cum


@dataclass
class GdnTreeLayout:
    """What every GDN layer of one verify forward needs of the trees' shape alone: built once per forward, not
    once per layer (a 64-layer model would otherwise rebuild the same masks and indices 48 times)."""

    anc: Tensor  # [B, T, T] bool, ancestors-or-self (padded nodes: self only)
    window_idx: Tensor  # [B, T, k] long: each node's conv window in [committed k-1 inputs | the T nodes], oldest first
    conv_kernel: int


def conv_windows(parents: Tensor, valid: Tensor, depth: Tensor, conv_kernel: int) -> Tensor:
    """[B, T, k] long: each node's conv window, oldest first, as rows of [committed k-1 inputs | the T nodes]: the
    node itself and its k-1 nearest ancestors, then past the root the committed inputs; no sync."""
    bsz, t = parents.shape
    kern = conv_kernel
    own = torch.arange(t, device=parents.device).unsqueeze(0).expand(bsz, t)
    par = torch.where(valid & (parents >= 0), parents, torch.full_like(parents, -1))
    cols, cur = [own + (kern - 1)], par
    for m in range(1, kern):  # ancestor at distance m, or committed input (k-1) - (m - depth) past the root
        cols.append(torch.where(cur >= 0, cur + (kern - 1), (kern - 1) - (m - depth)))
        cur = torch.where(cur >= 0, par.gather(1, cur.clamp(min=0)), cur)
    return torch.stack(cols[::-1], dim=-1)


def gdn_tree_layout(parents: Tensor, valid: Tensor, conv_kernel: int,
                    structure: TreeStructure | None = None) -> GdnTreeLayout:
    """The ancestor mask and conv windows of padded trees (parents [B, T], valid [B, T] prefix); no sync.
    structure: tree_structure(parents, sizes) when the forward has it already (with the windows, when made)."""
    if structure is None:
        structure = tree_structure(parents, valid.sum(dim=1))
    window = structure.conv_windows
    if window is None or window.shape[-1] != conv_kernel:
        window = conv_windows(parents, valid, structure.depth, conv_kernel)
    return GdnTreeLayout(anc=structure.anc, window_idx=window, conv_kernel=conv_kernel)


def gdn_tree_forward_wy(
    module: nn.Module, x: Tensor, parents: Tensor, valid: Tensor, conv_state: Tensor, rec_state: Tensor,
    kernel: bool | None = None, layout: GdnTreeLayout | None = None, state_index: Tensor | None = None,
) -> tuple[Tensor, GdnTreeWYTrace]:
    """Verify padded trees x [B, T, H] (parents [B, T], valid [B, T] prefix) -> (out [B, T, H], trace); no sync."""
    # kernel: the WY core through the fused Triton kernel (target_svc/gdn_tree_kernel.py); None = where it is
    # available for x's device and supports these shapes (gdn_tree_kernel.supports), unless DDTREE_GDN_KERNELS is off.
    # layout: gdn_tree_layout(parents, valid, conv kernel) shared by the forward's GDN layers (None: built here).
    # state_index [B]: conv_state and rec_state are the layer's state pools and tree b starts from slot
    #   state_index[b]'s states, read in place by the glue and the kernel (two gathers a layer fewer).
    dims = LinearAttnStateShape.from_module(module)
    dtype = _model_dtype(module)
    bsz, t, _ = x.shape
    kern = dims.conv_kernel
    dev = x.device
    if layout is None or layout.conv_kernel != kern:
        layout = gdn_tree_layout(parents, valid, kern)
    anc = layout.anc

    x = torch.where(valid.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=dev))
    p = _project(module, x)

    # Heads first: [B, Hv, T, D]; padded nodes get k = 0, beta = 0, g = 0. ext: [B, k-1+T, conv_dim].
    glue = _glue(module)
    inputs = (p.qkv_in, conv_state.to(dtype), state_index, layout.window_idx, valid, p.g, p.beta)
    if glue is not None:
        ext, qh, kh, vh, g, beta = glue.tree_inputs(module, *inputs, dims)
    else:
        ext, qh, kh, vh, g, beta = tree_inputs(*inputs, module.conv1d.weight[:, 0, :], module.conv1d.bias,
                                               (dims.num_k_heads, dims.head_k_dim), (dims.num_v_heads, dims.head_v_dim))
    s0 = rec_state.float()  # [B, Hv, Dk, Dv], or the pool
    auto = kernel is None
    if auto:
        kernel = (not gdn_kernels.disabled_by_env() and gdn_tree_kernel.available(dev)
                  and gdn_tree_kernel.supports(t, dims.head_k_dim, dims.head_v_dim)
                  and not getattr(module, _KERNEL_FAILED, False))
    core = None
    if kernel:
        try:
            core, u, cum = gdn_tree_kernel.tree_wy_core(qh, kh, vh, g, beta, anc, s0, s0_index=state_index,
                                                        precision=gdn_tree_kernel.serving_precision(dtype))
        except Exception as exc:  # noqa: BLE001 - a kernel that does not build here: the reference, not a dead service
            if not auto:  # asked for by name (tests, benches): the failure is the answer
                raise
            # Seen at the eager warm-up before any graph is captured; the layer remembers it and stops trying.
            log.warning("tree WY kernel failed (%s: %s); this layer uses the PyTorch core", type(exc).__name__, exc)
            setattr(module, _KERNEL_FAILED, True)
    if core is None:
        core, u, cum = _wy_core_reference(qh, kh, vh, g, beta, anc, s0 if state_index is None else s0[state_index])
    out = _output(module, core.transpose(1, 2), p.z, dims)
    out = out * valid.unsqueeze(-1).to(out.dtype)
    return out, GdnTreeWYTrace(conv_inputs=ext, window_idx=layout.window_idx, key=kh, u=u, cum_g=cum, anc=anc)


@dataclass
class AcceptedPath:
    """The part of a commit that depends on the accepted path only: computed once per commit and shared by every
    GDN layer."""

    last: Tensor     # [B] the last accepted node (0 where none)
    nodes: Tensor    # [B, P] the accepted nodes, root first (node 0 past a row's path, where on_path is 0)
    on_path: Tensor  # [B, P] fp32: 1 for the accepted nodes, 0 past each row's path
    keep: Tensor     # [B] bool: rows that accepted at least one node


def accepted_path(path: Tensor, path_len: Tensor, device: torch.device) -> AcceptedPath:
    """AcceptedPath of path[b, :path_len[b]] (root first, -1 padded), on device; no sync."""
    nodes = path.to(device).clamp(min=0)
    path_len = path_len.to(device)
    last = nodes.gather(1, (path_len - 1).clamp(min=0)[:, None])[:, 0]
    on_path = (torch.arange(nodes.shape[1], device=device)[None, :] < path_len[:, None]).to(torch.float32)
    return AcceptedPath(last=last, nodes=nodes, on_path=on_path, keep=path_len > 0)


def gdn_commit_path_wy(
    trace: GdnTreeWYTrace, path: Tensor, path_len: Tensor, conv_state: Tensor, rec_state: Tensor,
    accepted: AcceptedPath | None = None, commit: Callable[..., tuple[Tensor, Tensor]] | None = None,
    state_index: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """States after the accepted nodes path[b, :path_len[b]] (root first): closed form, no replay, no sync.
    accepted: accepted_path(path, path_len, device), when the caller shares it between layers; commit:
    commit_states compiled (HybridKernels.commit_states), else the plain function; state_index [B]: conv_state and
    rec_state are the layer's pools, row b's states at state_index[b] (gathered inside the compiled commit)."""
    if accepted is None:
        accepted = accepted_path(path, path_len, trace.anc.device)
    return (commit or commit_states)(trace.conv_inputs, trace.window_idx, trace.key, trace.u, trace.cum_g, conv_state,
                                     rec_state, accepted.last, accepted.nodes, accepted.on_path, accepted.keep,
                                     state_index)


@static_widths
def commit_states(conv_inputs: Tensor, window_idx: Tensor, key: Tensor, u: Tensor, cum_g: Tensor, conv_state: Tensor,
                  rec_state: Tensor, last: Tensor, nodes: Tensor, on_path: Tensor, keep: Tensor,
                  state_index: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One layer's (conv state, recurrent state) after the accepted path ending at node last[b] (GdnTreeWYTrace's
    fields, AcceptedPath's): S_l = e^{G_l} S_0 + sum over the path's nodes p of e^{G_l - G_p} k_p u_p^T, and the
    conv inputs of the last node's window; rows that accepted nothing keep their states (one GEMM and two or three
    kernels, compiled). The sum runs over the path's P columns gathered, not the tree's T nodes masked: a path is
    at most as long as the draft is deep, so the commit's cost no longer grows with the tree (the same nonzero
    terms in the same order; the GEMM may associate them differently). state_index: the states are pools, row
    b's at state_index[b]."""
    if state_index is not None:
        conv_state, rec_state = conv_state[state_index], rec_state[state_index]
    rows = torch.arange(u.shape[0], device=u.device)
    heads = cum_g.shape[1]
    g_last = cum_g.gather(2, last[:, None, None].expand(-1, heads, 1))  # [B, Hv, 1]
    at = nodes[:, None, :].expand(-1, heads, -1)  # [B, Hv, P]
    weight = on_path[:, None, :] * (g_last - cum_g.gather(2, at)).clamp(max=0).exp()  # [B, Hv, P]
    key_p = key.gather(2, at[..., None].expand(-1, -1, -1, key.shape[-1]))  # [B, Hv, P, Dk]
    u_p = u.gather(2, at[..., None].expand(-1, -1, -1, u.shape[-1]))  # [B, Hv, P, Dv]
    state = g_last.exp()[..., None] * rec_state.float() + (key_p * weight.unsqueeze(-1)).transpose(-1, -2) @ u_p
    state = torch.where(keep[:, None, None, None], state, rec_state.float())
    after_last = conv_inputs[rows[:, None], window_idx[rows, last, 1:]].transpose(1, 2)  # [B, C, k-1]
    conv = torch.where(keep[:, None, None], after_last, conv_state.to(after_last.dtype))
    return conv, state
