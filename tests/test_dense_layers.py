"""The fused dense layer path (fused projections, the kernels' plain definitions) equals HF's modules (CPU)."""
from __future__ import annotations

import pytest
import torch

from target_svc.dense_layers import add_rms_norm, fusable, qk_norm_rope, rms_norm, silu_mul
from target_svc.loader import load_target
from target_svc.model import TargetModel
from tests.fixtures import make_tiny_llama, make_tiny_qwen3, make_tiny_qwen3_5


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("q"), seed=5)


def test_rms_norm_equals_hf_module(qwen3_dir):
    norm = load_target(str(qwen3_dir), "cpu", torch.float32).layers[0].input_layernorm
    x = torch.randn(2, 3, norm.weight.shape[0])
    torch.testing.assert_close(rms_norm(x, norm.weight, norm.variance_epsilon), norm(x), atol=0, rtol=0)
    h, normed = add_rms_norm(x, x, norm.weight, norm.variance_epsilon)
    torch.testing.assert_close(h, 2 * x) and torch.testing.assert_close(normed, norm(2 * x), atol=0, rtol=0)


def test_silu_mul_equals_the_hf_mlp_before_down_proj(qwen3_dir):
    mlp = load_target(str(qwen3_dir), "cpu", torch.float32).layers[0].mlp
    x = torch.randn(2, 3, mlp.gate_proj.weight.shape[1])
    gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x), atol=0, rtol=0)


def test_qk_rope_without_norm_weights_is_plain_rope():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 2, 8)
    half = torch.randn(1, 2, 4)
    angle = torch.cat([half, half], dim=-1)  # the HF layout: each frequency twice
    q2, k2 = qk_norm_rope(q, k, None, None, 1e-6, angle.cos(), angle.sin())
    # rotating by angle and then by -angle gives the input back
    q3, k3 = qk_norm_rope(q2, k2, None, None, 1e-6, angle.cos(), -angle.sin())
    torch.testing.assert_close(q3, q, atol=1e-5, rtol=0) and torch.testing.assert_close(k3, k, atol=1e-5, rtol=0)


def test_hybrid_models_are_not_fusable(tmp_path):
    assert not fusable(load_target(str(make_tiny_qwen3_5(tmp_path / "h", seed=1)), "cpu", torch.float32).layers)


@pytest.mark.parametrize("maker", [make_tiny_qwen3, make_tiny_llama], ids=["qwen3", "llama"])
def test_fused_forward_equals_the_module_forward(tmp_path, maker):
    model_dir = str(maker(tmp_path / "m", seed=6))
    models = [TargetModel(load_target(model_dir, "cpu", torch.float32), 2, 64, 8, fused=f) for f in (False, True)]
    assert models[0].dense is None and models[1].dense is not None
    ids = torch.randint(4, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    parents = (torch.arange(9) - 1).expand(2, 9).contiguous()
    valid = torch.ones(2, 9, dtype=torch.bool)
    outs = [m.forward_block(ids, parents, valid, torch.zeros(2, dtype=torch.long), torch.tensor([0, 1]),
                            feature_layers=(0, 1), chain=True) for m in models]
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-4, rtol=0)  # logits
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-4, rtol=0)  # features
    torch.testing.assert_close(models[1].cache.k, models[0].cache.k, atol=1e-5, rtol=0)


def test_compiled_kernels_are_made_once_per_process_and_shared_by_every_model():
    """A second model reuses the first one's torch.compile wrappers (no re-trace); plain kernels stay the functions."""
    from target_svc.dense_layers import DenseKernels
    from target_svc.hybrid_layers import HybridKernels

    for kind in (DenseKernels, HybridKernels):
        first, second = kind.make(compiled=True), kind.make(compiled=True)
        for name in kind.__dataclass_fields__:
            assert getattr(first, name) is getattr(second, name), name
            assert getattr(first, name).plain is getattr(kind.make(compiled=False), name), name
    assert DenseKernels.make(compiled=True).rms_norm is not HybridKernels.make(compiled=True).rms_norm


def test_only_the_elementwise_products_compile_with_constant_widths():
    """SiLU * up (target and drafter) compiles with its widths as constants (aligned, vectorised loads); the norms
    and RoPE keep every dim symbolic, which their reductions ran faster with."""
    from drafter_svc import dflash_model
    from target_svc import dense_layers

    def constant_widths(fn) -> bool:
        return getattr(fn, "__compile_static_widths__", False)

    assert constant_widths(dense_layers.silu_mul) and constant_widths(dflash_model.silu_mul)
    assert not any(constant_widths(f) for f in (dense_layers.rms_norm, dense_layers.add_rms_norm,
                                                 dense_layers.qk_norm_rope, dflash_model.rms_norm))


def test_the_hybrids_gated_deltanet_glue_compiles_with_constant_widths_and_its_residual_norms_do_not():
    """The GDN glue, the output gate and the per-head gated RMSNorm ran faster at constant widths (H100, the 27B
    layout); the residual add + RMSNorm, the q/k norms with RoPE and the prefill's conv + l2norm stay symbolic."""
    from target_svc import gated_deltanet, gdn_tree_wy, hybrid_layers

    kernels = hybrid_layers.HybridKernels.make(compiled=False)
    static = {name for name in kernels.__dataclass_fields__
              if getattr(getattr(kernels, name), "__compile_static_widths__", False)}
    assert static == {"sigmoid_gate", "silu_mul", "gdn_gates", "conv_silu", "step_inputs", "tree_inputs",
                      "gated_rms_norm", "commit_states"}
    assert kernels.commit_states is gdn_tree_wy.commit_states and kernels.conv_heads is gated_deltanet.conv_heads


def test_the_static_widths_switch_names_more_functions_to_compile_at_constant_widths(monkeypatch):
    """DDTREE_GLUE_STATIC_WIDTHS (a bench A/B switch) adds functions by name, or all of them; marked ones stay."""
    from ddtree_serve.plumbing.compiled import STATIC_WIDTHS_ENV, compiles_static
    from target_svc import dense_layers, hybrid_layers

    monkeypatch.delenv(STATIC_WIDTHS_ENV, raising=False)
    assert compiles_static(dense_layers.silu_mul) and not compiles_static(hybrid_layers.add_rms_norm)
    monkeypatch.setenv(STATIC_WIDTHS_ENV, " add_rms_norm , qk_norm_rope")
    assert compiles_static(hybrid_layers.add_rms_norm) and compiles_static(hybrid_layers.qk_norm_rope)
    assert not compiles_static(dense_layers.rms_norm) and compiles_static(dense_layers.silu_mul)
    monkeypatch.setenv(STATIC_WIDTHS_ENV, "all")
    assert compiles_static(dense_layers.rms_norm)
