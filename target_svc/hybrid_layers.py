"""The hybrid Qwen3.5/3.6 layers (Gated DeltaNet + gated attention) in few kernels: fused projections, compiled glue.

The sibling of target_svc/dense_layers.py for the hybrid family. Per layer: one GEMM for the MLP's gate/up, one for
the gated attention's q(+gate)/k/v or for the Gated DeltaNet's four input projections (qkv | z | b | a), and one
compiled kernel each for "residual add + zero-centred RMSNorm", "q/k norm + partial RoPE", "sigmoid output gate",
"SiLU * up", the GDN gates (beta, g), the GDN conv + SiLU + head split + l2norm (with a decode step's padding
masks and next conv state, or a tree verify's conv windows, repeated key heads and padding masks), the GDN's
gated RMSNorm, and the closed-form commit of a tree's accepted path (target_svc/gdn_tree_wy.commit_states).
GEMMs stay GEMMs; the recurrences (fla, the tree WY kernel) are untouched. The plain functions are written in HF's
order of operations and casts (so a compiled kernel rounds where HF rounds: `emulate_precision_casts`); on the CPU
they run as they are. The GDN paths in target_svc/gated_deltanet.py take a FusedGdn where they take the HF module.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ddtree_serve.rope import rotate_half
from ddtree_serve.plumbing.compiled import compile_all, static_widths
from target_svc.dense_layers import fuse_linears, silu_mul
from target_svc.gated_deltanet import (
    LinearAttnStateShape,
    conv_heads,
    conv_silu,
    gated_rms_norm,
    gdn_gates,
    step_inputs,
    tree_inputs,
)
from target_svc.gdn_tree_wy import commit_states
from target_svc.quantization import QuantizedWeight, linear

# The HF classes whose forward the functions below reproduce exactly.
ZERO_CENTRED_NORM = "Qwen3_5RMSNorm"
GATED_NORM = "Qwen3_5RMSNormGated"
_SILU = ("SiLUActivation", "SiLU")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3.5's zero-centred RMSNorm: normalised and scaled by (1 + weight) in float32, then cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm(residual: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(residual + delta, rms_norm(residual + delta)): the residual stream and the next sublayer's input."""
    h = residual + delta
    return h, rms_norm(h, weight, eps)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotates the first cos.shape[-1] dims of x [B, T, H, D] (partial rotary leaves the rest as is)."""
    rot = cos.shape[-1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor,
                 sin: Tensor) -> tuple[Tensor, Tensor]:
    """Per-head zero-centred q/k RMSNorm, then (partial) RoPE; q [B, T, Hq, D], k [B, T, Hkv, D]."""
    return apply_rope(rms_norm(q, q_weight, eps), cos, sin), apply_rope(rms_norm(k, k_weight, eps), cos, sin)


@static_widths
def sigmoid_gate(out: Tensor, gate: Tensor) -> Tensor:
    """The gated attention's output gate: out [B, T, H * D] * sigmoid(gate [B, T, H, D]) in the model dtype."""
    return out * torch.sigmoid(gate.reshape(out.shape))


@dataclass
class HybridKernels:
    """The elementwise functions a hybrid layer calls: compiled on CUDA, plain elsewhere."""

    rms_norm: Callable[..., Tensor]
    add_rms_norm: Callable[..., tuple[Tensor, Tensor]]
    qk_norm_rope: Callable[..., tuple[Tensor, Tensor]]
    sigmoid_gate: Callable[..., Tensor]
    silu_mul: Callable[..., Tensor]
    gdn_gates: Callable[..., tuple[Tensor, Tensor]]
    conv_silu: Callable[..., Tensor]
    conv_heads: Callable[..., tuple[Tensor, Tensor, Tensor]]
    step_inputs: Callable[..., tuple[Tensor, ...]]
    tree_inputs: Callable[..., tuple[Tensor, ...]]
    gated_rms_norm: Callable[..., Tensor]
    commit_states: Callable[..., tuple[Tensor, Tensor]]

    @classmethod
    def make(cls, compiled: bool) -> "HybridKernels":
        """compiled=True: each function through torch.compile (one Triton kernel or a few, shapes dynamic)."""
        fns = (rms_norm, add_rms_norm, qk_norm_rope, sigmoid_gate, silu_mul, gdn_gates, conv_silu, conv_heads,
               step_inputs, tree_inputs, gated_rms_norm, commit_states)
        return cls(*compile_all(fns, compiled))


