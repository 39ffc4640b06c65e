"""DrafterRunner: the cached, batched draft equals a from-scratch forward per sequence; windows; errors."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from drafter_svc.runner import PROMPT_PUSH_ROWS, DeferredRows, DraftGraphs, DrafterConfig, DrafterRunner, DraftItem
from tests.fixtures import make_tiny_qwen3
from tests.fixtures.tiny_drafter import make_tiny_drafter
from tests.test_quantization_backend import INTERPRETER_PATCH, _run_interpreted, needs_triton

BS = 8  # block size of the test drafters (small, to keep the tests fast)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafter")
    target = make_tiny_qwen3(root / "target")
    return {
        "target": target,
        "full": make_tiny_drafter(root / "full", target, seed=1, block_size=BS, target_layer_ids=[0, 2]),
        "mixed": make_tiny_drafter(root / "mixed", target, seed=2, num_layers=3, block_size=BS, sliding_window=4,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
        "swa": make_tiny_drafter(root / "swa", target, seed=3, block_size=BS, sliding_window=4,
                                 layer_types=["sliding_attention", "sliding_attention"]),
    }


def _runner(dirs, kind: str, **kw) -> DrafterRunner:
    return DrafterRunner(DrafterConfig(str(dirs[kind]), str(dirs["target"]), **kw))


def _naive_logprobs(r: DrafterRunner, feats: torch.Tensor, bonus: int) -> torch.Tensor:
    """From scratch: the whole context + block in one uncached forward, one sequence alone -> [BS-1, V]."""
    c = feats.shape[0]
    ids = torch.tensor([[bonus] + [r.mask_token_id] * (BS - 1)])
    with torch.no_grad():
        h = r.model(r.model.embed(ids, r.embed_weight), feats[None], torch.arange(c + BS))
        return torch.log_softmax(r.model.compute_logits(h[0, 1:], r.lm_head_weight).float(), dim=-1)


def _check_batch(r: DrafterRunner, feats: dict[str, torch.Tensor], held: dict[str, int], order, top_k=5, depth=0):
    items = [DraftItem(s, 7 + i, held[s]) for i, s in enumerate(order)]
    vals, ids = r.draft(items, top_k=top_k, max_depth=depth)
    L = depth or BS - 1
    assert vals.shape == ids.shape == (len(order), L, min(top_k, r.vocab_size))
    for b, it in enumerate(items):
        ref = _naive_logprobs(r, feats[it.seq_id][: it.context_len], it.bonus_token)[:L]
        ref_vals, ref_ids = torch.topk(ref, vals.shape[-1], dim=-1)
        torch.testing.assert_close(vals[b], ref_vals, rtol=1e-5, atol=1e-5)
        # each returned id carries its own log-prob (near-ties may order equal values either way)
        torch.testing.assert_close(ref.gather(-1, ids[b]), vals[b], rtol=1e-5, atol=1e-5)
        clear = (ref_vals[:, :-1] - ref_vals[:, 1:]).abs().min(-1).values > 1e-4  # positions without near-ties
        assert torch.equal(ids[b][clear], ref_ids[clear])
        assert torch.all(vals[b, :, :-1] >= vals[b, :, 1:])  # sorted, best first
    return vals, ids


@pytest.mark.parametrize("kind", ["full", "mixed"])
def test_cached_batched_draft_equals_naive(dirs, kind):
    r = _runner(dirs, kind, max_batch=4, max_seq_len=64)
    g = torch.Generator().manual_seed(0)
    seqs = {"a": 23, "b": 14, "c": 31}
    feats = {s: torch.randn(n, r.feature_dim, generator=g) for s, n in seqs.items()}
    held = {s: 0 for s in seqs}
    # Several rounds of appends of uneven sizes (prefill, then accepted-token rows), a draft after each round.
    for rnd, chunk in enumerate([{"a": 9, "b": 5, "c": 3}, {"a": 1, "b": 4, "c": 12}, {"a": 13, "b": 5, "c": 16}]):
        for s, n in chunk.items():
            r.add_context(s, held[s], feats[s][held[s] : held[s] + n])
            held[s] += n
        _check_batch(r, feats, held, ["a", "b", "c"], top_k=5 + rnd)
    # A single sequence, a batch in another order, and non-consecutive slots after a release.
    _check_batch(r, feats, held, ["c"])
    _check_batch(r, feats, held, ["c", "a"], depth=3)
    assert r.release("b") and not r.release("b")
    r.add_context("d", 0, feats["b"][:6])
    held["d"], feats["d"] = 6, feats["b"]
    _check_batch(r, feats, held, ["d", "c", "a"], top_k=10_000)  # K clamps to the vocabulary
    assert r.cache_usage() == (3, 4, held["a"] + held["c"] + 6, 4 * 64)


def test_sliding_window_hides_old_context(dirs):
    """With only sliding layers (window 4), rows more than the window behind every query cannot matter."""
    g = torch.Generator().manual_seed(1)
    c = 12
    base = torch.randn(c, 3 * 64, generator=g)

    def draft(kind: str, feats: torch.Tensor) -> torch.Tensor:
        r = _runner(dirs, kind, max_batch=1, max_seq_len=32)
        r.add_context("s", 0, feats[:, : r.feature_dim])
        return r.draft([DraftItem("s", 5, c)], top_k=320)[0]

    ref = draft("swa", base)
    old = base.clone()
    old[: c - 3] += 10.0  # positions <= c - 4: |q - k| >= 4 for every block query at c .. c + BS - 1
    torch.testing.assert_close(draft("swa", old), ref, rtol=0, atol=1e-6)
    near = base.clone()
    near[c - 2] += 10.0  # inside the window of the first mask slot (position c + 1)
    assert not torch.allclose(draft("swa", near), ref, atol=1e-3)
    # A full-attention layer does see the old rows.
    assert not torch.allclose(draft("mixed", old), draft("mixed", base), atol=1e-3)


def test_runner_metadata(dirs):
    r = _runner(dirs, "mixed")
    assert r.block_size == BS and r.target_layer_ids == [1, 1, 1] and r.hidden_size == 64
    assert r.mask_token_id == 3  # <|MASK|> of the tiny tokenizer
    assert r.feature_dim == 3 * 64 and r.vocab_size == 320
    assert r.cache_usage() == (0, 8, 0, 8 * 2048)


def test_errors(dirs):
    r = _runner(dirs, "full", max_batch=2, max_seq_len=16)
    f = torch.randn(20, r.feature_dim)
    with pytest.raises(ValueError, match="start"):
        r.add_context("a", 3, f[:2])  # a new sequence starts at 0
    r.add_context("a", 0, f[:5])
    with pytest.raises(ValueError, match="expected 5"):
        r.add_context("a", 4, f[:2])
    with pytest.raises(ValueError, match="features must be"):
        r.add_context("a", 5, torch.randn(2, r.feature_dim + 1))
    with pytest.raises(RuntimeError, match="capacity"):
        r.add_context("a", 5, f[:12])  # 17 rows > max_seq_len 16
    assert r.context_len("a") == 5
    with pytest.raises(KeyError):
        r.draft([DraftItem("zz", 1, 0)], top_k=4)
    with pytest.raises(ValueError, match="context rows are held"):
        r.draft([DraftItem("a", 1, 6)], top_k=4)
    with pytest.raises(ValueError, match="top_k"):
        r.draft([DraftItem("a", 1, 5)], top_k=0)
    with pytest.raises(ValueError, match="max_depth"):
        r.draft([DraftItem("a", 1, 5)], top_k=4, max_depth=BS)
    with pytest.raises(ValueError, match="vocabulary"):
        r.draft([DraftItem("a", 320, 5)], top_k=4)
    with pytest.raises(ValueError, match="twice"):
        r.draft([DraftItem("a", 1, 5), DraftItem("a", 1, 5)], top_k=4)
    with pytest.raises(ValueError, match="at least one"):
        r.draft([], top_k=4)
    r.add_context("b", 0, f[:1])
    with pytest.raises(RuntimeError, match="capacity"):
        r.add_context("c", 0, f[:1])  # both slots in use
    assert r.release("a")
    r.add_context("c", 0, f[:1])  # the freed slot is reused
    vals, ids = r.draft([DraftItem("c", 1, 1), DraftItem("b", 2, 1)], top_k=3, max_depth=2)
    assert vals.shape == (2, 2, 3) and torch.isfinite(vals).all()


def test_one_batched_add_contexts_equals_separate_calls_and_a_bad_entry_fails_alone(dirs):
    gen = torch.Generator().manual_seed(4)
    one, batched = _runner(dirs, "full", max_batch=4), _runner(dirs, "full", max_batch=4)
    feats = {s: torch.randn(n, one.feature_dim, generator=gen) for s, n in (("a", 5), ("b", 3), ("c", 7))}
    for s, f in feats.items():
        one.add_context(s, 0, f)
    bad = torch.randn(2, one.feature_dim + 1)
    errors = batched.add_contexts([("a", 0, feats["a"]), ("x", 0, bad), ("b", 0, feats["b"]), ("c", 0, feats["c"])])
    assert errors["a"] is None and errors["b"] is None and errors["c"] is None
    assert isinstance(errors["x"], ValueError) and batched.context_len("x") == 0
    for s, f in feats.items():
        assert batched.context_len(s) == f.shape[0]
        for kc_one, kc_b in zip(one.k_cache + one.v_cache, batched.k_cache + batched.v_cache):
            torch.testing.assert_close(kc_b[batched._slot[s], :, : f.shape[0]], kc_one[one._slot[s], :, : f.shape[0]],
                                       atol=1e-5, rtol=0)  # other GEMM shapes: fp32 rounding
    # and the drafts agree
    items = [DraftItem(s, 9, f.shape[0]) for s, f in feats.items()]
    torch.testing.assert_close(batched.draft(items, top_k=4)[0], one.draft(items, top_k=4)[0], atol=1e-5, rtol=0)


def test_captured_context_stores_take_a_prompt_push_as_well_as_a_steps_pushes():
    """Row buckets cover a whole batch's accepted rows (16 a sequence) and a prompt of up to PROMPT_PUSH_ROWS tokens
    (the push every first draft waits for), never past what a sequence can hold; larger pushes run eagerly."""
    cpu = torch.device("cpu")
    one = DraftGraphs(1, 4096, 15, 32, cpu, torch.float32)
    assert one.rows_bucket(16) == 16 and one.rows_bucket(151) == PROMPT_PUSH_ROWS
    assert one.rows_bucket(PROMPT_PUSH_ROWS + 1) is None
    assert DraftGraphs(32, 4096, 15, 32, cpu, torch.float32).rows_bucket(32 * 16) == 512
    short = DraftGraphs(1, 100, 15, 32, cpu, torch.float32)
    assert short.rows_bucket(100) == 100 and short.rows_bucket(101) is None


def test_padding_rows_of_a_bucketed_store_land_in_the_scratch_slot_only(dirs):
    """What a captured store does with a bucket larger than the push: the extra rows change no sequence's cache."""
    gen = torch.Generator().manual_seed(5)
    exact, padded = _runner(dirs, "full", max_batch=2), _runner(dirs, "full", max_batch=2)
    f = torch.randn(3, exact.feature_dim, generator=gen)
    for r in (exact, padded):
        r.add_context("a", 0, f)
    rows = torch.randn(2, exact.feature_dim, generator=gen)
    slot = exact._slot["a"]
    exact._store_rows(rows, torch.tensor([3, 4]), torch.tensor([slot, slot]))
    scratch = padded.cfg.max_batch
    padded._store_rows(torch.cat([rows, torch.zeros(6, padded.feature_dim)]), torch.tensor([3, 4] + [0] * 6),
                       torch.tensor([slot, slot] + [scratch] * 6))
    for a, b in zip(exact.k_cache + exact.v_cache, padded.k_cache + padded.v_cache):
        torch.testing.assert_close(b[:scratch], a[:scratch], atol=1e-6, rtol=0)


