"""Gated DeltaNet (Qwen3.5/3.6 linear attention) over chains (prefill) and draft trees (depth by depth).

The PyTorch code here is the reference and the CPU path. With `kernels=True` (CUDA with fla-core, see
target_svc/gdn_kernels.py) chains and decode steps hand the same q, k, v, g, beta and state to fla's kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddtree_serve.plumbing.compiled import static_widths
from target_svc import gdn_kernels

# HF's l2norm (aligned with FLA) uses this epsilon for q and k.
L2NORM_EPS = 1e-6
DEFAULT_CHUNK = 64


# ----------------------------------------------------------------------------------------------------------------
# State shapes and allocation
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearAttnStateShape:
    """Per-layer Gated DeltaNet dimensions that size the conv and recurrent states."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        """Width of q (and of k) before the head split."""
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        """Width of v (and of z) before the head split."""
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise causal conv: q, k and v concatenated."""
        return 2 * self.key_dim + self.value_dim

    def conv_shape(self, n: int) -> tuple[int, int, int]:
        """Shape of n conv states: the last kernel-1 conv inputs, oldest first."""
        return (n, self.conv_dim, self.conv_kernel - 1)

    def rec_shape(self, n: int) -> tuple[int, int, int, int]:
        """Shape of n recurrent states [Hv, Dk, Dv]."""
        return (n, self.num_v_heads, self.head_k_dim, self.head_v_dim)

    @classmethod
    def from_config(cls, config) -> "LinearAttnStateShape":
        """Dimensions from a Qwen3.5 text config (`linear_*` fields)."""
        return cls(
            num_k_heads=int(config.linear_num_key_heads),
            num_v_heads=int(config.linear_num_value_heads),
            head_k_dim=int(config.linear_key_head_dim),
            head_v_dim=int(config.linear_value_head_dim),
            conv_kernel=int(config.linear_conv_kernel_dim),
        )

    @classmethod
    def from_module(cls, module: nn.Module) -> "LinearAttnStateShape":
        """Dimensions from a `Qwen3_5GatedDeltaNet` module (conv weight + head dims)."""
        conv_dim, _, kernel = module.conv1d.weight.shape
        head_k_dim = int(module.head_k_dim)
        head_v_dim = int(module.head_v_dim)
        num_v_heads = int(module.num_v_heads)
        # Derived from the conv width rather than trusting a possibly renamed attribute.
        num_k_heads = (conv_dim - num_v_heads * head_v_dim) // (2 * head_k_dim)
        shape = cls(num_k_heads, num_v_heads, head_k_dim, head_v_dim, int(kernel))
        if shape.conv_dim != conv_dim or num_v_heads % num_k_heads != 0:
            raise ValueError(f"inconsistent Gated DeltaNet dimensions: conv_dim={conv_dim}, {shape}")
        return shape


@dataclass
class LinearAttnState:
    """Per-slot state of one Gated DeltaNet layer: conv inputs (model dtype) and fp32 recurrent state."""

    conv: Tensor  # [n_slots, conv_dim, kernel-1], model dtype
    rec: Tensor  # [n_slots, Hv, Dk, Dv], float32


def allocate_linear_attn_state(
    shape: LinearAttnStateShape, n_slots: int, device: torch.device | str, dtype: torch.dtype
) -> LinearAttnState:
    """Zeroed state for n_slots sequences; the recurrent part is fp32 as in the reference."""
    return LinearAttnState(
        conv=torch.zeros(shape.conv_shape(n_slots), device=device, dtype=dtype),
        rec=torch.zeros(shape.rec_shape(n_slots), device=device, dtype=torch.float32),
    )


def gather_node_state(node_conv: Tensor, node_rec: Tensor, node_index: Tensor) -> tuple[Tensor, Tensor]:
    """States after node node_index[b] of tree b: ([B, conv_dim, k-1], [B, Hv, Dk, Dv])."""
    rows = torch.arange(node_conv.shape[0], device=node_conv.device)
    idx = node_index.to(device=node_conv.device, dtype=torch.long)
    return node_conv[rows, idx], node_rec[rows, idx]


# ----------------------------------------------------------------------------------------------------------------
# Shared pieces: every path (step, chain, tree, replay) uses these so that their arithmetic is the same.
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _Projected:
    """Token-wise projections of the layer input."""

    qkv_in: Tensor  # [..., conv_dim] model dtype, the conv input
    z: Tensor  # [..., value_dim] model dtype, the output gate
    beta: Tensor  # [..., Hv] fp32
    g: Tensor  # [..., Hv] fp32, log decay (<= 0)


