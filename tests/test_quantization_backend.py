"""Which matmul backend runs the quantized projections, and the pure parts of the Triton launcher
(target_svc/int8_matmul.py): what the kernels accept and the tile sizes they are given. CI has neither a GPU nor
Triton, so the kernels themselves run here only under Triton's interpreter, when Triton is installed."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from target_svc import int8_matmul
from target_svc.int8_matmul import GemvConfig, TileConfig, choose_config, choose_gemv_config, supports
from target_svc.quantization import (
    INT8_MATMUL_ENV,
    int4_linear,
    int8_linear,
    int8_matmul_backend,
    quantize_int4_groupwise,
    quantize_per_channel,
)

REPO = Path(__file__).resolve().parents[1]


# ---- backend selection ------------------------------------------------------------------------------------------

def _pretend_cuda(monkeypatch, capability=(9, 0), triton: bool = True) -> None:
    """A CUDA device of `capability` and Triton present or not, as available() sees them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if triton else None) if name == "triton" else real(name, *a))


def test_the_triton_kernels_are_never_available_on_a_cpu():
    assert not int8_matmul.available("cpu")
    assert int8_matmul_backend("cpu") == "int8pack"  # unchanged: torch's CPU kernel


def test_cuda_with_triton_chooses_the_triton_backend(monkeypatch):
    monkeypatch.delenv(INT8_MATMUL_ENV, raising=False)
    _pretend_cuda(monkeypatch)
    assert int8_matmul.available("cuda") and int8_matmul_backend("cuda") == "triton"


@pytest.mark.parametrize("capability, triton", [((9, 0), False), ((7, 5), True)])
def test_cuda_without_triton_or_without_bf16_dots_does_not_choose_triton(monkeypatch, capability, triton):
    monkeypatch.delenv(INT8_MATMUL_ENV, raising=False)
    _pretend_cuda(monkeypatch, capability, triton)
    assert not int8_matmul.available("cuda")
    assert int8_matmul_backend("cuda") in ("int8pack", "dequant")


def test_the_environment_forces_a_backend_and_refuses_what_cannot_run(monkeypatch):
    monkeypatch.setenv(INT8_MATMUL_ENV, "dequant")
    assert int8_matmul_backend("cpu") == "dequant"
    monkeypatch.setenv(INT8_MATMUL_ENV, "int8pack")
    _pretend_cuda(monkeypatch)
    assert int8_matmul_backend("cuda") == "int8pack"  # forced even where Triton would be chosen
    monkeypatch.setenv(INT8_MATMUL_ENV, "triton")
    assert int8_matmul_backend("cuda") == "triton"
    with pytest.raises(RuntimeError, match="cannot run on cpu"):
        int8_matmul_backend("cpu")
    monkeypatch.setenv(INT8_MATMUL_ENV, "fast")
    with pytest.raises(ValueError, match="one of auto, triton, int8pack, dequant"):
        int8_matmul_backend("cpu")


@pytest.mark.parametrize("bits", [8, 4])
def test_the_triton_backend_dequantizes_what_the_kernels_do_not_take(bits):
    """float32 activations (a float32 model on CUDA, or any CPU model) go through the dequantized weight."""
    w = torch.randn(48, 256)
    q = quantize_per_channel(w) if bits == 8 else quantize_int4_groupwise(w)
    x, b = torch.randn(3, 256), torch.randn(48)
    fn = int8_linear if bits == 8 else int4_linear
    torch.testing.assert_close(fn(x, q, b, backend="triton"), F.linear(x, q.dequantize(), b))


# ---- what the kernels take, and their tiles ---------------------------------------------------------------------

def test_the_kernels_take_16_bit_activations_and_int4_groups_of_at_least_16_columns():
    x = torch.empty(2, 256, dtype=torch.bfloat16)
    assert supports(x, 8, 256) and supports(x.half(), 8, 256)
    assert not supports(x.float(), 8, 256) and not supports(x, 8, 128)
    assert supports(x, 4, 256, 128) and supports(x, 4, 256, 16)
    assert not supports(x, 4, 256, 8) and not supports(x, 4, 256, 96)


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


