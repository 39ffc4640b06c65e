"""--quantize int4: the packing, the group-wise quantizer, QuantizedLinear and the fused dense path on int4 weights,
and freed memory (lossless decoding of the int4 target: tests/test_quantization.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from target_svc.dense_layers import fusable
from target_svc.loader import load_target
from target_svc.memory_plan import weight_bytes_of_config
from target_svc.model import TargetModel
from target_svc.quantization import (
    QuantizedLinear,
    QuantizedWeight,
    int4_group_size,
    pack_int4,
    quantize_int4_groupwise,
    tensor_bytes,
    unpack_int4,
)
from tests.conftest import prompts_for

KINDS = ("qwen3", "llama", "qwen3_5")


def _weight(out: int = 24, inp: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))


# ---- packing and the quantizer ----------------------------------------------------------------------------------

def test_packing_two_values_per_byte_round_trips_and_puts_even_columns_in_the_low_nibble():
    q = torch.randint(-8, 8, (5, 12), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 6)
    assert torch.equal(unpack_int4(packed), q)
    assert int(packed[0, 0]) == (int(q[0, 0]) + 8) | ((int(q[0, 1]) + 8) << 4)


def test_group_size_is_128_or_the_largest_power_of_two_dividing_the_columns():
    assert [int4_group_size(n) for n in (4096, 12288, 5120, 128, 64, 96, 2)] == [128, 128, 128, 128, 64, 32, 2]
    with pytest.raises(ValueError, match="odd"):
        int4_group_size(7)


def test_int4_is_symmetric_per_row_and_group_and_within_half_a_step():
    w = _weight()
    w[2, 128:] = 0.0  # an all-zero group must not divide by zero
    q = quantize_int4_groupwise(w)
    assert q.bits == 4 and q.group_size == 128 and q.in_features == 256
    assert q.qweight.shape == (24, 128) and q.scales.shape == (24, 2)
    values = unpack_int4(q.qweight).view(24, 2, 128)
    assert int(values.abs().max()) <= 7
    nonzero = torch.ones(24, 2, dtype=torch.bool)
    nonzero[2, 1] = False
    assert (values.abs().amax(dim=2)[nonzero] == 7).all()  # each group's largest weight maps to +-7
    torch.testing.assert_close(q.scales[nonzero], w.view(24, 2, 128).abs().amax(dim=2)[nonzero] / 7)
    assert (values[2, 1] == 0).all() and q.dequantize()[2, 128:].abs().max() == 0
    steps = q.scales.repeat_interleave(128, dim=1)
    assert ((q.dequantize() - w).abs() <= steps / 2 + 1e-7).all()


def test_int4_scales_are_kept_in_the_model_dtype():
    q = quantize_int4_groupwise(_weight(), torch.bfloat16)
    assert q.scales.dtype == torch.bfloat16 and q.dequantize().dtype == torch.bfloat16


def test_int4_row_concatenation_and_row_views_commute_with_quantization():
    a, b = _weight(16, 256, 1), _weight(8, 256, 2)
    fused = QuantizedWeight.cat([quantize_int4_groupwise(a), quantize_int4_groupwise(b)])
    whole = quantize_int4_groupwise(torch.cat([a, b]))
    assert fused.bits == 4 and torch.equal(fused.qweight, whole.qweight) and torch.equal(fused.scales, whole.scales)
    part = whole.rows(16, 24)
    assert part.bits == 4 and torch.equal(part.dequantize(), quantize_int4_groupwise(b).dequantize())
    assert part.qweight.data_ptr() == whole.qweight[16].data_ptr()  # a view, no copy


@pytest.mark.parametrize("backend", ["dequant", "triton", "int8pack"])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_quantized_linear_equals_f_linear_with_the_dequantized_weight(backend, bias):
    """Every backend name gives the dequantized product on a CPU (the kernels take only bf16/fp16 on CUDA)."""
    dense = nn.Linear(256, 48, bias=bias)
    qlin = QuantizedLinear.from_linear(dense, backend=backend, bits=4)
    x = torch.randn(2, 5, 256)
    expected = F.linear(x, qlin.quantized.dequantize(torch.float32), dense.bias)
    torch.testing.assert_close(qlin(x), expected, atol=1e-5, rtol=1e-5)
    assert qlin(x).shape == (2, 5, 48) and "int4" in repr(qlin)


# ---- the loaded target ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_int4_loading_keeps_packed_weights_and_group_scales_for_every_decoder_projection(kind, checkpoints):
    target_dir, _ = checkpoints(kind)
    plain = load_target(target_dir, "cpu", torch.float32)
    quant = load_target(target_dir, "cpu", torch.float32, quantize="int4")
    dense = packed = 0
    for m in plain.layers.modules():
        if isinstance(m, nn.Linear):
            dense += m.weight.nbytes
            packed += m.weight.numel() // 2 + m.out_features * (m.in_features // int4_group_size(m.in_features)) * 4
    assert tensor_bytes(quant.layers) == tensor_bytes(plain.layers) - dense + packed
    assert not any(isinstance(m, nn.Linear) for m in quant.layers.modules())
    for name, t in [*quant.layers.named_parameters(), *quant.layers.named_buffers()]:
        assert t.dtype == (torch.uint8 if name.endswith("qweight") else torch.float32), name
    assert quant.quantize == "int4"


def test_the_memory_plan_counts_int4_weights_below_int8_ones(checkpoints):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(checkpoints("qwen3")[0]))
    sizes = [weight_bytes_of_config(config, torch.bfloat16, q) for q in ("none", "int8", "int4")]
    assert sizes[0] > sizes[1] > sizes[2]


def test_the_fused_dense_path_runs_on_fused_int4_weights_that_the_modules_view(checkpoints):
    target_dir, _ = checkpoints("qwen3")
    target = load_target(target_dir, "cpu", torch.float32, quantize="int4")
    assert fusable(target.layers)
    fused = TargetModel(target, max_batch=2, max_seq_len=64, max_tree_nodes=8, fused=True)
    w, attn = fused.dense[0], target.layers[0].self_attn
    assert isinstance(w.qkv, QuantizedWeight) and w.qkv.bits == 4 and w.gate_up.bits == 4
    assert attn.q_proj.qweight.data_ptr() == w.qkv.qweight.data_ptr()  # a view: no second copy
    assert attn.k_proj.scales.data_ptr() == w.qkv.scales[attn.q_proj.out_features:].data_ptr()

    plain = TargetModel(load_target(target_dir, "cpu", torch.float32, quantize="int4"), 2, 64, 8, fused=False)
    ids = torch.tensor([prompts_for(target_dir, [12], seed=4)[0]])
    args = (ids, torch.arange(12)[None] - 1, torch.ones(1, 12, dtype=torch.bool), torch.tensor([0]), torch.tensor([0]))
    torch.testing.assert_close(fused.forward_block(*args, chain=True)[0], plain.forward_block(*args, chain=True)[0],
                               atol=1e-4, rtol=1e-4)


# Greedy decoding of the int4 target equal to transformers with its dequantized weights, and a chain accepted
# whole: tests/test_quantization.py, parametrized over int8 and int4.
