"""gRPC servicer of the target service: sequences keyed by id, one model thread, features pushed to the drafter."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from ddtree_serve.plumbing import auth
from ddtree_serve.plumbing.messages import guide_from_proto, logprobs_proto, logprobs_wanted, sampling_from_proto
from ddtree_serve.plumbing.metrics import TargetMetrics
from ddtree_serve.plumbing.model_servicer import ModelServiceConfig, ModelServicer, serve_model_service
from ddtree_serve.plumbing.rpc import RequestError, grpc_errors, require_ready
from ddtree_serve.plumbing.step_socket import StepMethod
from ddtree_serve.plumbing.step_stream import answer_each
from ddtree_serve.proto import common_pb2, drafter_pb2, drafter_pb2_grpc, target_pb2, target_pb2_grpc
from ddtree_serve.transport import TRANSPORTS, FeatureRows, FeatureSender, make_sender
from ddtree_serve.transport.base import EarlyRows
from ddtree_serve.transport.nccl_protocol import NcclSetupError, device_uuid, missing_nccl_package, nccl_refusal
from target_svc.grammar_compiler import UNAVAILABLE as GRAMMARS_UNAVAILABLE, GrammarCompiler
from target_svc.kernel_warmup import WarmupSpec, default_passes, run_passes
from target_svc.memory_plan import GIB, MemoryPlan
from target_svc.runner import PrefillItem, TargetConfig, TargetRunner, VerifyItem

log = logging.getLogger(__name__)

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "generation_config.json", "config.json")


@dataclass(kw_only=True)
class TargetServerConfig(ModelServiceConfig):
    """What `ddtree-serve target` was started with."""

    model_dir: str
    max_tree_nodes: int = 257
    graph_node_sizes: tuple[int, ...] = ()   # verify sizes captured besides 1, 4^k + 1 and max_tree_nodes
    prefill_chunk: int = 512
    gdn_state_snapshots: int = 0             # hybrid targets: TargetConfig.state_snapshots
    allowed_drafters: tuple[str, ...] = ()   # AttachDrafter targets allowed (empty: any, for secret holders)
    quantize: str = "none"                   # "int8": weight-only int8 decoder projections
    gpu_memory_utilization: float | None = None   # CUDA: fraction of the card (None: 0.9)
    kv_cache_memory_gb: float | None = None       # GiB for the cache, given directly
    gpu_memory_cap_gb: float | None = None        # CUDA: GiB this process's allocator may hold, taken as the card
    kernel_warmup_passes: int | None = None       # CUDA: kernel_warmup.py passes before loading (None: by model)
    early_push: bool = True   # a verify's features go out while it runs (shared-buffer transports; transport/shared.py)


WARMUP_LOG_S = 15.0   # a long warm-up (the 27B's ~120 buckets take minutes) logs its progress this often


def warmup_failure(exc: Exception, bucket: int, buckets: int) -> str:
    """The log line of a failed graph warm-up step: what failed, what the service does now, and, when the device
    ran out of memory, the flags that make room (as vLLM users know them)."""
    oom = isinstance(exc, torch.OutOfMemoryError)
    then = "its steps run eagerly" if oom else "the rest capture on first use"
    line = (f"verify graph warm-up failed at bucket {bucket} of {buckets} ({then}): "
            f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
    if oom:
        line += (". The graph does not fit beside the weights and the cache (eager steps are slower): lower "
                 "--max-batch or --max-seq-len, raise --gpu-memory-utilization (the graph pool and the "
                 "allocator's caching come out of its headroom), or serve with --enforce-eager")
    return line


class TargetServicer(ModelServicer, target_pb2_grpc.TargetServiceServicer):
    """Holds the TargetRunner; model work runs on one dedicated thread so the event loop stays responsive."""

    runner: TargetRunner

    def __init__(self, cfg: TargetServerConfig, metrics=None, client_interceptors=()):
        super().__init__("target-model", metrics, cfg.lease_s)
        self.cfg = cfg
        self.client_interceptors = list(client_interceptors)
        self.sender: FeatureSender | None = None
        self.sender_address = ""
        self.feature_seqs: set[str] = set()   # sequences whose features go to the drafter (not AR ones)
        # Prefix caching: parked sequence -> the session that parked it (only that session may reuse its rows)
        self.parked_by: dict[str, str] = {}
        self._warmup_task: asyncio.Task | None = None
        self.grammars: GrammarCompiler | None = None   # structured outputs, once the model is loaded
        self._grammar_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")

    async def load(self) -> None:
        """Loads the model on the model thread (health stays NOT_SERVING until this returns)."""
        dtype = getattr(torch, self.cfg.dtype)
        runner_cfg = TargetConfig(model_dir=self.cfg.model_dir, device=self.cfg.device, dtype=dtype,
                                  max_batch=self.cfg.max_batch, max_seq_len=self.cfg.max_seq_len,
                                  max_tree_nodes=self.cfg.max_tree_nodes, prefill_chunk=self.cfg.prefill_chunk,
                                  graph_node_sizes=self.cfg.graph_node_sizes, enforce_eager=self.cfg.enforce_eager, quantize=self.cfg.quantize,
                                  lazy_graphs=self.cfg.lazy_graphs,
                                  gpu_memory_utilization=self.cfg.gpu_memory_utilization,
                                  kv_cache_memory_bytes=None if self.cfg.kv_cache_memory_gb is None
                                  else int(self.cfg.kv_cache_memory_gb * GIB),
                                  gpu_memory_cap_bytes=None if self.cfg.gpu_memory_cap_gb is None
                                  else int(self.cfg.gpu_memory_cap_gb * GIB),
                                  state_snapshots=self.cfg.gdn_state_snapshots)
        passes = self.cfg.kernel_warmup_passes
        if passes is None and torch.device(self.cfg.device).type == "cuda":
            passes = default_passes(self.cfg.model_dir)
        if passes and torch.device(self.cfg.device).type == "cuda":
            # Autotuning in throwaway processes: this one then loads only the chosen kernels (kernel_warmup.py).
            await run_passes(WarmupSpec(self.cfg.model_dir, self.cfg.device, self.cfg.dtype, self.cfg.quantize,
                                        self.cfg.max_batch, self.cfg.prefill_chunk or 512,
                                        min(self.cfg.max_tree_nodes, 65)), passes)
        await self.load_runner(TargetRunner, runner_cfg, self.cfg.device, f"target model {self.cfg.model_dir}")
        if self.metrics is not None:
            self.metrics.set_memory_plan(self.runner.memory)
        grammars = GrammarCompiler(self.cfg.model_dir, self.runner.vocab_size, self.runner.eos_token_ids)
        self.grammars = grammars if grammars.available() else None
        if self.runner.max_batch < self.cfg.max_batch:
            log.warning("--max-batch %d does not fit in memory: holding %d sequences of %d tokens", self.cfg.max_batch,
                        self.runner.max_batch, self.runner.max_seq_len)
        if self.runner.max_seq_len < self.cfg.max_seq_len:
            log.warning("--max-seq-len %d exceeds the model's context (%d positions): serving %d", self.cfg.max_seq_len,
                        self.runner.max_seq_len, self.runner.max_seq_len)
        await self.start_step_socket(self.cfg.step_socket,
                                     [StepMethod("TargetService/Verify", target_pb2.VerifyRequest, self.Verify)])
        self.start_lease_reaper()

    async def release_lapsed(self, seq_ids: list[str]) -> int:
        """Frees sequences whose gateway session went silent."""
        released = await self.model_thread.run(self._release_all, seq_ids)
        self.feature_seqs.difference_update(seq_ids)
        self.leases.drop(seq_ids)
        self.observe_cache()
        return released

    def _start_warmup(self) -> None:
        if self._warmup_task is not None:
            self._warmup_task.cancel()   # a re-attach: the new feature layers need graphs of their own
        self._observe_buckets(len(self.runner.warmup_shapes()), 0, 0)   # pending from the attach's answer on
        self._warmup_task = asyncio.create_task(self._warm_up())

    async def _warm_up(self) -> None:
        """Captures every verify bucket, one bucket per model-thread item: a request arriving meanwhile waits
        behind one capture, not all of them (the 64-layer 27B's ~120 buckets took minutes, and the first
        requests ran past their deadline)."""
        t0 = last_log = time.perf_counter()
        shapes = self.runner.warmup_shapes()
        done = 0
        seconds, eager = 0.0, 0
        for done, shape in enumerate(shapes, start=1):
            try:
                seconds = await self.model_thread.run(self.runner.warmup, [shape])
            except asyncio.CancelledError:
                raise
            except torch.OutOfMemoryError as exc:   # that bucket runs eagerly; the others may still fit
                eager += 1
                log.error("%s; %s", warmup_failure(exc, done, len(shapes)), self.runner.memory_summary())
                self._observe_buckets(len(shapes) - done, done - eager, eager)
                continue
            except Exception as exc:  # noqa: BLE001 - the service still works: graphs capture on first use instead
                log.error("%s; %s", warmup_failure(exc, done, len(shapes)), self.runner.memory_summary())
                self._observe_buckets(0, done - 1 - eager, eager)
                return
            self._observe_buckets(len(shapes) - done, done - eager, eager)
            if time.perf_counter() - last_log >= WARMUP_LOG_S and done < len(shapes):
                last_log = time.perf_counter()
                log.info("verify graph warm-up: %d of %d buckets in %.0f s", done, len(shapes), last_log - t0)
        if shapes:
            log.info("verify graphs ready: %d buckets captured, %d eager (%.1f s of capture) in %.1f s; %s",
                     len(shapes) - eager, eager, seconds, time.perf_counter() - t0, self.runner.memory_summary())

    def _observe_buckets(self, pending: int, captured: int, eager: int) -> None:
        if self.metrics is not None:
            self.metrics.set_graph_buckets(pending, captured, eager)

    async def close(self) -> None:
        """Delivers queued features and stops the model thread."""
        if self._warmup_task is not None:
            self._warmup_task.cancel()
        await self.close_step_socket()
        self.stop_lease_reaper()
        if self.sender is not None:
            await self.sender.close()
        self.model_thread.shutdown()
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    @grpc_errors
    async def Info(self, request, context):
        require_ready(self.ready)
        self.leases.heard_from(auth.session_of(context))   # the gateway's health watch keeps its leases alive
        r = self.runner
        # max_seq_len is what the runner really serves (the model's context may be shorter than --max-seq-len).
        info = self.common_info(self.cfg.model_dir, self.cfg, max_seq_len=r.max_seq_len)
        info["max_batch"] = r.max_batch   # what the memory plan holds (at most --max-batch)
        return target_pb2.TargetInfo(**info, model_type=r.model_type, eos_token_ids=r.eos_token_ids,
                                     num_layers=r.num_layers, max_tree_nodes=self.cfg.max_tree_nodes,
                                     quantize=self.cfg.quantize, memory=memory_plan_proto(r.memory),
                                     structured_outputs=self.grammars is not None, prefix_reuse=r.prefix_reuse,
                                     state_snapshots=r.model.cache.spec.state_snapshots)

    @grpc_errors
    async def TokenizerFiles(self, request, context):
        files = {}
        for name in TOKENIZER_FILES:
            path = Path(self.cfg.model_dir) / name
            if path.is_file():
                files[name] = path.read_bytes()
        return target_pb2.TokenizerFilesResponse(files=files)

    @grpc_errors
    async def AttachDrafter(self, request, context):
        require_ready(self.ready)
        transport = request.transport or "inline"
        if not request.drafter_address:
            raise ValueError("drafter_address is required")
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {transport!r}; available: {', '.join(TRANSPORTS)}")
        if transport == "cuda-ipc" and torch.device(self.cfg.device).type != "cuda":
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"transport cuda-ipc needs the target on a CUDA device (it runs on {self.cfg.device})")
        if transport == "nccl":
            # What this side lacks is known before asking the drafter anything (and never imports cupy on a CPU).
            self._refuse_nccl(missing_nccl_package(), "", "")
        if self.cfg.allowed_drafters and request.drafter_address not in self.cfg.allowed_drafters:
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                               f"drafter {request.drafter_address!r} is not one this target is configured for")
        # The feature layers are the drafter's own: asked from it, never taken on the caller's word (a wrong set
        # would silently turn speculation off). Asking also proves a real drafter that holds our secret listens.
        info = await self._drafter_info(request.drafter_address)
        ids = list(info.target_layer_ids)
        if request.target_layer_ids and list(request.target_layer_ids) != ids:
            raise ValueError(f"target_layer_ids {list(request.target_layer_ids)} differ from the drafter's {ids}")
        if any(i < 0 or i >= self.runner.num_layers for i in ids):
            raise ValueError(f"target_layer_ids {ids} out of range for {self.runner.num_layers} layers")
        if transport == "nccl":
            self._refuse_nccl(None, info.device, info.device_uuid)
        step_socket = request.drafter_step_socket
        if step_socket and step_socket != info.step_socket:   # the drafter's own word, not the caller's
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"the drafter at {request.drafter_address} serves no step socket at {step_socket!r}")
        await self.model_thread.run(self.runner.set_feature_layers, ids)
        if not self.cfg.lazy_graphs:
            # Captured graphs bake the feature layers in, so they are captured now that the layers are known.
            self._start_warmup()
        # An nccl link is formed anew on every attach: the gateway re-attaches after a restart, when the old
        # communicator is dead on at least one side.
        if (self.sender is None or self.sender_address != request.drafter_address or self.sender.name != transport
                or self.sender.step_socket != step_socket or transport == "nccl"):
            if self.sender is not None:
                await self.sender.close()
                self.sender = None
            on_sent = None
            if self.metrics is not None:
                on_sent = lambda nbytes, seconds, t=transport: self.metrics.observe_transport(t, nbytes, seconds)  # noqa: E731
            sender = make_sender(transport, request.drafter_address, self.client_interceptors, on_sent, step_socket)
            if transport == "nccl":
                try:
                    await sender.establish(self.cfg.device)
                except NcclSetupError as exc:
                    await sender.close()
                    log.error("transport nccl refused: %s", exc)
                    raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"transport nccl: {exc}") from None
            self.sender = sender
            self.sender_address = request.drafter_address
        log.info("drafter attached at %s over %s%s, feature layers %s", request.drafter_address, transport,
                 f" (pushes on the step socket {step_socket})" if step_socket else "", ids)
        return target_pb2.AttachDrafterResponse(transport=transport, feature_dim=len(ids) * self.runner.hidden_size)

    def _refuse_nccl(self, missing_package: str | None, drafter_device: str, drafter_uuid: str) -> None:
        """FAILED_PRECONDITION (and a log line) when this target and that drafter cannot form an NCCL pair."""
        reason = nccl_refusal(self.cfg.device, device_uuid(self.cfg.device) if drafter_uuid else "", drafter_device,
                              drafter_uuid, missing_package)
        if reason:
            log.error("transport nccl refused: %s", reason)
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, reason)

    async def _drafter_info(self, address: str) -> drafter_pb2.DrafterInfo:
        try:
            async with auth.internal_channel(address) as channel:
                info = await drafter_pb2_grpc.DrafterServiceStub(channel).Info(drafter_pb2.DrafterInfoRequest(),
                                                                              timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"no drafter answers at {address}: {exc.code().name}") from None
        if info.hidden_size != self.runner.hidden_size:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"the drafter at {address} is not for this model (hidden size {info.hidden_size})")
        return info

    def _push(self, rows: list[FeatureRows]) -> int:
        if not rows:
            return 0
        if self.sender is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "no drafter attached (call AttachDrafter)")
        self.sender.submit(rows)
        return sum(r.data.numel() * r.data.element_size() for r in rows)

    def _early_push(self, items: list[VerifyItem]) -> EarlyPush | None:
        """The runner's early-push hook for one Verify (None: off, or no sequence of it pushes features)."""
        if not self.cfg.early_push or self.sender is None:
            return None
        wanted = {it.seq_id for it in items} & self.feature_seqs
        return EarlyPush(self.sender, asyncio.get_running_loop(), wanted) if wanted else None

    @grpc_errors
    async def Prefill(self, request, context):
        require_ready(self.ready)
        t0 = time.perf_counter_ns()
        if not request.items:
            raise ValueError("empty prefill batch")
        session = auth.session_of(context)
        self.leases.claim(session, (it.seq_id for it in request.items))
        guides, refused = await self._compile_guides(request.items)
        items = [PrefillItem(seq_id=it.seq_id, prompt_ids=list(it.prompt_ids), sampling=sampling_from_proto(it.sampling),
                             want_features=it.push_features, start=it.start, more=it.more,
                             logprobs=logprobs_wanted(it.logprobs, it.top_logprobs),
                             prompt_logprobs=logprobs_wanted(it.prompt_logprobs, it.prompt_top_logprobs),
                             guide=guides.get(it.seq_id), guide_start_after=tuple(it.guide.start_after),
                             # another session's rows are never reused (nor is their existence revealed)
                             reuse_from=it.reuse_from if self._reusable_by(session, it.reuse_from) else "",
                             reuse_max=it.reuse_max, reuse_copy=it.reuse_copy, outputs_from=it.outputs_from,
                             snapshot_at=it.snapshot_at)
                 for it in request.items if it.seq_id not in refused]
        if any(it.want_features for it in items) and self.sender is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "no drafter attached (call AttachDrafter)")
        t1 = time.perf_counter_ns()
        outputs = await self.model_thread.run(self.runner.prefill, items) if items else []
        t2 = time.perf_counter_ns()
        self.feature_seqs.update(it.seq_id for it in items if it.want_features)
        top_k = {it.seq_id: it.draft_top_k for it in request.items}
        nbytes = self._push([FeatureRows(o.seq_id, o.context_len - o.features.shape[0], o.features,
                                         next_token=o.next_token if o.next_token >= 0 else None,
                                         draft_top_k=top_k.get(o.seq_id) or None)
                             for o in outputs if o.features is not None and o.seq_id in self.feature_seqs])
        reused = sum(o.reused for o in outputs)
        if reused:
            self._forget_unparked()
        if self.metrics is not None:
            self.metrics.observe_forward("prefill", len(items), (t2 - t1) / 1e9,
                                         num_tokens=sum(len(it.prompt_ids) for it in items) - reused)
            self.metrics.observe_prefix_reused(reused)
        self.observe_cache()
        results = [target_pb2.PrefillResult(seq_id=o.seq_id, next_token=o.next_token, context_len=o.context_len,
                                            logprobs=logprobs_proto(o.logprobs),
                                            prompt_logprobs=logprobs_proto(o.prompt_logprobs), reused=o.reused,
                                            snapshot=o.snapshot)
                   for o in outputs]
        results += [target_pb2.PrefillResult(seq_id=seq_id, next_token=-1, error=error)
                    for seq_id, error in refused.items()]
        return target_pb2.PrefillResponse(results=results, timings=common_pb2.Timings(
            total_ns=time.perf_counter_ns() - t0, forward_ns=t2 - t1, transport_bytes=nbytes))

    @grpc_errors
    async def PrepareGuide(self, request, context):
        require_ready(self.ready)
        if self.grammars is None:
            raise ValueError(GRAMMARS_UNAVAILABLE)
        spec = guide_from_proto(request)
        if self.grammars.compiled(spec) is not None:
            self._observe_grammar("cached")
            return target_pb2.PrepareGuideResponse(compile_seconds=0.0)
        t0 = time.perf_counter()
        try:
            await asyncio.get_running_loop().run_in_executor(self._grammar_pool, self.grammars.compile, spec)
        except (ValueError, RuntimeError):
            self._observe_grammar("invalid")
            raise
        seconds = time.perf_counter() - t0
        self._observe_grammar("compiled", seconds)
        return target_pb2.PrepareGuideResponse(compile_seconds=seconds)

    def _observe_grammar(self, result: str, seconds: float | None = None) -> None:
        if self.metrics is not None:
            self.metrics.observe_grammar(result, seconds)

    async def _compile_guides(self, items) -> tuple[dict[str, object], dict[str, str]]:
        """The compiled grammars of the items that start a guided sequence (usually compiled already by PrepareGuide;
        otherwise off the model thread), and the refused items' reasons by seq id (a bad grammar refuses its own
        item, never the batch)."""
        wanted = [it for it in items if it.HasField("guide") and it.start == 0]
        if not wanted:
            return {}, {}
        loop = asyncio.get_running_loop()
        compiled, refused = {}, {}
        for it in wanted:
            if self.grammars is None:
                refused[it.seq_id] = GRAMMARS_UNAVAILABLE
                continue
            spec = guide_from_proto(it.guide)
            try:
                spec.check_start_after(self.runner.vocab_size)
            except ValueError as exc:
                refused[it.seq_id] = str(exc)
                continue
            ready = self.grammars.compiled(spec)
            if ready is not None:
                compiled[it.seq_id] = ready
                continue
            try:
                compiled[it.seq_id] = await loop.run_in_executor(self._grammar_pool, self.grammars.compile, spec)
            except (ValueError, RuntimeError) as exc:
                log.warning("prefill of %s refused: %s", it.seq_id, exc)
                refused[it.seq_id] = str(exc)
        return compiled, refused

    @grpc_errors
    async def Verify(self, request, context):
        require_ready(self.ready)
        received = time.time_ns()   # wall-clock stamps: the gateway's step segments (gateway/step_timeline.py)
        t0 = time.perf_counter_ns()
        if not request.items:
            raise ValueError("empty verify batch")
        self.leases.check(auth.session_of(context), (it.seq_id for it in request.items))
        items = []
        for it in request.items:
            if len(it.tokens) == 0 or len(it.tokens) != len(it.parents):
                raise ValueError(f"sequence {it.seq_id}: tree needs >= 1 node and one parent per token")
            items.append(VerifyItem(seq_id=it.seq_id, tokens=it.tokens, parents=it.parents, keep_nodes=it.keep_nodes))
        t1 = time.perf_counter_ns()
        early = self._early_push(items)
        outputs = await self.model_thread.run(self.runner.verify, items, early)
        t2, forward_done = time.perf_counter_ns(), time.time_ns()
        plain = [FeatureRows(o.seq_id, o.context_len - len(o.accepted_nodes), o.features, o.next_token,
                             o.features_ready)
                 for o in outputs if o.features is not None and o.seq_id in self.feature_seqs]
        plain_bytes = self._push(plain)
        nbytes = plain_bytes + (early.nbytes if early is not None else 0)
        if plain_bytes:
            # One turn of the event loop lets the sender put the push on the wire before this answer: the push
            # (-> the drafter's next draft) is the step's critical path, the answer has time to spare. (The sender
            # polls its staging copy without yielding first, so that turn normally runs through to the write.)
            await asyncio.sleep(0)
        if self.metrics is not None:
            self.metrics.observe_forward("verify", len(items), (t2 - t1) / 1e9,
                                         num_tokens=sum(o.verified_nodes for o in outputs))
            self.metrics.observe_verify_pushes(len(early.pushed) if early is not None else 0, len(plain))
            self.metrics.observe_verify_pruned(sum(len(it.tokens) - o.verified_nodes for it, o in zip(items, outputs)))
        results = [target_pb2.VerifyResult(seq_id=o.seq_id, accepted_nodes=o.accepted_nodes,
                                           accepted_tokens=o.accepted_tokens, next_token=o.next_token,
                                           context_len=o.context_len, logprobs=logprobs_proto(o.logprobs),
                                           verified_nodes=o.verified_nodes)
                   for o in outputs]
        return target_pb2.VerifyResponse(results=results, timings=common_pb2.Timings(
            total_ns=time.perf_counter_ns() - t0, forward_ns=t2 - t1, transport_bytes=nbytes,
            received_unix_ns=received, forward_done_unix_ns=forward_done, replied_unix_ns=time.time_ns()))

    async def VerifyStream(self, request_iterator, context):
        """Verify for each message of a long-lived stream, in order (the gateway's step path)."""
        async for response in answer_each(request_iterator, context, self.Verify, "TargetService/Verify",
                                          self.record_message):
            yield response

    @grpc_errors
    async def Release(self, request, context):
        require_ready(self.ready)
        session = auth.session_of(context)
        self.leases.check(session, request.seq_ids)
        released = await self.model_thread.run(self._release_all, list(request.seq_ids), request.keep_prefix)
        self.feature_seqs.difference_update(request.seq_ids)
        self.leases.drop(request.seq_ids)
        if request.keep_prefix:
            parked = self._forget_unparked()
            self.parked_by.update((seq_id, session) for seq_id in request.seq_ids if seq_id in parked)
        return target_pb2.ReleaseResponse(released=released, cache=self.observe_cache())

    def _reusable_by(self, session: str, seq_id: str) -> bool:
        """Whether the session may reuse the sequence's rows: it parked it, or it runs it."""
        return bool(seq_id) and session in (self.parked_by.get(seq_id), self.leases.owner.get(seq_id))

    def _forget_unparked(self) -> set[str]:
        """Drops the owners of sequences no longer parked (adopted or evicted); returns those parked."""
        parked = set(self.runner.model.cache.parked)   # a snapshot: the model thread may evict meanwhile
        self.parked_by = {seq_id: owner for seq_id, owner in self.parked_by.items() if seq_id in parked}
        return parked

    def _release_all(self, seq_ids: list[str], park: bool = False) -> int:
        released = 0
        for seq_id in seq_ids:
            try:
                self.runner.release(seq_id, park=park)
                released += 1
            except KeyError:
                pass  # idempotent: an abort may race with a normal finish
        return released


