"""Step-replay calibration (bench-only): a calibrated drafter replaying measured rows, its rescaling, its use."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from gateway.calibrated_drafts import DraftCalibrator, ReferenceStore, load_profile, rewrite
from gateway.replay_profile import NO_REFERENCE, ReplayProfile, sharpen


def rows(probs: list[list[float]]) -> torch.Tensor:
    """[D, K] sorted log-probs from explicit top-K probabilities (whatever is left is outside the top-K)."""
    return torch.tensor(probs).log()


def two_step_profile() -> ReplayProfile:
    """One confident step and one unsure step, 3 depths, K = 3."""
    confident = rows([[0.9, 0.05, 0.03]] * 3)
    unsure = rows([[0.5, 0.4, 0.05]] * 3)
    ranks = torch.tensor([[0, 0, 1], [1, NO_REFERENCE, NO_REFERENCE]])
    return ReplayProfile(torch.stack([confident, unsure]), ranks, meta={"source": "test"})


def test_sharpening_keeps_the_order_and_the_mass_and_grows_the_top_rank():
    lp = rows([[0.5, 0.3, 0.1]])
    for t in (0.3, 1.0, 2.0):
        top, absent = sharpen(lp.double(), t)
        total = top.exp().sum() + absent.exp().sum()
        assert total.item() == pytest.approx(1.0)
        assert torch.all(top[0, :-1] >= top[0, 1:])
    assert sharpen(lp.double(), 1.0)[0].exp()[0].tolist() == pytest.approx([0.5, 0.3, 0.1])
    # at T: p ** (1 / T) for the top-K, the outside mass as tokens no likelier than the K-th, renormalised
    t = 0.3
    raw = [0.5 ** (1 / t), 0.3 ** (1 / t), 0.1 ** (1 / t), 0.1 * 0.1 ** (1 / t - 1)]
    assert sharpen(lp.double(), t)[0][0, 0].exp().item() == pytest.approx(raw[0] / sum(raw))


def test_chain_tau_is_the_mean_of_each_steps_closed_form():
    profile = two_step_profile()
    expect = ((1 + 0.9 + 0.9 ** 2 + 0.9 ** 3) + (1 + 0.5 + 0.5 ** 2 + 0.5 ** 3)) / 2
    assert profile.chain_tau() == pytest.approx(expect)
    assert profile.chain_tau(depth=1) == pytest.approx(1 + (0.9 + 0.5) / 2)


def test_ranks_are_drawn_from_the_replayed_steps_rows():
    profile = ReplayProfile(rows([[0.6, 0.3, 0.05]])[None], None)
    rng = random.Random(0)
    counts = [0, 0, 0, 0]
    for _ in range(20000):
        ranks, lp = profile.draw(1, 3, rng)
        counts[int(ranks[0])] += 1
    assert [c / 20000 for c in counts] == pytest.approx([0.6, 0.3, 0.05, 0.05], abs=0.015)
    assert np.exp(lp[0]).tolist() == pytest.approx([0.6, 0.3, 0.05], rel=1e-3)


def test_draw_truncates_extends_and_reuses_the_last_depth():
    profile = two_step_profile()
    ranks, lp = profile.draw(5, 2, random.Random(3))        # deeper than measured, K smaller than measured
    assert lp.shape == (5, 2) and ranks.shape == (5,)
    assert np.array_equal(lp[4], lp[2])
    ranks, lp = profile.draw(2, 6, random.Random(3))        # K larger: the rows continue their tail slope
    assert lp.shape == (2, 6) and np.all(lp[:, :-1] >= lp[:, 1:])
    assert all(0 <= r <= 3 for r in ranks)                  # 3: absent from the profile's own top-K


def test_rescaling_reaches_the_chain_tau_with_a_sharper_drafter():
    profile = two_step_profile()
    scaled = profile.rescaled_to_chain_tau(3.6)
    assert scaled.chain_tau() == pytest.approx(3.6, abs=1e-5)
    assert scaled.temperature < 1 and scaled.meta["rescaled_to_chain_tau"] == 3.6
    assert torch.equal(scaled.logprobs, profile.logprobs)   # the measured rows are kept; the temperature moves
    weaker = profile.rescaled_to_chain_tau(1.5)
    assert weaker.temperature > 1
    with pytest.raises(ValueError, match="out of reach"):
        profile.rescaled_to_chain_tau(4.5)                  # above 1 + depths


def test_a_tree_accepts_more_than_the_chain_when_the_drafter_is_unsure():
    profile = two_step_profile()
    assert profile.simulated_tree_tau(8, trials=2000) > profile.chain_tau() + 0.2
    one_node = profile.simulated_tree_tau(1, trials=4000)   # one node: the top token of depth 1
    assert one_node == pytest.approx(profile.chain_tau(depth=1), abs=0.02)


def test_measured_taus_walk_the_measured_ranks():
    profile = two_step_profile()
    chain, tree = profile.measured_taus(budget=8)
    assert chain == pytest.approx(1 + (2 + 0) / 2)          # step 1: two hits then rank 1; step 2: rank 1 first
    assert tree > chain                                     # the tree holds the rank-1 siblings


def test_save_load_round_trip_and_load_profile_picks_the_kind(tmp_path):
    profile = two_step_profile().rescaled_to_chain_tau(3.0)
    profile.save(tmp_path / "p.steps.npz")
    again = load_profile(tmp_path / "p.steps.npz")
    assert isinstance(again, ReplayProfile)
    assert again.temperature == pytest.approx(profile.temperature)
    assert torch.allclose(again.logprobs, profile.logprobs, atol=1e-3)   # stored as float16
    assert torch.equal(again.ranks, profile.ranks) and again.meta["source"] == "test"
    assert again.chain_tau() == pytest.approx(3.0, abs=1e-2)


def test_a_calibrator_rewrites_drafts_with_a_replay_profile():
    profile = ReplayProfile(rows([[0.999, 0.0005, 0.0001]] * 4)[None], None)
    cal = DraftCalibrator(profile, ReferenceStore({(1, 2): [10, 11, 12, 13, 14]}))
    ids = torch.tensor([[5, 6, 7]] * 4)
    lp = torch.full((4, 3), -3.0)
    new_lp, new_ids = cal.rewrite_sequence([1, 2], [10], lp, ids)
    assert new_ids[:, 0].tolist() == [11, 12, 13, 14]       # P(rank 0) 0.999 at every depth
    assert new_lp[0, 0].item() == pytest.approx(math.log(0.999), abs=1e-3)
    again_lp, again_ids = rewrite(lp, ids, [11, 12, 13, 14], profile, random.Random(0))
    assert again_ids.shape == ids.shape and len(set(again_ids[0].tolist())) == 3


def test_the_gateways_flags_load_a_replay_profile(tmp_path, caplog):
    from gateway.calibrated_drafts import calibrator_from_args

    two_step_profile().save(tmp_path / "p.steps.npz")
    ReferenceStore({(1,): [5]}).save(tmp_path / "refs.json")
    with caplog.at_level("WARNING"):
        cal = calibrator_from_args(str(tmp_path / "p.steps.npz"), str(tmp_path / "refs.json"))
    assert isinstance(cal.profile, ReplayProfile)
    assert "CALIBRATED ACCEPTANCE (BENCH-ONLY)" in caplog.text