SHAPES = [(4096, 4096), (1024, 4096), (6144, 4096), (24576, 4096), (4096, 12288), (17408, 5120), (48, 256)]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n, k", SHAPES)
def test_tiles_are_valid_triton_blocks_for_every_row_count(n, k, bits):
    group = 128 if k % 128 == 0 else 64
    for m in list(range(1, 70)) + [130, 260, 520, 1000, 4096]:
        cfg = choose_config(m, n, k, bits, group)
        assert all(_is_pow2(v) for v in (cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps))
        assert cfg.block_m >= 16 and cfg.block_n >= 16 and cfg.block_k >= 16  # tl.dot's smallest tile
        assert cfg.num_stages >= 2
        if bits == 4:
            assert group % cfg.block_k == 0  # a K tile never straddles a scale group
        k_steps = -(-k // cfg.block_k)
        assert cfg.split_k <= k_steps  # every split has K to sum


def test_a_64_row_bucket_over_a_long_reduction_takes_deep_narrow_tiles():
    """33-64 rows over K >= 8192 (the 8B's down_proj in a 64-node verify): 64 x 64 tiles, 128-deep K steps, K split
    4 ways; a short K (4096) keeps the bucket's 64 x 128 x 64."""
    down = choose_config(64, 4096, 12288)
    assert (down.block_m, down.block_n, down.block_k, down.split_k) == (64, 64, 128, 4)
    assert choose_config(33, 4096, 12288) == down
    assert (choose_config(64, 4096, 4096).block_n, choose_config(64, 4096, 4096).block_k) == (128, 64)
    assert choose_config(65, 4096, 12288).block_m == 128   # the next bucket keeps its own tiles


def test_tiles_depend_on_the_row_bucket_not_on_each_row_count():
    """Padded graph buckets and eager calls of nearby sizes share compiled kernels."""
    assert len({choose_config(m, 4096, 4096) for m in range(1, 17)}) == 1
    assert len({choose_config(m, 24576, 4096) for m in range(33, 65)}) == 1


@pytest.mark.parametrize("n, k", SHAPES)
def test_int8_with_at_most_four_rows_takes_the_gemv_with_valid_tiles(n, k, monkeypatch):
    assert isinstance(int8_matmul.kernel_config(1, n, k, 8), TileConfig)  # off by default: not yet timed on a GPU
    monkeypatch.setenv(int8_matmul.GEMV_ENV, "on")
    for m in range(1, 70):
        cfg = int8_matmul.kernel_config(m, n, k, 8)
        assert isinstance(cfg, GemvConfig) == (m <= int8_matmul.GEMV_MAX_ROWS)
        assert isinstance(int8_matmul.kernel_config(m, n, k, 4, 64), TileConfig)  # int4 keeps the dot kernel
        if isinstance(cfg, GemvConfig):
            assert cfg == choose_gemv_config(1, n, k)  # one tiling for every decode batch of a shape
            assert all(_is_pow2(v) for v in (cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps))
            assert 16 <= cfg.block_k <= max(16, 2 * k) and 1 <= cfg.split_k <= -(-k // cfg.block_k)


def test_an_explicit_tile_config_is_a_frozen_value():
    cfg = TileConfig(16, 64, 128, 2)
    assert cfg == TileConfig(16, 64, 128, 2) and hash(cfg) == hash(TileConfig(16, 64, 128, 2))
    with pytest.raises(AttributeError):
        cfg.block_m = 32


# ---- the kernels under Triton's interpreter (where Triton is installed; never in CI) -----------------------------

# The interpreter tests need the triton package (scripts/test.sh installs it; a bare `pytest` without it skips them).
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs the triton package (scripts/test.sh installs it)")

# Run first in each interpreted subprocess: Triton 3.6's interpreter turns a scalar loop bound into a Python int with
# int() of a one-element array, which numpy >= 2.4 refuses; Triton 3.8 squeezes it first, as here.
INTERPRETER_PATCH = """
from triton.runtime import interpreter
_patch_tensor = interpreter._patch_lang_tensor
def _patch_with_index(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
interpreter._patch_lang_tensor = _patch_with_index
"""

INTERPRETED = INTERPRETER_PATCH + """
import itertools, torch
from target_svc import int8_matmul as im
from target_svc.quantization import quantize_int4_groupwise, quantize_per_channel
torch.manual_seed(0)
configs = [None, im.TileConfig(16, 32, 64, 1, False, 4, 2), im.TileConfig(16, 16, 32, 3, True, 4, 2),
           im.TileConfig(64, 32, 64, 2, False, 4, 2), im.TileConfig(64, 256, 64, 2, True, 8, 3)]
for (m, n, k), cfg, bits, bias in itertools.product([(1, 40, 96), (3, 33, 128), (65, 50, 256)], configs, (8, 4),
                                                    (False, True)):
    w = torch.randn(n, k) * 0.05
    q = quantize_per_channel(w, torch.float16) if bits == 8 else quantize_int4_groupwise(w, torch.float16)
    if bits == 4 and cfg is not None:
        cfg = im.TileConfig(cfg.block_m, cfg.block_n, min(cfg.block_k, q.group_size), cfg.split_k, cfg.swap_ab,
                            cfg.num_warps, cfg.num_stages)
    x = torch.randn(m, k).half()
    b = torch.randn(n).half() if bias else None
    y = im.matmul(x, q.qweight, q.scales, b, bits, cfg).float()
    ref = torch.nn.functional.linear(x.float(), q.dequantize().float(), None if b is None else b.float())
    err = ((y - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-2, (m, n, k, cfg, bits, bias, err)
print("ok")
"""


@needs_triton
def test_the_kernels_under_tritons_interpreter_equal_the_dequantized_reference_in_fp16():
    """fp16 only: Triton 3.6's interpreter multiplies bf16 dot operands as raw bits (the GPU tests cover bf16)."""
    _run_interpreted(INTERPRETED)


INTERPRETED_FUSED_REDUCE = INTERPRETER_PATCH + """
import itertools, torch
from target_svc import int8_matmul as im
from target_svc.quantization import quantize_int4_groupwise, quantize_per_channel
torch.manual_seed(0)
counters = torch.zeros(im.SPLIT_COUNTERS, dtype=torch.int32)
for (m, n, k), split, bits, bias in itertools.product([(1, 40, 256), (17, 70, 512)], (2, 4), (8, 4), (False, True)):
    w = torch.randn(n, k) * 0.05
    q = quantize_per_channel(w, torch.float16) if bits == 8 else quantize_int4_groupwise(w, torch.float16)
    cfg = im.TileConfig(16, 32, 64, split, False, 4, 2)
    x = torch.randn(m, k).half()
    b = torch.randn(n).half() if bias else None
    want = im.matmul(x, q.qweight, q.scales, b, bits, cfg)
    for _ in range(2):  # the counters are back at 0 after a call: a second call reduces again
        got = im.matmul(x, q.qweight, q.scales, b, bits, cfg, counters=counters)
        assert torch.equal(got, want), (m, n, k, split, bits, bias)
        assert not counters.any()
few = torch.zeros(1, dtype=torch.int32)  # fewer counters than tiles: the reduction kernel, untouched counters
assert torch.equal(im.matmul(x, q.qweight, q.scales, b, bits, cfg, counters=few), want) and not few.any()
print("ok")
"""


@needs_triton
def test_a_fused_split_k_reduction_gives_the_reduction_kernels_bits_and_leaves_its_counters_at_zero():
    """Splits 2 and 4, int8 and int4, with and without bias: the last split's sum equals splitk_reduce_kernel's."""
    _run_interpreted(INTERPRETED_FUSED_REDUCE)


def test_quantized_weights_get_split_counters_only_where_the_fused_reduction_runs(monkeypatch):
    """Off by default; on, a CPU (no Triton kernels) still gets none, and a fused weight carries them."""
    from target_svc import int8_matmul as im
    from target_svc.quantization import QuantizedWeight, quantize_per_channel

    assert not im.fused_reduce_enabled()
    monkeypatch.setenv(im.FUSED_REDUCE_ENV, "on")
    assert im.fused_reduce_enabled() and im.split_counters("cpu") is None
    monkeypatch.setattr(im, "available", lambda device: True)
    counters = im.split_counters("cpu")
    assert counters.dtype == torch.int32 and counters.shape == (im.SPLIT_COUNTERS,) and not counters.any()
    fused = QuantizedWeight.cat([quantize_per_channel(torch.randn(8, 16)) for _ in range(2)])
    assert fused.counters is not None and fused.rows(0, 8).counters is None


@needs_triton
def test_pdl_is_off_by_default_never_on_a_cpu_and_on_launches_every_kernel_of_a_matmul_with_it(monkeypatch):
    """DDTREE_INT8_PDL: off unless set, and a CPU device (the interpreter) never takes it; asked for, the product
    and its split-K reduction both launch with Triton's launch_pdl and the kernels' PDL switch."""
    from bench.kernel_sass import recorded_launches
    from target_svc import int8_matmul as im

    cpu = torch.device("cpu")
    assert not im.pdl_enabled(cpu)
    monkeypatch.setenv(im.PDL_ENV, "on")
    assert not im.pdl_enabled(cpu)
    x, q = torch.zeros(1, 4096, dtype=torch.bfloat16), quantize_per_channel(torch.randn(4096, 4096) * 0.02)
    for pdl in (True, False):
        with recorded_launches() as launches:
            im.matmul(x, q.qweight, q.scales.to(torch.bfloat16), pdl=pdl)
        assert [launch.fn.__name__ for launch in launches] == ["weight_only_matmul_kernel", "splitk_reduce_kernel"]
        for launch in launches:
            assert launch.kwargs.get("launch_pdl", False) is pdl and launch.kwargs.get("PDL", False) is pdl


def test_pdl_takes_products_of_at_most_pdl_max_rows_on_hopper_and_newer(monkeypatch):
    """Where DDTREE_INT8_PDL is on, a decode-sized product launches with PDL and a verify-sized one without (PDL_MAX_
    ROWS: measured slower at 64 rows); a GPU before Hopper has no programmatic dependent launch."""
    from target_svc import int8_matmul as im

    cuda = torch.device("cuda")
    monkeypatch.setenv(im.PDL_ENV, "on")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert im.pdl_enabled(cuda, 1) and im.pdl_enabled(cuda, im.PDL_MAX_ROWS)
    assert not im.pdl_enabled(cuda, im.PDL_MAX_ROWS + 1) and not im.pdl_enabled(cuda, 64)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    assert not im.pdl_enabled(cuda, 1)
    monkeypatch.setenv(im.PDL_ENV, "off")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert not im.pdl_enabled(cuda, 1)


INTERPRETED_GEMV = INTERPRETER_PATCH + """
import itertools, torch
from target_svc import int8_matmul as im
from target_svc.quantization import quantize_per_channel
torch.manual_seed(0)
configs = [None, im.GemvConfig(16, 64, 1, 4, 1), im.GemvConfig(32, 128, 3, 4, 2), im.GemvConfig(16, 32, 8, 2, 2)]
for (n, k), m, cfg, (bias, dtype) in itertools.product([(40, 1000), (33, 96), (70, 300)], range(1, 5), configs,
                                                       [(False, torch.float16), (True, torch.bfloat16)]):
    q = quantize_per_channel(torch.randn(n, k) * 0.05, dtype)
    x = torch.randn(m, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    if cfg is None:  # the default path with DDTREE_INT8_GEMV=on: the GEMV, split when the shape asks for it
        assert isinstance(im.kernel_config(m, n, k), im.GemvConfig)
    y = im.matmul(x, q.qweight, q.scales, b, 8, cfg)
    assert y.dtype == dtype and y.shape == (m, n)
    assert torch.equal(y, im.matmul(x, q.qweight, q.scales, b, 8, cfg))  # no atomics: the same bits every call
    w = q.qweight.float() * q.scales.float()[:, None]
    ref = torch.nn.functional.linear(x.float(), w, None if b is None else b.float())
    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-2, (m, n, k, cfg, bias, dtype, err)
print("ok")
"""


@needs_triton
def test_the_gemv_kernel_under_tritons_interpreter_equals_the_dequantized_reference():
    """1 to 4 rows, K not a multiple of BLOCK_K, with and without bias, split K off, on, and past K; fp16, bf16."""
    _run_interpreted(INTERPRETED_GEMV, {"DDTREE_INT8_GEMV": "on"})


def _run_interpreted(script: str, extra_env: dict[str, str] | None = None) -> None:
    """script in a fresh process with TRITON_INTERPRET=1 (set before Triton is imported); it prints "ok"."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path, **(extra_env or {})}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                         cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
