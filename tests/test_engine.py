"""The gateway's step loop against fake backends: step order, losslessness, and what each failure does.

The fakes answer the real proto messages. FakeTarget is a deterministic "model" whose greedy next token is
`succ(t)`; it verifies a tree by walking the children that match its own choice, as the real acceptance does.
FakeDrafter proposes succ-chains (right) or shifted ones (wrong) at rank 0, plus filler candidates.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from ddtree_serve.decoding.config import SamplingParams
from ddtree_serve.plumbing.messages import draft_result
from ddtree_serve.proto import common_pb2, drafter_pb2, target_pb2
from gateway.backends import BackendPair, PairAddress
from gateway.detokenizer import IncrementalDetokenizer
from gateway.engine import EngineConfig, PairEngine
from gateway.scheduler import AdmissionLimits, PairQueue
from gateway.sequence import Sequence, Status
from tests.fixtures import make_tiny_tokenizer

VOCAB = 200
BLOCK = 4


def succ(t: int) -> int:
    """The fake target's greedy choice after token t."""
    return (3 * t + 1) % VOCAB


def greedy(last: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        last = succ(last)
        out.append(last)
    return out


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class FakeTarget:
    """TargetService stand-in: per-sequence committed tokens, greedy succ() choices, optional failures."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.context: dict[str, list[int]] = {}
        self.fail: dict[str, grpc.aio.AioRpcError] = {}   # method -> error to raise
        self.released: list[str] = []
        self.verified: list[target_pb2.VerifyRequest] = []
        self.prefilled: list[list[int]] = []   # chunk lengths per Prefill call

    def _maybe_fail(self, method: str) -> None:
        self.log.append(method)
        if method in self.fail:
            raise self.fail[method]

    async def Prefill(self, request, timeout=None):
        self._maybe_fail("Prefill")
        self.prefilled.append([len(it.prompt_ids) for it in request.items])
        results = []
        for it in request.items:
            ctx = self.context.setdefault(it.seq_id, [])
            assert it.start == len(ctx), "chunks arrive in order"
            ctx.extend(it.prompt_ids)
            results.append(target_pb2.PrefillResult(seq_id=it.seq_id, context_len=len(ctx),
                                                    next_token=-1 if it.more else succ(ctx[-1])))
        return target_pb2.PrefillResponse(results=results)

    async def Verify(self, request, timeout=None):
        self._maybe_fail("Verify")
        self.verified.append(request)
        results = []
        for it in request.items:
            tokens, parents = list(it.tokens), list(it.parents)
            node, accepted_nodes, accepted = 0, [0], []
            while True:
                want = succ(tokens[node])
                child = next((i for i in range(len(tokens)) if parents[i] == node and tokens[i] == want), None)
                if child is None:
                    break
                node = child
                accepted_nodes.append(child)
                accepted.append(tokens[child])
            ctx = self.context[it.seq_id]
            ctx.extend([tokens[0], *accepted])
            results.append(target_pb2.VerifyResult(seq_id=it.seq_id, accepted_nodes=accepted_nodes,
                                                   accepted_tokens=accepted, next_token=succ(tokens[node]),
                                                   context_len=len(ctx)))
        return target_pb2.VerifyResponse(results=results)

    async def Release(self, request, timeout=None):
        self._maybe_fail("Release")
        self.released.extend(request.seq_ids)
        return target_pb2.ReleaseResponse(released=len(request.seq_ids))


class FakeDrafter:
    """DrafterService stand-in: rank 0 is the target's own chain (or a wrong token where told), rank > 0 filler."""

    def __init__(self, log: list[str], right: bool = True) -> None:
        self.log = log
        self.right = right
        self.fail: grpc.aio.AioRpcError | None = None
        self.error_for: dict[str, str] = {}   # seq id -> DraftResult.error
        self.requests: list[drafter_pb2.DraftRequest] = []
        self.released: list[str] = []

    async def Draft(self, request, timeout=None):
        self.log.append("Draft")
        self.requests.append(request)
        if self.fail is not None:
            raise self.fail
        depth, k = request.max_depth, request.top_k
        results = []
        for it in request.items:
            if it.seq_id in self.error_for:
                results.append(drafter_pb2.DraftResult(seq_id=it.seq_id, error=self.error_for[it.seq_id]))
                continue
            chain = greedy(it.bonus_token, depth)
            if not self.right:
                chain = [(t + 1) % VOCAB for t in chain]
            ids, logprobs = [], []
            for tok in chain:
                row = [tok] + [(tok + 7 * j) % VOCAB for j in range(1, k)]
                ids += row
                logprobs += [-0.1 * (j + 1) for j in range(k)]
            results.append(draft_result(it.seq_id, torch.tensor(logprobs).view(depth, k),
                                        torch.tensor(ids).view(depth, k)))
        return drafter_pb2.DraftResponse(results=results)

    async def Release(self, request, timeout=None):
        self.log.append("DrafterRelease")
        self.released.extend(request.seq_ids)
        return drafter_pb2.DrafterReleaseResponse(released=len(request.seq_ids))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_tokenizer(Path(tmp_path_factory.mktemp("tok")))


class Rig:
    """One PairEngine over fake backends, with a queue to add sequences to."""

    def __init__(self, tokenizer, right: bool = True, max_prefill_tokens: int = 2048,
                 max_verify_nodes: int = 0, batch_budgets: tuple[tuple[int, int], ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.log: list[str] = []
        self.target, self.drafter = FakeTarget(self.log), FakeDrafter(self.log, right)
        pair = BackendPair(PairAddress("target", "drafter"))
        pair.target, pair.drafter = self.target, self.drafter
        pair.target_info = target_pb2.TargetInfo(vocab_size=VOCAB, max_seq_len=512, max_batch=8,
                                                 cache=common_pb2.CacheUsage())
        pair.drafter_info = drafter_pb2.DrafterInfo(block_size=BLOCK)
        pair.target_ok = pair.drafter_ok = True   # what a connected pair starts with (the watch flips them)
        self.pair = pair
        self.queue = PairQueue(AdmissionLimits(max_running=8, max_reserved_tokens=10_000))
        self.engine = PairEngine(pair, self.queue, EngineConfig(max_prefill_tokens=max_prefill_tokens,
                                                                max_verify_nodes=max_verify_nodes,
                                                                batch_budgets=batch_budgets))

    def add(self, prompt: list[int], max_tokens: int = 12, mode: str = "ddtree", budget: int = 8) -> Sequence:
        s = Sequence(request_id=f"r{len(self.queue.waiting)}", prompt_ids=prompt, max_tokens=max_tokens,
                     sampling=SamplingParams(), mode=mode, budget=budget if mode == "ddtree" else 0,
                     stop_token_ids=frozenset(), detokenizer=IncrementalDetokenizer(self.tokenizer))
        self.queue.waiting.append(s)
        return s

    def run_to_end(self, max_steps: int = 100) -> int:
        """Steps until every sequence has finished; returns the number of steps."""
        async def go() -> int:
            for n in range(1, max_steps + 1):
                await self.engine.step()
                if not self.queue.running and not self.queue.waiting:
                    return n
            raise AssertionError("did not finish")
        return asyncio.run(go())

    def step(self) -> None:
        asyncio.run(self.engine.step())


def errors(s: Sequence) -> list[tuple[grpc.StatusCode, str]]:
    out = []
    while not s.events.empty():
        ev = s.events.get_nowait()
        if ev.error:
            out.append(ev.error)
    return out


def test_a_step_prefills_then_drafts_then_verifies(tokenizer) -> None:
    rig = Rig(tokenizer)
    rig.add([5, 6, 7])
    rig.step()
    assert rig.log == ["Prefill", "Draft", "Verify"]


@pytest.mark.parametrize("right", [True, False], ids=["good drafts", "wrong drafts"])
@pytest.mark.parametrize("mode", ["ddtree", "dflash", "ar"])
def test_output_is_the_targets_greedy_continuation(tokenizer, right: bool, mode: str) -> None:
    rig = Rig(tokenizer, right=right)
    a, b = rig.add([5, 6, 7], max_tokens=12, mode=mode), rig.add([9], max_tokens=5, mode=mode)
    rig.run_to_end()
    assert a.output_ids == greedy(7, 12) and b.output_ids == greedy(9, 5)
    assert a.finish_reason == b.finish_reason == "length"
    assert sorted(rig.target.released) == sorted(rig.drafter.released) == sorted([a.seq_id, b.seq_id])


def test_good_drafts_commit_several_tokens_per_step(tokenizer) -> None:
    rig = Rig(tokenizer, right=True)
    s = rig.add([5], max_tokens=13)
    steps = rig.run_to_end()
    assert steps <= 4   # the first token comes with the prefill, then up to BLOCK tokens per verify
    assert s.stats.accepted_tokens == 9


def test_an_ar_sequence_is_never_drafted(tokenizer) -> None:
    rig = Rig(tokenizer)
    rig.add([5], max_tokens=3, mode="ar")
    rig.run_to_end()
    assert "Draft" not in rig.log
    assert all(len(it.tokens) == 1 for req in rig.target.verified for it in req.items)


def test_a_batch_past_the_verify_node_cap_verifies_smaller_trees_with_the_same_output(tokenizer) -> None:
    rig = Rig(tokenizer, right=False, max_verify_nodes=24)   # 4 sequences x (root + 8) = 36 nodes > 24
    seqs = [rig.add([5 + i], max_tokens=10, budget=8) for i in range(4)]
    rig.run_to_end()
    first = rig.target.verified[0]
    assert [len(it.tokens) for it in first.items] == [5, 5, 5, 5]   # share 24 // 4 - 1 = 5 -> budget 4
    assert rig.drafter.requests[0].top_k == 4
    assert [s.output_ids for s in seqs] == [greedy(5 + i, 10) for i in range(4)]


def test_a_batch_within_the_verify_node_cap_keeps_its_budgets(tokenizer) -> None:
    rig = Rig(tokenizer, right=False, max_verify_nodes=36)
    for i in range(4):
        rig.add([5 + i], max_tokens=10, budget=8)
    rig.step()
    assert [len(it.tokens) for it in rig.target.verified[0].items] == [9, 9, 9, 9]


def test_a_batch_at_a_budget_ceiling_verifies_its_smaller_trees_and_a_lone_sequence_keeps_its_own(tokenizer) -> None:
    rig = Rig(tokenizer, right=False, batch_budgets=((3, 2),))   # from 3 sequences on, budgets of at most 2
    seqs = [rig.add([5 + i], max_tokens=10, budget=8) for i in range(3)]
    rig.run_to_end()
    first = rig.target.verified[0]
    assert [len(it.tokens) for it in first.items] == [3, 3, 3]   # root + 2
    assert rig.drafter.requests[0].top_k == 2
    assert [s.output_ids for s in seqs] == [greedy(5 + i, 10) for i in range(3)]
    alone = Rig(tokenizer, right=False, batch_budgets=((3, 2),))
    alone.add([5], max_tokens=10, budget=8)
    alone.step()
    assert [len(it.tokens) for it in alone.target.verified[0].items] == [9]


def test_draft_depth_never_drafts_past_max_tokens(tokenizer) -> None:
    rig = Rig(tokenizer)
    rig.add([5], max_tokens=3)
    rig.step()
    assert rig.drafter.requests[0].max_depth == 1   # one token came with the prefill, two are left: draft one


def test_a_failing_drafter_turns_its_sequences_autoregressive_not_failed(tokenizer) -> None:
    rig = Rig(tokenizer)
    rig.drafter.fail = rpc_error(grpc.StatusCode.UNAVAILABLE, "drafter down")
    s = rig.add([5, 6], max_tokens=6)
    rig.run_to_end()
    assert s.output_ids == greedy(6, 6) and not errors(s)
    assert not s.drafting and rig.log.count("Draft") == 1


def test_a_draft_error_for_one_sequence_leaves_the_others_drafting(tokenizer) -> None:
    rig = Rig(tokenizer)
    broken, fine = rig.add([5], max_tokens=8), rig.add([6], max_tokens=8)
    rig.drafter.error_for[broken.seq_id] = "context features lost"
    rig.run_to_end()
    assert not broken.drafting and fine.drafting
    assert broken.output_ids == greedy(5, 8) and fine.output_ids == greedy(6, 8)


def test_a_failing_verify_fails_the_batch_with_the_targets_status_and_frees_it(tokenizer) -> None:
    rig = Rig(tokenizer)
    rig.target.fail["Verify"] = rpc_error(grpc.StatusCode.UNAVAILABLE, "target down")
    a, b = rig.add([5]), rig.add([6])
    rig.step()
    for s in (a, b):
        [(code, message)] = errors(s)
        assert code == grpc.StatusCode.UNAVAILABLE and "verify" in message
        assert s.status == Status.FINISHED
    assert not rig.queue.running
    assert sorted(rig.target.released) == sorted(rig.drafter.released) == sorted([a.seq_id, b.seq_id])


def test_the_engine_serves_on_after_a_failed_step(tokenizer) -> None:
    rig = Rig(tokenizer)
    rig.target.fail["Verify"] = rpc_error(grpc.StatusCode.UNAVAILABLE, "target down")
    rig.add([5])
    rig.step()
    del rig.target.fail["Verify"]
    s = rig.add([8], max_tokens=4)
    rig.run_to_end()
    assert s.output_ids == greedy(8, 4) and not errors(s)


def test_a_failing_prefill_fails_only_the_sequences_it_carried(tokenizer) -> None:
    rig = Rig(tokenizer)
    running = rig.add([5], max_tokens=20)
    rig.step()
    rig.target.fail["Prefill"] = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "no slot")
    newcomer = rig.add([6])
    rig.step()
    [(code, _)] = errors(newcomer)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert running in rig.queue.running and not errors(running)


def test_a_cancelled_sequence_is_released_at_the_next_step_boundary(tokenizer) -> None:
    rig = Rig(tokenizer)
    gone, stays = rig.add([5], max_tokens=20), rig.add([6], max_tokens=20)
    rig.step()
    gone.cancelled = True
    verifies = len(rig.target.verified)
    rig.step()
    assert gone.finish_reason == "abort" and gone.seq_id in rig.target.released and gone.seq_id in rig.drafter.released
    assert [it.seq_id for it in rig.target.verified[verifies].items] == [stays.seq_id]


def test_an_unavailable_target_fails_the_running_batch_and_keeps_the_waiting_queue(tokenizer) -> None:
    rig = Rig(tokenizer)
    running = rig.add([5], max_tokens=20)
    rig.step()
    rig.pair.target_ok = False
    waiting = rig.add([6])
    calls = len(rig.log)
    rig.step()
    [(code, _)] = errors(running)
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "Prefill" not in rig.log[calls:] and "Verify" not in rig.log[calls:]
    assert waiting in rig.queue.waiting and not errors(waiting)


def test_a_drafter_marked_down_is_not_asked_and_its_sequences_go_autoregressive(tokenizer) -> None:
    rig = Rig(tokenizer)
    rig.pair.drafter_ok = False
    s = rig.add([5], max_tokens=5)
    rig.run_to_end()
    assert "Draft" not in rig.log and not s.drafting
    assert s.output_ids == greedy(5, 5)


def test_a_timed_out_draft_marks_the_drafter_down_until_the_watch_restores_it(tokenizer) -> None:
    rig = Rig(tokenizer)
    rig.drafter.fail = rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "stalled")
    rig.add([5], max_tokens=5)
    rig.step()
    assert rig.pair.drafter_ok is False


def test_a_failing_release_is_logged_not_fatal(tokenizer) -> None:
    rig = Rig(tokenizer)
    rig.target.fail["Release"] = rpc_error(grpc.StatusCode.UNAVAILABLE, "gone")
    s = rig.add([5], max_tokens=2)
    rig.run_to_end()
    assert s.output_ids == greedy(5, 2) and s.seq_id in rig.drafter.released


def test_a_long_prompt_is_prefilled_in_chunks_while_the_batch_decodes(tokenizer) -> None:
    rig = Rig(tokenizer, max_prefill_tokens=4)
    decoding = rig.add([5], max_tokens=30)
    rig.step()
    long = rig.add(list(range(10, 20)))
    for _ in range(3):
        verifies = len(rig.target.verified)
        rig.step()
        assert decoding.seq_id in [it.seq_id for it in rig.target.verified[verifies].items]
    assert rig.target.prefilled[1:] == [[4], [4], [2]]
    assert long.prefill_done and long.output_ids[:1] == greedy(19, 1)


def test_a_draft_reply_unpacks_into_exactly_its_numbers_as_float32_logprobs_and_int64_ids():
    import numpy as np
    import torch

    from ddtree_serve.plumbing.messages import draft_arrays

    logprobs = torch.randn(15, 64).log_softmax(-1)
    ids = torch.randint(0, 150_000, (15, 64), dtype=torch.int32)
    wire = draft_result("s", logprobs, ids).SerializeToString()
    lp, tok = draft_arrays(drafter_pb2.DraftResult.FromString(wire))
    assert lp.dtype == np.float32 and tok.dtype == np.int64
    assert np.array_equal(lp, logprobs.numpy()) and np.array_equal(tok, ids.long().numpy())
    empty = draft_arrays(drafter_pb2.DraftResult(seq_id="s", depth=0, k=8))   # no positions: no bytes
    assert empty[0].shape == (0, 8) and empty[1].shape == (0, 8)


def test_a_re_attach_keeps_the_step_calls_that_go_the_same_way_and_replaces_the_others() -> None:
    """Closing a pair's step calls would cancel a step in flight: a re-attach (a drafter restarted) keeps them
    unless they must now go elsewhere (step sockets appeared, or moved)."""
    from ddtree_serve.plumbing.step_socket import SocketCalls
    from ddtree_serve.plumbing.step_stream import StreamedCalls

    class Stub:
        def __getattr__(self, name):
            return lambda *a, **k: None

    pair = BackendPair(PairAddress("target", "drafter"))
    pair.target, pair.drafter = Stub(), Stub()
    pair.target_info = target_pb2.TargetInfo(step_socket="/run/t.sock")
    pair.drafter_info = drafter_pb2.DrafterInfo(step_socket="/run/d.sock")
    pair._make_step_calls(sockets=False)
    streams = (pair._verify_calls, pair._draft_calls)
    assert all(isinstance(c, StreamedCalls) for c in streams)
    pair._make_step_calls(sockets=False)
    assert (pair._verify_calls, pair._draft_calls) == streams
    pair._make_step_calls(sockets=True)
    sockets = (pair._verify_calls, pair._draft_calls)
    assert all(isinstance(c, SocketCalls) for c in sockets) and sockets[0].path == "/run/t.sock"
    pair._make_step_calls(sockets=True)
    assert (pair._verify_calls, pair._draft_calls) == sockets
    pair.drafter_info = drafter_pb2.DrafterInfo(step_socket="/run/d2.sock")   # a restarted drafter elsewhere
    pair._make_step_calls(sockets=True)
    assert pair._draft_calls is not sockets[1] and pair._draft_calls.path == "/run/d2.sock"
