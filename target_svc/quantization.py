"""Quantized decoder projections: weight-only int8 / int4, and w8a8 (int8 inputs too); symmetric scales.

Only the linear projections inside the decoder layers are quantized (attention q/k/v/o, Gated DeltaNet in/out
projections, MLP gate/up/down): they hold ~90 % of a model's bytes. Embeddings, the LM head, norms, the GDN
conv/A_log/dt_bias, and the attention and GDN kernels keep the model dtype -- except with mode "int8-head", which
quantizes the LM head to int8 too (per vocabulary row, as gpt-fast's int8 does with every linear): the rest of a
decode step's weight read (0.62 of the 8B's 8.2 GB in int8; 1.27 GB saved at the 27B's 248k x 5120 head), while
the embedding stays in the model dtype for its row gathers (a tied head gets an int8 copy of it). The quantized
model is a different model from the bf16 one; speculative decoding is lossless with respect to it (the target as
served).

int8: a projection y = x W^T becomes y = (x q^T) * s with q = round(W / s) in [-127, 127] and s = max|W_row| / 127
per output row. int4: q = round(W / s) in [-7, 7] with one s = max|W| / 7 per output row and group of
INT4_GROUP input columns, two values packed per byte. Either runs through a matmul backend: "triton" (our
kernels, target_svc/int8_matmul.py, on CUDA), "int8pack" (torch's int8 weight-only kernel, int8 only; the CPU
has one) or "dequant" (q * s as a dense weight, then F.linear): the same function up to rounding.

w8a8: the same int8 weights, and each row of a projection's input quantized to int8 as it runs (one scale per row,
its max|x| / 127, computed then): y = (xq q^T) * s_x * s, the integer product summed exactly, so a row's output
depends on that row alone (a decode step's row and a verify's equal bit for bit). On CUDA through
target_svc/w8a8_matmul.py's kernels, elsewhere through w8a8_reference: the same numbers.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from target_svc import int8_matmul, w8a8_matmul

log = logging.getLogger(__name__)

# What the target serves (the CLI's --quantize choices).
SERVED_QUANTIZE_MODES = ("none", "int8", "int4", "int8-head")
# w8a8 loads and runs for the benches, but is not served: rounding its inputs to a coarse grid per row makes a
# real model's output hop by whole grid steps where two forwards of one position differ by float rounding, so a
# speculative decoder's answer no longer follows the model's own greedy one (docs/MEMORY.md).
QUANTIZE_MODES = (*SERVED_QUANTIZE_MODES, "w8a8")
BITS = {"int8": 8, "int4": 4, "int8-head": 8, "w8a8": 8}
# Modes that quantize the projections' inputs as well (per row, at run time), and to how many bits.
ACTIVATION_BITS = {"w8a8": 8}
INT8_MAX = 127
INT4_MAX = 7
INT4_GROUP = 128  # input columns per int4 scale (fewer where in_features is not a multiple: int4_group_size)
_INT8_OP = "aten::_weight_int8pack_mm"
MATMUL_BACKENDS = ("triton", "int8pack", "dequant")
# bench/H200 switch: "auto" (the fastest backend the device has) or one of MATMUL_BACKENDS (always).
INT8_MATMUL_ENV = "DDTREE_INT8_MATMUL"


def check_quantize_mode(mode: str) -> str:
    """The mode if known, else ValueError listing the known ones."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"unknown quantize mode {mode!r}; one of {', '.join(QUANTIZE_MODES)}")
    return mode


def activation_bits(mode: str) -> int:
    """Bits of the projections' quantized inputs under mode (0: the activations stay in the model dtype)."""
    return ACTIVATION_BITS.get(mode, 0)


def quantizes_head(mode: str) -> bool:
    """Whether mode quantizes the LM head as well as the decoder layers (int8-head)."""
    return mode == "int8-head"