class EarlyPush:
    """Called by the runner on the model thread once a verify is queued: stages the rows of the sequences that
    push features (sender.stage_early) and hands the push to the event loop; returns the sequences it pushed (none
    when the transport cannot: they then go as a plain push after the verify)."""

    def __init__(self, sender: FeatureSender, loop: asyncio.AbstractEventLoop, seq_ids: set[str]) -> None:
        self.sender, self.loop, self.seq_ids = sender, loop, seq_ids
        self.nbytes = 0
        self.pushed: set[str] = set()

    def __call__(self, rows: list[EarlyRows]) -> set[str]:
        rows = [r for r in rows if r.seq_id in self.seq_ids]
        try:
            staged = self.sender.stage_early(rows) if rows else None
        except Exception:  # noqa: BLE001 - the verify must not fail for it: the rows go the plain way
            log.exception("early feature push failed to stage; the rows go after the verify")
            return set()
        if staged is None:
            return set()
        self.loop.call_soon_threadsafe(self.sender.send_staged, staged)
        self.nbytes = sum(r.data.numel() * r.data.element_size() for r in rows)
        self.pushed = {r.seq_id for r in rows}
        return self.pushed


def memory_plan_proto(plan: MemoryPlan) -> common_pb2.MemoryPlan:
    """The runner's memory plan as served in Info."""
    return common_pb2.MemoryPlan(
        weight_bytes=plan.weight_bytes, kv_bytes_per_token=plan.kv_bytes_per_token,
        state_bytes_per_sequence=plan.state_bytes_per_sequence, slot_bytes=plan.slot_bytes,
        cache_bytes=plan.cache_bytes, budget_bytes=plan.budget_bytes or 0, enforced=plan.budget_bytes is not None,
        workspace_bytes=plan.workspace_bytes, max_batch=plan.max_batch, fit_batch=plan.fit_batch,
        requested_batch=plan.requested_batch, max_seq_len=plan.max_seq_len, source=plan.source)


async def serve(cfg: TargetServerConfig, host: str, port: int, metrics_port: int | None = None,
                ready_file: str | None = None, reflection: bool | None = None, unix_socket: str | None = None) -> None:
    """Runs the target service until SIGTERM (also on `unix_socket` when given)."""
    await serve_model_service("target", SERVICE_NAME, cfg.model_dir, TargetMetrics,
                              lambda metrics, client_interceptors: TargetServicer(cfg, metrics, client_interceptors),
                              target_pb2_grpc.add_TargetServiceServicer_to_server, host, port, metrics_port, ready_file,
                              reflection=reflection, unix_socket=unix_socket)
