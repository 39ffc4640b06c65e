"""Prefix caching: a released sequence's rows parked in its slot serve the next prompt that starts with its tokens,
and the result equals running the whole prompt (transformers' generate is the oracle)."""
from __future__ import annotations

import pytest
import torch

from ddtree_serve.decoding.config import SamplingParams
from ddtree_serve.prefix_match import common_prefix_len, reusable_rows
from target_svc.kv_cache import CacheSpec, KVCache
from target_svc.runner import PrefillItem, TargetConfig, TargetRunner, VerifyItem
from tests.conftest import hf_greedy, reference_model
from tests.fixtures import make_tiny_qwen3, make_tiny_qwen3_5

VOCAB = 320


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {"qwen3": make_tiny_qwen3(tmp_path_factory.mktemp("qwen3"), seed=31),
            "qwen3_5": make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5"), seed=32)}


@pytest.fixture(scope="module")
def references(checkpoints):
    """transformers' own models, eos disabled (the oracle)."""
    return {name: reference_model(str(path)) for name, path in checkpoints.items()}


def _runner(path, max_batch: int = 2) -> TargetRunner:
    return TargetRunner(TargetConfig(model_dir=str(path), max_batch=max_batch, max_seq_len=256, max_tree_nodes=16))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(runner: TargetRunner, seq_id: str, prompt: list[int], n: int, **reuse) -> tuple[list[int], int]:
    """Greedy: prefill (with the given reuse) then root-only steps -> (n new tokens, prompt rows reused)."""
    out = runner.prefill([PrefillItem(seq_id, prompt, SamplingParams(), **reuse)])[0]
    tokens = [out.next_token]
    while len(tokens) < n:
        tokens.append(runner.verify([VerifyItem(seq_id, [tokens[-1]], [-1])])[0].next_token)
    return tokens, out.reused


def test_common_prefix_len_counts_the_shared_leading_ids():
    assert common_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([7], [8]) == 0


def test_reusable_rows_leave_the_last_prompt_token_to_run_and_respect_the_limit():
    held = [1, 2, 3, 4]
    assert reusable_rows(held, [1, 2, 3, 4, 5], limit=10, whole=False) == 4
    assert reusable_rows(held, [1, 2, 3, 4], limit=10, whole=False) == 3   # the last prompt token always runs
    assert reusable_rows(held, [1, 2, 3, 4, 5], limit=2, whole=False) == 2
    assert reusable_rows(held, [1, 2, 9, 9, 9], limit=10, whole=False) == 2


def test_reusable_rows_of_a_recurrent_cache_are_all_or_nothing():
    held = [1, 2, 3, 4]
    assert reusable_rows(held, [1, 2, 3, 4, 5], limit=10, whole=True) == 4
    assert reusable_rows(held, [1, 2, 9, 9, 9], limit=10, whole=True) == 0
    assert reusable_rows(held, [1, 2, 3, 4, 5], limit=3, whole=True) == 0


def _cache(max_batch: int = 2) -> KVCache:
    return KVCache.allocate(CacheSpec(max_batch=max_batch, max_seq_len=8, max_tree_nodes=2, num_full_layers=1,
                                      num_kv_heads=1, head_dim=2, linear_shapes=(), device=torch.device("cpu"),
                                      dtype=torch.float32))


def test_a_parked_slot_keeps_its_rows_for_the_sequence_that_adopts_it():
    c = _cache()
    slot = c.add_sequence("a")
    c.ctx_len[slot] = 3
    c.park("a", [5, 6, 7])
    assert c.num_sequences == 0 and c.slots_available == 2
    assert c.adopt("b", "a") == (slot, [5, 6, 7])
    assert c.ctx_len[slot] == 3 and c.slot("b") == slot
    with pytest.raises(KeyError):
        c.adopt("c", "a")   # adopted once only


def test_a_new_sequence_takes_free_slots_before_the_oldest_parked_one():
    c = _cache(max_batch=2)
    for sid in ("a", "b"):
        c.add_sequence(sid)
    c.park("a", [])
    c.park("b", [])
    c.add_sequence("c")          # no free slot: evicts "a", the oldest parked
    assert list(c.parked) == ["b"]
    with pytest.raises(RuntimeError, match="capacity"):
        c.add_sequence("d") and c.add_sequence("e")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_a_follow_up_prompt_reusing_the_parked_turn_equals_transformers_on_the_whole_prompt(arch, checkpoints,
                                                                                            references):
    runner = _runner(checkpoints[arch])
    first = _prompt(21, seed=1)
    answer, reused = _generate(runner, "turn1", first, 12)
    assert reused == 0
    runner.release("turn1", park=True)
    # The cache holds the prompt and every generated token but the last (pending, never written).
    follow_up = first + answer + _prompt(9, seed=2)
    tokens, reused = _generate(runner, "turn2", follow_up, 16, reuse_from="turn1", reuse_max=len(follow_up))
    assert reused == len(first) + len(answer) - 1
    assert tokens == hf_greedy(references[arch], follow_up, 16)


def test_a_dense_target_reuses_a_partial_prefix(checkpoints, references):
    runner = _runner(checkpoints["qwen3"])
    shared = _prompt(17, seed=3)
    _generate(runner, "a", shared + _prompt(5, seed=4), 4)
    runner.release("a", park=True)
    other = shared + _prompt(6, seed=5)
    tokens, reused = _generate(runner, "b", other, 10, reuse_from="a", reuse_max=100)
    assert reused == len(shared)
    assert tokens == hf_greedy(references["qwen3"], other, 10)


def test_a_hybrid_target_reuses_nothing_of_a_partial_prefix(checkpoints, references):
    runner = _runner(checkpoints["qwen3_5"])
    assert runner.prefix_reuse == "context"
    shared = _prompt(17, seed=3)
    _generate(runner, "a", shared + _prompt(5, seed=4), 4)
    runner.release("a", park=True)
    other = shared + _prompt(6, seed=5)
    tokens, reused = _generate(runner, "b", other, 10, reuse_from="a", reuse_max=100)
    assert reused == 0
    assert tokens == hf_greedy(references["qwen3_5"], other, 10)


def test_reuse_is_capped_by_reuse_max_and_skipped_for_prompt_logprobs(checkpoints):
    runner = _runner(checkpoints["qwen3"])
    prompt = _prompt(20, seed=6)
    _generate(runner, "a", prompt, 2)
    runner.release("a", park=True)
    assert _generate(runner, "b", prompt + [9], 2, reuse_from="a", reuse_max=7)[1] == 7
    runner.release("b", park=True)
    out = runner.prefill([PrefillItem("c", prompt + [9], SamplingParams(), prompt_logprobs=0, reuse_from="b",
                                      reuse_max=100)])[0]
    assert out.reused == 0 and len(out.prompt_logprobs) == len(prompt)


def test_an_unknown_or_evicted_parked_sequence_means_a_plain_prefill(checkpoints):
    runner = _runner(checkpoints["qwen3"], max_batch=1)
    prompt = _prompt(12, seed=7)
    want, _ = _generate(runner, "a", prompt, 6)
    runner.release("a", park=True)
    assert _generate(runner, "b", prompt, 6, reuse_from="nobody", reuse_max=100) == (want, 0)
    runner.release("b")   # not parked: "a"'s slot went to "b" and its rows are gone
    assert _generate(runner, "c", prompt, 6, reuse_from="a", reuse_max=100) == (want, 0)


# ---- the gateway's index ------------------------------------------------------------------------------------------
def test_the_index_names_the_parked_sequence_sharing_the_longest_prefix_and_forgets_it():
    from gateway.prefix_index import PrefixHit, PrefixIndex

    index = PrefixIndex(capacity=4, min_tokens=2)
    index.add("short", [1, 2, 3])
    index.add("long", [1, 2, 3, 4, 5])
    index.add("other", [9, 9, 9])
    assert index.take([1, 2, 3, 4, 5, 6]) == PrefixHit("long", 5)
    assert index.take([1, 2, 3, 4, 5, 6]) == PrefixHit("short", 3)   # "long" was taken: a slot is adopted once
    assert index.take([1, 2, 3, 4, 5, 6]) is None


def test_the_index_keeps_salts_apart_and_whole_matches_whole():
    from gateway.prefix_index import PrefixHit, PrefixIndex

    index = PrefixIndex(capacity=4, min_tokens=2)
    index.add("a", [1, 2, 3, 4], salt="tenant-a")
    assert index.take([1, 2, 3, 4, 5], salt="tenant-b") is None
    assert index.take([1, 2, 3, 9, 9], salt="tenant-a", whole=True) is None
    assert index.take([1, 2, 3, 4, 5], salt="tenant-a", whole=True) == PrefixHit("a", 4)


def test_the_index_drops_its_oldest_entry_past_capacity_and_ignores_short_ones():
    from gateway.prefix_index import PrefixIndex

    index = PrefixIndex(capacity=2, min_tokens=3)
    index.add("tiny", [1, 2])
    index.add("a", [1, 2, 3])
    index.add("b", [4, 5, 6])
    index.add("c", [7, 8, 9])
    assert len(index) == 2 and index.take([1, 2, 3, 4]) is None and index.take([7, 8, 9, 1]).seq_id == "c"


def test_a_state_snapshot_serves_whole_matches_as_a_copy_and_stays():
    from gateway.prefix_index import PrefixHit, PrefixIndex

    index = PrefixIndex(capacity=8, min_tokens=2)
    index.add_snapshot("a", [1, 2, 3])
    assert index.take([1, 2, 3, 7], whole=True) == PrefixHit("a", 3, copy=True)
    assert index.take([1, 2, 3, 8], whole=True) == PrefixHit("a", 3, copy=True)   # copied, so it stays
    assert index.take([1, 2, 9, 8], whole=True) is None
    assert index.take([1, 2, 3, 7]) is None   # a dense target keeps no snapshots: only a hybrid's lookups use them


def test_a_snapshot_goes_with_its_slot_to_the_sequence_adopting_it_and_with_its_sequence_when_forgotten():
    from gateway.prefix_index import PrefixHit, PrefixIndex

    index = PrefixIndex(capacity=8, min_tokens=2)
    index.add("a", [1, 2, 3, 4, 5])   # parked, with a snapshot after 3 tokens
    index.add_snapshot("a", [1, 2, 3])
    assert index.take([1, 2, 3, 4, 5, 6], whole=True, adopter="b") == PrefixHit("a", 5)
    assert index.take([1, 2, 3, 9], whole=True) == PrefixHit("b", 3, copy=True)
    index.discard("b")
    assert index.take([1, 2, 3, 9], whole=True) is None


def test_on_a_hybrid_newcomers_wait_for_the_snapshot_of_a_system_prompt_in_flight_or_ahead_of_them():
    from gateway.prefix_index import held_back_for_snapshots

    system, other = list(range(20)), list(range(50, 70))
    newcomers = [(system + [90, 91], 20, ""),    # its system prompt's snapshot is still to come in flight: waits
                 (other + [92], 20, ""),         # nothing ahead: runs, and its snapshot is ahead of the next
                 (other + [93, 94], 20, ""),     # waits for the one before it
                 (other + [95], 20, "tenant"),   # another salt: runs
                 (system[:19] + [7, 8], 19, "")]  # shares 19 tokens, not the whole snapshot prefix: runs
    assert held_back_for_snapshots(newcomers, [(system, "")]) == [0, 2]


def test_a_prefill_chunk_ends_where_the_target_keeps_a_snapshot():
    from gateway.scheduler import plan_prefill_chunks
    from gateway.sequence import Sequence

    s = Sequence(request_id="r", prompt_ids=list(range(30)), max_tokens=4, sampling=SamplingParams(), mode="ar",
                 budget=0, stop_token_ids=frozenset(), detokenizer=None, snapshot_at=20)
    assert plan_prefill_chunks([s], 64) == [(s, 20)]
    s.prefilled = 20
    assert plan_prefill_chunks([s], 64) == [(s, 10)]
    s.prefilled = 0
    assert plan_prefill_chunks([s], 8) == [(s, 8)]   # chunks shorter than the way there are cut as usual


# ---- the drafter's parked slots -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drafter_dirs(tmp_path_factory):
    from tests.fixtures.tiny_drafter import make_tiny_drafter

    root = tmp_path_factory.mktemp("drafter")
    target = make_tiny_qwen3(root / "target")
    return target, make_tiny_drafter(root / "drafter", target, seed=1, block_size=8, target_layer_ids=[0, 2])


def _drafter(drafter_dirs, max_batch: int = 2):
    from drafter_svc.runner import DrafterConfig, DrafterRunner

    target, drafter = drafter_dirs
    return DrafterRunner(DrafterConfig(str(drafter), str(target), max_batch=max_batch, max_seq_len=64))


def test_an_adopted_drafter_slot_drafts_as_if_its_rows_were_pushed_again(drafter_dirs):
    from drafter_svc.runner import DraftItem

    parked, fresh = _drafter(drafter_dirs), _drafter(drafter_dirs)
    feats = torch.randn(30, parked.feature_dim, generator=torch.Generator().manual_seed(0))
    parked.add_context("turn1", 0, feats[:20])
    assert parked.release("turn1", park=True) and parked.parked_ids() == ["turn1"]
    assert parked.adopt("turn2", "turn1", rows=25) == 20   # it holds 20 rows, not the 25 asked for
    parked.add_context("turn2", 20, feats[20:])
    fresh.add_context("turn2", 0, feats)
    got, want = (r.draft([DraftItem("turn2", 5, 30)], top_k=4) for r in (parked, fresh))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], want[1])


