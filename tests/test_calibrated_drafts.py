"""Calibrated acceptance (bench-only): the rewrite, the profile's rescaling, and the real services with a calibrator."""
from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from gateway.calibrated_drafts import (CalibrationDraw, CalibrationProfile, DraftCalibrator, ReferenceStore,
                                       WatchedReferences, chain_tau, place_calibration, rewrite, simulated_tree_tau)
from tests.conftest import make_request, prompts_for, run_streams, start_stack


def flat_profile(p0: float, k: int = 8, depths: int = 15, absent: float = 0.0) -> CalibrationProfile:
    """P(rank 0) = p0 at every depth, the rest spread evenly over ranks 1..k-1 (and `absent`)."""
    rest = (1 - p0 - absent) / (k - 1)
    row = [p0] + [rest] * (k - 1) + [absent]
    lps = [-0.1 * (r + 1) * (r + 1) for r in range(k)]
    return CalibrationProfile([list(row) for _ in range(depths)], [list(lps) for _ in range(depths)])


def drafter_lists(depth: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(50, generator=g)[:k] for _ in range(depth)])
    lp = torch.sort(torch.randn(depth, k, generator=g), descending=True).values - 3
    return lp, ids


def test_rewrite_puts_the_true_token_at_the_sampled_rank_and_keeps_the_other_ids_distinct_and_in_order():
    profile = flat_profile(0.3, k=8, absent=0.2)
    for seed in range(200):
        lp, ids = drafter_lists(6, 8, seed)
        # some true tokens already in the drafter's list (at another rank), some not, one unknown depth
        future = [int(ids[0, 5]), 77, int(ids[2, 0]), 78, int(ids[4, 7])]
        new_lp, new_ids = rewrite(lp, ids, future, profile, random.Random(seed))
        ranks = profile.sample_ranks(len(future), random.Random(seed))
        for d, (true, rank) in enumerate(zip(future, ranks)):
            row = new_ids[d].tolist()
            assert len(set(row)) == 8
            if rank < 8:
                assert row[rank] == true and row.count(true) == 1
            else:
                assert true not in row
            drafted = [t for t in ids[d].tolist() if t != true]
            kept = [t for t in row if t != true and t in drafted]
            assert kept == drafted[:len(kept)] and len(kept) >= 7   # the drafter's order; at most one filler
            assert new_lp[d].tolist() == pytest.approx(profile.logprobs_for(d, 8))
        assert torch.equal(new_ids[5], ids[5]) and torch.equal(new_lp[5], lp[5])  # no future token: unchanged


def test_a_draft_without_the_true_tokens_gets_each_inserted_at_its_rank_before_the_drafters_own_order():
    """The usual case (a random drafter never drafts the reference's tokens): row d is the drafter's row with
    true token d inserted at its drawn rank and the last id dropped; an absent rank leaves the row as drafted."""
    lp, ids = drafter_lists(5, 8, seed=4)                 # ids < 50
    true = [60, 61, 62, 63, 64]
    draw = CalibrationDraw(5, 8, np.array(true), np.array([0, 3, 7, 8, 5]), np.zeros((5, 8), dtype=np.float32))
    new_lp, new_ids = place_calibration(draw, lp, ids)
    for d, rank in enumerate(draw.ranks):
        row = ids[d].tolist()
        want = row if rank >= 8 else row[:rank] + [true[d]] + row[rank:7]
        assert new_ids[d].tolist() == want
    assert torch.equal(new_lp, torch.zeros(5, 8))


def test_rewrite_truncates_and_extends_the_profile_k():
    profile = flat_profile(0.5, k=8)
    for k in (1, 3, 20):
        lp, ids = drafter_lists(4, k, seed=k)
        new_lp, new_ids = rewrite(lp, ids, [60, 61, 62, 63], profile, random.Random(1))
        assert new_ids.shape == (4, k)
        for d in range(4):
            assert len(set(new_ids[d].tolist())) == k
            assert all(a >= b for a, b in zip(new_lp[d].tolist(), new_lp[d].tolist()[1:]))


def test_rank_frequencies_follow_the_profile():
    profile = flat_profile(0.6, k=4, absent=0.1)
    rng, counts = random.Random(3), [0] * 5
    for _ in range(20000):
        counts[profile.sample_rank(0, rng)] += 1
    assert [c / 20000 for c in counts] == pytest.approx([0.6, 0.1, 0.1, 0.1, 0.1], abs=0.015)


