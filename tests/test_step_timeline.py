"""A step's segments from the gateway's and the services' wall-clock stamps (gateway/step_timeline.py)."""
from __future__ import annotations

from ddtree_serve.proto import common_pb2
from gateway.step_timeline import GatewayStamps, PreviousVerify, step_segments

MS = 1_000_000   # ns


def test_every_segment_of_a_speculative_step_is_the_gap_between_its_two_stamps():
    previous = PreviousVerify(forward_done=100 * MS, received=101 * MS)
    gw = GatewayStamps(draft_sent=102 * MS, draft_received=106 * MS, verify_sent=107 * MS, verify_received=118 * MS)
    draft = common_pb2.Timings(received_unix_ns=103 * MS, features_received_unix_ns=101 * MS,
                               draft_made_unix_ns=104 * MS, replied_unix_ns=105 * MS)
    verify = common_pb2.Timings(received_unix_ns=108 * MS, forward_done_unix_ns=116 * MS, replied_unix_ns=117 * MS)
    segments = {k: round(v * 1000, 6) for k, v in step_segments(gw, draft, verify, previous).items()}
    assert segments == {"gateway_between_steps": 1, "feature_push": 1, "drafter_store_and_draft": 3,
                        "verify_done_to_draft": 4, "draft_request": 1, "draft_handler": 2, "draft_reply": 1,
                        "draft_answer": 1,
                        "gateway_tree": 1, "verify_request": 1, "target_handler": 9, "verify_answer": 1}
    # The step's own segments tile it: from the Draft sent to the Verify answer received.
    own = ("draft_request", "draft_handler", "draft_answer", "gateway_tree", "verify_request", "target_handler",
           "verify_answer")
    assert sum(segments[k] for k in own) == (gw.verify_received - gw.draft_sent) / MS


def test_a_push_stamped_by_the_target_splits_the_feature_push_into_staging_and_trip():
    previous = PreviousVerify(forward_done=100 * MS, received=101 * MS)
    gw = GatewayStamps(draft_sent=102 * MS, draft_received=106 * MS, verify_sent=107 * MS, verify_received=118 * MS)
    draft = common_pb2.Timings(received_unix_ns=103 * MS, features_sent_unix_ns=100 * MS + MS // 4,
                               features_received_unix_ns=101 * MS, draft_made_unix_ns=104 * MS,
                               replied_unix_ns=105 * MS)
    segments = step_segments(gw, draft, None, previous)
    assert round(segments["push_staging"] * 1000, 6) == 0.25 and round(segments["push_trip"] * 1000, 6) == 0.75
    assert round(segments["feature_push"] * 1000, 6) == 1


def test_an_early_push_sent_before_the_forward_was_done_has_no_push_segments_but_the_critical_path_one():
    """The target sent the push 3 ms before its forward was done (transport/shared.py early pushes): push_staging
    and feature_push would be negative and are left out; verify_done_to_draft still spans forward -> draft."""
    previous = PreviousVerify(forward_done=100 * MS, received=101 * MS)
    gw = GatewayStamps(draft_sent=102 * MS, draft_received=106 * MS, verify_sent=107 * MS, verify_received=118 * MS)
    draft = common_pb2.Timings(received_unix_ns=103 * MS, features_sent_unix_ns=97 * MS,
                               features_received_unix_ns=97 * MS + MS // 5, draft_made_unix_ns=102 * MS,
                               replied_unix_ns=104 * MS)
    segments = step_segments(gw, draft, None, previous)
    assert "feature_push" not in segments and "push_staging" not in segments
    assert round(segments["verify_done_to_draft"] * 1000, 6) == 2
    assert round(segments["drafter_store_and_draft"] * 1000, 6) == 4.8


def test_an_autoregressive_step_has_only_the_verify_segments_and_the_gap_since_the_last_one():
    gw = GatewayStamps(verify_sent=10 * MS, verify_received=20 * MS)
    verify = common_pb2.Timings(received_unix_ns=11 * MS, forward_done_unix_ns=18 * MS, replied_unix_ns=19 * MS)
    segments = step_segments(gw, None, verify, PreviousVerify(5 * MS, 6 * MS))
    assert segments.keys() == {"gateway_between_steps", "verify_request", "target_handler", "verify_answer"}
    assert round(segments["gateway_between_steps"] * 1000, 6) == 4


def test_missing_stamps_and_negative_gaps_give_no_segment():
    """A service that sends no stamps (an older build), or a clock on another machine that runs behind."""
    gw = GatewayStamps(draft_sent=10 * MS, draft_received=14 * MS, verify_sent=15 * MS, verify_received=25 * MS)
    unstamped = common_pb2.Timings(total_ns=3 * MS)
    behind = common_pb2.Timings(received_unix_ns=5 * MS, forward_done_unix_ns=12 * MS, replied_unix_ns=13 * MS)
    segments = step_segments(gw, unstamped, behind, None)
    assert "verify_request" not in segments                 # 5 ms "before" it was sent
    assert segments.keys() == {"gateway_tree", "target_handler", "verify_answer"}


def test_a_step_follows_on_from_the_last_verify_only_when_it_verified_every_one_of_its_sequences():
    previous = PreviousVerify(forward_done=1, received=2, seq_ids=frozenset({"a", "b"}))
    assert previous.precedes({"a", "b"}) and previous.precedes({"a"})   # one finished: the rest follow on
    assert not previous.precedes({"a", "c"})                             # c's features came from its prefill