def test_an_adopted_slots_first_push_may_start_below_its_rows_and_then_only_there(drafter_dirs):
    r = _drafter(drafter_dirs)
    feats = torch.randn(20, r.feature_dim, generator=torch.Generator().manual_seed(1))
    r.add_context("a", 0, feats)
    r.release("a", park=True)
    assert r.adopt("b", "a", rows=20) == 20
    r.add_context("b", 12, feats[12:15])   # the target reused only 12: rows 12.. come again
    assert r.context_len("b") == 15
    with pytest.raises(ValueError, match="start at 10, expected 15"):
        r.add_context("b", 10, feats[:2])


def test_the_drafter_adopts_nothing_unknown_and_evicts_its_oldest_parked_slot_first(drafter_dirs):
    r = _drafter(drafter_dirs, max_batch=2)
    feats = torch.randn(4, r.feature_dim)
    for sid in ("a", "b"):
        r.add_context(sid, 0, feats)
        r.release(sid, park=True)
    assert r.adopt("x", "nobody", rows=4) == 0
    r.add_context("c", 0, feats)   # no free slot: "a", the oldest parked, goes
    assert r.parked_ids() == ["b"] and r.adopt("y", "a", rows=4) == 0


# ---- copies from a running sequence (dense targets) ---------------------------------------------------------------
def test_a_dense_target_copies_a_running_sequences_rows_and_both_go_on_as_transformers(checkpoints, references):
    runner = _runner(checkpoints["qwen3"], max_batch=3)
    shared = _prompt(19, seed=8)
    first, second = shared + _prompt(4, seed=9), shared + _prompt(6, seed=10)
    out_a = runner.prefill([PrefillItem("a", first, SamplingParams())])[0]
    out_b = runner.prefill([PrefillItem("b", second, SamplingParams(), reuse_from="a", reuse_max=100,
                                        reuse_copy=True)])[0]
    assert out_b.reused == len(shared)
    tokens = {"a": [out_a.next_token], "b": [out_b.next_token]}
    while len(tokens["a"]) < 12:   # both decode side by side: the copy left "a"'s own rows alone
        for sid, out in zip("ab", runner.verify([VerifyItem(s, [tokens[s][-1]], [-1]) for s in "ab"])):
            tokens[sid].append(out.next_token)
    assert tokens["a"] == hf_greedy(references["qwen3"], first, 12)
    assert tokens["b"] == hf_greedy(references["qwen3"], second, 12)


