"""DFlash draft model: config formats, weight I/O, forward semantics against an eager re-implementation."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from drafter_svc.dflash_config import DFlashConfig, build_target_layer_ids, rope_inv_freq
from drafter_svc.dflash_model import DFlashDraftModel, load_target_embeddings
from tests.fixtures import make_tiny_qwen3, make_tiny_qwen3_5
from tests.fixtures.tiny_drafter import make_tiny_drafter

TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16)

# Shaped like z-lab/Qwen3-8B-DFlash-b16 (transformers-4 dump: block_size top level, rope_theta/rope_scaling).
QWEN3_8B_STYLE = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 300, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_hidden_layers": 5,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 320,
    **TINY,
}

# Shaped like z-lab/Qwen3.6-27B-DFlash (transformers-5 dump: block_size in dflash_config, rope_parameters, SWA).
QWEN36_STYLE = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "dflash_config": {"block_size": 16, "mask_token_id": 310, "target_layer_ids": [1, 16, 31, 46, 61]},
    "dtype": "bfloat16",
    "hidden_act": "silu",
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
    "max_position_embeddings": 256,
    "model_type": "qwen3",
    "num_hidden_layers": 5,
    "num_target_layers": 64,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "sliding_window": 8,
    "transformers_version": "5.5.0",
    "use_sliding_window": True,
    "vocab_size": 320,
    **TINY,
}


def _write_checkpoint(d: Path, cfg_dict: dict, seed: int = 0, dtype=torch.bfloat16) -> Path:
    """A checkpoint written the way z-lab publishes it: config.json + model.safetensors with published names."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg_dict))
    g = torch.Generator().manual_seed(seed)
    model = DFlashDraftModel(DFlashConfig.from_dict(cfg_dict))
    state = {k: (torch.randn(v.shape, generator=g) * 0.05 + (1.0 if k.endswith("norm.weight") else 0.0)).to(dtype)
             for k, v in model.state_dict().items()}
    save_file(state, str(d / "model.safetensors"))
    return d


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


# --------------------------------------------------------------------------------------------------------------
# Config and I/O
# --------------------------------------------------------------------------------------------------------------


def test_build_target_layer_ids_matches_published_checkpoints():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B-DFlash-b16
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # Qwen3.6-27B-DFlash
    assert build_target_layer_ids(24, 1) == [12]


def test_qwen3_8b_style_config_loads_and_round_trips(tmp_path):
    src = _write_checkpoint(tmp_path / "src", QWEN3_8B_STYLE)
    m = DFlashDraftModel.from_pretrained(src, "cpu", torch.float32)
    c = m.config
    assert (c.block_size, c.mask_token_id, c.target_layer_ids) == (16, 300, [1, 9, 17, 25, 33])
    assert c.rope_theta == 1e6 and c.rope_scaling is None and c.num_target_layers == 36
    assert c.layer_types == ["full_attention"] * 5 and c.causal is None
    assert m.fc.weight.shape == (64, 5 * 64)
    m.save_pretrained(tmp_path / "dst")
    out = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert set(out) >= set(QWEN3_8B_STYLE)
    for key in ("auto_map", "transformers_version", "max_window_layers", "bos_token_id", "block_size"):
        assert out[key] == QWEN3_8B_STYLE[key]
    assert out["dflash_config"] == QWEN3_8B_STYLE["dflash_config"]
    assert out["dtype"] == "float32" and "rope_parameters" not in out
    src_w, dst_w = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "dst" / "model.safetensors"))
    assert set(src_w) == set(dst_w)
    assert all(torch.equal(src_w[k].float(), dst_w[k]) for k in src_w)


def test_qwen36_style_config_loads_with_sliding_layers(tmp_path):
    src = _write_checkpoint(tmp_path / "src", QWEN36_STYLE)
    m = DFlashDraftModel.from_pretrained(src, "cpu", torch.float32)
    c = m.config
    assert c.block_size == 16 and c.mask_token_id == 310 and c.target_layer_ids == [1, 16, 31, 46, 61]
    assert [c.layer_window(i) for i in range(5)] == [8, 8, 8, 8, None]
    assert c.rope_theta == 1e7 and c.rope_scaling["rope_type"] == "yarn"
    h = m(torch.randn(1, 16, 64), torch.randn(1, 20, 5 * 64), torch.arange(36))
    assert h.shape == (1, 16, 64) and torch.isfinite(h).all()
    m.save_pretrained(tmp_path / "dst")
    out = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert "block_size" not in out and out["dflash_config"]["block_size"] == 16
    assert out["rope_parameters"] == QWEN36_STYLE["rope_parameters"]
    assert out["layer_types"] == QWEN36_STYLE["layer_types"] and out["sliding_window"] == 8
    assert DFlashConfig.from_dict(out).to_dict() == out


