"""The tree-layout kernel (target_svc/tree_layout.py) gives the very integers of the PyTorch tree structure and conv
windows: under Triton's interpreter where the triton package is installed (on the GPU: tests/test_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from target_svc import tree_layout
from target_svc.model import TargetModel
from target_svc.loader import load_target
from tests.fixtures import make_tiny_qwen3_5
from tests.test_quantization_backend import INTERPRETER_PATCH, _run_interpreted, needs_triton


def test_the_kernel_takes_trees_of_two_to_max_nodes_only():
    assert not tree_layout.supports(1) and tree_layout.supports(2) and tree_layout.supports(tree_layout.MAX_NODES)
    assert not tree_layout.supports(tree_layout.MAX_NODES + 1)
    with pytest.raises(ValueError, match="2..128 nodes"):
        tree_layout.tree_layout(torch.full((1, 1), -1), torch.ones(1, dtype=torch.long))


def test_the_kernel_is_never_chosen_on_the_cpu_or_when_switched_off(monkeypatch):
    assert not tree_layout.available("cpu")
    monkeypatch.setenv(tree_layout.ENV_VAR, "off")
    assert not tree_layout.available("cuda")


def test_a_cpu_model_builds_the_structure_and_windows_in_pytorch(tmp_path):
    """The model's tree_structure on the CPU: the reference (no windows: the GDN layout makes them)."""
    model = TargetModel(load_target(make_tiny_qwen3_5(tmp_path / "q35", multimodal_wrapper=False)), 2, 64, 8,
                        tree_gdn="wy")
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, -1, -1]])
    got = model.tree_structure(parents, torch.tensor([4, 2]))
    assert got.depth.tolist() == [[0, 1, 1, 2], [0, 1, 0, 0]] and got.conv_windows is None
    assert got.anc[0, 3].tolist() == [True, True, False, True]


INTERPRETED_LAYOUT = """
import torch
from ddtree_serve.decoding.tree_mask import tree_structure
from target_svc.gdn_tree_wy import conv_windows
from target_svc.tree_layout import tree_layout
gen = torch.Generator().manual_seed(0)
def padded(trees, t):
    parents = torch.full((len(trees), t), -1, dtype=torch.long)
    for b, p in enumerate(trees):
        parents[b, :len(p)] = torch.tensor(p, dtype=torch.long)
    return parents, torch.tensor([len(p) for p in trees])
def random_tree(n, depth):
    out, d = [-1], [0]
    for i in range(1, n):
        p = int(torch.randint(0, i, (1,), generator=gen))
        while d[p] >= depth:
            p = out[p]
        out.append(p); d.append(d[p] + 1)
    return out
cases = [
    ([[-1, 0]], 2),
    ([[-1, 0, 1, 2, 3], [-1, 0, 0]], 5),                                     # a chain, a padded star
    ([random_tree(17, 16), list(range(-1, 16)), [-1]], 17),
    ([random_tree(65, 16), random_tree(40, 3), list(range(-1, 64))], 65),
    ([random_tree(128, 127), random_tree(100, 16)], 128),
    ([random_tree(33, 8)] * 3, 40),                                            # padding past every tree
]
# Malformed parents (a parent at or after its node, out of range): the same integers as the reference all the same.
bad = torch.randint(-1, 20, (3, 20), generator=gen)
cases_t = [padded(trees, t) for trees, t in cases] + [(bad, torch.tensor([20, 7, 0]))]
for parents, sizes in cases_t:
    t = parents.shape[1]
    want = tree_structure(parents, sizes)
    valid = torch.arange(t)[None, :] < sizes[:, None]
    for kern in (0, 2, 4):
        got = tree_layout(parents, sizes, kern)
        assert torch.equal(got.anc, want.anc), (t, kern)
        assert torch.equal(got.depth, want.depth), (t, kern)
        if kern:
            assert torch.equal(got.conv_windows, conv_windows(parents, valid, want.depth, kern)), (t, kern)
        else:
            assert got.conv_windows is None
print("ok")
"""


@needs_triton
def test_the_kernel_under_tritons_interpreter_equals_the_pytorch_structure_and_windows():
    """2 to 128 nodes, chains, deep and shallow trees, padding, batches; windows of 2 and 4 taps; malformed parents."""
    _run_interpreted(INTERPRETER_PATCH + INTERPRETED_LAYOUT)


INTERPRETED_MODEL = """
import torch
from target_svc.loader import load_target
from target_svc.model import TargetModel
from target_svc.verify import VerifyBatch, VerifyShape, verify_forward, verify_walk
from tests.fixtures import make_tiny_qwen3_5
path = make_tiny_qwen3_5(CHECKPOINT, seed=5, multimodal_wrapper=False)
tokens = torch.randint(4, 300, (2, 9), generator=torch.Generator().manual_seed(1))
trees = [(tokens[0], torch.tensor([-1, 0, 0, 1, 1, 2, 3, 6, 0])), (tokens[1, :5], torch.tensor([-1, 0, 1, 1, 3]))]
out = []
for on in (False, True):
    model = TargetModel(load_target(path), max_batch=2, max_seq_len=64, max_tree_nodes=9, tree_gdn="wy")
    model.tree_layout_on = on   # the kernel, forced on where it would not be chosen (a CPU)
    slots = [model.cache.add_sequence("a"), model.cache.add_sequence("b")]
    batch = VerifyBatch.pack(trees, [0, 0], slots, VerifyShape(2, 9, 9), model.cache.spec.scratch_slot)
    logits, choices, _, anc = verify_forward(model, batch.packed, 9, 9, ())
    result, _, _, _ = verify_walk(batch.packed, 9, choices, None, 9, anc=anc)
    out.append((logits, result))
assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
print("ok")
"""


@needs_triton
def test_a_hybrid_verify_with_the_kernel_forced_on_gives_the_same_logits_and_walk(tmp_path):
    """TargetModel.tree_structure's kernel route end to end under Triton's interpreter: the attention keys, the
    Gated DeltaNet windows and the walk all read the kernel's integers, so every output is the same bits."""
    _run_interpreted(INTERPRETER_PATCH + INTERPRETED_MODEL.replace("CHECKPOINT", repr(str(tmp_path / "q35"))))
