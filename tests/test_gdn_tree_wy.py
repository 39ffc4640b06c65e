"""The one-pass (WY, ancestor-masked) tree Gated DeltaNet equals the depth-by-depth reference (CPU, float32)."""
from __future__ import annotations

import pytest
import torch

from bench.common import random_parents
from target_svc.gated_deltanet import LinearAttnStateShape, gdn_tree_forward
from target_svc.gdn_tree_wy import gdn_commit_path_wy, gdn_tree_forward_wy
from tests.test_gated_deltanet import HIDDEN, _make_layer

ATOL = 1e-4


@pytest.fixture(scope="module")
def layer():
    return _make_layer(seed=3)




def _batch(layer, sizes: list[int], max_depth: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    t = max(sizes)
    parents = torch.full((len(sizes), t), -1, dtype=torch.long)
    for b, n in enumerate(sizes):
        parents[b, :n] = torch.tensor(random_parents(n, max_depth, gen))
    valid = torch.arange(t)[None, :] < torch.tensor(sizes)[:, None]
    dims = LinearAttnStateShape.from_module(layer)
    x = torch.randn(len(sizes), t, HIDDEN, generator=gen)
    conv = torch.randn(dims.conv_shape(len(sizes)), generator=gen)
    rec = torch.randn(dims.rec_shape(len(sizes)), generator=gen) * 0.3
    return x, parents, valid, conv, rec


@pytest.mark.parametrize("sizes,max_depth", [([1, 1], 0), ([16, 9, 3], 15), ([64, 40], 12), ([256, 7], 16)])
def test_outputs_and_every_node_state_equal_the_depth_by_depth_reference(layer, sizes, max_depth):
    x, parents, valid, conv, rec = _batch(layer, sizes, max_depth, seed=len(sizes) + max_depth)
    want_out, want_conv, want_rec = gdn_tree_forward(layer, x, parents, valid, conv, rec)
    with torch.no_grad():
        got_out, trace = gdn_tree_forward_wy(layer, x, parents, valid, conv, rec)
    torch.testing.assert_close(got_out, want_out, atol=ATOL, rtol=0)
    # Committing a path that ends at node i gives the reference's state after node i, for every valid node.
    for b, n in enumerate(sizes):
        for node in range(n):
            path = torch.full((len(sizes), max(sizes)), -1, dtype=torch.long)
            chain = [node]
            while parents[b, chain[-1]] >= 0:
                chain.append(int(parents[b, chain[-1]]))
            path[b, : len(chain)] = torch.tensor(chain[::-1])
            lens = torch.zeros(len(sizes), dtype=torch.long)
            lens[b] = len(chain)
            got_conv, got_rec = gdn_commit_path_wy(trace, path, lens, conv, rec)
            torch.testing.assert_close(got_rec[b], want_rec[b, node], atol=ATOL, rtol=0, msg=f"tree {b} node {node}")
            torch.testing.assert_close(got_conv[b], want_conv[b, node], atol=0, rtol=0)
            others = [r for r in range(len(sizes)) if r != b]
            torch.testing.assert_close(got_rec[others], rec[others].float(), atol=0, rtol=0)  # path_len 0: kept


def test_states_read_in_place_from_the_pools_equal_the_gathered_states(layer):
    """state_index: the tree starts from its slot's states in the layer's pools (the model's path: no gathers),
    padding rows sharing one slot included; the same bits as handing the gathered states over."""
    x, parents, valid, conv, rec = _batch(layer, [9, 4, 1], 6, seed=11)
    gen = torch.Generator().manual_seed(12)
    conv_pool = torch.randn(5, *conv.shape[1:], generator=gen)
    rec_pool = torch.randn(5, *rec.shape[1:], generator=gen) * 0.3
    slots = torch.tensor([[3, 0, 4]]).expand(2, 3)[0]   # a strided view, as the packed batch hands slots over
    with torch.no_grad():
        want_out, want = gdn_tree_forward_wy(layer, x, parents, valid, conv_pool[slots], rec_pool[slots])
        got_out, got = gdn_tree_forward_wy(layer, x, parents, valid, conv_pool, rec_pool, state_index=slots)
    assert torch.equal(got_out, want_out)
    assert torch.equal(got.u, want.u) and torch.equal(got.conv_inputs, want.conv_inputs)
