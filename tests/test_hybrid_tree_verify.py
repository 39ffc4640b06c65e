"""Acceptance criterion: tree verification on a hybrid (Gated DeltaNet + attention) model equals step-by-step decoding.

Every node's logits and hidden states from one batched tree forward must equal what transformers computes when
it decodes that node's root-to-node path token by token with its own cache (recurrent GDN steps); after
committing an accepted path (KV compaction + GDN state of the last accepted node), the next step must too.
"""
from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from transformers import DynamicCache

from target_svc.loader import load_target
from target_svc.model import TargetModel
from tests.fixtures import make_tiny_qwen3_5

ATOL = 1e-4
ALL_LAYERS = (0, 1, 2, 3)
# Two trees of different sizes, deeper than the conv kernel (4), so conv windows cross into the committed state.
TREE_A = [-1, 0, 0, 1, 2, 2, 3, 4, 6, 8, 5, 9]  # depths 0 1 1 2 2 2 3 3 4 5 3 6
PATH_A = [0, 1, 3, 6, 8, 9, 11]
TREE_B = [-1, 0, 1, 1, 0, 4, 2]
PATH_B = [0, 4, 5]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(our model with two live sequences, HF reference, prompts) for a tiny Qwen3.5 in the flagship layout."""
    path = make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5"), seed=31, multimodal_wrapper=True)
    ref = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model = TargetModel(load_target(path), max_batch=3, max_seq_len=96, max_tree_nodes=16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 320, (n,), generator=g) for n in (30, 9)]
    model.cache.add_sequence("unused")  # the batch lives on slots 1 and 2
    slots = torch.tensor([model.cache.add_sequence(f"s{b}") for b in range(2)])
    tmax = max(len(p) for p in prompts)
    ids = torch.zeros(2, tmax, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    valid = torch.arange(tmax)[None, :] < torch.tensor([len(p) for p in prompts])[:, None]
    parents = (torch.arange(tmax) - 1).expand(2, tmax).contiguous()
    model.forward_block(ids, parents, valid, torch.zeros(2, dtype=torch.long), slots, chain=True)
    return model, ref, prompts, slots


def _hf_step_by_step(ref, prompt: torch.Tensor, steps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers decoding `steps` one token at a time after the prompt: (logits [V], features [4H]) of the last."""
    # The cache kwarg is `past_key_values` in transformers 5.17 and `cache` in newer releases.
    name = "cache" if "cache" in inspect.signature(ref.forward).parameters else "past_key_values"
    cache = {name: DynamicCache(config=ref.config)}
    with torch.no_grad():
        out = ref(prompt[None], use_cache=True, **cache)
        for tok in steps:
            out = ref(torch.tensor([[tok]]), use_cache=True, output_hidden_states=True, **cache)
    features = torch.cat([out.hidden_states[i + 1][0, -1] for i in ALL_LAYERS])
    return out.logits[0, -1], features


