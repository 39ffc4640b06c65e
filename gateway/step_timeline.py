"""Where a step's time goes between the processes: its segments from the services' wall-clock stamps.

Each step the gateway notes when it sent and got back its Draft and its Verify, and the services' answers carry
when their handlers ran (`common.Timings.*_unix_ns`): the target when its forward's results reached the host, the
drafter when the features of the drafted sequences arrived and when their drafts were made. The segments below
then split the step's critical path (Verify forward -> feature push -> drafter -> Draft answer -> tree -> Verify)
into one-way trips and handlers. They need the services to share one clock (one host): across machines, a segment
that crosses between two of them also holds the clocks' offset, and segments that come out negative are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

from ddtree_serve.proto import common_pb2

NS = 1e-9


@dataclass
class GatewayStamps:
    """The gateway's own wall-clock stamps (time.time_ns()) of one step; 0 where that call was not made."""

    draft_sent: int = 0
    draft_received: int = 0
    verify_sent: int = 0
    verify_received: int = 0


@dataclass
class PreviousVerify:
    """What the next step's segments need of the last step's Verify."""

    forward_done: int   # the target's stamp: the forward's results on the host (its features pushed from then)
    received: int       # the gateway's stamp: the Verify answer arrived
    seq_ids: frozenset[str] = frozenset()   # whom it verified: the next step's draft uses their pushed features

    def precedes(self, seq_ids: set[str]) -> bool:
        """Whether a step over seq_ids follows on from this Verify alone: every one of them was in it (a newcomer's
        features came from its prefill, and a prefill in between counts in neither segment)."""
        return seq_ids <= self.seq_ids


def step_segments(gw: GatewayStamps, draft: common_pb2.Timings | None, verify: common_pb2.Timings | None,
                  previous: PreviousVerify | None) -> dict[str, float]:
    """Seconds per segment of one step (those its stamps allow; none negative):

    - gateway_between_steps: the last Verify answer's arrival -> this step's first call (post-processing)
    - feature_push: the last Verify forward done on the target -> its features' push arrived at the drafter; split
      into push_staging (forward done -> the push sent: the target's loop, staging, the message) and push_trip
      (sent -> arrived: the socket and the drafter's loop), when the push carried the target's stamp. An early
      push (transport/shared.py) leaves before the forward is done: these two are then absent (negative), and
      drafter_store_and_draft below starts while the target still verifies
    - drafter_store_and_draft: those features arrived -> the draft made from them
    - verify_done_to_draft: the last Verify forward done on the target -> the draft made (push, store, draft: the
      critical path from one forward to the next step's tree, however the push went)
    - draft_request / draft_answer: the Draft's trip to the drafter and back; draft_handler: between (waiting for
      features, slicing the ready draft); draft_reply: the draft made -> its answer sent (the drafter's loop)
    - gateway_tree: the Draft answer arrived -> the Verify sent (unpacking, tree build, request)
    - verify_request / verify_answer: the Verify's trips; target_handler: between (the forward included)
    """
    out: dict[str, float] = {}

    def put(name: str, start: int, end: int) -> None:
        if start > 0 and end > 0 and end >= start:
            out[name] = (end - start) * NS

    if previous is not None:   # to this step's first call: its Draft, or an autoregressive step's Verify
        put("gateway_between_steps", previous.received, gw.draft_sent or gw.verify_sent)
    if draft is not None and gw.draft_sent:
        if previous is not None:
            put("feature_push", previous.forward_done, draft.features_received_unix_ns)
            put("push_staging", previous.forward_done, draft.features_sent_unix_ns)
            put("verify_done_to_draft", previous.forward_done, draft.draft_made_unix_ns)
        put("push_trip", draft.features_sent_unix_ns, draft.features_received_unix_ns)
        put("drafter_store_and_draft", draft.features_received_unix_ns, draft.draft_made_unix_ns)
        put("draft_request", gw.draft_sent, draft.received_unix_ns)
        put("draft_handler", draft.received_unix_ns, draft.replied_unix_ns)
        put("draft_reply", draft.draft_made_unix_ns, draft.replied_unix_ns)
        put("draft_answer", draft.replied_unix_ns, gw.draft_received)
        put("gateway_tree", gw.draft_received, gw.verify_sent)
    if verify is not None:
        put("verify_request", gw.verify_sent, verify.received_unix_ns)
        put("target_handler", verify.received_unix_ns, verify.replied_unix_ns)
        put("verify_answer", verify.replied_unix_ns, gw.verify_received)
    return out
