"""--quantize int8: the quantizer, QuantizedLinear, the fused dense path, freed memory, and greedy decoding of the
quantized (int8 and int4) target equal to transformers running the dequantized weights (lossless w.r.t. the target
as served)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddtree_serve.decoding.config import SamplingParams
from target_svc.dense_layers import fusable
from target_svc.loader import load_target
from target_svc.model import TargetModel
from target_svc.quantization import (
    INT8_MATMUL_ENV,
    QuantizedLinear,
    QuantizedWeight,
    int8_linear,
    int8_matmul_backend,
    linear,
    quantize_per_channel,
    tensor_bytes,
)
from target_svc.runner import PrefillItem, TargetConfig, TargetRunner, VerifyItem
from tests.conftest import prompts_for, reference_greedy

KINDS = ("qwen3", "llama", "qwen3_5")


def _weight(out: int = 48, inp: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))


# ---- the quantizer ----------------------------------------------------------------------------------------------

def test_quantization_is_symmetric_per_output_row_and_within_half_a_step():
    w = _weight()
    w[3] = 0.0  # an all-zero row must not divide by zero
    q = quantize_per_channel(w)
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == w.shape and q.scales.shape == (w.shape[0],)
    assert int(q.qweight.abs().max()) <= 127
    nonzero = [r for r in range(w.shape[0]) if r != 3]
    assert (q.qweight[nonzero].abs().amax(dim=1) == 127).all()  # each row's largest weight maps to +-127
    torch.testing.assert_close(q.scales[nonzero], w[nonzero].abs().amax(dim=1) / 127)
    assert (q.qweight[3] == 0).all() and q.dequantize()[3].abs().max() == 0
    assert ((q.dequantize() - w).abs() <= q.scales[:, None] / 2 + 1e-7).all()


def test_scales_are_kept_in_the_model_dtype():
    q = quantize_per_channel(_weight(), torch.bfloat16)
    assert q.scales.dtype == torch.bfloat16 and q.dequantize().dtype == torch.bfloat16


def test_row_concatenation_commutes_with_quantization():
    a, b = _weight(16, 32, 1), _weight(8, 32, 2)
    fused = QuantizedWeight.cat([quantize_per_channel(a), quantize_per_channel(b)])
    whole = quantize_per_channel(torch.cat([a, b]))
    assert torch.equal(fused.qweight, whole.qweight) and torch.equal(fused.scales, whole.scales)


# ---- QuantizedLinear --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["int8pack", "dequant"])
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_linear_equals_f_linear_with_the_dequantized_weight(backend, bias):
    dense = nn.Linear(64, 48, bias=bias)
    qlin = QuantizedLinear.from_linear(dense, backend=backend)
    x = torch.randn(2, 5, 64)
    expected = F.linear(x, qlin.quantized.dequantize(torch.float32), dense.bias)
    torch.testing.assert_close(qlin(x), expected, atol=1e-5, rtol=1e-5)
    assert qlin(x).shape == (2, 5, 48)


def test_linear_helper_is_f_linear_for_dense_weights_bit_for_bit():
    w, b, x = _weight(), torch.randn(48), torch.randn(3, 64)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    q = quantize_per_channel(w)
    assert torch.equal(linear(x, q, b), int8_linear(x, q, b))


def test_the_cpu_uses_torchs_int8_kernel_and_the_environment_can_force_dequantization(monkeypatch):
    assert int8_matmul_backend("cpu") == "int8pack"  # aten::_weight_int8pack_mm has a CPU kernel
    monkeypatch.setenv(INT8_MATMUL_ENV, "dequant")
    assert int8_matmul_backend("cpu") == "dequant"


# ---- the loaded target ------------------------------------------------------------------------------------------

def _linear_weight_bytes(layers: nn.Module) -> tuple[int, int]:
    """(float bytes of the decoder Linear weights, their int8 + scale bytes in the model dtype)."""
    dense, quant = 0, 0
    for m in layers.modules():
        if isinstance(m, nn.Linear):
            dense += m.weight.nbytes
            quant += m.weight.numel() + m.out_features * m.weight.element_size()
    return dense, quant


@pytest.mark.parametrize("kind", KINDS)
def test_int8_loading_releases_the_float_weights_of_every_decoder_projection(kind, checkpoints):
    target_dir, _ = checkpoints(kind)
    plain = load_target(target_dir, "cpu", torch.float32)
    quant = load_target(target_dir, "cpu", torch.float32, quantize="int8")
    dense, int8 = _linear_weight_bytes(plain.layers)
    assert tensor_bytes(quant.layers) == tensor_bytes(plain.layers) - dense + int8
    assert not any(isinstance(m, nn.Linear) for m in quant.layers.modules())
    # Embedding, LM head, norms and the GDN conv / A_log / dt_bias keep the model dtype.
    for name, t in [*quant.layers.named_parameters(), *quant.layers.named_buffers()]:
        assert t.dtype == (torch.int8 if name.endswith("qweight") else torch.float32), name
    assert quant.embed_tokens.weight.dtype == quant.lm_head.weight.dtype == torch.float32
    assert quant.quantize == "int8" and plain.quantize == "none"


def test_the_fused_dense_path_runs_on_fused_int8_weights_that_the_modules_view(checkpoints):
    target_dir, _ = checkpoints("qwen3")
    target = load_target(target_dir, "cpu", torch.float32, quantize="int8")
    assert fusable(target.layers)
    fused = TargetModel(target, max_batch=2, max_seq_len=64, max_tree_nodes=8, fused=True)
    w, attn = fused.dense[0], target.layers[0].self_attn
    assert isinstance(w.qkv, QuantizedWeight) and isinstance(w.gate_up, QuantizedWeight)
    assert attn.q_proj.qweight.data_ptr() == w.qkv.qweight.data_ptr()  # a view: no second copy
    assert attn.k_proj.scales.data_ptr() == w.qkv.scales[attn.q_proj.out_features:].data_ptr()

    plain = TargetModel(load_target(target_dir, "cpu", torch.float32, quantize="int8"), 2, 64, 8, fused=False)
    ids = torch.tensor([prompts_for(target_dir, [12], seed=4)[0]])
    args = (ids, torch.arange(12)[None] - 1, torch.ones(1, 12, dtype=torch.bool), torch.tensor([0]), torch.tensor([0]))
    torch.testing.assert_close(fused.forward_block(*args, chain=True)[0], plain.forward_block(*args, chain=True)[0],
                               atol=1e-4, rtol=1e-4)


def test_int8_head_quantizes_the_lm_head_per_vocabulary_row_and_keeps_the_embedding(checkpoints):
    target_dir, _ = checkpoints("qwen3")
    plain = load_target(target_dir, "cpu", torch.float32)
    quant = load_target(target_dir, "cpu", torch.float32, quantize="int8-head")
    assert isinstance(quant.lm_head, QuantizedLinear) and quant.lm_head.qweight.dtype == torch.int8
    assert torch.equal(quant.lm_head.qweight, quantize_per_channel(plain.lm_head.weight).qweight)
    assert torch.equal(quant.embed_tokens.weight, plain.embed_tokens.weight)
    assert tensor_bytes(quant.lm_head) < tensor_bytes(plain.lm_head) / 3


def test_a_tied_lm_head_becomes_an_int8_copy_of_the_embedding_which_stays_float(smollm2_dir):
    plain = load_target(smollm2_dir, "cpu", torch.float32)
    assert plain.lm_head.weight.data_ptr() == plain.embed_tokens.weight.data_ptr()   # SmolLM2 ties them
    quant = load_target(smollm2_dir, "cpu", torch.float32, quantize="int8-head")
    assert torch.equal(quant.lm_head.qweight, quantize_per_channel(plain.embed_tokens.weight).qweight)
    assert torch.equal(quant.embed_tokens.weight, plain.embed_tokens.weight)


def test_an_unknown_quantize_mode_is_refused(checkpoints):
    with pytest.raises(ValueError, match="unknown quantize mode 'int3'"):
        load_target(checkpoints("qwen3")[0], "cpu", torch.float32, quantize="int3")


# ---- lossless with respect to the quantized target ---------------------------------------------------------------

@pytest.mark.parametrize("mode", ["int8", "int4", "int8-head"])
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_greedy_decoding_equals_transformers_with_the_dequantized_weights(kind, mode, checkpoints):
    target_dir, _ = checkpoints(kind)
    runner = TargetRunner(TargetConfig(model_dir=str(target_dir), max_batch=2, max_seq_len=128, max_tree_nodes=16,
                                       quantize=mode))
    prompt = prompts_for(target_dir, [13], seed=3)[0]
    generated = [runner.prefill([PrefillItem("s", prompt, SamplingParams())])[0].next_token]
    while len(generated) < 40:
        out = runner.verify([VerifyItem("s", torch.tensor([generated[-1]]), torch.tensor([-1]))])[0]
        generated.append(out.next_token)
    expected = reference_greedy(target_dir, prompt, 40, quantize=mode)
    assert generated == expected
    # The quantized model is a different model: on this prompt its greedy output departs from the float one, so
    # the equality above could not hold by accident of an unquantized forward.
    assert expected != reference_greedy(target_dir, prompt, 40)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_chain_verified_against_the_quantized_target_is_accepted_whole(mode, checkpoints):
    """Drafts equal to the quantized model's own greedy continuation are all accepted (trees verify on it too)."""
    target_dir, _ = checkpoints("qwen3_5")
    runner = TargetRunner(TargetConfig(model_dir=str(target_dir), max_batch=2, max_seq_len=128, max_tree_nodes=16,
                                       quantize=mode))
    prompt = prompts_for(target_dir, [9], seed=5)[0]
    truth = reference_greedy(target_dir, prompt, 12, quantize=mode)
    first = runner.prefill([PrefillItem("s", prompt, SamplingParams())])[0].next_token
    assert first == truth[0]
    out = runner.verify([VerifyItem("s", torch.tensor(truth[:8]), torch.arange(8) - 1)])[0]
    assert out.accepted_tokens == truth[1:8] and out.next_token == truth[8]


# ---- on a CUDA device (skipped elsewhere) ------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_int8_kernel_and_dequantized_gemm_agree_in_bf16():
    dense = nn.Linear(512, 384, bias=False).to("cuda", torch.bfloat16)
    x = torch.randn(8 * 65, 512, device="cuda", dtype=torch.bfloat16)
    q = quantize_per_channel(dense.weight)
    fast, plain = int8_linear(x, q, backend="int8pack"), int8_linear(x, q, backend="dequant")
    torch.testing.assert_close(fast.float(), plain.float(), atol=0.05, rtol=0.02)