@pytest.mark.parametrize("tau", [2.0, 4.55, 7.79, 12.0])
def test_rescaling_hits_the_chain_tau_and_keeps_the_other_ranks_proportions(tau):
    rows = [[0.5 - 0.02 * d, 0.2, 0.1, 0.05, 0.15 + 0.02 * d] for d in range(15)]
    profile = CalibrationProfile(rows, [[-0.5, -1.5, -2.5, -3.5]] * 15)
    scaled = profile.rescaled_to_chain_tau(tau)
    assert scaled.chain_tau() == pytest.approx(tau, abs=1e-6)
    assert chain_tau(scaled.p_top1()) == pytest.approx(tau, abs=1e-6)
    assert scaled.meta["rescaled_to_chain_tau"] == tau
    for old, new in zip(profile.rank_probs, scaled.rank_probs):
        assert sum(new) == pytest.approx(1.0)
        assert [x / sum(new[1:]) for x in new[1:]] == pytest.approx([x / sum(old[1:]) for x in old[1:]])
    # one scalar for every depth: the order of P(rank 0) across depths is kept
    top = scaled.p_top1()
    assert all(a >= b for a, b in zip(top, top[1:]))
    with pytest.raises(ValueError):
        profile.rescaled_to_chain_tau(17.0)


def conditional_profile(k: int = 4, depths: int = 15) -> CalibrationProfile:
    """Marginal P(rank 0) = 0.5, but 0.8 after a hit and 0.2 after a miss (correlated depths)."""
    def row(p0):
        return [p0] + [(1 - p0) / k] * k
    return CalibrationProfile([row(0.5)] * depths, [[-0.5 * (r + 1) for r in range(k)]] * depths,
                              rank_probs_after_hit=[row(0.8)] * depths, rank_probs_after_miss=[row(0.2)] * depths)


def test_conditional_profile_draws_given_the_previous_depth_and_rescales(tmp_path):
    profile = conditional_profile()
    rng, after = random.Random(5), {True: [0, 0], False: [0, 0]}
    for _ in range(5000):
        ranks = profile.sample_ranks(15, rng)
        for prev, cur in zip(ranks, ranks[1:]):
            after[prev == 0][0] += cur == 0
            after[prev == 0][1] += 1
    assert after[True][0] / after[True][1] == pytest.approx(0.8, abs=0.02)
    assert after[False][0] / after[False][1] == pytest.approx(0.2, abs=0.02)
    assert profile.chain_tau() == pytest.approx(chain_tau([0.5] + [0.8] * 14))
    scaled = profile.rescaled_to_chain_tau(7.79)
    assert scaled.chain_tau() == pytest.approx(7.79, abs=1e-6) and scaled.conditional
    assert scaled.rank_probs_after_miss[3][0] > 0.2  # every table moves with the one factor
    chain_like = CalibrationProfile(scaled.rank_probs, [[0.0] + [-1000.0] * 3] * 15, [], {},
                                    scaled.rank_probs_after_hit, scaled.rank_probs_after_miss)
    assert simulated_tree_tau(chain_like, 15, trials=20000) == pytest.approx(7.79, rel=0.03)
    scaled.save(tmp_path / "c.json")
    again = CalibrationProfile.load(tmp_path / "c.json")
    assert again.rank_probs_after_hit == scaled.rank_probs_after_hit and again.chain_tau() == pytest.approx(7.79)


def test_profile_json_round_trip_and_simulated_tree_tau(tmp_path):
    profile = flat_profile(0.7, k=8, absent=0.05)
    profile.meta["source"] = "test"
    profile.save(tmp_path / "p.json")
    again = CalibrationProfile.load(tmp_path / "p.json")
    assert again.rank_probs == profile.rank_probs and again.mean_logprobs == profile.mean_logprobs
    assert again.meta == {"source": "test"}
    # a budget-15 tree whose log-probs make it a chain: the simulation agrees with the closed form
    chain_like = CalibrationProfile(profile.rank_probs, [[0.0] + [-1000.0] * 7] * 15)
    assert simulated_tree_tau(chain_like, 15, trials=20000) == pytest.approx(chain_like.chain_tau(), rel=0.03)
    assert simulated_tree_tau(profile, 64, trials=4000) > profile.chain_tau()


def test_reference_store_future_tokens_and_watched_file(tmp_path):
    store = ReferenceStore({(1, 2, 3): [10, 11, 12, 13]})
    assert store.future_tokens([1, 2, 3], [10], 2) == [11, 12]
    assert store.future_tokens([1, 2, 3], [10, 11, 12], 5) == [13]
    assert store.future_tokens([1, 2, 3], [10, 11, 12, 13], 5) == []       # reference ran out
    assert store.future_tokens([1, 2, 3], [10, 99], 5) == []               # diverged: not a prefix
    assert store.future_tokens([1, 2], [10], 5) == []                      # unknown prompt
    watched = WatchedReferences(tmp_path / "refs.json")
    assert len(watched.current()) == 0                                     # not written yet
    store.save(tmp_path / "refs.json")
    assert watched.current().future_tokens([1, 2, 3], [], 1) == [10]
    cal = DraftCalibrator(flat_profile(1.0, k=4), watched)
    lp, ids = drafter_lists(3, 4)
    _, new_ids = cal.rewrite_sequence([1, 2, 3], [10, 11], lp, ids)
    assert new_ids[0, 0].item() == 12 and new_ids[1, 0].item() == 13 and torch.equal(new_ids[2], ids[2])
    assert (cal.counters.rewritten_depths, cal.counters.unchanged_depths) == (2, 1)


