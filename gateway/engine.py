"""The step loop of one target/drafter pair: admit -> prefill -> draft -> build trees -> verify -> postprocess."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import numpy as np

from ddtree_serve.decoding.ddtree import MAX_TOP_K
from ddtree_serve.plumbing.background import BackgroundTask
from ddtree_serve.plumbing.messages import draft_arrays, guide_proto, sampling_proto
from ddtree_serve.proto import common_pb2, drafter_pb2, target_pb2
from gateway.backends import BackendPair
from gateway.prefix_index import PendingPrompt, PrefixIndex, held_back_for_shared_prefixes, held_back_for_snapshots
from gateway.scheduler import PairQueue, batch_budget_ceiling, plan_prefill_chunks, step_budgets
from gateway.sequence import Sequence, Status
from gateway.step_timeline import GatewayStamps, PreviousVerify, step_segments
from gateway.step_trees import build_step_trees

if TYPE_CHECKING:
    from gateway.calibrated_drafts import DraftCalibrator

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    """Step-loop settings shared by all pairs."""

    rpc_timeout_s: float = 120.0
    # A Draft slower than this turns its sequences autoregressive: a stalled drafter (SIGSTOP, overload, a drafter
    # waiting for features that never come) must not hold up the target's verify steps.
    draft_timeout_s: float = 10.0
    # Prompt tokens prefilled per step, over all sequences (0: no limit). A long prompt is prefilled in chunks
    # over several steps, so the running batch keeps decoding meanwhile (vLLM's chunked prefill).
    max_prefill_tokens: int = 2048
    # Verify nodes per step over the whole batch (0: no cap): past it, DDTree budgets shrink for that step
    # (gateway.scheduler.step_budgets), so that a wide batch's verify stays memory-bound.
    max_verify_nodes: int = 0
    # A structured output's trees are drafted this many times their budget and the target verifies the budget's
    # worth of the grammar-valid nodes (1: the budget alone, its refused nodes dropped). More tokens a step, and
    # the target's grammar walk over the larger tree (~14 us a node on a CPU core: ~0.9 ms more for a budget of
    # 64 at 2, a tenth of a GPU step), so opt-in.
    guided_overdraft: int = 1
    # Prefix caching (vLLM's --enable-prefix-caching, on by default there too): finished sequences' slots stay
    # parked with their rows, and a new prompt that starts with one's tokens reuses them (gateway/prefix_index.py).
    prefix_caching: bool = True
    # (from batch size, max budget) pairs: a step of that many sequences or more caps each DDTree budget there
    # (ddtree_serve.decoding.config.GPU_BATCH_BUDGETS); () or None: no ceiling (the gateway resolves None by
    # device).
    batch_budgets: tuple[tuple[int, int], ...] | None = None
    # Bench-only calibrated acceptance (gateway/calibrated_drafts.py DraftCalibrator): rewrites each draft's top-K
    # lists so that acceptance follows a measured profile. None in any real deployment.
    calibrator: DraftCalibrator | None = None


class PairEngine(BackgroundTask):
    """Drives one pair. Per step: one Prefill RPC for prompt chunks of newcomers, one Draft + one Verify RPC for the
    decoding batch."""

    def __init__(self, pair: BackendPair, queue: PairQueue, cfg: EngineConfig, metrics=None):
        self.pair = pair
        self.queue = queue
        self.cfg = cfg
        self.metrics = metrics
        self.block_size = pair.drafter_info.block_size
        self.vocab_size = pair.target_info.vocab_size
        self.task_name = f"engine-{pair.index}"
        self.releases_in_flight = 0   # Release RPCs sent and not yet answered (a drain waits for them)
        self._previous_verify: PreviousVerify | None = None   # the last step's, for the next step's segments
        # Running prompts and parked sequences: at most max_batch of each in the target.
        self.prefixes = (PrefixIndex(2 * max(1, pair.target_info.max_batch))
                         if cfg.prefix_caching and pair.target_info.prefix_reuse else None)

    async def run(self) -> None:
        """Steps while there is work; sleeps on the queue's wake-up event otherwise. Never dies on one bad step."""
        while True:
            if not self.queue.running and not self.queue.waiting:
                self.queue.wakeup.clear()
                await self.queue.wakeup.wait()
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep serving the other requests
                log.exception("pair %d step failed", self.pair.index)
                code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else grpc.StatusCode.INTERNAL
                await self._fail(list(self.queue.running), code, f"step failed ({type(exc).__name__})")

    async def lost_target(self, message: str) -> None:
        """The target restarted: the running sequences' state is gone, so they fail (alone; waiting ones stay)."""
        if self.prefixes is not None:
            self.prefixes.clear()   # its parked slots went with it
        await self._fail(list(self.queue.running), grpc.StatusCode.UNAVAILABLE, message)

    def lost_drafter(self) -> None:
        """The drafter restarted: running sequences lost their drafter context and continue autoregressively."""
        if self.prefixes is not None:
            self.prefixes.clear()   # its parked slots went with it
        for s in self.queue.running:
            s.drafting = False

    async def step(self) -> None:
        """One engine step for this pair's whole running batch."""
        await self._drop_cancelled()
        if not self.pair.target_ok:
            # Fail fast rather than wait out RPC timeouts; waiting requests stay queued for the recovery.
            if self.queue.running:
                await self._fail(list(self.queue.running), grpc.StatusCode.UNAVAILABLE,
                                 f"target {self.pair.address.target} is unavailable")
            await asyncio.sleep(0.2)
            return
        victims = self.queue.preemption_victims()
        if victims:
            await self._preempt(victims)
        self.queue.admit()
        live = [s for s in self.queue.running if s.status == Status.RUNNING and not s.finish_reason]
        prefilling = [s for s in live if not s.prefill_done]
        if prefilling:
            self._previous_verify = None   # the next step's segments do not follow on from the last Verify alone
            await self._prefill(prefilling)
        batch = [s for s in live if s.status == Status.RUNNING and not s.finish_reason and s.prefill_done]
        if batch:
            await self._decode(batch)
        finished = [s for s in self.queue.running if s.status == Status.FINISHED or s.finish_reason]
        if finished:
            await self._release(finished)
        if self.metrics is not None:
            self.metrics.set_queue(len(self.queue.running), len(self.queue.waiting))

    async def _drop_cancelled(self) -> None:
        cancelled = [s for s in self.queue.running if s.cancelled]
        if cancelled:
            for s in cancelled:
                s.finish_reason = s.finish_reason or "abort"
            await self._release(cancelled)

    @staticmethod
    def _asks_prompt_logprobs(s: Sequence) -> bool:
        """Whether its prefill reports prompt log-probs: asked for, and not a resumed one (they went out)."""
        return s.prompt_logprobs >= 0 and not s.resumed

    async def _prefill(self, seqs: list[Sequence]) -> None:
        """One Prefill RPC: the next prompt chunk of each sequence, oldest first, within max_prefill_tokens."""
        newcomers = [s for s in seqs if s.prefilled == 0 and not s.prefix_checked]
        for s in newcomers:
            if not self.pair.drafter_ok:
                s.drafting = False   # no drafter attached right now: this one runs autoregressively
        await self._find_prefixes(newcomers)
        for s in newcomers:
            if s.reuse_rows >= s.snapshot_at:   # its snapshot point lies in the rows it reuses: nothing to keep
                s.snapshot_at = 0
        held = self._hold_back_shared_prefixes(seqs, newcomers)
        if held:
            seqs = [s for s in seqs if s.seq_id not in held]
        chunks = plan_prefill_chunks(seqs, self.cfg.max_prefill_tokens)
        if not chunks:
            return
        now = time.perf_counter()
        for s, _ in chunks:
            s.scheduled_at = s.scheduled_at or now
        request = target_pb2.PrefillRequest(items=[
            target_pb2.PrefillItem(seq_id=s.seq_id, prompt_ids=s.prefill_ids[s.prefilled:s.prefilled + n],
                                   sampling=sampling_proto(s.sampling), push_features=s.speculative, start=s.prefilled,
                                   more=s.prefilled + n < len(s.prompt_ids) + s.resumed,
                                   draft_top_k=self._draft_top_k(s),
                                   logprobs=s.logprobs >= 0, top_logprobs=max(s.logprobs, 0),
                                   prompt_logprobs=self._asks_prompt_logprobs(s),
                                   prompt_top_logprobs=max(s.prompt_logprobs, 0),
                                   guide=guide_proto(s.guide)
                                   if s.guide is not None and s.prefilled == 0 else None,
                                   reuse_from=s.reuse_from if s.prefilled == 0 else "",
                                   reuse_max=s.reuse_rows if s.prefilled == 0 else 0,
                                   reuse_copy=s.reuse_copy and s.prefilled == 0,
                                   outputs_from=len(s.prompt_ids) if s.resumed else 0, snapshot_at=s.snapshot_at)
            for s, n in chunks])
        try:
            response = await self.pair.target.Prefill(request, timeout=self.cfg.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            failed = [s for s, _ in chunks]
            log.error("prefill of %d sequences failed: %s %s", len(failed), exc.code().name, exc.details())
            await self._fail(failed, exc.code(), f"target prefill failed ({exc.code().name})")
            return
        by_id = {r.seq_id: r for r in response.results}
        refused = [s for s, _ in chunks if by_id[s.seq_id].error]
        for s in refused:   # nothing of it was admitted; the batch's others went on
            await self._fail([s], grpc.StatusCode.INVALID_ARGUMENT, by_id[s.seq_id].error)
        now = time.perf_counter()
        for s, n in chunks:
            r = by_id[s.seq_id]
            if r.error:
                continue
            if s.prefilled == 0 and s.resumed:
                log.info("request %s resumes after %d tokens: %d of its %d rows kept, %d run", s.request_id,
                         s.resumed, r.reused, len(s.prompt_ids) + s.resumed, len(s.prompt_ids) + s.resumed - r.reused)
            elif s.prefilled == 0:
                s.cached_tokens = r.reused
            s.prefilled += n
            s.context_len = r.context_len
            if r.snapshot and self.prefixes is not None:
                self.prefixes.add_snapshot(s.seq_id, s.prefill_ids[:s.snapshot_at], s.cache_salt)
            if self._asks_prompt_logprobs(s):
                s.prompt_scores.extend(r.prompt_logprobs)
            if not s.prefill_done:
                continue
            s.bonus = r.next_token
            s.last_token_at = now
            if self.prefixes is not None and self.pair.target_info.prefix_reuse == "prefix":
                self.prefixes.add(s.seq_id, s.prefill_ids, s.cache_salt, running=True)   # its rows can be copied
            kept = s.append([r.next_token])
            s.emit(kept, r.logprobs)
            if s.resumed:   # its first token and prompt were counted before the preemption
                continue
            s.first_token_at = now
            if self.metrics is not None:
                self.metrics.observe_prompt(len(s.prompt_ids), s.cached_tokens if self.prefixes is not None else None)
                self.metrics.observe_first_token(now - s.arrival)

    def _hold_back_shared_prefixes(self, seqs: list[Sequence], newcomers: list[Sequence]) -> set[str]:
        """Ids of the newcomers found no cached prefix that wait a step for one in flight: a dense target copies
        a running prompt's rows once it is prefilled (n samples of one prompt, a batch of prompts under one system
        prompt), where running them beside it would compute the same rows twice; a hybrid one with state snapshots
        copies them once the snapshot at the shared system prompt's end is taken. They are looked up again next
        step."""
        info = self.pair.target_info
        hybrid = info.prefix_reuse == "context" and info.state_snapshots > 0
        if self.prefixes is None or not (info.prefix_reuse == "prefix" or hybrid):
            return set()
        looking = [s for s in newcomers if not s.reuse_from and not self._asks_prompt_logprobs(s)]
        if not looking:   # most prefill steps: chunks of prompts already under way
            return set()
        looking_ids = {s.seq_id for s in looking}
        if hybrid:   # a hybrid waits for the state snapshot at a shared system prompt's end
            held = [looking[i] for i in held_back_for_snapshots(
                [(s.prefill_ids, s.snapshot_at, s.cache_salt) for s in looking],
                [(s.prefill_ids[:s.snapshot_at], s.cache_salt) for s in seqs
                 if s.seq_id not in looking_ids and s.prefilled < s.snapshot_at])]
        else:
            in_flight = [PendingPrompt(s.prefill_ids, s.cache_salt) for s in seqs if s.seq_id not in looking_ids]
            held = [looking[i] for i in held_back_for_shared_prefixes(
                [PendingPrompt(s.prefill_ids, s.cache_salt) for s in looking], in_flight, self.prefixes.min_tokens)]
        for s in held:
            s.prefix_checked = False
            log.debug("request %s waits a step for the rows of a prompt sharing its prefix", s.request_id)
        if held and self.metrics is not None:
            self.metrics.observe_prompts_held_back(len(held))
        return {s.seq_id for s in held}

    async def _find_prefixes(self, newcomers: list[Sequence]) -> None:
        """Prefix caching: each new sequence's sequence to start from (Sequence.reuse_from: a parked one's slot
        adopted, or a running one's rows copied), and how many prompt tokens of it the drafter holds for a
        speculative one (one Adopt RPC for all; the target checks and answers in its Prefill)."""
        for s in newcomers:
            s.prefix_checked = True
        if self.prefixes is None:
            return
        whole = self.pair.target_info.prefix_reuse == "context"
        adopting, claiming = [], []
        for s in newcomers:
            if self._asks_prompt_logprobs(s):   # every prompt position's logits are wanted: the prompt runs whole
                continue
            hit = self.prefixes.take(s.prefill_ids, s.cache_salt, whole, adopter=s.seq_id)
            if hit is not None:
                s.reuse_from, s.reuse_rows, s.reuse_copy = hit.seq_id, hit.rows, hit.copy
                if s.speculative:
                    adopting.append(s)
            elif s.speculative and s.snapshot_at:
                # Its snapshot may serve a prompt admitted before its first Draft, which the drafter lets copy only
                # the rows of a sequence this session holds: an Adopt of nothing makes it this session's now.
                claiming.append(s)
        if not adopting and not claiming:
            return
        try:
            response = await self.pair.drafter.Adopt(drafter_pb2.AdoptRequest(items=[
                drafter_pb2.AdoptItem(seq_id=s.seq_id, parked_id=s.reuse_from, rows=s.reuse_rows, copy=s.reuse_copy,
                                      whole=whole and s.reuse_copy)   # a hybrid's copy: up to a snapshot, or none
                for s in adopting + claiming]), timeout=self.cfg.draft_timeout_s)
            rows = list(response.rows)
        except grpc.aio.AioRpcError as exc:
            log.warning("prefix caching: the drafter's Adopt failed (%s: %s); %d prompts run whole",
                        exc.code().name, exc.details(), len(adopting))
            rows = [0] * len(adopting)
        for s, n in zip(adopting, rows):
            # The target reuses no more than the drafter holds: the rows past them get their features pushed.
            s.reuse_rows = n
            if n == 0:
                s.reuse_from, s.reuse_copy = "", False

    async def _draft(self, seqs: list[Sequence], budgets: dict[str, int], stamps: GatewayStamps
                     ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], common_pb2.Timings | None]:
        """One Draft RPC for the speculative sequences -> (drafts by seq id, the drafter's timings); a drafter failure
        turns them autoregressive, not failed."""
        drafting = [s for s in seqs if s.speculative and self._max_depth(s) > 0]
        if not drafting:
            return {}, None
        if not self.pair.drafter_ok:
            for s in drafting:
                s.drafting = False
            return {}, None
        top_k = max(max(1, min(budgets[s.seq_id] if s.mode == "ddtree" else 1, self.vocab_size, MAX_TOP_K))
                    for s in drafting)
        depth = max(self._max_depth(s) for s in drafting)
        request = drafter_pb2.DraftRequest(
            items=[drafter_pb2.DraftItem(seq_id=s.seq_id, bonus_token=s.bonus, context_len=s.context_len)
                   for s in drafting], top_k=top_k, max_depth=depth)
        cal = self.cfg.calibrator
        draws = {}
        try:
            stamps.draft_sent = time.time_ns()
            if cal is None:
                response = await self.pair.draft(request, self.cfg.draft_timeout_s)
            else:
                response, draws = await self._draft_with_draws(request, drafting, depth, top_k)
            stamps.draft_received = time.time_ns()
        except grpc.aio.AioRpcError as exc:
            log.error("draft failed (%s: %s); %d sequences continue autoregressively", exc.code().name,
                      exc.details(), len(drafting))
            if exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                self.pair.drafter_ok = False   # until the watch sees it answer again and re-attaches
            for s in drafting:
                self._fall_back(s)
            return {}, None
        out = {}
        by_id = {s.seq_id: s for s in drafting}
        for r in response.results:
            if r.error:
                log.warning("sequence %s continues autoregressively: %s", by_id[r.seq_id].request_id, r.error)
                self._fall_back(by_id[r.seq_id])
                continue
            try:
                out[r.seq_id] = draft_arrays(r)   # numpy: the host tree build takes it without torch's per-op cost
            except ValueError as exc:   # a drafter bug must not fail the step: this sequence goes on without it
                log.error("sequence %s continues autoregressively: malformed draft (%s)", by_id[r.seq_id].request_id,
                          exc)
                self._fall_back(by_id[r.seq_id])
                continue
            if cal is not None:   # bench-only: the target still verifies every token (lossless)
                s = by_id[r.seq_id]
                out[r.seq_id] = cal.apply(draws[r.seq_id], s.prompt_ids, s.output_ids, *out[r.seq_id])
        return out, response.timings

    async def _draft_with_draws(self, request: drafter_pb2.DraftRequest, drafting: list[Sequence], depth: int,
                                top_k: int) -> tuple[drafter_pb2.DraftResponse, dict]:
        """Bench-only: the Draft, and the calibrator's draws for its answer made while it is in flight (~0.2 ms of
        cold-cache host work a step, off the step's path); before it leaves when the call polls for its answer,
        since a poll holds the loop until the answer is in."""
        def draw_all() -> dict:
            return {s.seq_id: self.cfg.calibrator.draw(s.prompt_ids, s.output_ids, depth, top_k) for s in drafting}

        if self.pair.polls_steps:
            draws = draw_all()
            return await self.pair.draft(request, self.cfg.draft_timeout_s), draws
        call = asyncio.ensure_future(self.pair.draft(request, self.cfg.draft_timeout_s))
        try:
            await asyncio.sleep(0)   # the call's first turn sends the Draft
            draws = draw_all()
        except BaseException:
            call.cancel()
            raise
        return await call, draws

    def _fall_back(self, s: Sequence) -> None:
        """The sequence continues autoregressively; its stats and the fallback counter show it."""
        s.drafting = False
        if self.metrics is not None:
            self.metrics.observe_drafter_fallback()

    def _draft_top_k(self, s: Sequence) -> int:
        """The top-K this sequence's Drafts ask for at most (0: it does not draft)."""
        if not s.speculative:
            return 0
        return max(1, min(s.budget if s.mode == "ddtree" else 1, self.vocab_size, MAX_TOP_K))

    def _max_depth(self, s: Sequence) -> int:
        """Draft depth this step: the block, the tokens still wanted, and the context limit all bound it."""
        room = self.pair.target_info.max_seq_len - s.context_len - 1
        return max(0, min(self.block_size - 1, s.remaining - 1, room))

    def _step_budgets(self, seqs: list[Sequence], depths: dict[str, int]) -> dict[str, int]:
        """Each sequence's DDTree budget this step (EngineConfig.batch_budgets, then .max_verify_nodes), given its
        draft depth."""
        ceiling = batch_budget_ceiling(self.cfg.batch_budgets or (), len(seqs))
        budgets = {s.seq_id: s.budget if ceiling is None else min(s.budget, ceiling) for s in seqs}
        if not self.cfg.max_verify_nodes:
            return budgets
        trees = [s for s in seqs if s.mode == "ddtree" and s.speculative and depths[s.seq_id] > 0]
        chains = [s for s in seqs if s.mode == "dflash" and s.speculative]
        other = sum(1 + depths[s.seq_id] for s in chains) + len(seqs) - len(trees) - len(chains)
        return step_budgets({s.seq_id: budgets[s.seq_id] for s in trees}, other, self.cfg.max_verify_nodes)

    async def _decode(self, seqs: list[Sequence]) -> None:
        t0 = time.perf_counter()
        stamps = GatewayStamps()
        depths = {s.seq_id: self._max_depth(s) for s in seqs}
        budgets = self._step_budgets(seqs, depths)
        drafts, draft_timings = await self._draft(seqs, budgets, stamps)
        t1 = time.perf_counter()
        # A guided sequence's tree is drafted guided_overdraft times larger; the target drops what its grammar
        # refuses and verifies the budget's worth of the rest (keep_nodes): grammar-valid nodes in place of refused
        # ones, which could never be accepted.
        keep = {s.seq_id: budgets[s.seq_id] + 1 for s in seqs if s.guide is not None and s.mode == "ddtree"}
        cap = self.pair.target_info.max_tree_nodes - 1
        drafted = {sid: min(self.cfg.guided_overdraft * (n - 1), cap) for sid, n in keep.items()}
        trees = build_step_trees(seqs, drafts, depths, {**budgets, **drafted})
        t2 = time.perf_counter()
        request = target_pb2.VerifyRequest(items=[
            target_pb2.TreeItem(seq_id=s.seq_id, tokens=trees[s.seq_id].tokens.tolist(),
                                parents=trees[s.seq_id].parents.tolist(), keep_nodes=keep.get(s.seq_id, 0))
            for s in seqs])
        try:
            stamps.verify_sent = time.time_ns()
            response = await self.pair.verify(request, self.cfg.rpc_timeout_s)
            stamps.verify_received = time.time_ns()
        except grpc.aio.AioRpcError as exc:
            self._previous_verify = None
            log.error("verify of %d sequences failed: %s %s", len(seqs), exc.code().name, exc.details())
            await self._fail(seqs, exc.code(), f"target verify failed ({exc.code().name})")
            return
        t3 = time.perf_counter()
        previous = self._previous_verify
        if previous is not None and not previous.precedes({s.seq_id for s in seqs}):
            previous = None
        segments = step_segments(stamps, draft_timings, response.timings, previous)
        self._previous_verify = PreviousVerify(response.timings.forward_done_unix_ns, stamps.verify_received,
                                               frozenset(s.seq_id for s in seqs))
        by_id = {r.seq_id: r for r in response.results}
        accepted_per_seq, tree_sizes = [], []
        for s in seqs:
            r = by_id[s.seq_id]
            tree_size = (r.verified_nodes or int(trees[s.seq_id].tokens.numel())) - 1
            accepted = list(r.accepted_tokens)
            s.stats.steps += 1
            s.stats.accepted_tokens += len(accepted)
            s.stats.draft_tokens += tree_size
            s.stats.drafted_steps += tree_size > 0
            s.context_len, s.bonus = r.context_len, r.next_token
            kept = s.append(accepted + [r.next_token])
            s.emit(kept, r.logprobs)
            if self.metrics is not None:
                self.metrics.observe_tokens(t3 - s.last_token_at, len(kept))
            s.last_token_at = t3
            if s.mode != "ar" and tree_size > 0:
                accepted_per_seq.append(len(accepted))
                tree_sizes.append(tree_size)
        if self.metrics is not None:
            modes = {s.mode for s in seqs}
            mode = modes.pop() if len(modes) == 1 else "mixed"
            self.metrics.observe_step(batch_size=len(seqs), tree_sizes=tree_sizes, accepted_per_seq=accepted_per_seq,
                                      draft_s=t1 - t0, tree_s=t2 - t1, verify_s=t3 - t2,
                                      step_s=time.perf_counter() - t0, mode=mode)
            self.metrics.observe_segments(segments, mode)

    async def _preempt(self, seqs: list[Sequence]) -> None:
        """Stops running sequences for a waiting one of higher priority: their state is freed in both services
        (their rows parked for prefix caching, so running them again costs little while those stay) and they wait
        again, to go on from their prompt and outputs under a new id."""
        for s in seqs:
            self.queue.running.remove(s)
        await self._free(seqs)
        for s in seqs:
            log.info("request %s (priority %d) preempted after %d tokens", s.request_id, s.priority,
                     len(s.output_ids))
            s.preempt()
            self.queue.enqueue(s)
        if self.metrics is not None:
            self.metrics.observe_preempted(len(seqs))

    async def _release(self, seqs: list[Sequence]) -> None:
        """Frees the sequences in both services and reports their end; release failures are logged, not fatal."""
        for s in seqs:
            if s in self.queue.running:
                self.queue.running.remove(s)
            if s.status != Status.FINISHED:
                s.status = Status.FINISHED
                if self.metrics is not None and s.finish_reason not in ("abort", "error"):
                    self.metrics.observe_finished(s.finish_reason, len(s.prompt_ids), len(s.output_ids),
                                                  time.perf_counter() - s.arrival, s.scheduled_at - s.arrival)
        await self._free(seqs)

    async def _free(self, seqs: list[Sequence]) -> None:
        """The Release RPCs of both services (rows parked under prefix caching) and the prefix index's update."""
        ids = [s.seq_id for s in seqs]
        keep = self.prefixes is not None
        self.releases_in_flight += 1
        try:
            results = await asyncio.gather(
                self.pair.target.Release(target_pb2.ReleaseRequest(seq_ids=ids, keep_prefix=keep), timeout=30),
                self.pair.drafter.Release(drafter_pb2.DrafterReleaseRequest(
                    seq_ids=ids, keep_prefix=keep,
                    park_rows=[s.context_len if keep and s.speculative and s.finish_reason != "error" else 0
                               for s in seqs]), timeout=30),
                return_exceptions=True)
        finally:
            self.releases_in_flight -= 1
        for service, res in zip(("target", "drafter"), results):
            if isinstance(res, Exception):
                log.error("release of %d sequences on the %s failed: %s", len(ids), service, res)
        if keep and isinstance(results[0], Exception):
            for s in seqs:
                self.prefixes.discard(s.seq_id)
        if keep and not isinstance(results[0], Exception):
            for s in seqs:
                # What the target's rows hold, as far as the gateway knows them (the target checks the rest).
                tokens = (s.prompt_ids + s.output_ids)[:s.context_len]
                # A recurrent cache is reused whole or not at all: its tokens must all be known here.
                complete = len(tokens) == s.context_len or self.pair.target_info.prefix_reuse != "context"
                if s.finish_reason != "error" and s.prefill_done and complete:
                    self.prefixes.add(s.seq_id, tokens, s.cache_salt)
                else:
                    self.prefixes.discard(s.seq_id)

    async def _fail(self, seqs: list[Sequence], code: grpc.StatusCode, message: str) -> None:
        for s in seqs:
            if s.status != Status.FINISHED:
                s.fail(code, message)
        await self._release(seqs)
