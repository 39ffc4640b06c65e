"""train-drafter: the DFlash training layout matches decoding, and a tiny run trains, checkpoints, resumes, reloads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from drafter_svc.dflash_model import DFlashDraftModel
from drafter_svc.train import cli
from drafter_svc.train.batching import collate
from drafter_svc.train.blocks import (
    block_attention_mask,
    block_inputs_and_labels,
    block_position_ids,
    sample_anchors,
    slot_weights,
    valid_label_index,
)
from drafter_svc.train.new_drafter import DrafterShape, init_drafter, new_drafter_config
from drafter_svc.train.prompts import PromptRecord, drop_overlapping
from drafter_svc.train.samples import Sample, load_samples
from tests.fixtures.tiny_models import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 4-layer Llama with the fixtures' tokenizer (chat template included)."""
    return make_tiny_llama(tmp_path_factory.mktemp("target"), seed=2)


def test_anchor_sampling_stays_in_the_response() -> None:
    """Anchors are distinct, sorted, inside [loss_start, length - 2]; short rows are padded with keep False."""
    lengths = torch.tensor([40, 12, 30])
    starts = torch.tensor([10, 8, 29])  # row 2 has no anchor position at all
    g = torch.Generator().manual_seed(0)
    anchors, keep = sample_anchors(lengths, starts, num_anchors=8, generator=g)
    assert anchors.shape == (3, 8)
    assert keep.sum(1).tolist() == [8, 3, 0]
    for b in range(3):
        a = anchors[b][keep[b]]
        assert torch.all(a >= starts[b]) and torch.all(a <= lengths[b] - 2)
        assert a.unique().numel() == a.numel() and torch.equal(a, a.sort().values)
    assert anchors[1][keep[1]].tolist() == [8, 9, 10]


def test_block_mask_sees_context_strictly_before_the_anchor() -> None:
    """Block b: context positions < anchor_b and its own block; nothing of other blocks."""
    anchors = torch.tensor([[3, 7]])
    keep = torch.tensor([[True, False]])
    bs, s = 4, 10
    m = block_attention_mask(anchors, keep, s, bs)[0, 0]
    assert m.shape == (2 * bs, s + 2 * bs)
    for q in range(bs):  # block 0, anchor 3
        assert m[q, :s].tolist() == [True] * 3 + [False] * 7
        assert m[q, s : s + bs].all() and not m[q, s + bs :].any()
    for q in range(bs, 2 * bs):  # dropped block: only itself (never an empty row)
        assert not m[q, :s].any() and not m[q, s : s + bs].any() and m[q, s + bs :].all()
    pos = block_position_ids(anchors, s, bs)[0]
    assert pos.tolist() == list(range(s)) + [3, 4, 5, 6, 7, 8, 9, 10]


def test_labels_are_the_tokens_at_each_slots_own_position() -> None:
    """Slot k of the block anchored at a is labelled x[a + k] (no shift); slot 0 and positions past the end are not."""
    x = torch.arange(100, 112)[None]
    noise, labels, valid = block_inputs_and_labels(x, torch.tensor([12]), torch.tensor([[5, 9]]),
                                                   torch.tensor([[True, True]]), 4, mask_token_id=1)
    assert noise.tolist() == [[105, 1, 1, 1, 109, 1, 1, 1]]
    assert labels[0, 0].tolist() == [105, 106, 107, 108]
    assert valid[0, 0].tolist() == [False, True, True, True]
    assert valid[0, 1].tolist() == [False, True, True, False]  # 9 + 3 = 12 is past the sequence
    w = slot_weights(16, 7.0, "cpu")
    assert w[0] == 0 and w[1] == 1 and torch.isclose(w[8], torch.exp(torch.tensor(-1.0)))


def test_host_label_index_matches_the_labels_valid_mask() -> None:
    """The labelled-slot index drawn on the host is exactly block_inputs_and_labels' valid mask, flattened."""
    g = torch.Generator().manual_seed(3)
    lengths, starts = torch.tensor([40, 12, 25]), torch.tensor([10, 8, 20])
    anchors, keep = sample_anchors(lengths, starts, num_anchors=6, generator=g)
    x = torch.randint(5, 50, (3, 40), generator=g)
    _, _, valid = block_inputs_and_labels(x, lengths, anchors, keep, 8, mask_token_id=1)
    idx = valid_label_index(lengths, anchors, keep, 8)
    assert torch.equal(idx, valid.reshape(-1).nonzero().squeeze(1))
    assert idx.numel() > 0


