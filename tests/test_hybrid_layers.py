"""The fused hybrid (Qwen3.5) layer path: the glue's plain definitions equal HF's modules bit for bit (CPU), the fused
forward equals the module forward, and greedy decoding through it equals transformers' generate()."""
from __future__ import annotations

import random

import pytest
import torch
import transformers
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from ddtree_serve.decoding.config import SamplingParams
from target_svc.dense_layers import fusable
from target_svc.gated_deltanet import (
    LinearAttnStateShape,
    gated_rms_norm,
    gdn_chain_forward,
    gdn_gates,
    gdn_step_forward_lean,
)
from target_svc.hybrid_layers import (
    FusedGdn,
    add_rms_norm,
    fusable_hybrid,
    qk_norm_rope,
    rms_norm,
    sigmoid_gate,
    silu_mul,
)
from target_svc.loader import load_target
from target_svc.model import TargetModel
from target_svc.quantization import QuantizedWeight
from target_svc.runner import PrefillItem, TargetConfig, TargetRunner, VerifyItem
from tests.fixtures import make_tiny_qwen3, make_tiny_qwen3_5

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_tiny_qwen3_5(tmp_path_factory.mktemp("h"), seed=31, multimodal_wrapper=True)


def _layers(model_dir, dtype: torch.dtype):
    """The decoder layers in dtype, with random norm weights (the checkpoint's are zeros / ones: too easy)."""
    target = load_target(str(model_dir), "cpu", dtype)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in target.layers.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return target.layers


def _randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _exact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 rounding of a few differently blocked GEMMs: 1e-4 of the largest magnitude."""
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_centred_rms_norm_equals_hf_module(hybrid_dir, dtype):
    norm = _layers(hybrid_dir, dtype)[0].input_layernorm
    assert type(norm).__name__ == "Qwen3_5RMSNorm"
    x, d = _randn(2, 3, 64, dtype=dtype, seed=1), _randn(2, 3, 64, dtype=dtype, seed=2)
    _exact(rms_norm(x, norm.weight, norm.eps), norm(x))
    h, normed = add_rms_norm(x, d, norm.weight, norm.eps)
    _exact(h, x + d)
    _exact(normed, norm(x + d))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_equals_hf_module(hybrid_dir, dtype):
    gdn = _layers(hybrid_dir, dtype)[0].linear_attn
    hv, dv = gdn.num_v_heads, gdn.head_v_dim
    core = _randn(2, 3, hv, dv, seed=4)  # the recurrence's fp32 output
    z = _randn(2, 3, hv * dv, dtype=dtype, seed=5)
    # HF: the kernel output in the model dtype, flattened to one row per head, gated by z.
    want = gdn.norm(core.to(dtype).reshape(-1, dv), z.reshape(-1, dv)).reshape(2, 3, hv * dv)
    _exact(gated_rms_norm(core, z, gdn.norm.weight, gdn.norm.variance_epsilon), want)
    # z as a column slice of a wider fused projection (as the fused path hands it over)
    wide = torch.cat([_randn(2, 3, 7, dtype=dtype), z, _randn(2, 3, 5, dtype=dtype)], dim=-1)
    _exact(gated_rms_norm(core, wide[..., 7:7 + hv * dv], gdn.norm.weight, gdn.norm.variance_epsilon), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_partial_rope_equals_hf_attention(hybrid_dir, dtype):
    layers = _layers(hybrid_dir, dtype)
    attn = layers[3].self_attn
    q, k = _randn(2, 3, 4, 16, dtype=dtype, seed=6), _randn(2, 3, 2, 16, dtype=dtype, seed=7)
    half = _randn(2, 3, 4, seed=8) * 3
    angle = torch.cat([half, half], dim=-1)  # rotary dim 8 of head dim 16 (partial rotary), HF's layout
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    want_q, want_k = hf.apply_rotary_pos_emb(attn.q_norm(q).transpose(1, 2), attn.k_norm(k).transpose(1, 2), cos, sin)
    got_q, got_k = qk_norm_rope(q, k, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, cos, sin)
    _exact(got_q, want_q.transpose(1, 2))
    _exact(got_k, want_k.transpose(1, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_gate_and_silu_mul_equal_hf(hybrid_dir, dtype):
    layers = _layers(hybrid_dir, dtype)
    # The gate as HF splits it off q_proj's output: per head [q | gate], gate reshaped to [B, T, H * D].
    qg = _randn(2, 3, 4, 32, dtype=dtype, seed=9)
    out = _randn(2, 3, 64, dtype=dtype, seed=10)
    gate = qg.chunk(2, dim=-1)[1]
    _exact(sigmoid_gate(out, gate), out * torch.sigmoid(gate.reshape(2, 3, 64)))
    mlp = layers[0].mlp
    x = _randn(2, 3, 64, dtype=dtype, seed=11)
    gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
    _exact(mlp.down_proj(silu_mul(gate_up)), mlp(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_gates_and_output_equal_the_hf_layer(hybrid_dir, dtype, monkeypatch):
    """beta, g and the output (gated norm + out_proj) of HF's own GDN forward, caught at its delta rule."""
    gdn = _layers(hybrid_dir, dtype)[0].linear_attn
    seen = {}
    delta_rule = hf.torch_chunk_gated_delta_rule

    def spy(query, key, value, g, beta, **kw):
        core, state = delta_rule(query, key, value, g=g, beta=beta, **kw)
        seen.update(g=g, beta=beta, core=core)
        return core, state

    monkeypatch.setattr(hf, "torch_chunk_gated_delta_rule", spy)
    x = _randn(2, 5, 64, dtype=dtype, seed=12)
    with torch.no_grad():
        want = gdn(x)
    beta, g = gdn_gates(gdn.in_proj_b(x), gdn.in_proj_a(x), gdn.A_log, gdn.dt_bias)
    _exact(beta, seen["beta"].float())  # HF keeps beta in the model dtype; we hand the kernel its fp32 value
    _exact(g, seen["g"])
    z = gdn.in_proj_z(x)
    _exact(gdn.out_proj(gated_rms_norm(seen["core"].float(), z, gdn.norm.weight, gdn.norm.variance_epsilon)), want)