def test_a_copy_from_a_parked_slot_keeps_it_parked_while_another_slot_is_free(checkpoints):
    runner = _runner(checkpoints["qwen3"], max_batch=2)
    prompt = _prompt(20, seed=11)
    _generate(runner, "a", prompt, 2)
    runner.release("a", park=True)
    assert _generate(runner, "b", prompt + [5], 2, reuse_from="a", reuse_max=100, reuse_copy=True)[1] == 20
    assert list(runner.model.cache.parked) == ["a"]   # copied from, still parked
    # No free slot left: the copy adopts the parked slot instead.
    assert _generate(runner, "c", prompt + [6], 2, reuse_from="a", reuse_max=100, reuse_copy=True)[1] == 20
    assert not runner.model.cache.parked


def test_a_hybrid_target_copies_nothing(checkpoints):
    runner = _runner(checkpoints["qwen3_5"], max_batch=3)
    prompt = _prompt(20, seed=12)
    runner.prefill([PrefillItem("a", prompt, SamplingParams())])
    out = runner.prefill([PrefillItem("b", prompt + [5], SamplingParams(), reuse_from="a", reuse_max=100,
                                      reuse_copy=True)])[0]
    assert out.reused == 0


def test_the_drafter_copies_a_running_sequences_rows_into_a_slot_of_its_own(drafter_dirs):
    from drafter_svc.runner import DraftItem

    shared, fresh = _drafter(drafter_dirs, max_batch=3), _drafter(drafter_dirs)
    feats = torch.randn(24, shared.feature_dim, generator=torch.Generator().manual_seed(2))
    shared.add_context("a", 0, feats[:16])
    assert shared.adopt("b", "a", rows=12, copy=True) == 12
    shared.add_context("b", 12, feats[16:24])
    fresh.add_context("b", 0, torch.cat([feats[:12], feats[16:24]]))
    got, want = (r.draft([DraftItem("b", 5, 20)], top_k=4) for r in (shared, fresh))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert shared.context_len("a") == 16 and shared.adopt("c", "a", rows=4) == 0   # running: only copies