def _glue(module: nn.Module):
    """The fused projection and compiled glue of a hybrid_layers.FusedGdn standing in for the HF module, or None."""
    # Duck-typed (no import of target_svc.hybrid_layers, which imports the functions below to compile them): an HF
    # module has no `glue` attribute, so every path runs the reference arithmetic for it.
    return getattr(module, "glue", None)


@static_widths
def gdn_gates(b: Tensor, a: Tensor, a_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """(beta, g) from the b and a projections: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), fp32."""
    # contiguous(): b and a may be column slices of one fused projection, and the CPU's vectorised sigmoid and
    # softplus round differently from their strided loops; a no-op in a compiled kernel.
    b, a = b.contiguous(), a.contiguous()
    # Sigmoid in the model dtype first, as the reference does, then fp32 for the kernel.
    beta = b.sigmoid().float()
    # fp32 so that exp(A_log) cannot overflow in half precision.
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return beta, g


def _project(module: nn.Module, x: Tensor) -> _Projected:
    """in_proj_qkv / z / b / a and the beta, g transforms of the reference."""
    glue = _glue(module)
    if glue is not None:
        return _Projected(*glue.project(module, x))
    qkv_in = module.in_proj_qkv(x)
    z = module.in_proj_z(x)
    beta, g = gdn_gates(module.in_proj_b(x), module.in_proj_a(x), module.A_log, module.dt_bias)
    return _Projected(qkv_in=qkv_in, z=z, beta=beta, g=g)


@static_widths
def conv_silu(taps: list[Tensor], weight: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """Depthwise causal conv + SiLU from the k window entries (oldest first), each [..., conv_dim]; weight [conv_dim, k]."""
    weight = weight.float()
    # Fixed fp32 accumulation order over taps: chain, tree and step paths then agree bit for bit.
    acc = taps[0].float() * weight[:, 0]
    for j in range(1, len(taps)):
        acc = acc + taps[j].float() * weight[:, j]
    if bias is not None:
        acc = acc + bias.float()
    # Rounded to the model dtype like the reference's conv output, before the fp32 kernel.
    return F.silu(acc).to(out_dtype)


def _conv_taps(module: nn.Module, taps: list[Tensor], out_dtype: torch.dtype) -> Tensor:
    """Depthwise causal conv + SiLU of the layer from the k window entries (oldest first), each [..., conv_dim]."""
    glue = _glue(module)
    if glue is not None:
        return glue.conv(module, taps, out_dtype)
    return conv_silu(taps, module.conv1d.weight[:, 0, :], module.conv1d.bias, out_dtype)


def _l2norm(t: Tensor) -> Tensor:
    """L2 normalisation of the last dim with the reference's epsilon."""
    return t * torch.rsqrt((t * t).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def split_heads(mixed: Tensor, q_shape: tuple[int, int], v_shape: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
    """Conv output -> fp32 q (normalised, scaled) [..., Hk, Dk], k (normalised) [..., Hk, Dk], v [..., Hv, Dv]."""
    lead = mixed.shape[:-1]
    (hk, dk), (hv, dv) = q_shape, v_shape
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    q = _l2norm(q.reshape(*lead, hk, dk).float()) * (dk**-0.5)
    k = _l2norm(k.reshape(*lead, hk, dk).float())
    v = v.reshape(*lead, hv, dv).float()
    return q, k, v


def conv_heads(taps: list[Tensor], weight: Tensor, bias: Tensor | None, out_dtype: torch.dtype,
               q_shape: tuple[int, int], v_shape: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
    """conv_silu then split_heads: the conv window entries -> fp32 q, k, v (one compiled kernel on CUDA)."""
    return split_heads(conv_silu(taps, weight, bias, out_dtype), q_shape, v_shape)


def _split_heads(mixed: Tensor, dims: LinearAttnStateShape) -> tuple[Tensor, Tensor, Tensor]:
    """Conv output -> fp32 q (normalised, scaled) [..., Hk, Dk], k (normalised) [..., Hk, Dk], v [..., Hv, Dv]."""
    return split_heads(mixed, (dims.num_k_heads, dims.head_k_dim), (dims.num_v_heads, dims.head_v_dim))


def _conv_split(module: nn.Module, taps: list[Tensor], out_dtype: torch.dtype,
                dims: LinearAttnStateShape) -> tuple[Tensor, Tensor, Tensor]:
    """_split_heads(_conv_taps(...)) of the layer; one compiled kernel where the layer is a FusedGdn."""
    glue = _glue(module)
    if glue is not None:
        return glue.conv_split(module, taps, out_dtype, dims)
    return _split_heads(_conv_taps(module, taps, out_dtype), dims)


def _to_v_heads(t: Tensor, dims: LinearAttnStateShape) -> Tensor:
    """Repeat key heads so that value head h uses key head h // (Hv / Hk), as the reference does."""
    return _repeat_heads(t, dims.num_v_heads // dims.num_k_heads)


def _repeat_heads(t: Tensor, rep: int) -> Tensor:
    """Each head of t [..., H, D] repeated rep times in place (head h -> heads h*rep .. h*rep + rep - 1)."""
    return t if rep == 1 else t.repeat_interleave(rep, dim=-2)


def _delta_update(
    state: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, q: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """One gated delta-rule step on [N, Hv, Dk, Dv] fp32 states; returns (new state, q S_new or None)."""
    # S' = exp(g) S ; S_new = S' + k (beta (v - S'^T k))^T ; o = S_new^T q
    state = state * g.exp()[..., None, None]
    recalled = (k.unsqueeze(-2) @ state).squeeze(-2)  # [N, Hv, Dv]
    delta = (v - recalled) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = None if q is None else (q.unsqueeze(-2) @ state).squeeze(-2)
    return state, out


@static_widths
def gated_rms_norm(core: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3.5's gated RMSNorm per value head: core [..., Hv, Dv] fp32, gate z [..., Hv * Dv] -> [..., Hv * Dv]."""
    # HF's Qwen3_5RMSNormGated on the kernel output handed over in the model dtype: normalised in fp32, cast
    # back, scaled by the weight in the model dtype, then gated by SiLU(z) in fp32 and cast back.
    dtype = z.dtype
    h = core.to(dtype).float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    h = h * F.silu(z.contiguous().reshape(core.shape).float())  # contiguous(): as in gdn_gates
    return h.to(dtype).flatten(-2)


def _output(module: nn.Module, core: Tensor, z: Tensor, dims: LinearAttnStateShape) -> Tensor:
    """Gated RMSNorm with z, then out_proj: core [..., Hv, Dv] fp32 -> [..., hidden]."""
    glue = _glue(module)
    if glue is not None:
        return glue.output(module, core, z)
    lead = core.shape[:-2]
    # The reference hands the kernel output to the norm in the model dtype.
    o = core.to(z.dtype).reshape(-1, dims.head_v_dim)
    o = module.norm(o, z.reshape(-1, dims.head_v_dim))
    return module.out_proj(o.reshape(*lead, dims.value_dim))


def _model_dtype(module: nn.Module) -> torch.dtype:
    """The model dtype of the layer (= of its conv state); the conv keeps it when projections are int8."""
    return module.conv1d.weight.dtype


# ----------------------------------------------------------------------------------------------------------------
# One decode step (the per-token reference)
# ----------------------------------------------------------------------------------------------------------------


def gdn_step(module: nn.Module, x_t: Tensor, conv_state: Tensor, rec_state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One token per row: x_t [B, H] -> (out [B, H], conv [B, conv_dim, k-1], rec [B, Hv, Dk, Dv] fp32)."""
    dims = LinearAttnStateShape.from_module(module)
    dtype = _model_dtype(module)
    p = _project(module, x_t)
    conv_state = conv_state.to(dtype)
    taps = [conv_state[:, :, j] for j in range(dims.conv_kernel - 1)] + [p.qkv_in]
    q, k, v = _conv_split(module, taps, dtype, dims)
    new_rec, core = _delta_update(
        rec_state.float(), _to_v_heads(k, dims), v, p.g, p.beta, _to_v_heads(q, dims)
    )
    new_conv = torch.cat([conv_state, p.qkv_in.unsqueeze(-1)], dim=-1)[:, :, 1:]
    return _output(module, core, p.z, dims), new_conv, new_rec


# ----------------------------------------------------------------------------------------------------------------
# Chains (prompt prefill, continuation)
# ----------------------------------------------------------------------------------------------------------------


def _chunked_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, chunk: int
) -> tuple[Tensor, Tensor]:
    """Gated delta rule over [B, S, Hv, *] fp32 inputs from state [B, Hv, Dk, Dv]; returns (o [B,S,Hv,Dv], state)."""
    bsz, seq, hv, dk = k.shape
    dv = v.shape[-1]
    pad = (-seq) % chunk
    n = (seq + pad) // chunk
    # Padding has g = 0, beta = 0, k = 0: an exact identity update of the state.
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(1, 2).reshape(bsz, hv, n, chunk, -1) for t in (q, k, v))
    g, beta = (F.pad(t, (0, 0, 0, pad)).transpose(1, 2).reshape(bsz, hv, n, chunk) for t in (g, beta))

    # Within a chunk, with G_t = sum_{s<=t} g_s and new values u_s = beta_s (v_s - exp(g_s) S_{s-1}^T k_s):
    #   S_t = e^{G_t} S_0 + sum_{s<=t} e^{G_t - G_s} k_s u_s^T
    #   (I + A) U = beta*V - (beta e^G * K) S_0,  A[s, r] = beta_s (k_s . k_r) e^{G_s - G_r} for r < s
    #   o_t = e^{G_t} S_0^T q_t + sum_{s<=t} e^{G_t - G_s} (q_t . k_s) u_s
    cum = g.cumsum(dim=-1)  # [B, Hv, N, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # Mask before exp: the upper triangle would be exp of a positive number (overflow).
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [.., t, s]
    k_beta = k * beta.unsqueeze(-1)
    strict = (k_beta @ k.transpose(-1, -2)) * decay
    system = strict.tril(-1) + torch.eye(chunk, dtype=q.dtype, device=q.device)
    w_val = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w_key = torch.linalg.solve_triangular(
        system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    q_decayed = q * cum.exp().unsqueeze(-1)
    intra = (q @ k.transpose(-1, -2)) * decay
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()  # [B, Hv, N]

    out = q.new_empty(bsz, hv, n, chunk, dv)
    for c in range(n):
        u = w_val[:, :, c] - w_key[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + intra[:, :, c] @ u
        state = state * chunk_decay[:, :, c, None, None] + k_to_end[:, :, c].transpose(-1, -2) @ u
    out = out.reshape(bsz, hv, n * chunk, dv)[:, :, :seq].transpose(1, 2)
    return out, state


# The two reference delta rules below take what the chain/step paths compute, in the contract of the kernel
# adapters (target_svc/gdn_kernels.py): q, k [B, T, Hk, Dk] (q scaled, both normalised, not repeated), v
# [B, T, Hv, Dv], g, beta [B, T, Hv], state [B, Hv, Dk, Dv], all fp32 -> (o [B, T, Hv, Dv], final state).


def stepwise_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                        state: Tensor) -> tuple[Tensor, Tensor]:
    """Reference: token by token, the update of gdn_step and of the tree walk."""
    rep = v.shape[-2] // k.shape[-2]
    outs = []
    for t in range(k.shape[1]):
        state, o = _delta_update(state, _repeat_heads(k[:, t], rep), v[:, t], g[:, t], beta[:, t],
                                 _repeat_heads(q[:, t], rep))
        outs.append(o)
    return torch.stack(outs, dim=1), state


def chunked_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                       chunk_size: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor]:
    """Reference: the chunked (WY) form that gdn_chain_forward runs on the CPU."""
    rep = v.shape[-2] // k.shape[-2]
    return _chunked_delta_rule(_repeat_heads(q, rep), _repeat_heads(k, rep), v, g, beta, state, chunk_size)


def gdn_chain_forward(
    module: nn.Module,
    x: Tensor,
    lengths: Tensor,
    conv_state: Tensor,
    rec_state: Tensor,
    chunk_size: int = DEFAULT_CHUNK,
    kernels: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded chains x [B, S, H] (row b valid up to lengths[b]) from given states -> (out, conv, rec).

    out [B, S, H] (zeros at padding); conv [B, conv_dim, k-1] model dtype and rec [B, Hv, Dk, Dv] fp32 are the
    states after each row's last valid token (unchanged for a row of length 0). kernels: the recurrence through
    fla's kernels (gdn_kernels.delta_rule) instead of the chunked PyTorch reference.
    """
    dims = LinearAttnStateShape.from_module(module)
    dtype = _model_dtype(module)
    bsz, seq, _ = x.shape
    kern = dims.conv_kernel
    lengths = lengths.to(device=x.device, dtype=torch.long)
    if bool(((lengths < 0) | (lengths > seq)).any()):
        raise ValueError(f"chain lengths must lie in [0, {seq}]")
    valid = torch.arange(seq, device=x.device).unsqueeze(0) < lengths.unsqueeze(1)  # [B, S]
    # Padding may hold anything (even NaN): zero it before it enters any projection.
    x = torch.where(valid.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))
    p = _project(module, x)

    # Committed conv inputs then the chain's: ext[:, j] is input j-(k-1) relative to the chain start.
    ext = torch.cat([conv_state.to(dtype).transpose(1, 2), p.qkv_in], dim=1)  # [B, k-1+S, conv_dim]
    taps = [ext[:, j : j + seq] for j in range(kern)]
    q, k, v = _conv_split(module, taps, dtype, dims)
    last = lengths.unsqueeze(1) + torch.arange(kern - 1, device=x.device).unsqueeze(0)  # [B, k-1]
    new_conv = ext.gather(1, last.unsqueeze(-1).expand(-1, -1, dims.conv_dim)).transpose(1, 2).contiguous()

    vf = valid.float()
    k = k * vf[:, :, None, None]
    g = p.g * vf.unsqueeze(-1)
    beta = p.beta * vf.unsqueeze(-1)
    if kernels:
        # Padding (k = 0, g = 0, beta = 0) is an exact identity update in the kernels too.
        core, new_rec = gdn_kernels.delta_rule(q, k, v, g, beta, rec_state.float())
    else:
        core, new_rec = chunked_delta_rule(q, k, v, g, beta, rec_state.float(), chunk_size)
    out = _output(module, core, p.z, dims)
    out = out * valid.unsqueeze(-1).to(out.dtype)
    return out, new_conv, new_rec


# ----------------------------------------------------------------------------------------------------------------
# Trees (DDTree verification)
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class GdnTreeTrace:
    """What a lean tree pass keeps per node so that the accepted path's state can be replayed exactly."""

    node_conv: Tensor  # [B, T, conv_dim, k-1] model dtype, conv state after each node
    key: Tensor  # [B, T, Hk, Dk] fp32, normalised keys (not repeated to value heads)
    value: Tensor  # [B, T, Hv, Dv] fp32
    g: Tensor  # [B, T, Hv] fp32
    beta: Tensor  # [B, T, Hv] fp32
    # One-node blocks (decode steps): the recurrence's state after the node, which the forward computes anyway and
    # the commit then takes as it is instead of replaying the node (every real row accepts its root).
    final_state: Tensor | None = None  # [B, Hv, Dk, Dv] fp32


@dataclass
class _TreeTopology:
    """Depths, ancestor tables and the depth-major node order of a padded batch of trees."""

    parents: Tensor  # [B, T], -1 for roots and for padded nodes
    depth: Tensor  # [B, T]
    ancestors: list[Tensor]  # ancestors[m-1] [B, T] = ancestor at distance m (-1 past the root), m = 1..k-1
    order: Tensor  # [n_valid] flat ids (b*T + i) of valid nodes sorted by depth
    counts: list[int]  # valid nodes per depth


def _tree_topology(parents: Tensor, valid: Tensor, kern: int) -> _TreeTopology:
    """Validate the tree convention and derive depths and ancestors (one pass per depth, all nodes at once)."""
    bsz, t = parents.shape
    idx = torch.arange(t, device=parents.device).unsqueeze(0)
    par_valid = parents.clamp(0, t - 1)
    parent_ok = valid.gather(1, par_valid)
    bad_root = valid[:, 0] & (parents[:, 0] != -1)
    bad_node = valid[:, 1:] & ((parents[:, 1:] < 0) | (parents[:, 1:] >= idx[:, 1:]) | ~parent_ok[:, 1:])
    if bool(bad_root.any() | bad_node.any()):
        raise ValueError("bad tree: need parents[0] = -1 and 0 <= parents[i] < i with a valid parent")
    par = torch.where(valid, parents, torch.full_like(parents, -1))
    par[:, 0] = -1

    depth = torch.zeros_like(par)
    ancestors: list[Tensor] = []
    cur = par
    m = 1
    while True:
        has = cur >= 0
        if m <= kern - 1:
            ancestors.append(cur)
        elif not bool(has.any()):
            break
        depth = depth + has.long()
        cur = torch.where(has, par.gather(1, cur.clamp(min=0)), cur)
        m += 1
        if m > t + kern:  # parents < i guarantees termination; this only guards malformed input
            raise ValueError("bad tree: cycle in parents")

    big = torch.full_like(depth, t + 1)
    key = torch.where(valid, depth, big).reshape(-1)
    order = torch.sort(key, stable=True).indices[: int(valid.sum())]
    counts = torch.bincount(depth[valid]).tolist() if bool(valid.any()) else []
    return _TreeTopology(par, depth, ancestors, order, counts)


def _gdn_tree(
    module: nn.Module,
    x: Tensor,
    parents: Tensor,
    valid: Tensor,
    conv_state: Tensor,
    rec_state: Tensor,
    keep_node_states: bool,
) -> tuple[Tensor, Tensor, Tensor | None, GdnTreeTrace]:
    """Shared tree pass; node_rec is materialised only when keep_node_states."""
    dims = LinearAttnStateShape.from_module(module)
    dtype = _model_dtype(module)
    bsz, t, _ = x.shape
    kern = dims.conv_kernel
    dev = x.device
    # Topology is computed where the caller keeps parents (CPU from the tree builder: no device syncs).
    topo = _tree_topology(parents.long(), valid.bool(), kern)
    topo = _TreeTopology(
        parents=topo.parents.to(dev),
        depth=topo.depth.to(dev),
        ancestors=[a.to(dev) for a in topo.ancestors],
        order=topo.order.to(dev),
        counts=topo.counts,
    )
    valid = valid.to(device=dev, dtype=torch.bool)

    x = torch.where(valid.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=dev))
    p = _project(module, x)

    # Conv windows for all nodes at once: the node's input and its k-1 predecessors along the ancestor path,
    # falling back to the committed conv inputs past the root. ext = [committed (k-1) | nodes (T)].
    ext = torch.cat([conv_state.to(dtype).transpose(1, 2), p.qkv_in], dim=1)  # [B, k-1+T, conv_dim]
    own = torch.arange(t, device=dev).unsqueeze(0).expand(bsz, t)
    cols = []
    for j in range(kern):
        m = kern - 1 - j  # distance from the node
        if m == 0:
            cols.append(own + (kern - 1))
        else:
            anc = topo.ancestors[m - 1]
            committed = (kern - 1) - (m - topo.depth)  # >= 0 since m <= k-1 and depth >= 0
            cols.append(torch.where(anc >= 0, anc + (kern - 1), committed))
    window_idx = torch.stack(cols, dim=-1)  # [B, T, k]
    rows = torch.arange(bsz, device=dev)[:, None, None]
    window = ext[rows, window_idx]  # [B, T, k, conv_dim]
    q, k, v = _conv_split(module, [window[:, :, j] for j in range(kern)], dtype, dims)
    vmask = valid[:, :, None, None]
    node_conv = (window[:, :, 1:] * vmask.to(dtype)).transpose(2, 3).contiguous()  # [B, T, conv_dim, k-1]

    # Recurrent part, depth by depth: each depth is one batched update over every node of that depth.
    n_flat = bsz * t
    qf = _to_v_heads(q, dims).reshape(n_flat, dims.num_v_heads, dims.head_k_dim)
    kf = _to_v_heads(k, dims).reshape(n_flat, dims.num_v_heads, dims.head_k_dim)
    vf = v.reshape(n_flat, dims.num_v_heads, dims.head_v_dim)
    gf = p.g.reshape(n_flat, dims.num_v_heads)
    bf = p.beta.reshape(n_flat, dims.num_v_heads)
    par_flat = topo.parents.reshape(-1)
    rec0 = rec_state.float()
    core = torch.zeros(n_flat, dims.num_v_heads, dims.head_v_dim, dtype=torch.float32, device=dev)
    node_rec = torch.zeros(dims.rec_shape(n_flat), dtype=torch.float32, device=dev) if keep_node_states else None
    # Lean mode keeps only the previous depth's states; row_of maps a flat node id to its row there.
    level_states = rec0[:0]
    row_of = torch.full((n_flat,), -1, dtype=torch.long, device=dev)

    start = 0
    for d, count in enumerate(topo.counts):
        ids = topo.order[start : start + count]
        start += count
        if d == 0:
            parent_state = rec0[ids // t]
        else:
            parent_ids = (ids // t) * t + par_flat[ids]
            parent_state = node_rec[parent_ids] if node_rec is not None else level_states[row_of[parent_ids]]
        new_state, out = _delta_update(parent_state, kf[ids], vf[ids], gf[ids], bf[ids], qf[ids])
        core[ids] = out
        if node_rec is not None:
            node_rec[ids] = new_state
        else:
            row_of[ids] = torch.arange(count, device=dev)
            level_states = new_state

    out = _output(module, core.reshape(bsz, t, dims.num_v_heads, dims.head_v_dim), p.z, dims)
    out = out * valid.unsqueeze(-1).to(out.dtype)
    trace = GdnTreeTrace(node_conv=node_conv, key=k, value=v, g=p.g, beta=p.beta)
    node_rec_out = None if node_rec is None else node_rec.reshape(bsz, t, *dims.rec_shape(1)[1:])
    return out, node_conv, node_rec_out, trace


def gdn_tree_forward(
    module: nn.Module, x: Tensor, parents: Tensor, valid: Tensor, conv_state: Tensor, rec_state: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Verify trees x [B, T, H] -> (out [B, T, H], node_conv [B, T, conv_dim, k-1], node_rec [B, T, Hv, Dk, Dv]).

    parents [B, T] (parents[b, 0] = -1, parents[b, i] < i), valid [B, T] bool; conv_state / rec_state are the
    committed states. node_* hold the state after consuming each node (zeros for padded nodes).
    """
    out, node_conv, node_rec, _ = _gdn_tree(module, x, parents, valid, conv_state, rec_state, True)
    assert node_rec is not None
    return out, node_conv, node_rec


def gdn_tree_forward_lean(
    module: nn.Module, x: Tensor, parents: Tensor, valid: Tensor, conv_state: Tensor, rec_state: Tensor
) -> tuple[Tensor, GdnTreeTrace]:
    """As gdn_tree_forward, but keeps a per-node trace instead of every node's [Hv, Dk, Dv] state."""
    out, _, _, trace = _gdn_tree(module, x, parents, valid, conv_state, rec_state, False)
    return out, trace


def gdn_step_forward_lean(
    module: nn.Module, x: Tensor, valid: Tensor, conv_state: Tensor, rec_state: Tensor, kernels: bool = False
) -> tuple[Tensor, GdnTreeTrace]:
    """One-node trees x [B, 1, H] (a decode step) -> (out [B, 1, H], trace for gdn_commit_path); no host sync.

    The arithmetic of gdn_tree_forward_lean for a root without children; kernels: the recurrence through fla's
    recurrent kernel (CUDA-graph capturable) instead of the reference update.
    """
    dims = LinearAttnStateShape.from_module(module)
    dtype = _model_dtype(module)
    valid = valid.to(device=x.device, dtype=torch.bool)  # [B, 1]
    x = torch.where(valid.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))
    p = _project(module, x)
    glue = _glue(module)
    if glue is not None:
        step = glue.step_inputs(module, p.qkv_in, conv_state.to(dtype), valid, p.g, p.beta, dims)
    else:
        step = step_inputs(p.qkv_in, conv_state.to(dtype), valid, p.g, p.beta, module.conv1d.weight[:, 0, :],
                           module.conv1d.bias, (dims.num_k_heads, dims.head_k_dim), (dims.num_v_heads, dims.head_v_dim))
    q, k, v, k_in, g_in, beta_in, node_conv = step
    delta_rule = gdn_kernels.recurrent_delta_rule if kernels else stepwise_delta_rule
    core, final_state = delta_rule(q, k_in, v, g_in, beta_in, rec_state.float())
    out = _output(module, core, p.z, dims)
    out = out * valid.unsqueeze(-1).to(out.dtype)
    return out, GdnTreeTrace(node_conv=node_conv, key=k, value=v, g=p.g, beta=p.beta, final_state=final_state)


@static_widths
def step_inputs(qkv_in: Tensor, conv_state: Tensor, valid: Tensor, g: Tensor, beta: Tensor, weight: Tensor,
                bias: Tensor | None, q_shape: tuple[int, int], v_shape: tuple[int, int]) -> tuple[Tensor, ...]:
    """A decode step's glue between the projections and the recurrence (one compiled kernel or two on CUDA).

    qkv_in [B, 1, conv_dim] and conv_state [B, conv_dim, k-1] in the model dtype, valid [B, 1] bool ->
    (q, k, v, k_in, g_in, beta_in, node_conv): k_in, g_in, beta_in are k, g, beta zeroed on padded rows (the
    recurrence's inputs), node_conv [B, 1, conv_dim, k-1] the conv state after the node (zeros when padded).
    """
    dtype = conv_state.dtype
    # The root's conv window: the k-1 committed inputs (oldest first), then its own input.
    taps = [conv_state[:, None, :, j] for j in range(conv_state.shape[-1])] + [qkv_in]
    q, k, v = conv_heads(taps, weight, bias, dtype, q_shape, v_shape)
    node_conv = torch.cat([conv_state, qkv_in.transpose(1, 2)], dim=-1)[:, None, :, 1:]
    node_conv = node_conv * valid[:, :, None, None].to(dtype)
    vf = valid.float()
    # A padded row gets k = 0, g = 0, beta = 0: an identity update (its output is zeroed anyway).
    return q, k, v, k * vf[:, :, None, None], g * vf[..., None], beta * vf[..., None], node_conv


@static_widths
def tree_inputs(qkv_in: Tensor, conv_state: Tensor, conv_index: Tensor | None, window_idx: Tensor, valid: Tensor,
                g: Tensor, beta: Tensor, weight: Tensor, bias: Tensor | None, q_shape: tuple[int, int],
                v_shape: tuple[int, int]) -> tuple[Tensor, ...]:
    """A tree verify's glue between the projections and the WY core (a few compiled kernels on CUDA, not ~12).

    qkv_in [B, T, conv_dim] and conv_state [B, conv_dim, k-1] in the model dtype (or, with conv_index [B], the
    layer's pool of conv states, row b's at conv_index[b]), window_idx [B, T, k] (each node's conv window as rows of
    [committed inputs | the nodes]: gdn_tree_wy.conv_windows), valid [B, T] bool, g, beta [B, T, Hv] fp32 ->
    (conv_inputs [B, k-1+T, conv_dim], q, k [B, Hv, T, Dk], v [B, Hv, T, Dv], g, beta [B, Hv, T]): heads first
    (transposed views), key heads repeated to value heads, padded nodes with k = g = beta = 0.
    """
    if conv_index is not None:
        conv_state = conv_state[conv_index]
    conv_inputs = torch.cat([conv_state.transpose(1, 2), qkv_in], dim=1)
    rows = torch.arange(qkv_in.shape[0], device=qkv_in.device)[:, None, None]
    window = conv_inputs[rows, window_idx]  # [B, T, k, conv_dim]
    q, k, v = conv_heads([window[:, :, j] for j in range(window_idx.shape[-1])], weight, bias, conv_state.dtype,
                         q_shape, v_shape)
    vf = valid.to(torch.float32)
    rep = v_shape[0] // q_shape[0]
    qh = _repeat_heads(q, rep).transpose(1, 2)
    kh = (_repeat_heads(k, rep) * vf[:, :, None, None]).transpose(1, 2)
    return (conv_inputs, qh, kh, v.transpose(1, 2), (g * vf[..., None]).transpose(1, 2),
            (beta * vf[..., None]).transpose(1, 2))


def gdn_commit_path(
    trace: GdnTreeTrace, path: Tensor, path_len: Tensor, conv_state: Tensor, rec_state: Tensor,
    kernels: bool = False,
) -> tuple[Tensor, Tensor]:
    """States after the accepted nodes path[b, :path_len[b]] (root first), replayed from the committed states.

    Uses the same update as the tree pass, so it reproduces gdn_tree_forward's node states; rows with
    path_len 0 keep their committed state. A decode step's trace carries the state its forward computed, which is
    taken as it is (the very state its output was read from). kernels: the replay through fla's recurrent kernel.
    """
    bsz, t = trace.g.shape[:2]
    dev = trace.g.device
    path = path.to(device=dev, dtype=torch.long).clamp(0, t - 1)
    path_len = path_len.to(device=dev, dtype=torch.long)
    rep = trace.value.shape[-2] // trace.key.shape[-2]
    rows = torch.arange(bsz, device=dev)
    if trace.final_state is not None:   # a one-node block: its state was computed by the forward
        state = torch.where((path_len > 0)[:, None, None, None], trace.final_state, rec_state.float())
    elif kernels:
        state = _replay_path_kernel(trace, path, path_len, rec_state.float())
    else:
        state = rec_state.float()
        for j in range(path.shape[1]):
            node = path[:, j]
            key = _repeat_heads(trace.key[rows, node], rep)
            value, g, beta = trace.value[rows, node], trace.g[rows, node], trace.beta[rows, node]
            stepped, _ = _delta_update(state, key, value, g, beta, None)
            state = torch.where((j < path_len)[:, None, None, None], stepped, state)
    last = path[rows, (path_len - 1).clamp(min=0)]
    conv = torch.where((path_len > 0)[:, None, None], trace.node_conv[rows, last], conv_state.to(trace.node_conv.dtype))
    return conv, state


def _replay_path_kernel(trace: GdnTreeTrace, path: Tensor, path_len: Tensor, state: Tensor) -> Tensor:
    """The path's nodes as one chain per row through fla's recurrent kernel; steps past path_len are identities."""
    on = torch.arange(path.shape[1], device=path.device)[None, :] < path_len[:, None]  # [B, W]
    rows = torch.arange(path.shape[0], device=path.device)[:, None]
    zero = torch.zeros((), dtype=torch.float32, device=path.device)
    # k = 0, g = 0, beta = 0 leave the state exactly as it is (exp(0) = 1, a zero update); where() rather than a
    # product so that no value of a skipped node can leak in.
    key = torch.where(on[..., None, None], trace.key[rows, path], zero)
    value = torch.where(on[..., None, None], trace.value[rows, path], zero)
    g = torch.where(on[..., None], trace.g[rows, path], zero)
    beta = torch.where(on[..., None], trace.beta[rows, path], zero)
    # The outputs are not needed; q = k only fills the argument.
    _, state = gdn_kernels.recurrent_delta_rule(key, key, value, g, beta, state)
    return state


__all__ = [
    "DEFAULT_CHUNK",
    "GdnTreeTrace",
    "LinearAttnState",
    "LinearAttnStateShape",
    "allocate_linear_attn_state",
    "chunked_delta_rule",
    "gather_node_state",
    "gdn_chain_forward",
    "gdn_commit_path",
    "gdn_step",
    "gdn_step_forward_lean",
    "gdn_tree_forward",
    "gdn_tree_forward_lean",
    "stepwise_delta_rule",
]