def test_fusable_hybrid_accepts_qwen3_5_only(hybrid_dir, tmp_path):
    hybrid = load_target(str(hybrid_dir), "cpu", torch.float32)
    assert fusable_hybrid(hybrid.layers, hybrid.norm) and not fusable(hybrid.layers)
    dense = load_target(str(make_tiny_qwen3(tmp_path / "d", seed=1)), "cpu", torch.float32)
    assert not fusable_hybrid(dense.layers, dense.norm)
    assert not fusable_hybrid(hybrid.layers, dense.norm)  # a final norm of another kind


def _models(model_dir, quantize: str = "none") -> list[TargetModel]:
    return [TargetModel(load_target(str(model_dir), "cpu", torch.float32, quantize=quantize), 2, 64, 8, fused=f)
            for f in (False, True)]


def test_fused_hybrid_forward_equals_the_module_forward(hybrid_dir):
    """float32 on the CPU, prefill chains then trees: the fused projections and the glue equal the module forward
    within float32 rounding. (Bit for bit where the BLAS splits a fused GEMM's sums as it splits the separate
    ones: on one 2-core Xeon it did, on a 2-core EPYC logits moved by 1e-5; each fused part alone is exact above.)"""
    models = _models(hybrid_dir)
    assert models[0].hybrid is None and models[1].hybrid is not None
    assert isinstance(models[1].hybrid[0].gdn, FusedGdn) and models[1].hybrid[3].qkv is not None
    ids = torch.randint(4, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    parents = (torch.arange(9) - 1).expand(2, 9).contiguous()
    valid = torch.tensor([[True] * 9, [True] * 6 + [False] * 3])
    slots = torch.tensor([0, 1])
    outs = [m.forward_block(ids, parents, valid, torch.zeros(2, dtype=torch.long), slots, feature_layers=(0, 3),
                            chain=True) for m in models]
    _close(outs[1][0], outs[0][0])
    _close(outs[1][1], outs[0][1])
    tree_ids = torch.randint(4, 300, (2, 5), generator=torch.Generator().manual_seed(1))
    tree = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, -1, -1]])
    tree_valid = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    ctx = torch.tensor([9, 6])
    for tree_gdn in ("depthwise", "wy"):
        for m in models:
            m.tree_gdn = tree_gdn
        outs = [m.forward_block(tree_ids, tree, tree_valid, ctx, slots, key_len=14) for m in models]
        _close(outs[1][0], outs[0][0])
        for m in models:
            m.commit_block(torch.tensor([[0, 1, 3], [0, 1, -1]]), torch.tensor([3, 2]), slots, ctx)
        ctx = ctx + torch.tensor([3, 2])
    for mine, ref in zip(models[1].cache.linear, models[0].cache.linear):
        _close(mine.conv, ref.conv)
        _close(mine.rec, ref.rec)
    _close(models[1].cache.k, models[0].cache.k)
    _close(models[1].cache.v, models[0].cache.v)


