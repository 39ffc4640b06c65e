"""The tree-attention kernel: how it splits its work (a pure function of the shape), and what it computes under
Triton's interpreter where the triton package is installed (on the GPU: tests/test_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.tree_attention import MAX_BLOCK_NODES, choose_config
from tests.test_quantization_backend import INTERPRETER_PATCH, _run_interpreted, needs_triton


@pytest.mark.parametrize("batch, num_kv, rep, nodes, key_len, head_dim", [
    (1, 8, 4, 1, 512, 128), (1, 8, 4, 65, 1024, 128), (8, 8, 4, 65, 8257, 128), (32, 8, 4, 1, 4096, 128),
    (1, 4, 6, 1, 600, 256), (1, 4, 6, 65, 16384, 256), (2, 2, 1, 1, 1, 64), (1, 8, 4, MAX_BLOCK_NODES, 40, 128)])
def test_the_split_covers_every_key_in_whole_tiles_within_the_program_budget(batch, num_kv, rep, nodes, key_len,
                                                                               head_dim):
    cfg = choose_config(batch, num_kv, rep * nodes, key_len, head_dim, num_sms=132)
    assert cfg.splits >= 1
    assert cfg.split_len % cfg.block_n == 0 and cfg.splits * cfg.split_len >= key_len
    assert (cfg.splits - 1) * cfg.split_len < key_len   # no slice starts past the keys
    programs = batch * num_kv * -(-(rep * nodes) // cfg.block_m)
    assert cfg.splits == 1 or programs * cfg.splits <= 5 * 132


def test_a_one_token_decode_spreads_its_keys_over_the_sms_and_a_wide_batch_does_not_split():
    decode = choose_config(1, 8, 4, 1024, 128, num_sms=132)   # 8 KV heads alone would leave 124 SMs idle
    assert decode.block_m == 16 and decode.splits == 16
    wide = choose_config(64, 8, 4 * 65, 2048, 128, num_sms=132)
    assert wide.splits == 1


def test_a_tree_block_of_one_sequence_takes_balanced_32_by_64_tiles_and_a_wide_batch_keeps_wide_ones():
    """The H100 sweep's fastest tilings at the 8B heads, 512-token context in the 1024-key bucket (17 nodes: 8
    balanced splits, 65: 3), no register cap, and the 64-row tiles where the grid is full without them."""
    for nodes, splits in [(17, 8), (65, 3), (129, 2)]:
        cfg = choose_config(1, 8, 4 * nodes, 1024, 128, num_sms=132)
        assert (cfg.block_m, cfg.block_n, cfg.splits, cfg.num_warps) == (32, 64, splits, 4), nodes
        assert cfg.balanced and cfg.context_loop and cfg.max_registers is None
    wide = choose_config(8, 8, 4 * 65, 1024, 128, num_sms=132)
    assert wide.block_m == 64 and not wide.balanced
    assert choose_config(1, 4, 6 * 65, 1024, 256, num_sms=132).block_m == 32   # the 27B's heads: not swept yet


def test_the_fused_merge_is_off_by_default_and_its_counts_cover_any_tiling(monkeypatch):
    from ddtree_serve.kernels.tree_attention import FUSED_MERGE_ENV, merge_counts

    monkeypatch.delenv(FUSED_MERGE_ENV, raising=False)
    assert merge_counts(2, 8, 4 * 65, torch.device("cpu")) is None
    assert not choose_config(1, 8, 4, 1024, 128).fused_merge
    monkeypatch.setenv(FUSED_MERGE_ENV, "on")
    counts = merge_counts(2, 8, 4 * 65, torch.device("cpu"))
    assert counts.dtype == torch.int32 and counts.numel() == 2 * 8 * 17 and not counts.any()   # 16-row blocks
    assert choose_config(1, 8, 4, 1024, 128, fused_merge=True).fused_merge
    assert not choose_config(64, 8, 4 * 65, 2048, 128, fused_merge=True).fused_merge   # one slice: nothing to merge


INTERPRETED_ATTENTION = """
import torch, torch.nn.functional as F
from ddtree_serve.decoding.tree_mask import ancestor_mask_batch, tree_attention_mask
from ddtree_serve.kernels.tree_attention import SplitConfig, TreeKeys, choose_config, tree_attention
torch.manual_seed(0)
for heads, kv_heads, head_dim, nodes in [(8, 2, 64, 1), (8, 2, 64, 5), (4, 4, 64, 17)]:
    bsz, dtype = 3, torch.float16
    k_cache = torch.randn(bsz + 1, 300, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(bsz + 1, 300, kv_heads, head_dim).to(dtype)
    # strided columns, as the verify batch hands them over; contexts of whole tiles and a partial one, none, and
    # whole tiles exactly (the context loop's two loops and its empty partial one)
    packed = torch.tensor([[2, 100], [0, 0], [3, 64]])
    slots, ctx = packed[:, 0], packed[:, 1]
    parents = torch.full((bsz, nodes), -1, dtype=torch.long)
    for i in range(1, nodes):
        parents[:, i] = torch.randint(0, i, (bsz,))
    sizes = torch.randint(1, nodes + 1, (bsz,))
    sizes[-1] = nodes
    q = torch.randn(bsz, nodes, heads, head_dim).to(dtype)
    key_len, scale, rep = 150 + nodes, head_dim ** -0.5, heads // kv_heads
    mask = tree_attention_mask(ctx, parents, sizes, key_len)
    keys, values = k_cache[slots, :key_len].float(), v_cache[slots, :key_len].float()
    ref = F.scaled_dot_product_attention(
        q.float().transpose(1, 2), keys.repeat_interleave(rep, 2).transpose(1, 2),
        values.repeat_interleave(rep, 2).transpose(1, 2), attn_mask=mask[:, None], scale=scale).transpose(1, 2)
    tree_keys = TreeKeys(ctx, ancestor_mask_batch(parents, sizes))
    for cfg in (None, SplitConfig(16, 64, 1, 192), SplitConfig(16, 32, 3, 64),
                SplitConfig(16, 64, 1, 192, context_loop=False), SplitConfig(16, 32, 3, 64, context_loop=False),
                SplitConfig(16, 32, 3, 64, balanced=True), SplitConfig(16, 32, 4, 64, context_loop=False, balanced=True),
                SplitConfig(16, 32, 3, 64, fused_merge=True), SplitConfig(16, 32, 4, 64, balanced=True, fused_merge=True)):
        got = tree_attention(q, k_cache, v_cache, slots, tree_keys, key_len, scale, cfg).float()
        assert (got - ref).abs().max().item() < 2e-2, (heads, nodes, cfg)
    # The fused merge's counts, shared by two launches (two layers of one forward): each launch leaves them zero.
    counts = torch.zeros(bsz * kv_heads * -(-(rep * nodes) // 16), dtype=torch.int32)
    shared = TreeKeys(ctx, tree_keys.ancestors, counts)
    for _ in range(2):
        got = tree_attention(q, k_cache, v_cache, slots, shared, key_len, scale,
                             SplitConfig(16, 32, 3, 64, balanced=True, fused_merge=True)).float()
        assert (got - ref).abs().max().item() < 2e-2 and not counts.any(), (heads, nodes)
print("ok")
"""


@needs_triton
def test_the_kernel_under_tritons_interpreter_equals_sdpa_over_the_masked_rows():
    """Decode and tree blocks, GQA and not, one slice, the chosen split and an uneven one, each with the committed
    keys in the main loop and in a loop of their own, slices balanced on each sequence's keys, and the merge fused
    into the split's last slice, its counts left zero for the next launch (fp16: see test_quantization_backend on
    the interpreter's bf16)."""
    _run_interpreted(INTERPRETER_PATCH + INTERPRETED_ATTENTION)


INTERPRETED_MODEL = """
import sys, torch
from target_svc.loader import load_target
from target_svc.model import TargetModel
from tests.fixtures import make_tiny_qwen3
path = make_tiny_qwen3(sys.argv[1], seed=11)
models = []
for on in (False, True):
    model = TargetModel(load_target(path), max_batch=2, max_seq_len=64, max_tree_nodes=8)
    model.tree_attention_on = on   # the kernel, forced on where it would not be chosen (a CPU, float32)
    models.append(model)
gen = torch.Generator().manual_seed(0)
out = []
for model in models:
    slots = torch.tensor([model.cache.add_sequence("a"), model.cache.add_sequence("b")])
    prompt = torch.randint(4, 320, (2, 9), generator=torch.Generator().manual_seed(1))
    parents = (torch.arange(9) - 1).expand(2, 9).contiguous()
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 7:] = False
    logits, _ = model.forward_block(prompt, parents, valid, torch.zeros(2, dtype=torch.long), slots, chain=True)
    tree = torch.tensor([[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 0, 0]])
    ids = torch.randint(4, 320, (2, 6), generator=torch.Generator().manual_seed(2))
    ctx = torch.tensor([9, 7])
    tree_logits, _ = model.forward_block(ids, tree, torch.ones(2, 6, dtype=torch.bool), ctx, slots)
    out.append((logits, tree_logits))
for want, got in zip(out[0], out[1]):
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
print("ok")
"""


@needs_triton
def test_the_target_model_with_the_kernel_forced_on_gives_the_logits_of_sdpa(tmp_path):
    """TargetModel's dispatch end to end under Triton's interpreter (float32): a padded prefill chain and a tree
    block over two slots of different context lengths, the kernel against SDPA over the gathered masked rows."""
    _run_interpreted(INTERPRETER_PATCH + INTERPRETED_MODEL.replace("sys.argv[1]", repr(str(tmp_path / "qwen3"))))


def test_the_kernel_benchmark_refuses_a_machine_without_cuda_with_a_message(capsys):
    """bench.tree_attention_kernel imports the kernel's launcher and says why it cannot run, on a CPU machine."""
    from bench import tree_attention_kernel

    assert tree_attention_kernel.main(["--shapes", "8b", "--nodes", "1"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