@dataclass
class QuantizedWeight:
    """A quantized weight [out, in] and its scales in the model dtype.

    bits=8: qweight int8 [out, in], scales [out] (one per output row).
    bits=4: qweight uint8 [out, in // 2], two values per byte (column 2j in the low nibble, 2j + 1 in the high
    one), each stored as q + 8; scales [out, in // group] (one per output row and group of input columns).
    counters: the Triton matmul's split-K tile counters for this weight (int8_matmul.split_counters), or None.
    act_bits=8 (w8a8, with bits=8): the inputs are quantized per row too (quantize_rows) before the product.
    """

    qweight: Tensor
    scales: Tensor
    bits: int = 8
    counters: Tensor | None = None
    act_bits: int = 0

    @property
    def in_features(self) -> int:
        """Columns of the dense weight."""
        return self.qweight.shape[1] * (2 if self.bits == 4 else 1)

    @property
    def group_size(self) -> int:
        """Input columns per scale (in_features for the per-row int8 scales)."""
        return self.in_features // self.scales.shape[1] if self.bits == 4 else self.in_features

    @property
    def nbytes(self) -> int:
        """Bytes held by the quantized weight and the scales."""
        return self.qweight.nbytes + self.scales.nbytes

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """q * s as a dense [out, in] weight in dtype (default: the scales' dtype)."""
        dtype = dtype or self.scales.dtype
        if self.bits == 4:
            scales = self.scales.to(dtype).repeat_interleave(self.group_size, dim=1)
            return unpack_int4(self.qweight).to(dtype) * scales
        return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]

    def rows(self, start: int, stop: int) -> "QuantizedWeight":
        """Output rows start..stop-1 as views (scales are per row, so a row slice is a weight of its own); no
        split-K counters (a slice's split launches take the reduction kernel)."""
        return QuantizedWeight(self.qweight[start:stop], self.scales[start:stop], self.bits, act_bits=self.act_bits)

    @staticmethod
    def cat(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Row-wise concatenation; per-row scales make it equal to quantizing the concatenated weight."""
        qweight = torch.cat([p.qweight for p in parts])
        if len({p.act_bits for p in parts}) > 1:
            raise ValueError("cannot fuse weights whose inputs are quantized differently")
        return QuantizedWeight(qweight, torch.cat([p.scales for p in parts]), parts[0].bits,
                               int8_matmul.split_counters(qweight.device), parts[0].act_bits)


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


def int4_group_size(in_features: int) -> int:
    """INT4_GROUP, or the largest power of two dividing in_features below it (small test models)."""
    if in_features % 2:
        raise ValueError(f"int4 packs two columns per byte; in_features {in_features} is odd")
    group = INT4_GROUP
    while in_features % group:
        group //= 2
    return group


def pack_int4(q: Tensor) -> Tensor:
    """int8 values in [-8, 7], [out, in] (in even) -> uint8 [out, in // 2]: column 2j + 8 in the low nibble,
    2j + 1 + 8 in the high one."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """pack_int4's inverse: uint8 [out, in // 2] -> int8 [out, in]."""
    low = (packed & 0xF).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def quantize_int4_groupwise(weight: Tensor, dtype: torch.dtype | None = None) -> QuantizedWeight:
    """Symmetric int4 of a [out, in] weight, one scale per output row and group of int4_group_size(in) columns;
    scales in dtype (default: the weight's dtype)."""
    dtype = dtype or weight.dtype
    out_features, in_features = weight.shape
    group = int4_group_size(in_features)
    w = weight.detach().float().reshape(out_features, in_features // group, group)
    amax = w.abs().amax(dim=2)
    scales = torch.where(amax > 0, amax / INT4_MAX, torch.ones_like(amax)).to(dtype)
    q = torch.round(w / scales.float()[:, :, None]).clamp_(-INT4_MAX, INT4_MAX).to(torch.int8)
    return QuantizedWeight(pack_int4(q.reshape(out_features, in_features)), scales, bits=4)


def quantize_weight(weight: Tensor, bits: int, dtype: torch.dtype | None = None, act_bits: int = 0) -> QuantizedWeight:
    """quantize_per_channel (bits=8) or quantize_int4_groupwise (bits=4); act_bits=8: a w8a8 weight."""
    if bits == 4:
        if act_bits:
            raise ValueError("int4 weights take unquantized inputs")
        return quantize_int4_groupwise(weight, dtype)
    q = quantize_per_channel(weight, dtype)
    q.act_bits = act_bits
    return q


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8 of activations x [M, K]: (xq int8 [M, K], scales float32 [M]), xq = round(x / s) with
    s = max|x_row| / 127 (1 for an all-zero row), both in float32 with IEEE division, ties to even: the
    reference of w8a8_matmul's row-quantizing kernel, which computes the very same numbers."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # A tensor divisor, not the number 127: CUDA torch divides by a Python scalar as a multiplication by its
    # reciprocal, a last-bit difference from IEEE division for some rows (an H100 run, 2026-12-07).
    scales = torch.where(amax > 0, amax / torch.full_like(amax, INT8_MAX), torch.ones_like(amax))
    xq = torch.round(xf / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return xq, scales


def w8a8_reference(x2d: Tensor, weight: QuantizedWeight) -> Tensor:
    """(xq q^T) * s_x * s for x2d [M, K] as float32 [M, N]: quantize_rows, the integer product exact (in float64,
    exact below 2^53, as int32 is on the GPU), then the two scales in float32 in that order, as the kernel does."""
    xq, sx = quantize_rows(x2d)
    acc = xq.double() @ weight.qweight.double().t()
    return acc.float() * sx[:, None] * weight.scales.float()[None, :]


def int8_matmul_backend(device: torch.device | str) -> str:
    """The matmul backend for quantized weights on device: the one DDTREE_INT8_MATMUL names, else (auto) 'triton'
    where our Triton kernels run (CUDA, Triton installed), 'int8pack' where torch has an int8 weight-only kernel
    for the device (the CPU), else 'dequant'."""
    forced = os.environ.get(INT8_MATMUL_ENV, "auto")
    if forced not in (*MATMUL_BACKENDS, "auto"):
        raise ValueError(f"{INT8_MATMUL_ENV}={forced!r}: one of auto, {', '.join(MATMUL_BACKENDS)}")
    if forced == "triton" and not int8_matmul.available(device):
        raise RuntimeError(f"{INT8_MATMUL_ENV}=triton, but the Triton kernels cannot run on {device} "
                           "(they need a CUDA device of compute capability >= 8.0 and the triton package)")
    if forced != "auto":
        return forced
    if int8_matmul.available(device):
        return "triton"
    key = {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS"}.get(torch.device(device).type)
    try:
        has = key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(_INT8_OP, key)
    except RuntimeError:  # an older torch without the operator
        has = False
    return "int8pack" if has else "dequant"


def w8a8_linear(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None, backend: str = "dequant") -> Tensor:
    """x [..., in] -> [..., out] in x's dtype through a w8a8 weight: its rows quantized to int8, the int8 product,
    the two scales (+ bias in x's dtype): the Triton kernels on CUDA, else the PyTorch reference (same numbers)."""
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if backend == "triton" and w8a8_matmul.supports(x2d, weight.in_features):
        y = w8a8_matmul.matmul(x2d, weight.qweight, weight.scales)
    else:
        y = w8a8_reference(x2d, weight).to(x.dtype)
    y = y.view(*lead, -1)
    return y if bias is None else y + bias


def _triton_takes(x: Tensor, weight: QuantizedWeight, backend: str) -> bool:
    return backend == "triton" and int8_matmul.supports(x, weight.bits, weight.in_features, weight.group_size)


def int8_linear(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None, backend: str = "int8pack") -> Tensor:
    """x [..., in] @ (q * s)^T (+ bias) -> [..., out] in x's dtype, for an int8 weight."""
    if _triton_takes(x, weight, backend):
        return int8_matmul.matmul(x, weight.qweight, weight.scales, bias, bits=8, counters=weight.counters)
    lead = x.shape[:-1]
    if backend == "int8pack":
        x2d = x.reshape(-1, x.shape[-1]).contiguous()
        scales = weight.scales if weight.scales.dtype == x.dtype else weight.scales.to(x.dtype)
        y = torch._weight_int8pack_mm(x2d, weight.qweight, scales).view(*lead, -1)
        return y if bias is None else y + bias
    # "dequant", and "triton" for what the kernels do not take (float32 activations)
    return F.linear(x, weight.dequantize(x.dtype), bias)


def int4_linear(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None, backend: str = "dequant") -> Tensor:
    """x [..., in] @ (q * s)^T (+ bias) -> [..., out] in x's dtype, for an int4 weight: the Triton kernel, else
    dequantized (torch's int8 kernel does not apply)."""
    if _triton_takes(x, weight, backend):
        return int8_matmul.matmul(x, weight.qweight, weight.scales, bias, bits=4, counters=weight.counters)
    return F.linear(x, weight.dequantize(x.dtype), bias)


def linear(x: Tensor, weight: Tensor | QuantizedWeight, bias: Tensor | None = None, backend: str = "int8pack") -> Tensor:
    """F.linear for a dense weight, int8_linear / int4_linear for a quantized one (the fused dense path calls
    this)."""
    if isinstance(weight, QuantizedWeight):
        if weight.act_bits:
            return w8a8_linear(x, weight, bias, backend)
        return (int4_linear if weight.bits == 4 else int8_linear)(x, weight, bias, backend)
    return F.linear(x, weight, bias)


class QuantizedLinear(nn.Module):
    """nn.Linear with a quantized weight (buffers `qweight`, `scales`; shapes as in QuantizedWeight for bits)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None, backend: str = "int8pack", bits: int = 8,
                 act_bits: int = 0) -> None:
        super().__init__()
        self.in_features, self.out_features, self.backend, self.bits = in_features, out_features, backend, bits
        self.act_bits = act_bits
        if bits == 4:
            group = int4_group_size(in_features)
            qweight = torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
            scales = torch.ones(out_features, in_features // group, dtype=dtype, device=device)
        else:
            qweight = torch.zeros(out_features, in_features, dtype=torch.int8, device=device)
            scales = torch.ones(out_features, dtype=dtype, device=device)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias \
            else None
        self.split_counters: Tensor | None = None  # set once the weight is on its device (attach_split_counters)

    @property
    def quantized(self) -> QuantizedWeight:
        """The weight as a QuantizedWeight (views of the buffers)."""
        return QuantizedWeight(self.qweight, self.scales, self.bits, self.split_counters, self.act_bits)

    def set_quantized(self, weight: QuantizedWeight) -> None:
        """Points the buffers at weight's tensors (views into a fused weight share its memory)."""
        self.qweight, self.scales, self.split_counters = weight.qweight, weight.scales, weight.counters

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.quantized, self.bias, self.backend)

    def extra_repr(self) -> str:
        kind = "w8a8" if self.act_bits else f"int{self.bits}"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"{kind} ({self.backend})"

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: str = "int8pack", bits: int = 8,
                    act_bits: int = 0) -> "QuantizedLinear":
        """Quantizes a loaded nn.Linear (its float weight is not kept)."""
        w = linear.weight
        q = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, "meta", backend, bits,
                act_bits)
        q.set_quantized(quantize_weight(w, bits, act_bits=act_bits))
        q.split_counters = int8_matmul.split_counters(q.qweight.device)
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
        return q


def replace_linears(layers: nn.Module, prefix: str, dtype: torch.dtype, backend: str, bits: int = 8,
                    act_bits: int = 0) -> set[str]:
    """Swaps every nn.Linear under `layers` (on the meta device, before loading) for a QuantizedLinear of `bits`
    (act_bits: of its inputs); returns their full names (prefix + relative name) so the loader quantizes those
    checkpoint weights."""
    names = set()
    for name, module in list(layers.named_modules()):
        if type(module) is nn.Linear:
            parent_name, _, attr = name.rpartition(".")
            parent = layers.get_submodule(parent_name) if parent_name else layers
            setattr(parent, attr, quantized_placeholder(module, dtype, backend, bits, act_bits))
            names.add(prefix + name)
    return names


def quantized_placeholder(linear: nn.Linear, dtype: torch.dtype, backend: str, bits: int = 8,
                          act_bits: int = 0) -> QuantizedLinear:
    """A QuantizedLinear of linear's shape and bias on the meta device, for the loader to fill."""
    return QuantizedLinear(linear.in_features, linear.out_features, linear.bias is not None, dtype, "meta", backend,
                           bits, act_bits)


def attach_split_counters(layers: nn.Module) -> None:
    """Gives every loaded QuantizedLinear under layers its own split-K counters (int8_matmul.split_counters; None
    where the fused reduction is off or the kernels do not run)."""
    for module in layers.modules():
        if isinstance(module, QuantizedLinear):
            module.split_counters = int8_matmul.split_counters(module.qweight.device)


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