def test_fused_gdn_layer_equals_the_hf_module_in_bf16(hybrid_dir):
    """A bf16 GDN layer through FusedGdn equals it through the HF module: same roundings (prefill chains)."""
    model = TargetModel(load_target(str(hybrid_dir), "cpu", torch.bfloat16), 2, 64, 8, fused=True)
    gdn, fused = model.target.layers[0].linear_attn, model.hybrid[0].gdn
    dims = LinearAttnStateShape.from_module(gdn)
    x = _randn(2, 7, 64, dtype=torch.bfloat16, seed=13)
    conv0, rec0 = _randn(*dims.conv_shape(2), dtype=torch.bfloat16, seed=14), _randn(*dims.rec_shape(2), seed=15) * 0.1
    lengths = torch.tensor([7, 4])
    want = gdn_chain_forward(gdn, x, lengths, conv0, rec0)
    got = gdn_chain_forward(fused, x, lengths, conv0, rec0)
    # The one GEMM over the four fused projections may round differently from four GEMMs: bf16 rounding.
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[2], want[2], atol=1e-3, rtol=1e-3)


def test_fused_hybrid_runs_on_fused_int8_weights_that_the_modules_view(hybrid_dir):
    plain, fused = _models(hybrid_dir, "int8")
    w, gdn = fused.hybrid[0], fused.target.layers[0].linear_attn
    assert isinstance(w.gdn.glue.in_proj, QuantizedWeight) and isinstance(w.gate_up, QuantizedWeight)
    assert gdn.in_proj_qkv.qweight.data_ptr() == w.gdn.glue.in_proj.qweight.data_ptr()  # a view: no second copy
    assert fused.target.layers[3].self_attn.k_proj.scales.data_ptr() == \
        fused.hybrid[3].qkv.scales[fused.target.layers[3].self_attn.q_proj.out_features:].data_ptr()
    ids = torch.randint(4, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    args = (ids, torch.arange(12)[None] - 1, torch.ones(1, 12, dtype=torch.bool), torch.tensor([0]), torch.tensor([0]))
    torch.testing.assert_close(fused.forward_block(*args, chain=True)[0], plain.forward_block(*args, chain=True)[0],
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tree_gdn", ["depthwise", "wy"])
def test_fused_hybrid_greedy_equals_hf_generate(hybrid_dir, tree_gdn):
    """Prefill, decode steps and small trees through the fused hybrid path: transformers' greedy tokens."""
    runner = TargetRunner(TargetConfig(model_dir=str(hybrid_dir), max_batch=2, max_seq_len=256, max_tree_nodes=8))
    runner.model = TargetModel(runner.target, runner.memory.max_batch, runner.max_seq_len, 8, fused=True,
                               tree_gdn=tree_gdn)
    assert runner.model.hybrid is not None
    config = transformers.AutoConfig.from_pretrained(hybrid_dir)
    ref = getattr(transformers, config.architectures[0]).from_pretrained(hybrid_dir, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None  # fixed lengths
    prompt = torch.randint(4, 320, (17,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        truth = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 17, dtype=torch.long),
                             do_sample=False, max_new_tokens=40, min_new_tokens=0, pad_token_id=0)[0, 17:].tolist()
    tokens = [runner.prefill([PrefillItem("s", prompt, SamplingParams())])[0].next_token]
    rng = random.Random(5)
    while len(tokens) < 32:
        if rng.random() < 0.5:  # a decode step
            item = VerifyItem("s", torch.tensor([tokens[-1]]), torch.tensor([-1]))
        else:  # a small tree: the true next two tokens on one branch, a random token beside them
            n = len(tokens)
            item = VerifyItem("s", torch.tensor([tokens[-1], truth[n], rng.randrange(4, 300), truth[n + 1]]),
                              torch.tensor([-1, 0, 0, 1]))
        out = runner.verify([item])[0]
        tokens += out.accepted_tokens + [out.next_token]
    assert tokens[:32] == truth[:32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_gdn_decode_step_equals_the_hf_module_step(hybrid_dir, dtype):
    """gdn_step_forward_lean through FusedGdn (fused projection, step_inputs glue) against the HF module, a padded
    row included: the same bits in float32, bf16 rounding in bf16."""
    model = TargetModel(load_target(str(hybrid_dir), "cpu", dtype), 3, 64, 8, fused=True)
    gdn, fused = model.target.layers[1].linear_attn, model.hybrid[1].gdn
    dims = LinearAttnStateShape.from_module(gdn)
    x = _randn(3, 1, 64, dtype=dtype, seed=16)
    valid = torch.tensor([[True], [False], [True]])
    conv0, rec0 = _randn(*dims.conv_shape(3), dtype=dtype, seed=17), _randn(*dims.rec_shape(3), seed=18) * 0.1
    want_out, want = gdn_step_forward_lean(gdn, x, valid, conv0, rec0)
    got_out, got = gdn_step_forward_lean(fused, x, valid, conv0, rec0)
    check = _exact if dtype == torch.float32 else (lambda a, b: torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2))
    check(got_out, want_out)
    assert not got_out[1].any()  # the padded row
    for name in ("node_conv", "key", "value", "g", "beta"):
        check(getattr(got, name), getattr(want, name))
