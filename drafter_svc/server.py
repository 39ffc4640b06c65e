"""gRPC servicer of the drafter service: context features arrive by transport, drafts are batched."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from ddtree_serve.decoding.ddtree import MAX_TOP_K
from ddtree_serve.plumbing import auth
from ddtree_serve.plumbing.host_copy import to_host
from ddtree_serve.plumbing.messages import draft_result
from ddtree_serve.plumbing.metrics import DrafterMetrics
from ddtree_serve.plumbing.model_servicer import ModelServiceConfig, ModelServicer, serve_model_service
from ddtree_serve.plumbing.rpc import RequestError, grpc_errors, require_ready
from ddtree_serve.plumbing.step_socket import StepMethod
from ddtree_serve.plumbing.step_stream import answer_each
from ddtree_serve.plumbing.waiters import Waiters
from ddtree_serve.proto import common_pb2, drafter_pb2, drafter_pb2_grpc
from ddtree_serve.transport import OpenedBuffers, decode_rows, payload_bytes, rows_view
from ddtree_serve.transport.nccl_protocol import (NcclLinkLost, NcclSetupError, device_uuid, missing_nccl_package,
                                                  nccl_refusal)
from drafter_svc.runner import DeferredRows, DraftItem, DrafterConfig, DrafterRunner

log = logging.getLogger(__name__)

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name
RECENT_DRAFTS = 64        # Drafts whose widest top-k a sequence's first, unasked-for draft is made with
PARK_WAIT_S = 0.5   # a parking release waits this long at most for the features still in flight
RELEASED_MEMORY = 65536   # released ids remembered, so late feature pushes don't resurrect a sequence
OPENED_EVENTS = 4         # targets' interprocess ready events kept open (the newest)


@dataclass
class PrefetchedDraft:
    """A draft made when a sequence's features arrived, before its Draft asked for it: numpy arrays [D, K] (float32,
    int32), made on the model thread, so that answering from it takes no torch op on the event loop."""

    context_len: int
    bonus_token: int
    logprobs: np.ndarray
    token_ids: np.ndarray
    made_unix_ns: int = 0   # wall clock when it was made (the gateway's step segments)

    def answers(self, item: DraftItem, top_k: int, depth: int) -> bool:
        """True when this draft is the one `item` asks for (same context and bonus, at least as deep and wide)."""
        return (self.context_len == item.context_len and self.bonus_token == item.bonus_token
                and self.token_ids.shape[0] >= depth and self.token_ids.shape[1] >= top_k)


@dataclass(kw_only=True)
class DrafterServerConfig(ModelServiceConfig):
    """What `ddtree-serve drafter` was started with."""

    drafter_dir: str
    target_model_dir: str
    feature_wait_s: float = 30.0


class DrafterServicer(ModelServicer, drafter_pb2_grpc.DrafterServiceServicer):
    """Holds the DrafterRunner; a Draft waits until the target's features for its context have arrived."""

    runner: DrafterRunner

    def __init__(self, cfg: DrafterServerConfig, metrics=None):
        # Pushed rows renew a sequence; a Draft leases it to the calling gateway session.
        super().__init__("drafter-model", metrics, cfg.lease_s)
        self.cfg = cfg
        self.rows_held: dict[str, int] = {}
        self.context_waiters = Waiters()   # Drafts waiting for their sequences' features (and drafts made on push)
        self.released: OrderedDict[str, None] = OrderedDict()
        self.broken: dict[str, str] = {}   # seq id -> why its context can no longer be trusted
        # Prefix caching: parked sequence -> the session that parked it (only that session may adopt its rows)
        self.parked_by: dict[str, str] = {}
        self.opened_buffers = OpenedBuffers()   # the target's staging buffers (shm / cuda-ipc transports)
        # Draft on push: a push that carries a sequence's next bonus token is drafted at once with the top-k its
        # last Draft asked for, so the step's Draft finds the answer ready (the drafter forward overlaps the
        # Verify answer's trip to the gateway and the Draft request's trip here).
        self.last_top_k: dict[str, int] = {}
        # A sequence that has not asked yet (its first push: the prompt's rows and first token) is drafted with the
        # top-k the gateway named for it in its Prefill (FeatureRows.draft_top_k, set as last_top_k on arrival);
        # without one (an older gateway), with the widest top-k of the last RECENT_DRAFTS Drafts of any sequence,
        # which misses when the window holds no ask as wide as this sequence's (long requests of other budgets).
        self.recent_top_ks: deque[int] = deque(maxlen=RECENT_DRAFTS)
        self.prefetched: dict[str, PrefetchedDraft] = {}
        self.ipc_events: OrderedDict[bytes, torch.cuda.Event] = OrderedDict()   # early pushes' ready events by handle
        # seq id -> (wall clock of its latest push's arrival, the target's stamp as it sent it): step segments
        self.features_arrived: dict[str, tuple[int, int]] = {}
        self.nccl = None                        # NcclReceiver, made on the first JoinNccl (imports no cupy before)
        self.device_uuid = ""                   # the model device's UUID, asked once at load ("" on the CPU)

    async def load(self) -> None:
        """Loads drafter + the target's embedding and LM head on the model thread."""
        runner_cfg = DrafterConfig(drafter_dir=self.cfg.drafter_dir, target_model_dir=self.cfg.target_model_dir,
                                   device=self.cfg.device, dtype=getattr(torch, self.cfg.dtype),
                                   max_batch=self.cfg.max_batch, max_seq_len=self.cfg.max_seq_len,
                                   enforce_eager=self.cfg.enforce_eager, lazy_graphs=self.cfg.lazy_graphs)
        await self.load_runner(DrafterRunner, runner_cfg, self.cfg.device, f"drafter {self.cfg.drafter_dir}")
        # Asked once: Info answers the gateway's watch every second, on the event loop the steps share, and the
        # CUDA queries behind a device's UUID took ~2 ms a call there on the H200 (py-spy).
        self.device_uuid = device_uuid(self.cfg.device)
        await self.start_step_socket(self.cfg.step_socket, [
            StepMethod("DrafterService/Draft", drafter_pb2.DraftRequest, self.Draft),
            StepMethod("DrafterService/PushFeatures", drafter_pb2.FeatureBatch, self.PushFeatures)])
        self.start_lease_reaper()

    async def release_lapsed(self, seq_ids: list[str]) -> int:
        """Frees sequences nobody fed or drafted for a lease (gateway gone, or slots squatted by pushes)."""
        return await self._release_ids(seq_ids)

    async def close(self) -> None:
        """Stops the lease reaper and the model thread, and unmaps the target's staging buffers."""
        await self.close_step_socket()
        self.stop_lease_reaper()
        self.model_thread.shutdown()
        self.opened_buffers.close()
        if self.nccl is not None:
            self.nccl.close()

    @grpc_errors
    async def Info(self, request, context):
        require_ready(self.ready)
        self.leases.heard_from(auth.session_of(context))
        r = self.runner
        return drafter_pb2.DrafterInfo(**self.common_info(self.cfg.drafter_dir, self.cfg), block_size=r.block_size,
                                       target_layer_ids=list(r.target_layer_ids), mask_token_id=r.mask_token_id,
                                       device_uuid=self.device_uuid)

    @grpc_errors
    async def JoinNccl(self, request, context):
        require_ready(self.ready)
        if torch.device(self.cfg.device).type != "cuda" or missing_nccl_package():
            reason = nccl_refusal("cuda", "", self.cfg.device, "", missing_nccl_package()) or ""
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"drafter: {reason}")
        from ddtree_serve.transport.nccl import NcclReceiver

        if self.nccl is None:
            self.nccl = NcclReceiver()
        try:
            await self.nccl.join(request, self.cfg.device)
        except NcclSetupError as exc:
            log.error("NCCL join refused: %s", exc)
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"drafter: {exc}") from None
        return drafter_pb2.NcclJoinResponse(device_uuid=self.device_uuid)

    @grpc_errors
    async def PushFeatures(self, request, context):
        require_ready(self.ready)
        arrived = time.time_ns()
        shared = request.shared if request.HasField("shared") else None
        nccl = request.nccl if request.HasField("nccl") else None
        transport = "nccl" if nccl is not None else shared.kind if shared is not None else "inline"
        buffer = None
        try:
            if shared is not None:
                # Opening maps memory (CUDA IPC on the model thread's device); later pushes only look it up, which
                # spares every step's push a trip to the model thread.
                buffer = (self.opened_buffers.get(shared) if self.opened_buffers.is_open(shared)
                          else await self.model_thread.run(self.opened_buffers.get, shared))
            elif nccl is not None:
                if self.nccl is None:
                    raise NcclLinkLost(f"no NCCL communicator {nccl.comm_id!r} here (never joined)")
                buffer = await self.nccl.receive(request, self.cfg.feature_wait_s)
        except (ValueError, NcclLinkLost) as exc:
            # Every sequence of this push lost rows: they go autoregressive instead of waiting for features.
            for rows in request.rows:
                if rows.seq_id not in self.released:
                    self.broken.setdefault(rows.seq_id, f"context features lost: {exc}")
            await self._notify_rows_changed()
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        stored = received = 0
        entries, next_tokens, deferred = [], {}, []
        for rows in request.rows:
            # Bytes received count every payload that crossed over, stored or dropped, so the target's "send"
            # and the drafter's "recv" counters meet.
            received += payload_bytes(rows, request.feature_dim)
            if rows.seq_id in self.released:
                continue  # the sequence finished while its last features were in flight
            self.leases.touch([rows.seq_id])
            try:
                if rows.HasField("header_offset"):   # an early push: its rows counted on the target's device
                    if shared is None:
                        raise ValueError("an early push's rows must be in a shared buffer")
                    deferred.append(DeferredRows(rows.seq_id, rows.start, self.opened_buffers.rows(
                        shared, rows.shared_offset, rows.num_rows, request.feature_dim, rows.dtype),
                        self.opened_buffers.header(shared, rows.header_offset)))
                    continue
                if shared is not None:
                    data = self.opened_buffers.rows(shared, rows.shared_offset, rows.num_rows, request.feature_dim,
                                                    rows.dtype)
                elif nccl is not None:   # a view of the receive buffer, read before this push is answered
                    data = rows_view(buffer, rows.shared_offset, rows.num_rows, request.feature_dim, rows.dtype)
                else:
                    data = decode_rows(rows.dtype, rows.data, rows.num_rows, request.feature_dim)
            except (ValueError, KeyError, RuntimeError) as exc:
                self._reject(rows.seq_id, exc)
                continue
            entries.append((rows.seq_id, rows.start, data))
            if rows.HasField("draft_top_k") and rows.draft_top_k > 0:   # the K its Drafts will ask for
                self.last_top_k[rows.seq_id] = rows.draft_top_k
            if rows.HasField("next_token") and (rows.seq_id in self.last_top_k or self.recent_top_ks):
                next_tokens[rows.seq_id] = (rows.start + rows.num_rows, rows.next_token)
        # All sequences' rows in one projection, the prefetched drafts and the wait for the buffer's reads in one
        # trip to the model thread.
        errors, drafts, draft_s = await self.model_thread.run(
            self._store_and_prefetch, entries, next_tokens, buffer.device if buffer is not None else None, deferred,
            request.ready_event)
        for d in deferred:
            if errors[d.seq_id] is not None:
                self._reject(d.seq_id, errors[d.seq_id])
                continue
            held = self.runner.context_len(d.seq_id)
            stored += (held - d.start) * d.rows.shape[1] * d.rows.element_size()
            self.rows_held[d.seq_id] = held
            self.features_arrived[d.seq_id] = (arrived, request.sent_unix_ns)
        for seq_id, start, data in entries:
            if errors[seq_id] is not None:
                self._reject(seq_id, errors[seq_id])
            else:
                stored += data.numel() * data.element_size()
                self.rows_held[seq_id] = start + data.shape[0]
                self.features_arrived[seq_id] = (arrived, request.sent_unix_ns)
        self.prefetched.update((seq_id, d) for seq_id, d in drafts.items() if seq_id not in self.released)
        await self._notify_rows_changed()
        if drafts:
            # A Draft may be waiting for these: one turn of the loop lets it answer (the step's critical path)
            # before this push's answer and the metrics below.
            await asyncio.sleep(0)
        if self.metrics is not None:
            if drafts:
                self.metrics.observe_draft(len(drafts), draft_s)
            self.metrics.observe_transport_received(transport, received)
        return drafter_pb2.PushFeaturesResponse(bytes=stored)

    async def PushFeaturesStream(self, request_iterator, context):
        """PushFeatures for each message of a long-lived stream, in order (the target's feature sender)."""
        async for response in answer_each(request_iterator, context, self.PushFeatures,
                                          "DrafterService/PushFeatures", self.record_message):
            yield response

    def _draft_on_host(self, items: list[DraftItem], top_k: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Model thread: runner.draft, its (log-probs, ids) copied to the host without holding the GIL."""
        return to_host(*self.runner.draft(items, top_k, depth))

    def _store_and_prefetch(self, entries: list, next_tokens: dict[str, tuple[int, int]],
                            buffer_device: torch.device | None, deferred: list[DeferredRows] = (),
                            ready_event: bytes = b"") -> tuple[dict, dict[str, PrefetchedDraft], float]:
        """Model thread: stores the rows, drafts the sequences whose next bonus token came along (an early push's:
        all of them, the rows and the draft queued behind the target's ready event), and (for a shared/nccl buffer)
        waits until the buffer's reads are done, since the answer lets it be overwritten."""
        errors = self.runner.add_contexts(entries) if entries else {}
        drafts, seconds = {}, 0.0
        if deferred:
            seconds = self._draft_deferred(deferred, ready_event, buffer_device, errors, drafts)
        items = [DraftItem(seq_id, bonus, context_len) for seq_id, (context_len, bonus) in next_tokens.items()
                 if errors.get(seq_id) is None and self.runner.context_len(seq_id) == context_len]
        if items:
            t0 = time.perf_counter()
            try:
                top_k = self._prefetch_top_k([it.seq_id for it in items])
                logprobs, ids = to_host(*self.runner.draft(items, top_k))
                logprobs, ids = logprobs.float(), ids.to(torch.int32)
                made = time.time_ns()
                logprobs, ids = logprobs.numpy(), ids.numpy()
                drafts.update((it.seq_id, PrefetchedDraft(it.context_len, it.bonus_token, logprobs[b], ids[b], made))
                              for b, it in enumerate(items))
            except (ValueError, KeyError, RuntimeError) as exc:   # the Draft will say what is wrong, if still so
                log.debug("no prefetched draft for this push: %s", exc)
            seconds += time.perf_counter() - t0
        if buffer_device is not None:
            self.runner.synchronize(buffer_device)
        return errors, drafts, seconds

    def _draft_deferred(self, deferred: list[DeferredRows], ready_event: bytes, device: torch.device | None,
                        errors: dict, drafts: dict[str, PrefetchedDraft]) -> float:
        """Model thread: an early push's rows stored and drafted in one go (runner.add_deferred_and_draft), behind
        its ready event; fills errors and drafts; returns the draft's own seconds."""
        try:
            ready = self._ipc_event(ready_event, device) if ready_event else None
        except (ValueError, RuntimeError) as exc:   # its rows cannot be read safely: none of them is stored
            errors.update((d.seq_id, ValueError(f"early push: {exc}")) for d in deferred)
            return 0.0
        top_k = self._prefetch_top_k([d.seq_id for d in deferred])
        results, seconds = self.runner.add_deferred_and_draft(list(deferred), top_k, ready)
        made = time.time_ns()
        for r in results:
            errors[r.seq_id] = r.error
            if r.error is None and r.logprobs is not None:
                drafts[r.seq_id] = PrefetchedDraft(r.context_len, r.bonus_token, r.logprobs.numpy(),
                                                   r.token_ids.numpy(), made)
        return seconds

    def _prefetch_top_k(self, seq_ids: list[str]) -> int:
        """The K of a draft nobody asked for yet: each sequence's last asked K, else the widest recently asked."""
        first_ask = max(self.recent_top_ks, default=1)
        return min(max(self.last_top_k.get(s, first_ask) for s in seq_ids), MAX_TOP_K, self.runner.vocab_size)

    def _ipc_event(self, handle: bytes, device: torch.device | None):
        """The target's interprocess event of an early push (opened once per handle; CUDA only)."""
        event = self.ipc_events.get(handle)
        if event is None:
            if device is None or device.type != "cuda":
                raise ValueError("an early push's ready event needs its rows in a CUDA buffer")
            event = torch.cuda.Event.from_ipc_handle(device, handle)
            self.ipc_events[handle] = event
            while len(self.ipc_events) > OPENED_EVENTS:   # one per target sender: a restarted target brings a new one
                self.ipc_events.popitem(last=False)
        return event

    def _reject(self, seq_id: str, exc: Exception) -> None:
        # one bad sequence must not hold up the rows of the others in the same push
        log.warning("features of sequence %s rejected: %s", seq_id, exc)
        self.broken[seq_id] = f"context features rejected: {exc}"

    async def _notify_rows_changed(self) -> None:
        self.context_waiters.wake()

    async def _wait_for_context(self, items: list[DraftItem]) -> None:
        def have_all() -> bool:
            return all(self.rows_held.get(it.seq_id, 0) >= it.context_len or it.seq_id in self.broken
                       for it in items)

        try:
            await self.context_waiters.wait_for(have_all, self.cfg.feature_wait_s)
        except asyncio.TimeoutError:
            missing = [f"{it.seq_id} ({self.rows_held.get(it.seq_id, 0)}/{it.context_len} rows)"
                       for it in items if self.rows_held.get(it.seq_id, 0) < it.context_len]
            raise RequestError(grpc.StatusCode.UNAVAILABLE,
                               f"context features did not arrive within {self.cfg.feature_wait_s:.0f} s: "
                               + ", ".join(missing)) from None

    @grpc_errors
    async def Draft(self, request, context):
        require_ready(self.ready)
        received = time.time_ns()   # wall-clock stamps: the gateway's step segments (gateway/step_timeline.py)
        t0 = time.perf_counter_ns()
        if not request.items:
            raise ValueError("empty draft batch")
        if request.top_k <= 0:
            raise ValueError(f"top_k must be > 0, got {request.top_k}")
        if request.max_depth < 0 or request.max_depth > self.runner.block_size - 1:
            raise ValueError(f"max_depth must be in [0, {self.runner.block_size - 1}], got {request.max_depth}")
        for it in request.items:
            if it.seq_id in self.released:
                raise KeyError(it.seq_id)
        self.leases.claim(auth.session_of(context), (it.seq_id for it in request.items))
        items = [DraftItem(seq_id=it.seq_id, bonus_token=it.bonus_token, context_len=it.context_len)
                 for it in request.items]
        await self._wait_for_context(items)
        results = [drafter_pb2.DraftResult(seq_id=it.seq_id, error=self.broken[it.seq_id])
                   for it in items if it.seq_id in self.broken]
        items = [it for it in items if it.seq_id not in self.broken]
        t1 = time.perf_counter_ns()
        top_k = min(request.top_k, MAX_TOP_K, self.runner.vocab_size)
        depth = request.max_depth or self.runner.block_size - 1
        ready = {}
        self.recent_top_ks.append(top_k)
        made = 0
        for it in items:
            self.last_top_k[it.seq_id] = top_k
            d = self.prefetched.pop(it.seq_id, None)
            if d is not None and d.answers(it, top_k, depth):
                ready[it.seq_id] = (d.logprobs[:depth, :top_k], d.token_ids[:depth, :top_k])
                made = max(made, d.made_unix_ns)
        missing = [it for it in items if it.seq_id not in ready]
        if missing:
            # On the model thread, host copy included: the event loop never waits for the GPU.
            logprobs, ids = await self.model_thread.run(self._draft_on_host, missing, top_k, depth)
            logprobs, ids = logprobs.float(), ids.to(torch.int32)
            ready.update((it.seq_id, (logprobs[b], ids[b])) for b, it in enumerate(missing))
            made = time.time_ns()
        for it in items:
            logprobs, ids = ready[it.seq_id]
            results.append(draft_result(it.seq_id, logprobs, ids))
        t2 = time.perf_counter_ns()
        if self.metrics is not None:
            if missing:
                self.metrics.observe_draft(len(missing), (t2 - t1) / 1e9)
            if items:
                self.metrics.observe_prefetch(hits=len(items) - len(missing), misses=len(missing))
        arrived, sent = max((self.features_arrived.get(it.seq_id, (0, 0)) for it in items), default=(0, 0))
        return drafter_pb2.DraftResponse(results=results, timings=common_pb2.Timings(
            total_ns=time.perf_counter_ns() - t0, forward_ns=t2 - t1, queue_ns=t1 - t0, received_unix_ns=received,
            features_received_unix_ns=arrived, features_sent_unix_ns=sent, draft_made_unix_ns=made,
            replied_unix_ns=time.time_ns()))

    async def DraftStream(self, request_iterator, context):
        """Draft for each message of a long-lived stream, in order (the gateway's step path)."""
        async for response in answer_each(request_iterator, context, self.Draft, "DrafterService/Draft",
                                          self.record_message):
            yield response

    @grpc_errors
    async def Release(self, request, context):
        require_ready(self.ready)
        session = auth.session_of(context)
        ids = list(self.leases.check(session, request.seq_ids))
        if request.keep_prefix and request.park_rows:
            await self._wait_for_parked_rows(dict(zip(request.seq_ids, request.park_rows)))
        released = await self._release_ids(ids, park=request.keep_prefix)
        if request.keep_prefix:
            parked = self._forget_unparked()
            self.parked_by.update((seq_id, session) for seq_id in ids if seq_id in parked)
        return drafter_pb2.DrafterReleaseResponse(released=released, cache=self.observe_cache())

    async def _wait_for_parked_rows(self, rows: dict[str, int]) -> None:
        """Before parking: waits (at most PARK_WAIT_S) until each sequence holds the rows the target sent features
        for; its last verify's push may still be in flight, and a slot parked short is reused less (or, for a
        Gated DeltaNet target, not at all)."""
        def have_all() -> bool:
            return all(seq_id not in self.rows_held or seq_id in self.broken or self.rows_held[seq_id] >= n
                       for seq_id, n in rows.items())

        try:
            await self.context_waiters.wait_for(have_all, PARK_WAIT_S)
        except asyncio.TimeoutError:
            log.info("parking sequences whose last features have not arrived within %.1f s", PARK_WAIT_S)

    @grpc_errors
    async def Adopt(self, request, context):
        require_ready(self.ready)
        session = auth.session_of(context)
        for it in request.items:
            if it.seq_id in self.released or it.seq_id in self.rows_held:
                raise ValueError(f"sequence {it.seq_id!r} exists or existed: only a new sequence adopts rows")
        self.leases.claim(session, (it.seq_id for it in request.items))
        # another session's rows are never reused (nor is their existence revealed)
        adoptions = [(it.seq_id, it.parked_id if session in (self.parked_by.get(it.parked_id),
                                                             self.leases.owner.get(it.parked_id)) else "",
                      it.rows, it.copy) for it in request.items]
        whole = {it.seq_id: it.rows for it in request.items if it.whole}
        if whole:   # all the rows or none: a running source's may still be in flight (not even its first push)
            wanted = {src: whole[seq_id] for seq_id, src, _, _ in adoptions if seq_id in whole and src}

            def ready() -> bool:
                return all(self._holds(src, n) or src in self.broken or src in self.released
                           for src, n in wanted.items())

            with contextlib.suppress(asyncio.TimeoutError):
                await self.context_waiters.wait_for(ready, PARK_WAIT_S)
            adoptions = [(seq_id, src if seq_id not in whole or self._holds(src, n) else "", n, copy)
                         for seq_id, src, n, copy in adoptions]
        rows = await self.model_thread.run(self._adopt_all, adoptions)
        for (seq_id, *_), n in zip(adoptions, rows):
            if n:
                self.rows_held[seq_id] = n
        self._forget_unparked()
        return drafter_pb2.AdoptResponse(rows=rows)

    def _holds(self, source: str, rows: int) -> bool:
        """Whether a running or parked sequence holds at least `rows` context rows."""
        return self.rows_held.get(source, 0) >= rows or self.runner.parked_rows(source) >= rows

    def _adopt_all(self, adoptions: list[tuple[str, str, int, bool]]) -> list[int]:
        return [self.runner.adopt(seq_id, source, rows, copy) if source else 0
                for seq_id, source, rows, copy in adoptions]

    def _forget_unparked(self) -> set[str]:
        """Drops the owners of sequences no longer parked (adopted or evicted); returns those parked."""
        parked = set(self.runner.parked_ids())
        self.parked_by = {seq_id: owner for seq_id, owner in self.parked_by.items() if seq_id in parked}
        return parked

    async def _release_ids(self, ids: list[str], park: bool = False) -> int:
        # Tombstones first, before any await: a feature push checked after this point is dropped, and one
        # checked before it was queued on the model thread ahead of the release below.
        for seq_id in ids:
            self.rows_held.pop(seq_id, None)
            self.broken.pop(seq_id, None)
            self.last_top_k.pop(seq_id, None)
            self.prefetched.pop(seq_id, None)
            self.features_arrived.pop(seq_id, None)
            self.released[seq_id] = None
        while len(self.released) > RELEASED_MEMORY:
            self.released.popitem(last=False)
        self.leases.drop(ids)
        return await self.model_thread.run(self._release_all, ids, park)

    def _release_all(self, seq_ids: list[str], park: bool = False) -> int:
        return sum(bool(self.runner.release(seq_id, park)) for seq_id in seq_ids)


async def serve(cfg: DrafterServerConfig, host: str, port: int, metrics_port: int | None = None,
                ready_file: str | None = None, reflection: bool | None = None, unix_socket: str | None = None) -> None:
    """Runs the drafter service until SIGTERM (also on `unix_socket` when given)."""
    await serve_model_service("drafter", SERVICE_NAME, cfg.drafter_dir, DrafterMetrics,
                              lambda metrics, _client_interceptors: DrafterServicer(cfg, metrics),
                              drafter_pb2_grpc.add_DrafterServiceServicer_to_server, host, port, metrics_port,
                              ready_file, reflection=reflection, unix_socket=unix_socket)
