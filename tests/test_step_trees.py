"""The gateway's per-step trees: DDTree (host heap path) equals the batched builder and the reference heap bit for
bit; chains; root-only for AR."""
from __future__ import annotations

import torch

from ddtree_serve.decoding.config import SamplingParams
from ddtree_serve.decoding.ddtree import build_chain, build_ddtree_batch, build_ddtree_reference
from gateway.sequence import Sequence
from gateway.step_trees import build_step_trees


def _seq(seq_id: str, mode: str, budget: int, bonus: int) -> Sequence:
    s = Sequence(request_id=seq_id, prompt_ids=[1], max_tokens=64, sampling=SamplingParams(), mode=mode,
                 budget=budget, stop_token_ids=frozenset(), detokenizer=None, seq_id=seq_id)
    s.bonus = bonus
    return s


def test_step_trees_match_the_batched_builders():
    g = torch.Generator().manual_seed(0)
    seqs = [_seq("a", "ddtree", 64, 5), _seq("b", "ddtree", 7, 6), _seq("c", "dflash", 0, 7), _seq("d", "ar", 0, 8)]
    drafts = {}
    for s in seqs[:3]:
        lp = torch.log_softmax(torch.randn(15, 64, generator=g) * 3, -1).sort(-1, descending=True).values
        drafts[s.seq_id] = (lp, torch.randperm(300, generator=g)[:64].expand(15, -1).contiguous())
    depths = {"a": 15, "b": 4, "c": 9, "d": 0}
    trees = build_step_trees(seqs, drafts, depths)
    for s in seqs[:2]:
        lp, ids = drafts[s.seq_id]
        want = build_ddtree_batch(lp[None], ids[None], [s.bonus], [s.budget], [depths[s.seq_id]]).tree(0)
        assert torch.equal(trees[s.seq_id].tokens, want.tokens)
        assert torch.equal(trees[s.seq_id].parents, want.parents)
    assert trees["a"].size == 65 and trees["b"].size == 8 and int(trees["b"].depths.max()) <= 4
    lp, ids = drafts["c"]
    chain = build_chain(lp[None], ids[None], [7], [9]).tree(0)
    assert torch.equal(trees["c"].tokens, chain.tokens) and trees["c"].size == 10
    assert trees["d"].tokens.tolist() == [8] and trees["d"].parents.tolist() == [-1]


def test_host_ddtree_trees_are_the_reference_heaps_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    seqs = [_seq(f"s{i}", "ddtree", budget, 10 + i) for i, budget in enumerate((64, 64, 16, 5, 300, 1, 0))]
    drafts, depths = {}, {}
    for i, s in enumerate(seqs):
        k = min(max(s.budget, 1), 64)
        logits = torch.randn(15, 500, generator=g) * (2 + i)
        if i == 3:
            logits = logits.round()  # equal log-probs among the top-k: ties
        lp, ids = torch.log_softmax(logits, -1).topk(k, -1)
        if i == 5:
            lp[2, 0] = float("nan")
        drafts[s.seq_id] = (lp.contiguous(), ids.contiguous())
        depths[s.seq_id] = (15, 15, 9, 15, 15, 4, 15)[i]
    trees = build_step_trees(seqs, drafts, depths)
    for s in seqs:
        want = build_ddtree_reference(*drafts[s.seq_id], s.budget, depths[s.seq_id], s.bonus)
        for name in ("tokens", "parents", "depths", "log_probs"):
            got, ref = getattr(trees[s.seq_id], name), getattr(want, name)
            assert got.dtype == ref.dtype and got.numpy().tobytes() == ref.numpy().tobytes(), (s.seq_id, name)


def test_the_gateways_numpy_drafts_make_the_same_trees_as_host_tensors():
    """The engine hands the builders numpy arrays (straight from the Draft reply's bytes): the very same trees."""
    g = torch.Generator().manual_seed(2)
    seqs = [_seq("a", "ddtree", 64, 5), _seq("b", "ddtree", 16, 6), _seq("c", "dflash", 0, 7)]
    tensors = {s.seq_id: tuple(t.contiguous() for t in torch.log_softmax(torch.randn(15, 400, generator=g) * 4, -1)
                              .topk(64, -1)) for s in seqs}
    arrays = {k: (lp.numpy(), ids.numpy()) for k, (lp, ids) in tensors.items()}
    depths = {"a": 15, "b": 7, "c": 11}
    want, got = build_step_trees(seqs, tensors, depths), build_step_trees(seqs, arrays, depths)
    for s in seqs:
        for name in ("tokens", "parents", "depths", "log_probs"):
            a, b = getattr(got[s.seq_id], name), getattr(want[s.seq_id], name)
            assert a.dtype == b.dtype and torch.equal(a, b), (s.seq_id, name)