def test_a_draw_made_before_the_draft_arrives_places_what_a_rewrite_after_it_would():
    refs = ReferenceStore({(1, 2, 3): list(range(100, 140))})
    lp, ids = drafter_lists(6, 8, seed=3)
    early = DraftCalibrator(flat_profile(0.6), refs, seed=7)
    late = DraftCalibrator(flat_profile(0.6), refs, seed=7)
    draw = early.draw([1, 2, 3], [100, 101], depth=6, k=8)
    placed = early.apply(draw, [1, 2, 3], [100, 101], lp, ids)
    rewritten = late.rewrite_sequence([1, 2, 3], [100, 101], lp, ids)
    assert torch.equal(placed[1], rewritten[1]) and torch.equal(placed[0], rewritten[0])
    assert early.counters == late.counters


def test_a_draft_of_other_shapes_than_drawn_for_is_calibrated_afresh_and_counted_once():
    refs = ReferenceStore({(1, 2, 3): list(range(100, 140))})
    cal = DraftCalibrator(flat_profile(0.6), refs)
    draw = cal.draw([1, 2, 3], [100], depth=6, k=8)
    lp, ids = drafter_lists(4, 8)
    new_lp, new_ids = cal.apply(draw, [1, 2, 3], [100], lp, ids)
    assert new_ids.shape == (4, 8) and (new_ids == torch.arange(101, 105)[:, None]).any(1).sum() >= 1
    assert cal.counters.rewritten_depths == 6        # the first draw's count; the redraw is not counted


# ---- through the real services -------------------------------------------------------------------------------------
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def calibrated_stack(checkpoints, tmp_path_factory):
    """One stack on the tiny Qwen3 pair whose gateway calibrates with P(rank 0) = 0.9 at every depth; the
    references file does not exist yet when the gateway starts."""
    target, drafter = checkpoints("qwen3")
    d = tmp_path_factory.mktemp("calib")
    flat_profile(0.9, k=8).save(d / "profile.json")
    refs = d / "refs.json"
    stack = start_stack(target, drafter, extra={"gateway": ["--calibrated-acceptance", str(d / "profile.json"),
                                                            "--calibration-references", str(refs)]})
    try:
        yield stack, target, refs
    finally:
        stack.stop()


def test_calibrated_services_keep_ar_outputs_and_accept_like_the_profile(calibrated_stack):
    stack, target, refs = calibrated_stack
    prompts = prompts_for(target, [6, 11, 17], seed=21)
    ar = run_streams(stack.gateway, [make_request(p, MAX_TOKENS, "ar") for p in prompts])
    # before the references exist nothing is rewritten: the tiny random drafter accepts next to nothing
    plain = run_streams(stack.gateway, [make_request(prompts[0], MAX_TOKENS, "dflash")])[0]
    ReferenceStore({tuple(p): r["token_ids"] for p, r in zip(prompts, ar)}).save(refs)
    requests = [make_request(p, MAX_TOKENS, mode, 16 if mode == "ddtree" else 0)
                for mode in ("ddtree", "dflash") for p in prompts]
    results = run_streams(stack.gateway, requests)
    for i, r in enumerate(results):
        assert r["token_ids"] == ar[i % len(prompts)]["token_ids"]
    assert plain["token_ids"] == ar[0]["token_ids"]
    assert plain["stats"].mean_acceptance_length < 1.5
    for r in results:
        assert r["stats"].mean_acceptance_length > 2.5, r["stats"]
    log = (Path(stack.log_dir) / "gateway.log").read_text()
    assert "CALIBRATED ACCEPTANCE (BENCH-ONLY)" in log and "loaded 3 reference continuations" in log


def test_a_rescaled_profile_drafts_with_the_log_probs_of_its_own_rank_frequencies():
    """A drafter that accepts like the rescaled profile is as confident as its frequencies: log P_d(rank r),
    sorted (non-increasing) along the ranks."""
    profile = flat_profile(0.5, k=8, absent=0.1)
    scaled = profile.rescaled_to_chain_tau(6.0)
    for probs, lps in zip(scaled.rank_probs, scaled.mean_logprobs):
        assert lps[0] == pytest.approx(math.log(probs[0]))
        assert all(a >= b for a, b in zip(lps, lps[1:]))
    assert "calibrated drafter" in scaled.meta["logprobs"]   # the report says where the log-probs come from



def test_numpy_drafts_are_placed_as_tensors_are_and_stay_numpy():
    lp, ids = drafter_lists(5, 8, seed=4)
    for true in ([60, 61, 62, 63, 64], ids[:, 2].tolist()):   # none drafted; each drafted (at rank 2)
        draw = CalibrationDraw(5, 8, np.array(true), np.array([0, 3, 7, 8, 5]), np.zeros((5, 8), dtype=np.float32))
        want_lp, want_ids = place_calibration(draw, lp, ids)
        got_lp, got_ids = place_calibration(draw, lp.numpy(), ids.numpy())
        assert isinstance(got_lp, np.ndarray) and isinstance(got_ids, np.ndarray)
        assert np.array_equal(got_lp, want_lp.numpy()) and np.array_equal(got_ids, want_ids.numpy())
