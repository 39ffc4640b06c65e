"""Weight-only int8 for the target's decoder layers: symmetric per-output-channel scales, computed at load time.

Only the linear projections inside the decoder layers are quantized (attention q/k/v/o, Gated DeltaNet in/out
projections, MLP gate/up/down): they hold ~90 % of a model's bytes. Embeddings, the LM head, norms, the GDN
conv/A_log/dt_bias, and the attention and GDN kernels keep the model dtype. The quantized model is a different
model from the bf16 one; speculative decoding is lossless with respect to it (the target as served).

A projection y = x W^T becomes y = (x q^T) * s with q = round(W / s) in [-127, 127] and s = max|W_row| / 127 per
output row. `int8_linear` runs it through torch's int8 weight-only matmul where the device has a kernel, else
dequantizes (q * s) and runs F.linear: the same function up to rounding.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

QUANTIZE_MODES = ("none", "int8")
INT8_MAX = 127
_INT8_OP = "aten::_weight_int8pack_mm"
# bench/H200 switch: "auto" (the int8 kernel where the device has one), "int8pack" or "dequant" (always).
INT8_MATMUL_ENV = "DDTREE_INT8_MATMUL"


def check_quantize_mode(mode: str) -> str:
    """The mode if known, else ValueError listing the known ones."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"unknown quantize mode {mode!r}; one of {', '.join(QUANTIZE_MODES)}")
    return mode


@dataclass
class QuantizedWeight:
    """An int8 weight [out, in] and its per-output-row scales [out] in the model dtype."""

    qweight: Tensor  # int8 [out, in]
    scales: Tensor   # [out], model dtype

    @property
    def nbytes(self) -> int:
        """Bytes held by the int8 weight and the scales."""
        return self.qweight.nbytes + self.scales.nbytes

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """q * s as a dense [out, in] weight in dtype (default: the scales' dtype)."""
        dtype = dtype or self.scales.dtype
        return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]

    @staticmethod
    def cat(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Row-wise concatenation; per-row scales make it equal to quantizing the concatenated weight."""
        return QuantizedWeight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]))


def quantize_per_channel(weight: Tensor, dtype: torch.dtype | None = None) -> QuantizedWeight:
    """Symmetric per-output-row int8 of a [out, in] weight; scales in dtype (default: the weight's dtype)."""
    dtype = dtype or weight.dtype
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    # An all-zero row keeps scale 1 (q = 0) instead of dividing by zero.
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax)).to(dtype)
    # Rounded against the scale as stored (in dtype), so that q * s is the nearest grid point to W.
    q = torch.round(w / scales.float()[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return QuantizedWeight(q, scales)


def int8_matmul_backend(device: torch.device | str) -> str:
    """'int8pack' when torch has an int8 weight-only matmul kernel for the device (or the env forces it), else
    'dequant'."""
    forced = os.environ.get(INT8_MATMUL_ENV, "auto")
    if forced in ("int8pack", "dequant"):
        return forced
    key = {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS"}.get(torch.device(device).type)
    try:
        has = key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(_INT8_OP, key)
    except RuntimeError:  # an older torch without the operator
        has = False
    return "int8pack" if has else "dequant"


def int8_linear(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None, backend: str = "int8pack") -> Tensor:
    """x [..., in] @ (q * s)^T (+ bias) -> [..., out] in x's dtype."""
    lead = x.shape[:-1]
    if backend == "int8pack":
        x2d = x.reshape(-1, x.shape[-1]).contiguous()
        scales = weight.scales if weight.scales.dtype == x.dtype else weight.scales.to(x.dtype)
        y = torch._weight_int8pack_mm(x2d, weight.qweight, scales).view(*lead, -1)
        return y if bias is None else y + bias
    return F.linear(x, weight.dequantize(x.dtype), bias)


def linear(x: Tensor, weight: Tensor | QuantizedWeight, bias: Tensor | None = None, backend: str = "int8pack") -> Tensor:
    """F.linear for a dense weight, int8_linear for a quantized one (the fused dense path calls this)."""
    if isinstance(weight, QuantizedWeight):
        return int8_linear(x, weight, bias, backend)
    return F.linear(x, weight, bias)


class QuantizedLinear(nn.Module):
    """nn.Linear with an int8 weight [out, in] and per-output-row scales [out] (buffers `qweight`, `scales`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None, backend: str = "int8pack") -> None:
        super().__init__()
        self.in_features, self.out_features, self.backend = in_features, out_features, backend
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.ones(out_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias \
            else None

    @property
    def quantized(self) -> QuantizedWeight:
        """The weight as a QuantizedWeight (views of the buffers)."""
        return QuantizedWeight(self.qweight, self.scales)

    def set_quantized(self, weight: QuantizedWeight) -> None:
        """Points the buffers at weight's tensors (views into a fused weight share its memory)."""
        self.qweight, self.scales = weight.qweight, weight.scales

    def forward(self, x: Tensor) -> Tensor:
        return int8_linear(x, self.quantized, self.bias, self.backend)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"int8 ({self.backend})"

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: str = "int8pack") -> "QuantizedLinear":
        """Quantizes a loaded nn.Linear (its float weight is not kept)."""
        w = linear.weight
        q = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, "meta", backend)
        q.set_quantized(quantize_per_channel(w))
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
        return q


def replace_linears(layers: nn.Module, prefix: str, dtype: torch.dtype, backend: str) -> set[str]:
    """Swaps every nn.Linear under `layers` (on the meta device, before loading) for a QuantizedLinear; returns
    their full names (prefix + relative name) so the loader quantizes those checkpoint weights."""
    names = set()
    for name, module in list(layers.named_modules()):
        if type(module) is nn.Linear:
            parent_name, _, attr = name.rpartition(".")
            parent = layers.get_submodule(parent_name) if parent_name else layers
            setattr(parent, attr, QuantizedLinear(module.in_features, module.out_features, module.bias is not None,
                                                  dtype, "meta", backend))
            names.add(prefix + name)
    return names


def tensor_bytes(*modules: nn.Module) -> int:
    """Bytes of the parameters and buffers of modules, each storage region counted once (tied weights, views)."""
    seen: set[tuple[int, int, int]] = set()
    total = 0
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            key = (id(t),) * 3 if t.is_meta else (t.data_ptr(), t.nbytes, 0)
            if key not in seen:
                seen.add(key)
                total += t.nbytes
    return total
