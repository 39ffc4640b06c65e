"""w8a8 projections: int8 weights, each input row quantized to int8 at run time, the integer product exact.

The PyTorch reference (target_svc/quantization.py) runs everywhere; the Triton kernels (target_svc/w8a8_kernels.py)
run here under Triton's interpreter where Triton is installed, and compiled in tests/test_gpu.py."""
from __future__ import annotations

import pytest
import torch

from target_svc import w8a8_matmul
from target_svc.loader import load_target
from target_svc.quantization import (
    INT8_MAX,
    QuantizedLinear,
    QuantizedWeight,
    linear,
    quantize_rows,
    quantize_weight,
    w8a8_reference,
)
from tests.test_quantization_backend import INTERPRETER_PATCH, _run_interpreted, needs_triton


def test_each_row_is_quantized_against_its_own_largest_magnitude():
    x = torch.tensor([[0.5, -2.0, 1.0], [0.0, 0.0, 0.0], [3.0, 0.25, -0.1]])
    xq, scales = quantize_rows(x)
    assert xq.dtype == torch.int8 and scales.dtype == torch.float32
    torch.testing.assert_close(scales, torch.tensor([2.0 / INT8_MAX, 1.0, 3.0 / INT8_MAX]))
    assert xq[0, 1] == -INT8_MAX and xq[2, 0] == INT8_MAX   # the largest magnitude maps to +-127
    assert not xq[1].any()                                 # an all-zero row: scale 1, zeros, no division by 0
    assert (xq.float() * scales[:, None] - x).abs().max() <= scales.max() / 2 + 1e-7


def test_a_rows_scale_is_the_correctly_rounded_quotient_of_its_largest_magnitude():
    """IEEE division, not a multiplication by 1/127 (a last-bit difference the row-quantizing kernel would not make)."""
    torch.manual_seed(2)
    x = torch.randn(512, 64) * torch.rand(512, 1) * 10
    _, scales = quantize_rows(x)
    assert torch.equal(scales, (x.abs().amax(dim=-1).double() / INT8_MAX).float())


def test_a_rows_output_does_not_depend_on_the_other_rows():
    """The integer product is exact and the scales are per row: a decode step's row equals a verify's bit for bit."""
    torch.manual_seed(0)
    weight = quantize_weight(torch.randn(96, 256), 8, act_bits=8)
    x = torch.randn(65, 256)
    x[7] *= 1000.0   # one row far larger than the others changes no other row's scale
    together = linear(x, weight)
    for row in (0, 7, 64):
        assert torch.equal(linear(x[row:row + 1], weight), together[row:row + 1])


def test_the_product_is_close_to_the_float_one():
    torch.manual_seed(1)
    w, x = torch.randn(64, 512), torch.randn(9, 512)
    y = linear(x, quantize_weight(w, 8, act_bits=8))
    ref = x @ w.t()
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 0.02


def test_the_reference_sums_the_integer_product_exactly():
    """Inputs whose int8 products sum past float32's 2^24: the float64 sum is still the exact integer."""
    k = 2048
    weight = QuantizedWeight(torch.full((2, k), INT8_MAX, dtype=torch.int8), torch.ones(2), act_bits=8)
    x = torch.ones(1, k)
    exact = k * INT8_MAX * INT8_MAX   # 33,032,192 > 2^24
    assert w8a8_reference(x, weight)[0, 0].item() == float(exact) / INT8_MAX


def test_int4_weights_do_not_take_quantized_inputs():
    with pytest.raises(ValueError, match="int4 weights take unquantized inputs"):
        quantize_weight(torch.randn(8, 32), 4, act_bits=8)


def test_weights_with_differently_quantized_inputs_are_not_fused():
    a = quantize_weight(torch.randn(8, 32), 8, act_bits=8)
    b = quantize_weight(torch.randn(8, 32), 8)
    with pytest.raises(ValueError, match="quantized differently"):
        QuantizedWeight.cat([a, b])
    fused = QuantizedWeight.cat([a, a])
    assert fused.act_bits == 8 and fused.rows(0, 8).act_bits == 8


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_a_w8a8_target_loads_every_decoder_projection_as_w8a8(kind, checkpoints):
    target = load_target(checkpoints(kind)[0], "cpu", torch.float32, quantize="w8a8")
    projections = [m for m in target.layers.modules() if isinstance(m, QuantizedLinear)]
    assert projections and all(m.act_bits == 8 and m.bits == 8 for m in projections)
    assert not isinstance(target.lm_head, QuantizedLinear)   # the head keeps the model dtype
    assert "w8a8" in repr(projections[0])