def test_save_load_round_trip_is_exact(tmp_path, target_dir):
    src = make_tiny_drafter(tmp_path / "a", target_dir, seed=3, layer_types=["sliding_attention", "full_attention"])
    m = DFlashDraftModel.from_pretrained(src)
    m.save_pretrained(tmp_path / "b")
    assert json.loads((src / "config.json").read_text()) == json.loads((tmp_path / "b" / "config.json").read_text())
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    m2 = DFlashDraftModel.from_pretrained(tmp_path / "b")
    assert all(torch.equal(x, y) for x, y in zip(m.state_dict().values(), m2.state_dict().values()))


def test_sharded_checkpoint_and_strict_weights(tmp_path):
    src = _write_checkpoint(tmp_path / "src", QWEN3_8B_STYLE, dtype=torch.float32)
    state = load_file(str(src / "model.safetensors"))
    names = sorted(state)
    shard = tmp_path / "sharded"
    shard.mkdir()
    (shard / "config.json").write_text((src / "config.json").read_text())
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(shard / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in halves.items() for k in ks}}
    (shard / "model.safetensors.index.json").write_text(json.dumps(index))
    m = DFlashDraftModel.from_pretrained(shard)
    assert all(torch.equal(m.state_dict()[k], state[k]) for k in names)

    def reload(mutate) -> None:
        d = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "config.json").write_text((src / "config.json").read_text())
        s = dict(state)
        mutate(s)
        save_file(s, str(d / "model.safetensors"))
        DFlashDraftModel.from_pretrained(d)

    with pytest.raises(ValueError, match="lacks weights"):
        reload(lambda s: s.pop("layers.2.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match="does not know"):
        reload(lambda s: s.update({"layers.0.self_attn.sinks": torch.zeros(4)}))
    reload(lambda s: s.update({"lm_head.weight": torch.zeros(320, 64)}))  # a bundled head copy is ignored


def test_rope_scaling_matches_transformers():
    from transformers import LlamaConfig, Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for rope_type, params, hf_cls in (
        ("yarn", {"factor": 4.0, "original_max_position_embeddings": 64}, Qwen3Config),
        ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64}, LlamaConfig),
    ):
        cfg = DFlashConfig.from_dict({**QWEN3_8B_STYLE, "max_position_embeddings": 256,
                                      "rope_scaling": {"rope_type": rope_type, **params}, "rope_theta": 10000.0})
        hf = hf_cls(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256,
                    rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, **params})
        ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
        inv, scale = rope_inv_freq(cfg)
        torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
        assert math.isclose(scale, float(ref_scale), rel_tol=1e-9)


def test_low_precision_cast_keeps_float32_rope():
    m = DFlashDraftModel(DFlashConfig.from_dict(QWEN3_8B_STYLE)).to(torch.bfloat16)
    assert m.rotary.inv_freq.dtype == torch.float32 and m.fc.weight.dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------------------------
# Forward semantics
# --------------------------------------------------------------------------------------------------------------