def test_a_prefetched_draft_answers_only_the_draft_it_was_made_for():
    """Same context length and bonus token, and at least the asked depth and top-k; anything else drafts anew."""
    import torch

    from drafter_svc.runner import DraftItem
    from drafter_svc.server import PrefetchedDraft

    d = PrefetchedDraft(context_len=10, bonus_token=4, logprobs=torch.zeros(15, 8), token_ids=torch.zeros(15, 8))
    assert d.answers(DraftItem("s", 4, 10), top_k=8, depth=15)
    assert d.answers(DraftItem("s", 4, 10), top_k=2, depth=3)
    assert not d.answers(DraftItem("s", 5, 10), top_k=8, depth=15)    # another bonus token
    assert not d.answers(DraftItem("s", 4, 11), top_k=8, depth=15)    # another context
    assert not d.answers(DraftItem("s", 4, 10), top_k=16, depth=15)   # wider than drafted


def test_the_block_forward_writes_its_logits_into_a_given_buffer_and_normalizes_them(dirs):
    """What the captured block forwards rely on (they share one output buffer): the same logits, in place, and
    normalizers that make them the log-softmax's log-probs."""
    r = _runner(dirs, "full", max_batch=2, max_seq_len=64)
    r.add_context("a", 0, torch.randn(11, r.feature_dim, generator=torch.Generator().manual_seed(3)))
    packed = r._pack([(7, 11, r._slot["a"])], 2)
    with torch.no_grad():
        want, want_lse = r._draft_logits(packed, 16, BS - 1)
        out = torch.full_like(want, float("nan"))
        got, lse = r._draft_logits(packed, 16, BS - 1, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    torch.testing.assert_close(want - lse[..., None], torch.log_softmax(want.float(), -1), atol=1e-5, rtol=0)


def test_cache_usage_never_waits_for_the_model_threads_lock(dirs):
    """Info and the metrics read the usage on the event loop: a draft or a store holding the runner's lock (on the
    model thread) must not hold them up."""
    import threading

    r = _runner(dirs, "mixed", max_batch=2, max_seq_len=64)
    r.add_context("a", 0, torch.randn(5, r.feature_dim))
    answer = []
    with r._lock:   # as the model thread holds it through a draft
        reader = threading.Thread(target=lambda: answer.append(r.cache_usage()))
        reader.start()
        reader.join(timeout=5)
        assert not reader.is_alive()
    assert answer == [(1, 2, 5, 2 * 64)]


def test_an_early_push_stores_the_headers_rows_and_drafts_as_a_plain_push_then_a_draft_would(dirs):
    """add_deferred_and_draft: of each sequence's R rows only the header's first n are context, the draft starts
    at start + n from the header's bonus token; cache, lengths and drafts equal add_context + draft."""
    plain, early = _runner(dirs, "full"), _runner(dirs, "full")
    g = torch.Generator().manual_seed(11)
    prompt = {s: torch.randn(n, plain.feature_dim, generator=g) for s, n in (("a", 5), ("b", 3))}
    step = {s: torch.randn(6, plain.feature_dim, generator=g) for s in prompt}   # R = 6 rows each
    accepted, bonus = {"a": 4, "b": 1}, {"a": 9, "b": 13}
    for r in (plain, early):
        for s, f in prompt.items():
            r.add_context(s, 0, f)
    for s in prompt:
        plain.add_context(s, prompt[s].shape[0], step[s][:accepted[s]])
    want = plain.draft([DraftItem(s, bonus[s], prompt[s].shape[0] + accepted[s]) for s in prompt], top_k=4)
    results, seconds = early.add_deferred_and_draft(
        [DeferredRows(s, prompt[s].shape[0], step[s], torch.tensor([accepted[s], bonus[s]])) for s in prompt], 4)
    assert seconds >= 0
    for b, (s, res) in enumerate(zip(prompt, results)):
        assert res.error is None and res.seq_id == s
        assert res.context_len == early.context_len(s) == plain.context_len(s) == prompt[s].shape[0] + accepted[s]
        assert res.bonus_token == bonus[s]
        torch.testing.assert_close(res.logprobs, want[0][b].float(), rtol=1e-5, atol=1e-5)
        assert torch.equal(res.token_ids, want[1][b].to(torch.int32))
        slot_p, slot_e, n = plain._slot[s], early._slot[s], res.context_len
        for kc_p, kc_e in zip(plain.k_cache, early.k_cache):
            torch.testing.assert_close(kc_e[slot_e, :, :n], kc_p[slot_p, :, :n], rtol=1e-6, atol=1e-6)
    # the next step goes on from there, the plain way
    nxt = torch.randn(2, plain.feature_dim, generator=g)
    for r in (plain, early):
        r.add_context("a", r.context_len("a"), nxt)
    a = [DraftItem("a", 3, plain.context_len("a"))]
    torch.testing.assert_close(early.draft(a, top_k=3)[0], plain.draft(a, top_k=3)[0], rtol=1e-5, atol=1e-5)


def test_an_early_push_whose_header_is_out_of_range_fails_that_sequence_alone(dirs):
    r = _runner(dirs, "full")
    f = torch.randn(4, r.feature_dim)
    r.add_context("a", 0, f)
    results, _ = r.add_deferred_and_draft([
        DeferredRows("a", 4, f, torch.tensor([5, 3])),          # 5 accepted of at most 4 rows
        DeferredRows("b", 0, f, torch.tensor([2, 3])),          # a new sequence, fine
        DeferredRows("c", 7, f, torch.tensor([1, 3])),          # starts where nothing is held
        DeferredRows("d", 0, f, torch.tensor([1, 10 ** 9])),    # a bonus token outside the vocabulary
    ], top_k=2)
    a, b, c, d = results
    assert isinstance(a.error, ValueError) and r.context_len("a") == 4   # its rows past the context are not held
    assert b.error is None and b.context_len == 2 and b.logprobs is not None
    assert isinstance(c.error, ValueError) and "expected 0" in str(c.error)
    assert d.error is None and d.context_len == 1 and d.logprobs is None   # stored, but nothing to draft from


INTERPRETED_SLOT_DRAFT = """
import sys, torch
from drafter_svc.runner import DrafterConfig, DrafterRunner, DraftItem
from tests.fixtures import make_tiny_qwen3
from tests.fixtures.tiny_drafter import make_tiny_drafter
from tests.test_quantization_backend import INTERPRETER_PATCH, _run_interpreted, needs_triton
root = sys.argv[1]
target = make_tiny_qwen3(root + "/target")
drafter = make_tiny_drafter(root + "/drafter", target, seed=1, block_size=8, target_layer_ids=[0, 2])
runner = DrafterRunner(DrafterConfig(str(drafter), str(target), max_batch=3, max_seq_len=48))
assert not runner.slot_attention   # a CPU: the gathered rows
gen = torch.Generator().manual_seed(0)
for seq, n in (("a", 9), ("b", 40), ("c", 1)):   # contexts of different lengths, one of a single row
    runner.add_context(seq, 0, torch.randn(n, runner.feature_dim, generator=gen))
items = [DraftItem("a", 5, 9), DraftItem("b", 7, 40), DraftItem("c", 3, 1)]
drafts = []
for on in (False, True, False):   # the gather path again after the in-place one: its block rows change nothing
    runner.slot_attention = on    # the kernel, forced on where it would not be chosen (a CPU, float32)
    drafts.append(runner.draft(items, 6))
for lp, ids in drafts[1:]:
    assert torch.equal(ids, drafts[0][1])
    assert (lp - drafts[0][0]).abs().max().item() <= 1e-4 * drafts[0][0].abs().max().item()
print("ok")
"""


@needs_triton
def test_a_draft_attending_in_place_over_its_slot_equals_the_gathered_rows(tmp_path):
    """DrafterRunner.slot_attention under Triton's interpreter (float32): three sequences of 1, 9 and 40 context
    rows drafted at once, the block's K/V written past each context and the kernel reading the slots in place,
    against SDPA over the gathered rows; and the gathered path unchanged after it."""
    _run_interpreted(INTERPRETER_PATCH + INTERPRETED_SLOT_DRAFT.replace("sys.argv[1]", repr(str(tmp_path))))


def test_drafts_attend_in_place_only_where_the_kernel_runs_and_every_layer_is_full_and_bidirectional(dirs, monkeypatch):
    """The choice at load: a full-attention drafter takes the kernel where it is available; a drafter with sliding
    layers keeps the gathered rows (the kernel has no window); DDTREE_TREE_ATTENTION=off turns it off."""
    from ddtree_serve.kernels import tree_attention

    assert not _runner(dirs, "full").slot_attention   # a CPU: the kernel is not available
    monkeypatch.setattr(tree_attention, "available", lambda device, head_dim, dtype: True)
    assert _runner(dirs, "full").slot_attention
    assert not _runner(dirs, "mixed").slot_attention
    monkeypatch.setenv(tree_attention.ENV_VAR, "off")
    assert not _runner(dirs, "full").slot_attention