def test_the_index_keeps_a_running_entry_for_copies_and_hybrid_targets_skip_it():
    from gateway.prefix_index import PrefixHit, PrefixIndex

    index = PrefixIndex(capacity=4, min_tokens=2)
    index.add("run", [1, 2, 3, 4], running=True)
    assert index.take([1, 2, 3, 4, 5]) == PrefixHit("run", 4, copy=True)
    assert index.take([1, 2, 3, 4, 5]) == PrefixHit("run", 4, copy=True)   # still there
    assert index.take([1, 2, 3, 4, 5], whole=True) is None
    index.add("run", [1, 2, 3, 4, 5, 6])   # released: parked now, adopted once
    assert index.take([1, 2, 3, 4, 5, 6, 7]) == PrefixHit("run", 6, copy=False)
    assert index.take([1, 2, 3, 4, 5, 6, 7]) is None


def test_newcomers_sharing_a_prefix_with_one_ahead_of_them_wait_and_the_first_of_a_group_runs():
    from gateway.prefix_index import PendingPrompt, held_back_for_shared_prefixes

    system = list(range(100, 120))
    newcomers = [PendingPrompt(system + [1, 2]), PendingPrompt(system + [3]), PendingPrompt(system + [4], "other"),
                 PendingPrompt(list(range(20))), PendingPrompt(system + [4], "other")]
    # The first of the shared-prefix group runs; the second waits for it; another salt is a group of its own.
    assert held_back_for_shared_prefixes(newcomers, [], min_tokens=16) == [1, 4]
    # A prompt already in flight counts as ahead of every newcomer.
    assert held_back_for_shared_prefixes(newcomers[:2], [PendingPrompt(system)], min_tokens=16) == [0, 1]


def test_a_newcomer_is_not_held_back_for_less_than_the_least_reusable_prefix():
    from gateway.prefix_index import PendingPrompt, held_back_for_shared_prefixes

    ahead = [PendingPrompt(list(range(40)))]
    assert held_back_for_shared_prefixes([PendingPrompt(list(range(15)) + [99])], ahead, min_tokens=16) == []
    # An identical prompt reuses all but its last token (which runs to give the first sample): 16 rows of 17.
    assert held_back_for_shared_prefixes([PendingPrompt(list(range(17)))], ahead, min_tokens=16) == [0]
    assert held_back_for_shared_prefixes([PendingPrompt(list(range(16)))], ahead, min_tokens=16) == []