def test_training_prompts_that_copy_held_out_text_are_dropped() -> None:
    """A training prompt quoting 180+ characters of a held-out prompt goes, whatever wraps it; others stay."""
    held_text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog. " for i in range(12))
    held = [PromptRecord("h0", "pydoc", "doc-a", "Summarise:\n" + held_text)]
    copy = PromptRecord("t0", "pydoc", "doc-b", "Explain this passage.\n" + held_text[100:320] + "\nThanks.")
    short = PromptRecord("t1", "pydoc", "doc-c", "Explain: " + held_text[:60])  # a short common phrase only
    other = PromptRecord("t2", "pysrc", "doc-d", "Review this code:\n" + "x = 1\n" * 80)
    kept = drop_overlapping([copy, short, other], held)
    assert [p.id for p in kept] == ["t1", "t2"]


def test_training_layout_equals_the_decode_step(tiny_target: Path) -> None:
    """Many anchored blocks in one masked forward give, per block, the plain decode-step forward's output."""
    cfg = new_drafter_config(tiny_target, DrafterShape(num_layers=2, block_size=8))
    model = init_drafter(cfg, seed=3).eval()
    g = torch.Generator().manual_seed(1)
    s = 24
    x = torch.randint(5, cfg.vocab_size, (1, s), generator=g)
    feats = torch.randn(1, s, cfg.feature_dim, generator=g)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    anchors = torch.tensor([[0, 6, 11, 20]])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    noise_ids, _, _ = block_inputs_and_labels(x, torch.tensor([s]), anchors, keep, 8, cfg.mask_token_id)
    with torch.no_grad():
        batched = model(model.embed(noise_ids, embed), feats, block_position_ids(anchors, s, 8),
                        attention_mask=block_attention_mask(anchors, keep, s, 8))
        for n, a in enumerate(anchors[0].tolist()):
            block = torch.tensor([[int(x[0, a])] + [cfg.mask_token_id] * 7])
            ctx = feats[:, :a] if a > 0 else None
            ref = model(model.embed(block, embed), ctx, torch.arange(a + 8)[None])
            torch.testing.assert_close(batched[:, n * 8 : (n + 1) * 8], ref, rtol=1e-4, atol=1e-5)


def _args(target: Path, out: Path, work: Path, corpus: Path, **over) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    argv = [
        "--target", str(target), "--out", str(out), "--work-dir", str(work), "--device", "cpu",
        "--corpus", str(corpus), "--no-system-corpora", "--num-prompts", "16", "--num-heldout", "3",
        "--max-new-tokens", "24", "--eval-max-new-tokens", "20", "--gen-batch-size", "16",
        "--num-layers", "2", "--num-anchors", "12", "--max-tokens", "1200", "--lr", "3e-3",
        "--eval-budgets", "4,16", "--no-progress",
    ]
    for k, v in over.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return parser.parse_args(argv)