@dataclass
class GdnGlue:
    """A Gated DeltaNet layer's fused input projection and the kernels of its glue (see FusedGdn)."""

    in_proj: Tensor | QuantizedWeight  # [conv_dim + value_dim + 2 Hv, H]: in_proj_qkv rows, then z, b, a
    widths: tuple[int, int, int, int]  # conv_dim, value_dim, Hv, Hv
    conv_weight: Tensor  # [conv_dim, k], a view of conv1d.weight
    kernels: HybridKernels
    backend: str  # the int8/int4 matmul backend of quantized weights

    def project(self, module: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(qkv_in, z, beta, g) as gated_deltanet._project computes them: one GEMM, one gate kernel."""
        qkv_in, z, b, a = linear(x, self.in_proj, None, self.backend).split(self.widths, dim=-1)
        beta, g = self.kernels.gdn_gates(b, a, module.A_log, module.dt_bias)
        return qkv_in, z, beta, g

    def conv(self, module: nn.Module, taps: list[Tensor], out_dtype: torch.dtype) -> Tensor:
        """gated_deltanet.conv_silu of the layer, compiled."""
        return self.kernels.conv_silu(taps, self.conv_weight, module.conv1d.bias, out_dtype)

    def conv_split(self, module: nn.Module, taps: list[Tensor], out_dtype: torch.dtype,
                   dims: LinearAttnStateShape) -> tuple[Tensor, Tensor, Tensor]:
        """gated_deltanet.conv_heads of the layer (conv, SiLU, head split, l2norm), compiled."""
        return self.kernels.conv_heads(taps, self.conv_weight, module.conv1d.bias, out_dtype,
                                       (dims.num_k_heads, dims.head_k_dim), (dims.num_v_heads, dims.head_v_dim))

    def step_inputs(self, module: nn.Module, qkv_in: Tensor, conv_state: Tensor, valid: Tensor, g: Tensor,
                    beta: Tensor, dims: LinearAttnStateShape) -> tuple[Tensor, ...]:
        """gated_deltanet.step_inputs of the layer (a decode step's conv, heads and padding masks), compiled."""
        return self.kernels.step_inputs(qkv_in, conv_state, valid, g, beta, self.conv_weight, module.conv1d.bias,
                                        (dims.num_k_heads, dims.head_k_dim), (dims.num_v_heads, dims.head_v_dim))

    def tree_inputs(self, module: nn.Module, qkv_in: Tensor, conv_state: Tensor, conv_index: Tensor | None,
                    window_idx: Tensor, valid: Tensor, g: Tensor, beta: Tensor,
                    dims: LinearAttnStateShape) -> tuple[Tensor, ...]:
        """gated_deltanet.tree_inputs of the layer (a tree verify's conv windows, heads and padding masks), compiled."""
        return self.kernels.tree_inputs(qkv_in, conv_state, conv_index, window_idx, valid, g, beta, self.conv_weight,
                                        module.conv1d.bias, (dims.num_k_heads, dims.head_k_dim),
                                        (dims.num_v_heads, dims.head_v_dim))

    def output(self, module: nn.Module, core: Tensor, z: Tensor) -> Tensor:
        """Gated RMSNorm (compiled) then out_proj: core [..., Hv, Dv] fp32 -> [..., hidden]."""
        norm = module.norm
        return module.out_proj(self.kernels.gated_rms_norm(core, z, norm.weight, norm.variance_epsilon))


class FusedGdn:
    """An HF Gated DeltaNet module plus its GdnGlue; target_svc/gated_deltanet.py's paths take it in the module's
    place (they find `glue` on it) and read everything else (conv1d, A_log, head dims, norm, out_proj) through."""

    def __init__(self, module: nn.Module, glue: GdnGlue) -> None:
        self.module = module
        self.glue = glue

    def __getattr__(self, name: str):
        # Only reached for names not set on the proxy itself: those of the HF module.
        if name in ("module", "glue"):
            raise AttributeError(name)
        return getattr(self.module, name)


@dataclass
class HybridLayerWeights:
    """One hybrid layer's fused projection weights (the HF modules' weights become views into them)."""

    gate_up: Tensor | QuantizedWeight  # [2 * I, H]: gate rows, then up
    qkv: Tensor | QuantizedWeight | None = None  # gated attention: q_proj rows (q and gate per head), then k, v
    gdn: FusedGdn | None = None  # Gated DeltaNet layers


def _bias_free(*linears: nn.Module) -> bool:
    """True when none of the projections has a bias."""
    return all(getattr(p, "bias", None) is None for p in linears)


def _norm_is(module: nn.Module | None, name: str) -> bool:
    """True when module is the HF norm class `name` (matched by name: the class lives in transformers)."""
    return module is not None and type(module).__name__ == name


def fusable_hybrid(layers: nn.ModuleList, final_norm: nn.Module | None = None) -> bool:
    """True when every layer is a Qwen3.5 GDN or gated-attention layer the functions above reproduce exactly."""
    if final_norm is not None and not _norm_is(final_norm, ZERO_CENTRED_NORM):
        return False
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return False
        if type(getattr(mlp, "act_fn", None)).__name__ not in _SILU or not _bias_free(mlp.gate_proj, mlp.up_proj):
            return False
        if not (_norm_is(getattr(layer, "input_layernorm", None), ZERO_CENTRED_NORM)
                and _norm_is(getattr(layer, "post_attention_layernorm", None), ZERO_CENTRED_NORM)):
            return False
        gdn, attn = getattr(layer, "linear_attn", None), getattr(layer, "self_attn", None)
        if gdn is not None:
            projs = [getattr(gdn, n, None) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]
            if None in projs or not _bias_free(*projs) or not _norm_is(getattr(gdn, "norm", None), GATED_NORM):
                return False
            if gdn.norm.activation != "silu" or getattr(gdn, "activation", "silu") not in ("silu", "swish"):
                return False
        elif attn is not None:
            # Gated attention: q_proj emits q and the output gate; q/k norms are zero-centred.
            if attn.q_proj.out_features != 2 * attn.o_proj.in_features:
                return False
            if not (_norm_is(getattr(attn, "q_norm", None), ZERO_CENTRED_NORM)
                    and _norm_is(getattr(attn, "k_norm", None), ZERO_CENTRED_NORM)):
                return False
            if not _bias_free(attn.q_proj, attn.k_proj, attn.v_proj) or attn.q_norm.eps != attn.k_norm.eps:
                return False
        else:
            return False
    return True


def fuse_hybrid(layers: nn.ModuleList, kernels: HybridKernels, backend: str) -> list[HybridLayerWeights]:
    """Fuses each layer's projections (the modules are re-pointed at views: no extra memory); GDN layers get a
    FusedGdn carrying the kernels."""
    out = []
    for layer in layers:
        mlp = layer.mlp
        weights = HybridLayerWeights(gate_up=fuse_linears((mlp.gate_proj, mlp.up_proj)))
        gdn = getattr(layer, "linear_attn", None)
        if gdn is not None:
            projs = (gdn.in_proj_qkv, gdn.in_proj_z, gdn.in_proj_b, gdn.in_proj_a)
            widths = tuple(int(p.out_features) for p in projs)
            glue = GdnGlue(fuse_linears(projs), widths, gdn.conv1d.weight[:, 0, :], kernels, backend)
            weights.gdn = FusedGdn(gdn, glue)
        else:
            attn = layer.self_attn
            weights.qkv = fuse_linears((attn.q_proj, attn.k_proj, attn.v_proj))
        out.append(weights)
    return out