def _root_path(parents: list[int], tokens: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.insert(0, tokens[node])
        node = parents[node]
    return path


def _batch(trees: list[list[int]], tokens: list[list[int]]):
    tmax = max(len(t) for t in trees)
    ids = torch.zeros(len(trees), tmax, dtype=torch.long)
    parents = torch.full((len(trees), tmax), -1, dtype=torch.long)
    for b, (par, tok) in enumerate(zip(trees, tokens)):
        ids[b, : len(tok)] = torch.tensor(tok)
        parents[b, : len(par)] = torch.tensor(par)
    valid = torch.arange(tmax)[None, :] < torch.tensor([len(t) for t in trees])[:, None]
    return ids, parents, valid


def _distinct_tokens(n: int, seed: int) -> list[int]:
    return (torch.randperm(300, generator=torch.Generator().manual_seed(seed))[:n] + 4).tolist()


def test_every_tree_node_equals_step_by_step_decoding_then_commit_continues_it(hybrid):
    model, ref, prompts, slots = hybrid
    trees = [TREE_A, TREE_B]
    tokens = [_distinct_tokens(len(TREE_A), 1), _distinct_tokens(len(TREE_B), 2)]
    ctx = torch.tensor([len(p) for p in prompts])
    ids, parents, valid = _batch(trees, tokens)
    logits, features = model.forward_block(ids, parents, valid, ctx, slots, feature_layers=ALL_LAYERS)

    for b in range(2):
        for node in range(len(trees[b])):
            want_logits, want_features = _hf_step_by_step(ref, prompts[b], _root_path(trees[b], tokens[b], node))
            torch.testing.assert_close(logits[b, node], want_logits, atol=ATOL, rtol=0, msg=f"seq {b} node {node}")
            torch.testing.assert_close(features[b, node], want_features, atol=ATOL, rtol=0, msg=f"seq {b} node {node}")

    # Commit two accepted paths of different lengths (with gaps in node order), then verify a next tree.
    paths = [PATH_A, PATH_B]
    path = torch.full((2, len(PATH_A)), -1, dtype=torch.long)
    for b, p in enumerate(paths):
        path[b, : len(p)] = torch.tensor(p)
    model.commit_block(path, torch.tensor([len(p) for p in paths]), slots, ctx)
    committed = [[tokens[b][i] for i in p] for b, p in enumerate(paths)]

    next_tree = [-1, 0, 0, 1]
    next_tokens = [[7, 50, 51, 60], [8, 52, 53, 61]]
    ids, parents, valid = _batch([next_tree, next_tree], next_tokens)
    new_ctx = ctx + torch.tensor([len(p) for p in paths])
    logits, features = model.forward_block(ids, parents, valid, new_ctx, slots, feature_layers=ALL_LAYERS)
    for b in range(2):
        for node in range(len(next_tree)):
            steps = committed[b] + _root_path(next_tree, next_tokens[b], node)
            want_logits, want_features = _hf_step_by_step(ref, prompts[b], steps)
            torch.testing.assert_close(logits[b, node], want_logits, atol=ATOL, rtol=0, msg=f"seq {b} node {node}")
            torch.testing.assert_close(features[b, node], want_features, atol=ATOL, rtol=0, msg=f"seq {b} node {node}")


def test_a_one_node_commit_writes_the_forwards_states_and_a_row_that_accepted_nothing_keeps_its_own(tmp_path):
    """commit_block of a decode step's traces (the states its forward computed, as fla's kernel path leaves them):
    the states of rows with an accepted root are the forward's; a row with path_len 0 keeps its slot's states
    (its new ones land in the scratch slot), as gdn_commit_path decides."""
    from target_svc.gated_deltanet import gdn_commit_path, gdn_step_forward_lean

    model = TargetModel(load_target(make_tiny_qwen3_5(tmp_path / "q35", seed=5, multimodal_wrapper=False)),
                        max_batch=3, max_seq_len=32, max_tree_nodes=4)
    gen = torch.Generator().manual_seed(2)
    slots = torch.tensor([2, 0])
    for state in model.cache.linear:
        state.conv.copy_(torch.randn(state.conv.shape, generator=gen))
        state.rec.copy_(torch.randn(state.rec.shape, generator=gen) * 0.3)
    before = [(s.conv.clone(), s.rec.clone()) for s in model.cache.linear]
    traces, want = [], []
    path, path_len = torch.zeros(2, 1, dtype=torch.long), torch.tensor([1, 0])
    for i, state in zip(model.linear_index, model.cache.linear):
        gdn = model.target.layers[i].linear_attn
        x = torch.randn(2, 1, model.target.hidden_size, generator=gen)
        _, trace = gdn_step_forward_lean(gdn, x, torch.ones(2, 1, dtype=torch.bool), state.conv[slots],
                                         state.rec[slots])
        traces.append(trace)
        want.append(gdn_commit_path(trace, path, path_len, state.conv[slots], state.rec[slots]))
    model.commit_block(path, path_len, slots, torch.tensor([5, 3]), traces)
    for state, (conv, rec), (conv0, rec0) in zip(model.cache.linear, want, before):
        assert torch.equal(state.conv[slots], conv) and torch.equal(state.rec[slots], rec)
        assert torch.equal(state.rec[1], rec0[1]) and torch.equal(state.conv[1], conv0[1])   # a slot not in the block
    assert not torch.equal(want[0][1][0], before[0][1][2])   # the accepted row's state did change
