"""Sliced int8 projections: each input row cut into int8 slices under a power-of-two scale, each slice times the
int8 weight exactly in integers, the slices combined in float32 (target_svc/int8_slices.py).

The PyTorch reference runs everywhere; the Triton kernels (target_svc/int8_slices_kernels.py) run here under
Triton's interpreter where Triton is installed, and compiled in tests/test_gpu.py."""
from __future__ import annotations

import pytest
import torch

from target_svc import int8_slices
from target_svc.quantization import quantize_per_channel
from tests.test_quantization_backend import INTERPRETER_PATCH, _run_interpreted, needs_triton


def _bf16_rows(m: int, k: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.randn(m, k) * torch.rand(m, 1) * 8
    return x.to(torch.bfloat16)


def test_a_rows_scale_is_the_least_power_of_two_that_holds_its_largest_magnitude_in_127_steps():
    x = torch.tensor([[1.0, -127.0, 3.0], [0.0, 0.0, 0.0], [128.0, 1.0, 0.5], [0.75, 0.0, -0.25]])
    digits, p = int8_slices.slice_rows(x)
    assert p.tolist() == [1.0, 1.0, 2.0, 2.0 ** -7]
    assert digits.dtype == torch.int8 and digits.shape == (int8_slices.SLICES, 4, 3)
    assert not digits[:, 1].any()            # an all-zero row: scale 1, every slice 0
    assert digits[0].abs().max() <= 127 and digits[1:].abs().max() <= 64
    torch.manual_seed(3)
    x = torch.randn(256, 64) * torch.rand(256, 1) * 100
    _, p = int8_slices.slice_rows(x)
    top = x.abs().amax(dim=-1)
    assert torch.equal(torch.frexp(p)[0], torch.full_like(p, 0.5))   # powers of two
    assert (top <= 127 * p).all() and (top > 127 * p / 2).all()       # the least such power


def test_the_slices_rebuild_every_bf16_element_of_at_least_a_128th_of_the_scale_exactly():
    x = _bf16_rows(33, 512)
    x[5, 7] = 0.0
    digits, p = int8_slices.slice_rows(x)
    rebuilt = sum(d.double() / int8_slices.SLICE_BASE ** i for i, d in enumerate(digits)) * p.double()[:, None]
    big = x.double().abs() >= p.double()[:, None] / 128
    assert big.float().mean() > 0.9
    assert torch.equal(rebuilt[big], x.double()[big])
    # the rest lie within half of the last slice's step of p
    assert ((rebuilt - x.double()).abs() <= p.double()[:, None] * 2.0 ** -22).all()


def test_the_sliced_product_is_the_weight_only_product_to_float32_rounding():
    torch.manual_seed(1)
    w = torch.randn(96, 1024) * 0.05
    q = quantize_per_channel(w, torch.bfloat16)
    x = _bf16_rows(17, 1024, seed=2)
    x[3, 11] = 300.0   # an outlier row: its small elements are still cut within 2^-22 of its scale
    exact = x.double() @ q.dequantize(torch.float32).double().t()
    got = int8_slices.reference(x, q.qweight, q.scales)
    assert got.dtype == torch.float32
    assert ((got.double() - exact).abs().max() / exact.abs().max()).item() < 1e-6


def test_a_rows_output_does_not_depend_on_the_other_rows():
    """Per-row scales and exact integer sums: a decode step's row equals the same row inside a verify, bit for bit."""
    torch.manual_seed(0)
    q = quantize_per_channel(torch.randn(64, 256), torch.bfloat16)
    x = _bf16_rows(65, 256, seed=4)
    x[9] *= 1000
    together = int8_slices.reference(x, q.qweight, q.scales)
    for row in (0, 9, 64):
        assert torch.equal(int8_slices.reference(x[row:row + 1], q.qweight, q.scales), together[row:row + 1])


def test_fewer_slices_cut_coarser():
    torch.manual_seed(5)
    q = quantize_per_channel(torch.randn(32, 512), torch.bfloat16)
    x = _bf16_rows(8, 512, seed=6)
    exact = x.double() @ q.dequantize(torch.float32).double().t()
    errors = [(int8_slices.reference(x, q.qweight, q.scales, slices=s).double() - exact).abs().max().item()
              for s in (1, 2, 3)]
    assert errors[0] > errors[1] > errors[2]


@pytest.mark.parametrize("value, rows", [("", None), ("off", None), ("0", None), ("on", 1), ("1", 1), ("17", 17)])
def test_the_switch_names_the_least_row_count_that_takes_the_sliced_kernels(value, rows, monkeypatch):
    monkeypatch.setenv(int8_slices.SLICES_ENV, value)
    assert int8_slices.rows_threshold() == rows


@pytest.mark.parametrize("value", ["sometimes", "-3"])
def test_a_malformed_switch_is_refused_with_its_name(value, monkeypatch):
    monkeypatch.setenv(int8_slices.SLICES_ENV, value)
    with pytest.raises(ValueError, match=int8_slices.SLICES_ENV):
        int8_slices.rows_threshold()


def test_only_16_bit_inputs_of_enough_rows_take_the_sliced_kernels():
    x = torch.zeros(17, 64, dtype=torch.bfloat16)
    assert int8_slices.takes(x, 64, 1) and int8_slices.takes(x, 64, 17)
    assert not int8_slices.takes(x, 64, 18)          # too few rows: the weight-only kernels
    assert not int8_slices.takes(x, 64, None)        # off
    assert not int8_slices.takes(x.float(), 64, 1)   # float32 models keep the other backends
    assert not int8_slices.takes(x, 32, 1)


@pytest.mark.parametrize("m", [1, 4, 17, 64, 65, 130])
@pytest.mark.parametrize("n, k", [(4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288), (40, 96)])
def test_tiles_are_valid_and_a_pure_function_of_the_shape(m, n, k):
    cfg = int8_slices.choose_config(m, n, k)
    assert cfg.block_m in (16, 32, 64) and cfg.block_m >= min(m, 64)
    assert cfg.block_k == 128 and cfg.split_k in (1, 2, 4)
    assert int8_slices.choose_config(m, n, k) == cfg


INTERPRETED = INTERPRETER_PATCH + """
import itertools, torch
from target_svc import int8_slices as sl
from target_svc.quantization import quantize_per_channel
torch.manual_seed(0)
configs = [None, sl.TileConfig(16, 32, 64, 1), sl.TileConfig(16, 16, 32, 3), sl.TileConfig(64, 32, 64, 2)]
for (m, n, k), cfg, dtype, slices, bias in itertools.product(
        [(1, 40, 96), (3, 33, 128), (65, 50, 256)], configs, (torch.float16, torch.bfloat16), (3, 2), (False, True)):
    q = quantize_per_channel(torch.randn(n, k) * 0.05, dtype)
    x = (torch.randn(m, k) * 3).to(dtype)
    x[0, :5] = 0.0
    if m > 2:
        x[1] = 0.0           # an all-zero row
        x[2, 3] = 4000.0     # an outlier
    b = (torch.randn(n) * 0.1).to(dtype) if bias else None
    digits, p = sl.slice_rows_gpu(x, slices)
    want_d, want_p = sl.slice_rows(x, slices)
    assert torch.equal(p, want_p) and torch.equal(digits, want_d), (m, k, dtype, slices)
    y = sl.matmul(x, q.qweight, q.scales, b, cfg, slices)
    exact = sl.reference(x, q.qweight, q.scales, b, slices)
    if dtype == torch.bfloat16:   # Triton 3.6's interpreter narrows float32 to bf16 by truncation (the GPU rounds)
        exact = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32)
    want = exact.to(dtype)
    assert y.dtype == dtype and torch.equal(y, want), (m, n, k, cfg, dtype, slices, (y.float() - want.float()).abs().max())
print("ok")
"""


@needs_triton
def test_the_kernels_under_tritons_interpreter_equal_the_reference_bit_for_bit():
    """Slicing, the sliced product unsplit and split 2 and 3 ways, 2 and 3 slices, with and without bias, fp16 and
    bf16 outputs: the very bits of the PyTorch reference (the interpreter's bf16 stores truncate, so bf16 is compared
    with the truncated reference here, and rounded in test_gpu.py)."""
    _run_interpreted(INTERPRETED)


def test_the_sliced_backend_runs_int8_weights_through_the_sliced_product_on_the_cpu(monkeypatch):
    """DDTREE_INT8_MATMUL=sliced: the backend a target takes on any device, and its int8 projections are the
    sliced reference's bits (not the dequantized product's: the float32 inputs are cut at the third slice)."""
    from target_svc.quantization import INT8_MATMUL_ENV, int8_matmul_backend, linear

    monkeypatch.setenv(INT8_MATMUL_ENV, "sliced")
    assert int8_matmul_backend("cpu") == "sliced"
    torch.manual_seed(7)
    q = quantize_per_channel(torch.randn(48, 320) * 0.05, torch.float32)
    x = torch.randn(2, 5, 320)
    bias = torch.randn(48)
    y = linear(x, q, bias, backend="sliced")
    assert y.shape == (2, 5, 48)
    assert torch.equal(y.view(10, 48), int8_slices.reference(x.view(10, 320), q.qweight, q.scales, bias))
    dequantized = linear(x, q, bias, backend="dequant")
    assert not torch.equal(y, dequantized)
    torch.testing.assert_close(y, dequantized, rtol=0, atol=1e-4)


def test_the_reference_sums_the_integer_products_exactly_past_float32s_integers():
    """Digits and weights at their largest over K = 4096: each sum (66 million) is past 2^24, and still exact."""
    k = 4096
    digits = torch.full((3, 2, k), 127, dtype=torch.int8)
    digits[1:] = -64
    qweight = torch.full((3, k), 127, dtype=torch.int8)
    qweight[1, 1::2] = -127
    sums = int8_slices._integer_product(digits, qweight)
    assert sums.dtype == torch.float64
    assert sums[0, 0, 0].item() == 127 * 127 * k and sums[1, 1, 0].item() == -64 * 127 * k
    assert sums[0, 0, 1].item() == 0.0
    assert torch.equal(sums, (digits.long().view(6, k) @ qweight.long().t()).double().view(3, 2, 3))