def test_tiny_end_to_end_trains_checkpoints_resumes_and_reloads(tiny_target: Path, tmp_path: Path) -> None:
    """Distillation data from the tiny target, a few CPU steps, checkpoint, resume, reload, offline eval."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "story.txt").write_text("\n\n".join(
        f"Paragraph {i}: the rain stopped and the children ran outside to count puddles on the road, "
        f"while the baker opened the shop and the night train left the quiet town number {i}." for i in range(40)))
    (corpus / "funcs.py").write_text("\n\n".join(
        f"def add_{i}(x):\n    \"\"\"Return x plus {i}, doubled, for the tests.\"\"\"\n    y = x + {i}\n    return 2 * y\n"
        for i in range(30)))
    out, work = tmp_path / "drafter", tmp_path / "work"

    m1 = cli.run(_args(tiny_target, out, work, corpus, steps=6, ckpt_every=3, no_eval=True))
    assert m1["train"]["steps"] == 6
    latest = work / "checkpoints" / "latest"
    assert (latest / "config.json").is_file() and (latest / "model.safetensors").is_file()
    assert (latest / "trainer_state.pt").is_file()

    # z-lab format on disk: published config keys and parameter names
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 16
    assert cfg["num_target_layers"] == 4 and len(cfg["dflash_config"]["target_layer_ids"]) == 2
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight",
            "layers.0.mlp.gate_proj.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)

    # resume: same work dir, more steps, reusing the generated samples
    m2 = cli.run(_args(tiny_target, out, work, corpus, steps=14, ckpt_every=0,
                       samples=work / "samples.pt"))
    assert m2["train"]["steps"] == 14
    log = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in log]
    assert steps[0] == 1 and 7 <= min(s for s in steps if s > 6) and steps[-1] == 14
    assert sorted(steps) == steps  # continued, not restarted
    first, last = m1["train"]["first_loss"], m2["train"]["last_loss"]
    assert last < 0.7 * first, (first, last)

    drafter = DFlashDraftModel.from_pretrained(out, device="cpu", dtype=torch.float32)
    assert drafter.config.num_hidden_layers == 2 and drafter.mask_token_id == cfg["dflash_config"]["mask_token_id"]
    ev = m2["eval"]
    assert ev["sequences"] == len(load_samples(work / "heldout_samples.pt"))
    for key in ("chain_mean_acceptance_length", "ddtree_b4_mean_acceptance_length", "ddtree_b16_mean_acceptance_length"):
        assert 1.0 <= ev[key] <= 16.0
    # a bigger tree never accepts less than the chain (it contains the chain's path)
    assert ev["ddtree_b16_mean_acceptance_length"] >= ev["chain_mean_acceptance_length"] - 1e-9
    assert len(ev["chain"]["per_position"]) == 15


def test_collate_right_pads() -> None:
    """Batches are right-padded with lengths and loss starts."""
    b = collate([Sample([1, 2, 3], 1), Sample([4, 5, 6, 7, 8], 2)], pad_id=0)
    assert b.input_ids.tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]]
    assert b.lengths.tolist() == [3, 5] and b.loss_start.tolist() == [1, 2]


def test_offline_eval_drafts_like_the_drafter_service(tiny_target: Path, tmp_path: Path) -> None:
    """The evaluation's per-root top-k equals what DrafterRunner returns for the same context (serving path)."""
    from drafter_svc.runner import DrafterConfig, DrafterRunner, DraftItem
    from drafter_svc.train.evaluate import draft_topk_all_roots
    from drafter_svc.train.target_features import load_frozen_target, target_features

    cfg = new_drafter_config(tiny_target, DrafterShape(num_layers=2))
    init_drafter(cfg, seed=5).save_pretrained(tmp_path / "d")
    runner = DrafterRunner(DrafterConfig(str(tmp_path / "d"), str(tiny_target)))
    target = load_frozen_target(tiny_target, "cpu", torch.float32)
    x = torch.randint(5, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    feats = target_features(target, x[None], runner.target_layer_ids)
    roots = torch.tensor([3, 17, 38])
    lp, ids = draft_topk_all_roots(runner.model, runner.embed_weight, runner.lm_head_weight, x[None], feats, roots, 8)
    for n, p in enumerate(roots.tolist()):
        runner.release("s")
        runner.add_context("s", 0, feats[0, :p])
        v, k = runner.draft([DraftItem("s", int(x[p]), p)], top_k=8)
        assert torch.equal(k[0], ids[n])
        torch.testing.assert_close(v[0], lp[n], rtol=0, atol=1e-4)


def test_prompts_of_a_corpus_whose_every_document_is_held_out_still_train(tmp_path: Path) -> None:
    """A tiny corpus can have all its documents fall on the held-out side (each does with probability
    heldout_doc_fraction, the coin keyed by the document's path): individual prompts are split instead."""
    from drafter_svc.train.corpora import Corpora
    from drafter_svc.train.prompts import build_prompts

    story = tmp_path / "story.txt"
    story.write_text("\n\n".join(f"Paragraph {i}: the rain stopped and the children ran outside to count the "
                                 f"puddles on the road, while the baker opened the shop number {i}." for i in range(30)))
    corpora = Corpora(pysrc=[], pydoc=[], speech=[], fortune=[], text=[story])
    train, heldout = build_prompts(corpora, n_train=8, n_heldout=2, heldout_doc_fraction=1.0)
    assert len(train) == 8 and len(heldout) == 2
    assert not {p.text for p in train} & {p.text for p in heldout}
