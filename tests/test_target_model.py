"""target_svc.loader + model: our forward over the HF weights equals transformers' own forward."""
from __future__ import annotations

import pytest
import torch
import transformers

from target_svc.loader import load_target
from target_svc.model import TargetModel
from tests.fixtures import make_tiny_llama, make_tiny_qwen3, make_tiny_qwen3_5, make_tiny_tokenizer

MAKERS = {
    "qwen3": lambda d: make_tiny_qwen3(d, seed=11),
    "llama": lambda d: make_tiny_llama(d, seed=12),
    "qwen3_5": lambda d: make_tiny_qwen3_5(d, seed=13, multimodal_wrapper=True),
}
ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(MAKERS))
def checkpoint(request, tmp_path_factory):
    """(model_dir, HF reference model) per architecture, built once per module."""
    path = MAKERS[request.param](tmp_path_factory.mktemp(request.param))
    config = transformers.AutoConfig.from_pretrained(path)
    ref = getattr(transformers, config.architectures[0]).from_pretrained(path, dtype=torch.float32).eval()
    return path, ref


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(4, 320, (n,), generator=torch.Generator().manual_seed(seed))


def _prefill(model: TargetModel, prompts: list[torch.Tensor], feature_layers=()):
    """Chain forward of right-padded prompts from an empty context, each in a freshly taken slot."""
    slots = [model.cache.add_sequence(f"seq{b}") for b in range(len(prompts))]
    tmax = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), tmax, dtype=torch.long)
    valid = torch.zeros(len(prompts), tmax, dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
        valid[b, : len(p)] = True
    parents = (torch.arange(tmax) - 1).expand(len(prompts), tmax).contiguous()
    ctx = torch.zeros(len(prompts), dtype=torch.long)
    return model.forward_block(
        ids, parents, valid, ctx, torch.tensor(slots), feature_layers=feature_layers, chain=True
    )


def test_loader_serves_text_model_only(checkpoint):
    path, ref = checkpoint
    target = load_target(path)
    assert target.num_layers == 4 and target.hidden_size == 64 and target.vocab_size == 320
    assert target.eos_token_ids == (0,)
    n_text_params = sum(p.numel() for n, p in ref.named_parameters() if "visual" not in n)
    modules = (target.embed_tokens, target.layers, target.norm, target.lm_head)
    ours = sum(p.numel() for m in modules for p in m.parameters())
    assert ours == n_text_params  # nothing of a vision tower is kept
    if ref.config.model_type == "qwen3_5":
        assert target.layer_types == ("linear_attention",) * 3 + ("full_attention",)


def test_prefill_logits_and_features_equal_hf(checkpoint):
    path, ref = checkpoint
    model = TargetModel(load_target(path), max_batch=2, max_seq_len=128, max_tree_nodes=8)
    prompt = _prompt(90, seed=1)
    logits, features = _prefill(model, [prompt], feature_layers=(0, 3))
    with torch.no_grad():
        out = ref(prompt[None], output_hidden_states=True)
    torch.testing.assert_close(logits[0], out.logits[0], atol=ATOL, rtol=0)
    # HF convention: hidden_states[i + 1] is layer i's output; the last one is taken after the final norm.
    expected = torch.cat([out.hidden_states[1][0], out.hidden_states[4][0]], dim=-1)
    torch.testing.assert_close(features[0], expected, atol=ATOL, rtol=0)


def test_batched_prompts_of_different_lengths_equal_each_alone(checkpoint):
    path, _ = checkpoint
    target = load_target(path)
    prompts = [_prompt(n, seed=n) for n in (23, 70, 4)]
    batched = TargetModel(target, max_batch=4, max_seq_len=128, max_tree_nodes=8)
    batched.cache.add_sequence("occupies slot 0")  # so that the batch lands on slots 1..3, not 0..2
    logits, _ = _prefill(batched, prompts)
    for b, p in enumerate(prompts):
        alone = TargetModel(target, max_batch=1, max_seq_len=128, max_tree_nodes=8)
        single, _ = _prefill(alone, [p])
        torch.testing.assert_close(logits[b, : len(p)], single[0], atol=ATOL, rtol=0)


def test_tree_block_node_logits_equal_hf_on_root_to_node_path(checkpoint):
    path, ref = checkpoint
    model = TargetModel(load_target(path), max_batch=1, max_seq_len=128, max_tree_nodes=8)
    prompt = _prompt(30, seed=5)
    _prefill(model, [prompt])
    # root, two children, grandchildren under both: depths 0 1 1 2 2 3
    tokens = torch.tensor([[7, 40, 41, 90, 91, 120]])
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3]])
    valid = torch.ones_like(tokens, dtype=torch.bool)
    logits, _ = model.forward_block(tokens, parents, valid, torch.tensor([30]), torch.tensor([0]))
    for i in range(tokens.shape[1]):
        node_path, j = [], i
        while j >= 0:
            node_path.insert(0, int(tokens[0, j]))
            j = int(parents[0, j])
        with torch.no_grad():
            expected = ref(torch.cat([prompt, torch.tensor(node_path)])[None]).logits[0, -1]
        torch.testing.assert_close(logits[0, i], expected, atol=ATOL, rtol=0)


def test_forward_block_writes_logits_and_features_into_given_buffers(checkpoint):
    """What a captured graph relies on: the outputs land in the shared buffers, equal to freshly made ones."""
    path, _ = checkpoint
    loaded = load_target(path)
    prompt, layers = _prompt(12, seed=6), (0, loaded.num_layers - 1)
    fresh_logits, fresh_features = _prefill(TargetModel(loaded, max_batch=1, max_seq_len=64, max_tree_nodes=8),
                                            [prompt], feature_layers=layers)
    model = TargetModel(loaded, max_batch=1, max_seq_len=64, max_tree_nodes=8)
    logits_out = torch.full_like(fresh_logits, float("nan"))
    features_out = torch.full_like(fresh_features, float("nan"))
    slot = model.cache.add_sequence("seq0")
    logits, features = model.forward_block(
        prompt[None], (torch.arange(12) - 1)[None], torch.ones(1, 12, dtype=torch.bool), torch.zeros(1, dtype=torch.long),
        torch.tensor([slot]), feature_layers=layers, chain=True, logits_out=logits_out, features_out=features_out)
    assert logits.data_ptr() == logits_out.data_ptr() and features.data_ptr() == features_out.data_ptr()
    torch.testing.assert_close(logits_out, fresh_logits, atol=0, rtol=0)
    torch.testing.assert_close(features_out, fresh_features, atol=0, rtol=0)


def test_loader_ties_lm_head_when_the_checkpoint_omits_it(tmp_path):
    make_tiny_tokenizer(tmp_path)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)  # tied: no lm_head.weight in the file
    target = load_target(tmp_path)
    torch.testing.assert_close(target.lm_head.weight, target.embed_tokens.weight, atol=0, rtol=0)


def test_loader_rejects_unsupported_architectures(tmp_path):
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported target model_type 'gpt2'"):
        load_target(tmp_path)
