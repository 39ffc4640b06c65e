"""Gated DeltaNet chain/tree/step paths against HF's layer and against step-by-step decoding."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from target_svc.gated_deltanet import (
    GdnTreeTrace,
    LinearAttnStateShape,
    allocate_linear_attn_state,
    gather_node_state,
    gdn_chain_forward,
    gdn_commit_path,
    gdn_step,
    gdn_step_forward_lean,
    gdn_tree_forward,
    gdn_tree_forward_lean,
)

HIDDEN = 64
ATOL = 2e-5


def _make_layer(seed: int = 0) -> Qwen3_5GatedDeltaNet:
    """Tiny fp32 layer (2 key heads, 4 value heads, dims 16, kernel 4) with non-trivial random weights."""
    config = Qwen3_5TextConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        hidden_act="silu",
        rms_norm_eps=1e-6,
    )
    layer = Qwen3_5GatedDeltaNet(config, layer_idx=0).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lin in (layer.in_proj_qkv, layer.in_proj_z, layer.in_proj_b, layer.in_proj_a, layer.out_proj):
            fan_in = lin.weight.shape[1]
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) / fan_in**0.5)
        layer.conv1d.weight.copy_(torch.randn(layer.conv1d.weight.shape, generator=gen) * 0.5)
        # Decays from slow (~0.99 per token) to fast, so that long-range state matters.
        layer.A_log.copy_(torch.empty(4).uniform_(-3.0, 1.0, generator=gen))
        layer.dt_bias.copy_(torch.randn(4, generator=gen))
        layer.norm.weight.copy_(torch.empty(16).uniform_(0.5, 1.5, generator=gen))
    return layer


@pytest.fixture(scope="module")
def layer() -> Qwen3_5GatedDeltaNet:
    return _make_layer()


def _steps(layer, xs: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor):
    """Token-by-token reference over xs [B, S, H]: (outputs [B, S, H], conv, rec)."""
    outs = [xs.new_zeros(xs.shape[0], 0, HIDDEN)]
    for s in range(xs.shape[1]):
        o, conv, rec = gdn_step(layer, xs[:, s], conv, rec)
        outs.append(o.unsqueeze(1))
    return torch.cat(outs, dim=1), conv, rec


def _committed_states(layer, batch: int, prefix: int, gen: torch.Generator):
    """Non-zero states as left by decoding a random prefix."""
    dims = LinearAttnStateShape.from_module(layer)
    st = allocate_linear_attn_state(dims, batch, "cpu", torch.float32)
    xs = torch.randn(batch, prefix, HIDDEN, generator=gen)
    _, conv, rec = _steps(layer, xs, st.conv, st.rec)
    assert rec.abs().max() > 1e-2 and conv.abs().max() > 1e-2
    return conv, rec


@torch.no_grad()
def test_state_shapes_and_allocation(layer):
    dims = LinearAttnStateShape.from_module(layer)
    config = Qwen3_5TextConfig(
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    )
    assert dims == LinearAttnStateShape.from_config(config)
    assert dims.conv_dim == 2 * 2 * 16 + 4 * 16
    st = allocate_linear_attn_state(dims, 3, "cpu", torch.bfloat16)
    assert st.conv.shape == (3, dims.conv_dim, 3) and st.conv.dtype == torch.bfloat16
    assert st.rec.shape == (3, 4, 16, 16) and st.rec.dtype == torch.float32


@torch.no_grad()
def test_step_matches_hf_forward(layer):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 80, HIDDEN, generator=gen)  # > 64: HF runs its chunked kernel over two chunks
    ref = layer(x)
    dims = LinearAttnStateShape.from_module(layer)
    st = allocate_linear_attn_state(dims, 2, "cpu", torch.float32)
    out, _, _ = _steps(layer, x, st.conv, st.rec)
    assert ref.abs().mean() > 1e-2
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-4)


@torch.no_grad()
def test_chain_fresh_matches_hf_forward(layer):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 130, HIDDEN, generator=gen)
    dims = LinearAttnStateShape.from_module(layer)
    st = allocate_linear_attn_state(dims, 1, "cpu", torch.float32)
    out, _, _ = gdn_chain_forward(layer, x, torch.tensor([130]), st.conv, st.rec)
    torch.testing.assert_close(out, layer(x), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("chunk_size", [64, 16])
@torch.no_grad()
def test_chain_padded_rows_and_continuation(layer, chunk_size):
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([150, 37, 0, 1])
    bsz, seq = 4, 150
    conv0, rec0 = _committed_states(layer, bsz, 9, gen)
    x = torch.randn(bsz, seq, HIDDEN, generator=gen)
    # Garbage in the padding must not leak anywhere.
    pad = torch.arange(seq)[None, :] >= lengths[:, None]
    x_padded = x.masked_fill(pad[..., None], float("nan"))

    out, conv, rec = gdn_chain_forward(layer, x_padded, lengths, conv0, rec0, chunk_size=chunk_size)
    assert torch.isfinite(out).all() and torch.isfinite(rec).all()
    assert (out[pad] == 0).all()
    for b in range(bsz):
        n = int(lengths[b])
        ref_out, ref_conv, ref_rec = _steps(layer, x[b : b + 1, :n], conv0[b : b + 1], rec0[b : b + 1])
        torch.testing.assert_close(out[b, :n], ref_out[0], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(conv[b], ref_conv[0], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(rec[b], ref_rec[0], atol=ATOL, rtol=1e-4)


@torch.no_grad()
def test_chain_split_equals_whole(layer):
    """Prefill in two pieces (continuing from the first piece's states) equals one prefill."""
    gen = torch.Generator().manual_seed(4)
    dims = LinearAttnStateShape.from_module(layer)
    st = allocate_linear_attn_state(dims, 2, "cpu", torch.float32)
    x = torch.randn(2, 100, HIDDEN, generator=gen)
    full = torch.tensor([100, 100])
    out, conv, rec = gdn_chain_forward(layer, x, full, st.conv, st.rec)
    out_a, conv_a, rec_a = gdn_chain_forward(layer, x[:, :70], torch.tensor([70, 70]), st.conv, st.rec)
    out_b, conv_b, rec_b = gdn_chain_forward(layer, x[:, 70:], torch.tensor([30, 30]), conv_a, rec_a)
    torch.testing.assert_close(torch.cat([out_a, out_b], 1), out, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(conv_b, conv, atol=0, rtol=0)
    torch.testing.assert_close(rec_b, rec, atol=ATOL, rtol=1e-4)


def _random_tree(n: int, max_depth: int, gen: torch.Generator) -> list[int]:
    """Parents of a random tree with n nodes: a spine to max_depth, then random branches under it."""
    parents, depth = [-1], [0]
    for i in range(1, n):
        if i <= max_depth:
            p = i - 1  # guarantees the full depth
        else:
            choices = [j for j in range(i) if depth[j] < max_depth]
            p = choices[int(torch.randint(len(choices), (1,), generator=gen))]
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents


def _path(parents: list[int], node: int) -> list[int]:
    """Root-to-node path."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def _tree_batch(gen: torch.Generator, sizes=(13, 7), depths=(6, 4)):
    """Two random trees padded to the larger size: parents, valid, the python parent lists."""
    t = max(sizes)
    lists = [_random_tree(n, d, gen) for n, d in zip(sizes, depths)]
    parents = torch.zeros(len(sizes), t, dtype=torch.long)  # padded nodes point at the root: must be ignored
    valid = torch.zeros(len(sizes), t, dtype=torch.bool)
    for b, par in enumerate(lists):
        parents[b, : len(par)] = torch.tensor(par)
        valid[b, : len(par)] = True
    assert any(lists[0].count(p) > 1 for p in lists[0])  # several branches
    return parents, valid, lists


@torch.no_grad()
def test_tree_matches_step_along_each_path(layer):
    gen = torch.Generator().manual_seed(5)
    parents, valid, lists = _tree_batch(gen)
    bsz, t = parents.shape
    conv0, rec0 = _committed_states(layer, bsz, 6, gen)
    x = torch.randn(bsz, t, HIDDEN, generator=gen)
    x_nan = x.masked_fill(~valid[..., None], float("nan"))

    out, node_conv, node_rec = gdn_tree_forward(layer, x_nan, parents, valid, conv0, rec0)
    assert out.shape == (bsz, t, HIDDEN)
    assert node_conv.shape == (bsz, t, 128, 3) and node_rec.shape == (bsz, t, 4, 16, 16)
    for tensor in (out, node_conv, node_rec):
        assert torch.isfinite(tensor).all()
        assert (tensor[~valid] == 0).all()
    for b, par in enumerate(lists):
        for node in range(len(par)):
            path = _path(par, node)
            ref_out, ref_conv, ref_rec = _steps(layer, x[b : b + 1, path], conv0[b : b + 1], rec0[b : b + 1])
            torch.testing.assert_close(out[b, node], ref_out[0, -1], atol=ATOL, rtol=1e-4)
            torch.testing.assert_close(node_conv[b, node], ref_conv[0], atol=ATOL, rtol=1e-4)
            torch.testing.assert_close(node_rec[b, node], ref_rec[0], atol=ATOL, rtol=1e-4)

    # A padded row's content must not disturb the real nodes: rerun tree 0 alone.
    n0 = len(lists[0])
    out_solo, _, rec_solo = gdn_tree_forward(
        layer, x[:1, :n0], parents[:1, :n0], valid[:1, :n0], conv0[:1], rec0[:1]
    )
    torch.testing.assert_close(out_solo[0], out[0, :n0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rec_solo[0], node_rec[0, :n0], atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_single_node_tree_is_a_decode_step(layer):
    gen = torch.Generator().manual_seed(6)
    conv0, rec0 = _committed_states(layer, 3, 5, gen)
    x = torch.randn(3, 1, HIDDEN, generator=gen)
    out, node_conv, node_rec = gdn_tree_forward(
        layer, x, torch.full((3, 1), -1), torch.ones(3, 1, dtype=torch.bool), conv0, rec0
    )
    ref_out, ref_conv, ref_rec = gdn_step(layer, x[:, 0], conv0, rec0)
    torch.testing.assert_close(out[:, 0], ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(node_conv[:, 0], ref_conv, atol=0, rtol=0)
    torch.testing.assert_close(node_rec[:, 0], ref_rec, atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_a_decode_step_commits_the_state_its_forward_computed(layer):
    """A one-node block's trace carries the recurrence's state after the node; the commit takes it (no replay) and
    it equals a replay of the node and the reference step; a padded row and a row that accepts nothing keep their
    committed state."""
    gen = torch.Generator().manual_seed(8)
    conv0, rec0 = _committed_states(layer, 3, 5, gen)
    x = torch.randn(3, 1, HIDDEN, generator=gen)
    valid = torch.tensor([[True], [True], [False]])
    _, trace = gdn_step_forward_lean(layer, x, valid, conv0, rec0)
    assert trace.final_state is not None
    path, path_len = torch.zeros(3, 1, dtype=torch.long), torch.tensor([1, 0, 1])
    conv, rec = gdn_commit_path(trace, path, path_len, conv0, rec0)
    replay_conv, replay_rec = gdn_commit_path(GdnTreeTrace(trace.node_conv, trace.key, trace.value, trace.g,
                                                           trace.beta), path, path_len, conv0, rec0)
    torch.testing.assert_close(rec[:2], replay_rec[:2], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(conv, replay_conv, atol=0, rtol=0)
    _, ref_conv, ref_rec = gdn_step(layer, x[:1, 0], conv0[:1], rec0[:1])
    torch.testing.assert_close(rec[:1], ref_rec, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rec[1:], rec0[1:], atol=0, rtol=0)   # accepted nothing; padded (identity update)


@torch.no_grad()
def test_commit_node_then_continue(layer):
    gen = torch.Generator().manual_seed(7)
    parents, valid, lists = _tree_batch(gen, sizes=(11, 9), depths=(6, 5))
    bsz, t = parents.shape
    conv0, rec0 = _committed_states(layer, bsz, 7, gen)
    x = torch.randn(bsz, t, HIDDEN, generator=gen)
    out, node_conv, node_rec = gdn_tree_forward(layer, x, parents, valid, conv0, rec0)
    out_lean, trace = gdn_tree_forward_lean(layer, x, parents, valid, conv0, rec0)
    assert isinstance(trace, GdnTreeTrace)
    torch.testing.assert_close(out_lean, out, atol=0, rtol=0)

    # Accept a deep leaf in tree 0 and an inner node in tree 1.
    chosen = [max(range(len(lists[0])), key=lambda i: len(_path(lists[0], i))), 2]
    paths = [_path(lists[b], chosen[b]) for b in range(bsz)]
    conv_c, rec_c = gather_node_state(node_conv, node_rec, torch.tensor(chosen))

    # The lean replay of the accepted path gives the same committed state.
    width = max(len(p) for p in paths)
    path_t = torch.zeros(bsz, width, dtype=torch.long)
    for b, p in enumerate(paths):
        path_t[b, : len(p)] = torch.tensor(p)
    path_len = torch.tensor([len(p) for p in paths])
    conv_r, rec_r = gdn_commit_path(trace, path_t, path_len, conv0, rec0)
    torch.testing.assert_close(conv_r, conv_c, atol=0, rtol=0)
    torch.testing.assert_close(rec_r, rec_c, atol=1e-6, rtol=1e-6)
    conv_none, rec_none = gdn_commit_path(trace, path_t, torch.zeros(bsz, dtype=torch.long), conv0, rec0)
    torch.testing.assert_close(conv_none, conv0, atol=0, rtol=0)
    torch.testing.assert_close(rec_none, rec0, atol=0, rtol=0)

    # Continue (a chain, then a decode step) from the committed state vs decoding path + continuation.
    cont = torch.randn(bsz, 5, HIDDEN, generator=gen)
    out_c, conv_n, rec_n = gdn_chain_forward(layer, cont, torch.tensor([5, 5]), conv_c, rec_c)
    step_out, _, _ = gdn_step(layer, cont[:, 0], conv_r, rec_r)
    for b in range(bsz):
        seq = torch.cat([x[b, paths[b]], cont[b]], dim=0).unsqueeze(0)
        ref_out, ref_conv, ref_rec = _steps(layer, seq, conv0[b : b + 1], rec0[b : b + 1])
        torch.testing.assert_close(out_c[b], ref_out[0, -5:], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(step_out[b], ref_out[0, -5], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(conv_n[b], ref_conv[0], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(rec_n[b], ref_rec[0], atol=ATOL, rtol=1e-4)


@torch.no_grad()
def test_tree_rejects_bad_parents(layer):
    x = torch.zeros(1, 3, HIDDEN)
    dims = LinearAttnStateShape.from_module(layer)
    st = allocate_linear_attn_state(dims, 1, "cpu", torch.float32)
    ok = torch.ones(1, 3, dtype=torch.bool)
    for bad in ([0, 0, 1], [-1, 1, 0], [-1, 0, -1]):
        with pytest.raises(ValueError):
            gdn_tree_forward(layer, x, torch.tensor([bad]), ok, st.conv, st.rec)
    # A valid node under a padded one is malformed too.
    with pytest.raises(ValueError):
        gdn_tree_forward(layer, x, torch.tensor([[-1, 0, 1]]), torch.tensor([[True, False, True]]), st.conv, st.rec)


@torch.no_grad()
def test_bf16_tree_and_step_agree():
    """In bf16 the tree pass and decode steps share the conv/projection arithmetic; states stay fp32."""
    layer = _make_layer(seed=11).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(8)
    dims = LinearAttnStateShape.from_module(layer)
    st = allocate_linear_attn_state(dims, 1, "cpu", torch.bfloat16)
    x = torch.randn(1, 6, HIDDEN, generator=gen).to(torch.bfloat16)
    parents = torch.tensor([[-1, 0, 1, 1, 3, 0]])
    out, node_conv, node_rec = gdn_tree_forward(layer, x, parents, torch.ones(1, 6, dtype=torch.bool), st.conv, st.rec)
    assert out.dtype == torch.bfloat16 and node_conv.dtype == torch.bfloat16 and node_rec.dtype == torch.float32
    path = [0, 1, 3, 4]
    ref_out, ref_conv, ref_rec = _steps(layer, x[:, path], st.conv, st.rec)
    torch.testing.assert_close(out[0, 4], ref_out[0, -1], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(node_conv[0, 4], ref_conv[0], atol=0, rtol=0)
    torch.testing.assert_close(node_rec[0, 4], ref_rec[0], atol=1e-5, rtol=1e-5)
