"""The dense decoder layer (Llama, Qwen2, Qwen3) in few kernels: fused projections, compiled elementwise ops.

Inside a captured graph a decode step is bound by its kernels, not by Python: HF's RMSNorm alone is six kernels,
RoPE a dozen. Here each layer runs one GEMM for q/k/v, one for gate/up, and one kernel each for "residual add +
RMSNorm", "q/k norm + RoPE" and "SiLU * up", compiled by torch.compile (Triton) on CUDA. The functions below are
the plain PyTorch definitions, written in HF's order of operations and casts (so that a compiled kernel rounds
where HF rounds: `emulate_precision_casts`); on the CPU they run as they are.
"""
from __future__ import annotations


from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddtree_serve.fused_rows import fuse_rows
from ddtree_serve.plumbing.compiled import compile_all, static_widths
from ddtree_serve.rope import rotate_half
from target_svc.quantization import QuantizedLinear, QuantizedWeight


# The norm and MLP classes whose forward the functions below reproduce exactly.
FUSABLE_NORMS = ("Qwen3RMSNorm", "Qwen2RMSNorm", "LlamaRMSNorm")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's RMSNorm: normalised in float32, cast back, then scaled."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(residual: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(residual + delta, rms_norm(residual + delta)): the residual stream and the next sublayer's input."""
    h = residual + delta
    return h, rms_norm(h, weight, eps)


def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor | None, k_weight: Tensor | None, eps: float, cos: Tensor,
                 sin: Tensor) -> tuple[Tensor, Tensor]:
    """Per-head q/k RMSNorm (Qwen3; skipped when the weights are None), then full-width RoPE; [B, T, H, D]."""
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@static_widths
def silu_mul(gate_up: Tensor) -> Tensor:
    """SiLU(gate) * up over the fused [gate | up] projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass
class DenseKernels:
    """The elementwise functions a dense layer calls: compiled on CUDA, plain elsewhere."""

    rms_norm: Callable[..., Tensor]
    add_rms_norm: Callable[..., tuple[Tensor, Tensor]]
    qk_norm_rope: Callable[..., tuple[Tensor, Tensor]]
    silu_mul: Callable[..., Tensor]

    @classmethod
    def make(cls, compiled: bool) -> "DenseKernels":
        """compiled=True: each function through torch.compile (one Triton kernel each, shapes dynamic)."""
        return cls(*compile_all((rms_norm, add_rms_norm, qk_norm_rope, silu_mul), compiled))


@dataclass
class DenseLayerWeights:
    """One layer's fused projection weights (the HF modules' weights become views into them).

    With --quantize int8/int4 the fused weights are QuantizedWeights (quantized rows + their per-row or per-row-
    and-group scales); the layer calls them through target_svc.quantization.linear either way.
    """

    qkv: Tensor | QuantizedWeight  # [(nh + 2 * nkv) * hd, H]: q rows, then k, then v
    qkv_bias: Tensor | None
    gate_up: Tensor | QuantizedWeight  # [2 * I, H]: gate rows, then up


def fusable(layers: nn.ModuleList) -> bool:
    """True when every layer is a plain dense Llama/Qwen2/Qwen3 layer (the functions above are exact for it)."""
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not hasattr(mlp, "gate_proj"):
            return False
        if type(layer.input_layernorm).__name__ not in FUSABLE_NORMS:
            return False
        if getattr(mlp, "act_fn", None).__class__.__name__ not in ("SiLUActivation", "SiLU"):
            return False
        biases = [attn.q_proj.bias is None, attn.k_proj.bias is None, attn.v_proj.bias is None]
        if len(set(biases)) != 1 or attn.o_proj.bias is not None or mlp.gate_proj.bias is not None:
            return False
        if attn.q_proj.out_features != attn.o_proj.in_features:  # gated attention (Qwen3.5) is not dense
            return False
    return True


def fuse_weights(layers: nn.ModuleList) -> list[DenseLayerWeights]:
    """Concatenates q/k/v and gate/up weights per layer, re-pointing the modules at views (no extra memory)."""
    out = []
    with torch.no_grad():
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            projs = (attn.q_proj, attn.k_proj, attn.v_proj)
            if isinstance(attn.q_proj, QuantizedLinear):
                out.append(_fuse_quantized(projs, (mlp.gate_proj, mlp.up_proj)))
                continue
            qkv, bias = fuse_rows(projs)
            gate_up, _ = fuse_rows((mlp.gate_proj, mlp.up_proj))
            out.append(DenseLayerWeights(qkv, bias, gate_up))
    return out


def fuse_linears(linears: tuple[nn.Module, ...]) -> Tensor | QuantizedWeight:
    """Concatenates the rows of bias-free projections of one input (all nn.Linear or all QuantizedLinear), re-pointing
    each at its rows of the fused weight (no extra memory)."""
    if any(p.bias is not None for p in linears):
        raise ValueError("fuse_linears takes projections without bias")
    with torch.no_grad():
        if all(isinstance(p, QuantizedLinear) for p in linears):
            fused = QuantizedWeight.cat([p.quantized for p in linears])
            row = 0
            for p in linears:
                p.set_quantized(fused.rows(row, row + p.out_features))
                row += p.out_features
            return fused
        if not all(type(p) is nn.Linear for p in linears):
            raise ValueError("fuse_linears takes all nn.Linear or all QuantizedLinear")
        return fuse_rows(linears)[0]


def _fuse_quantized(qkv_projs: tuple[QuantizedLinear, ...], gate_up_projs: tuple[QuantizedLinear, ...]
                    ) -> DenseLayerWeights:
    """fuse_weights for quantized layers: quantized rows and their scales concatenated (scales belong to rows, so
    this commutes with quantizing)."""
    fused = []
    for projs in (qkv_projs, gate_up_projs):
        w = QuantizedWeight.cat([p.quantized for p in projs])
        row = 0
        for p in projs:
            n = p.out_features
            p.set_quantized(w.rows(row, row + n))
            row += n
        fused.append(w)
    bias = torch.cat([p.bias for p in qkv_projs]) if qkv_projs[0].bias is not None else None
    if bias is not None:
        _repoint_bias(qkv_projs, bias)
    return DenseLayerWeights(fused[0], bias, fused[1])


def _repoint_bias(linears: tuple[QuantizedLinear, ...], fused_bias: Tensor) -> None:
    """Makes each projection's bias a slice view of the fused bias."""
    row = 0
    for lin in linears:
        n = lin.out_features
        lin.bias = nn.Parameter(fused_bias[row : row + n], requires_grad=False)
        row += n