def _eager_reference(m: DFlashDraftModel, noise, feats, pos, window=None, causal=False) -> torch.Tensor:
    """The reference computation spelled out: q from the block, k/v from [fc-fused context | block], eager softmax."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    c = m.config
    hf = Qwen3Config(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads, head_dim=c.head_dim,
                     rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta})
    cos, sin = Qwen3RotaryEmbedding(hf)(noise, pos[None])

    def rms(x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)).to(x.dtype)

    lc, lq, nh, nkv, hd = feats.shape[0], noise.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
    ctx = rms(feats @ m.fc.weight.T, m.hidden_norm.weight)
    q_pos, k_pos = pos[lc:], pos
    h = noise
    for layer in m.layers:
        a = layer.self_attn
        x = rms(h, layer.input_layernorm.weight)
        q = rms((x @ a.q_proj.weight.T).view(lq, nh, hd), a.q_norm.weight).transpose(0, 1)[None]
        kv_in = torch.cat([ctx, x])
        k = rms((kv_in @ a.k_proj.weight.T).view(lc + lq, nkv, hd), a.k_norm.weight).transpose(0, 1)[None]
        v = (kv_in @ a.v_proj.weight.T).view(lc + lq, nkv, hd).transpose(0, 1)[None]
        q, k = apply_rotary_pos_emb(q, q, cos[:, lc:], sin[:, lc:])[0], apply_rotary_pos_emb(k, k, cos, sin)[0]
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        d = q_pos[:, None] - k_pos[None, :]
        keep = torch.ones_like(d, dtype=torch.bool)
        if window is not None and layer is not m.layers[-1]:
            keep &= d.abs() < window
        if causal:
            keep &= d >= 0
        scores = scores.masked_fill(~keep, float("-inf"))
        o = (scores.float().softmax(-1) @ v).transpose(1, 2).reshape(lq, nh * hd)
        h = h + o @ a.o_proj.weight.T
        y = rms(h, layer.post_attention_layernorm.weight)
        mlp = layer.mlp
        act = torch.nn.functional.silu(y @ mlp.gate_proj.weight.T) * (y @ mlp.up_proj.weight.T)
        h = h + act @ mlp.down_proj.weight.T
    return rms(h, m.norm.weight)


def test_forward_matches_eager_reference(target_dir, tmp_path):
    m = DFlashDraftModel.from_pretrained(make_tiny_drafter(tmp_path / "d", target_dir, seed=1))
    g = torch.Generator().manual_seed(0)
    feats, noise = torch.randn(11, m.config.feature_dim, generator=g), torch.randn(16, 64, generator=g)
    pos = torch.arange(27)
    out = m(noise[None], feats[None], pos)[0]
    torch.testing.assert_close(out, _eager_reference(m, noise, feats, pos), rtol=1e-5, atol=1e-5)
    # Positions are used as given (RoPE is relative, so shift context and block together: output unchanged).
    torch.testing.assert_close(m(noise[None], feats[None], pos + 100)[0], out, rtol=1e-4, atol=1e-4)


def test_sliding_and_causal_layers_match_reference(target_dir, tmp_path):
    d = make_tiny_drafter(tmp_path / "d", target_dir, seed=2, num_layers=3,
                          layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=5)
    m = DFlashDraftModel.from_pretrained(d)
    g = torch.Generator().manual_seed(1)
    feats, noise = torch.randn(12, m.config.feature_dim, generator=g), torch.randn(16, 64, generator=g)
    pos = torch.arange(28)
    out = m(noise[None], feats[None], pos)[0]
    torch.testing.assert_close(out, _eager_reference(m, noise, feats, pos, window=5), rtol=1e-5, atol=1e-5)
    # An explicit causal flag in the checkpoint makes every layer causal inside the block.
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["causal"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    mc = DFlashDraftModel.from_pretrained(d)
    assert all(mc.config.layer_is_causal(i) for i in range(3))
    out_c = mc(noise[None], feats[None], pos)[0]
    ref_c = _eager_reference(mc, noise, feats, pos, window=5, causal=True)
    torch.testing.assert_close(out_c, ref_c, rtol=1e-5, atol=1e-5)
    bumped = noise.clone()
    bumped[9] += 1.0
    out_b = mc(bumped[None], feats[None], pos)[0]
    assert torch.equal(out_b[:9], out_c[:9]) and not torch.allclose(out_b[9:], out_c[9:])
    out_nb = m(bumped[None], feats[None], pos)[0]
    assert not torch.allclose(out_nb[:9], out[:9])  # bidirectional by default: earlier slots see slot 9


def test_attention_mask_and_past_compose(target_dir, tmp_path):
    """A 4D mask restricting context visibility equals running on the visible prefix; past K/V equal raw features."""
    m = DFlashDraftModel.from_pretrained(make_tiny_drafter(tmp_path / "d", target_dir, seed=4))
    g = torch.Generator().manual_seed(2)
    feats, noise = torch.randn(1, 10, m.config.feature_dim, generator=g), torch.randn(1, 16, 64, generator=g)
    mask = torch.ones(1, 1, 16, 26, dtype=torch.bool)
    mask[..., 6:10] = False  # the block sees context rows 0..5 only
    masked = m(noise, feats, torch.arange(26), attention_mask=mask)
    prefix = m(noise, feats[:, :6], torch.cat([torch.arange(6), torch.arange(10, 26)]))
    torch.testing.assert_close(masked, prefix, rtol=1e-5, atol=1e-5)
    past = m.project_context(feats[:, :4], torch.arange(4)[None])
    split = m(noise, feats[:, 4:], torch.arange(4, 26), past=past)
    torch.testing.assert_close(split, m(noise, feats, torch.arange(26)), rtol=1e-5, atol=1e-5)


def test_training_layout_many_blocks_equals_one_block_each(target_dir, tmp_path):
    """Training shape: blocks of several anchors in one query set, whole sequence as context, a 4D mask."""
    d = make_tiny_drafter(tmp_path / "d", target_dir, seed=5, layer_types=["sliding_attention", "full_attention"],
                          sliding_window=6)
    m = DFlashDraftModel.from_pretrained(d)
    g = torch.Generator().manual_seed(3)
    seq, bs, anchors = 24, 16, [4, 9, 17]
    feats = torch.randn(1, seq, m.config.feature_dim, generator=g)
    noise = torch.randn(1, len(anchors) * bs, 64, generator=g)
    pos = torch.cat([torch.arange(seq)] + [torch.arange(a, a + bs) for a in anchors])
    mask = torch.zeros(1, 1, len(anchors) * bs, seq + len(anchors) * bs, dtype=torch.bool)
    for b, a in enumerate(anchors):
        rows = slice(b * bs, (b + 1) * bs)
        mask[0, 0, rows, :a] = True  # context strictly before the anchor
        mask[0, 0, rows, seq + b * bs : seq + (b + 1) * bs] = True  # its own block only
    out = m(noise, feats, pos, attention_mask=mask)
    for b, a in enumerate(anchors):
        one = m(noise[:, b * bs : (b + 1) * bs], feats[:, :a], torch.cat([torch.arange(a), torch.arange(a, a + bs)]))
        torch.testing.assert_close(out[:, b * bs : (b + 1) * bs], one, rtol=1e-5, atol=1e-5)


def test_logit_transforms_and_embedding_scale():
    cfg = DFlashConfig.from_dict({**QWEN3_8B_STYLE, "dflash_config": {
        **QWEN3_8B_STYLE["dflash_config"], "output_multiplier": 0.5, "final_logit_softcapping": 2.0,
        "input_embedding_scale": 3.0}})
    m = DFlashDraftModel(cfg)
    w, h = torch.randn(320, 64), torch.randn(2, 5, 64)
    torch.testing.assert_close(m.compute_logits(h, w), torch.tanh(h @ w.T * 0.5 / 2.0) * 2.0)
    torch.testing.assert_close(m.embed(torch.tensor([[1, 2]]), w), w[[1, 2]][None] * 3.0)
    plain = DFlashDraftModel(DFlashConfig.from_dict(QWEN3_8B_STYLE))
    head = torch.nn.Linear(64, 320, bias=False)
    torch.testing.assert_close(plain.compute_logits(h, head), plain.compute_logits(h, head.weight))


# --------------------------------------------------------------------------------------------------------------
# Target embeddings
# --------------------------------------------------------------------------------------------------------------


def _tensor(d: Path, name: str) -> torch.Tensor:
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name)


def test_load_target_embeddings_layouts(target_dir, tmp_path):
    embed, head = load_target_embeddings(target_dir, "cpu", torch.float32)
    assert torch.equal(embed, _tensor(target_dir, "model.embed_tokens.weight"))
    assert torch.equal(head, _tensor(target_dir, "lm_head.weight")) and not torch.equal(embed, head)

    mm = make_tiny_qwen3_5(tmp_path / "mm")  # Qwen3.5/3.6 multimodal layout
    embed, head = load_target_embeddings(mm, "cpu", torch.bfloat16)
    assert embed.dtype == torch.bfloat16
    assert torch.equal(embed, _tensor(mm, "model.language_model.embed_tokens.weight").to(torch.bfloat16))
    assert torch.equal(head, _tensor(mm, "lm_head.weight").to(torch.bfloat16))

    tied = tmp_path / "tied"
    tied.mkdir()
    cfg = json.loads((target_dir / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    w = torch.randn(320, 64)
    save_file({"model.embed_tokens.weight": w, "model.norm.weight": torch.ones(64)}, str(tied / "model.safetensors"))
    embed, head = load_target_embeddings(tied)
    assert torch.equal(embed, w) and head is embed

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((target_dir / "config.json").read_text())
    full = load_file(str(target_dir / "model.safetensors"))
    parts = {"model-00001-of-00002.safetensors": ["model.embed_tokens.weight", "model.norm.weight"],
             "model-00002-of-00002.safetensors": ["lm_head.weight"]}
    for fname, keys in parts.items():
        save_file({k: full[k] for k in keys}, str(sharded / fname))
    index = {"weight_map": {k: f for f, ks in parts.items() for k in ks}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    embed, head = load_target_embeddings(sharded)
    assert torch.equal(embed, full["model.embed_tokens.weight"]) and torch.equal(head, full["lm_head.weight"])


def test_compile_glue_routes_every_norm_rope_and_swiglu_through_one_compiled_wrapper_each():
    """What the drafter runner does on CUDA (the compiled kernels themselves run in the GPU tests): every RMSNorm,
    attention and MLP of the model calls the shared compiled function, and the plain ones stay the default."""
    from ddtree_serve.plumbing.compiled import CompiledOrPlain
    from drafter_svc.dflash_model import (DFlashAttention, DFlashMLP, RMSNorm, add_rms_norm, norm_rope, rms_norm,
                                          rope_tables, silu_mul)

    cfg = DFlashConfig.from_dict({**QWEN3_8B_STYLE, **TINY, "vocab_size": 320, "num_hidden_layers": 2,
                                  "layer_types": ["full_attention"] * 2})
    model = DFlashDraftModel(cfg)
    assert {m.fn for m in model.modules() if isinstance(m, RMSNorm)} == {rms_norm}
    model.compile_glue()
    norms = {m.fn for m in model.modules() if isinstance(m, RMSNorm)}
    ropes = {m.norm_rope for m in model.modules() if isinstance(m, DFlashAttention)}
    swiglus = {m.silu_mul for m in model.modules() if isinstance(m, DFlashMLP)}
    assert [len(norms), len(ropes), len(swiglus)] == [1, 1, 1]
    (norm,), (rope,), (swiglu,) = norms, ropes, swiglus
    assert all(isinstance(f, CompiledOrPlain) for f in (norm, rope, swiglu, model.rotary.fn, model.add_rms_norm))
    assert (norm.plain, rope.plain, swiglu.plain) == (rms_norm, norm_rope, silu_mul)
    assert (model.rotary.fn.plain, model.add_rms_norm.plain) == (rope_tables, add_rms_norm)


@torch.no_grad()
def test_fused_projections_keep_the_forward_the_weights_and_the_context_projection(target_dir, tmp_path):
    """fuse_projections (the runner's CUDA set-up): one q/k/v and one gate/up GEMM per layer give the reference
    forward and the same context K/V; the state dict is unchanged and each projection is a view of its fused rows."""
    m = DFlashDraftModel.from_pretrained(make_tiny_drafter(tmp_path / "d", target_dir, seed=1))
    g = torch.Generator().manual_seed(0)
    feats, noise = torch.randn(11, m.config.feature_dim, generator=g), torch.randn(16, 64, generator=g)
    pos = torch.arange(27)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    past = m.project_context(feats[None, :7], pos[None, :7])
    m.fuse_projections()
    torch.testing.assert_close(m(noise[None], feats[None], pos)[0], _eager_reference(m, noise, feats, pos),
                               rtol=1e-5, atol=1e-5)
    fused_past = m.project_context(feats[None, :7], pos[None, :7])
    for want, got in zip(past.keys + past.values, fused_past.keys + fused_past.values):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    after = m.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    attn, mlp = m.layers[0].self_attn, m.layers[0].mlp
    assert attn.k_proj.weight.data_ptr() == attn.qkv_weight[attn.q_proj.out_features:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up_weight[mlp.gate_proj.out_features:].data_ptr()