@pytest.mark.parametrize("m", [1, 4, 17, 64, 65, 130, 600])
@pytest.mark.parametrize("n, k", [(4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288), (40, 96)])
def test_tiles_are_valid_and_depend_on_the_row_bucket(m, n, k):
    cfg = w8a8_matmul.choose_config(m, n, k)
    assert cfg.block_m >= 16 and cfg.block_m & (cfg.block_m - 1) == 0 and cfg.block_m >= min(m, 128)
    assert cfg.block_k == 128 and cfg.split_k in (1, 2, 4)
    assert w8a8_matmul.choose_config(m, n, k) == cfg   # a pure function of the shape


def test_the_kernels_take_16_bit_two_dimensional_activations_only():
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    assert w8a8_matmul.supports(x, 64)
    assert not w8a8_matmul.supports(x.float(), 64)     # float32 models take the reference
    assert not w8a8_matmul.supports(x, 32)
    assert not w8a8_matmul.supports(torch.zeros(2, 3, 64, dtype=torch.bfloat16), 64)


INTERPRETED = INTERPRETER_PATCH + """
import itertools, torch
from target_svc import w8a8_matmul as wm
from target_svc.quantization import quantize_rows, quantize_weight, w8a8_reference
torch.manual_seed(0)
configs = [None, wm.TileConfig(16, 32, 64, 1), wm.TileConfig(16, 16, 32, 3), wm.TileConfig(64, 32, 64, 2)]
for (m, n, k), cfg, dtype in itertools.product([(1, 40, 96), (3, 33, 128), (65, 50, 256)], configs,
                                               (torch.float16, torch.bfloat16)):
    w = torch.randn(n, k) * 0.05
    q = quantize_weight(w, 8, dtype, act_bits=8)
    x = (torch.randn(m, k) * 3).to(dtype)
    x[0, :5] = 0.0
    xq, sx = wm.quantize_rows(x)
    want_q, want_s = quantize_rows(x)
    assert torch.equal(sx, want_s) and torch.equal(xq, want_q), (m, k, dtype)
    y = wm.matmul(x, q.qweight, q.scales, cfg)
    exact = w8a8_reference(x, q)
    if dtype == torch.bfloat16:   # Triton 3.6's interpreter narrows float32 to bf16 by truncation (the GPU rounds)
        exact = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32)
    want = exact.to(dtype)
    assert y.dtype == dtype and torch.equal(y, want), (m, n, k, cfg, dtype, (y.float() - want.float()).abs().max())
print("ok")
"""


@needs_triton
def test_the_kernels_under_tritons_interpreter_equal_the_reference_bit_for_bit():
    """Row quantization, the int8 product unsplit and split 2 and 3 ways, fp16 and bf16 outputs: the very bits of
    the PyTorch reference (the integer sums are exact, the epilogue the same float32 operations; the interpreter's
    bf16 stores truncate, so bf16 is compared with the truncated reference there, and rounded in test_gpu.py)."""
    _run_interpreted(INTERPRETED)


def test_the_divergence_bench_finds_no_hop_in_an_unquantized_model_and_traces_every_projection(checkpoints, tmp_path):
    """bench.w8a8_divergence on a tiny checkpoint: both forwards agree to float rounding without quantization, and
    every decoder projection is traced; its report files are written."""
    import json

    from bench import w8a8_divergence

    target_dir, _ = checkpoints("qwen3")
    w8a8_divergence.main(["--model", str(target_dir), "--short", "5", "--long", "12", "--out-dir", str(tmp_path)])
    data = json.loads(next(tmp_path.glob("w8a8-divergence-*.json")).read_text())
    none, w8a8 = data["results"]["none"], data["results"]["w8a8"]
    assert none["logit_diff"] < 1e-4 and none["first_hop"] is None
    import transformers

    linears = sum(1 for n, m in transformers.AutoModelForCausalLM.from_pretrained(str(target_dir)).named_modules()
                  if ".layers." in n and isinstance(m, torch.nn.Linear))
    assert len(none["projections"]) == len(w8a8["projections"]) == linears
