"""The public gRPC API: validation, request ids, streaming, cancellation; the engines do the decoding."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from transformers import AutoTokenizer

from ddtree_serve.decoding import ddtree_native
from ddtree_serve.decoding.config import default_batch_budgets, default_budget
from ddtree_serve.decoding.guides import GuideSpec
from ddtree_serve.plumbing.messages import guide_from_proto, guide_proto, logprobs_wanted, sampling_from_proto
from ddtree_serve.plumbing.request_context import get_request_id, set_request_id
from ddtree_serve.proto import gateway_pb2, gateway_pb2_grpc, target_pb2
from ddtree_serve.plumbing.rpc import RequestError, grpc_errors, metrics_hooks, require_ready, run_service
from gateway import limits
from gateway.backends import BackendPair, PairAddress
from gateway.bad_words import bad_word_token_ids, check_bad_words
from gateway.detokenizer import IncrementalDetokenizer
from gateway.engine import EngineConfig, PairEngine
from gateway.prefix_index import MIN_REUSED_TOKENS
from gateway.reasoning import REASONING_PARSERS
from gateway.scheduler import SCHEDULING_POLICIES, AdmissionLimits, PairQueue, Scheduler
from gateway.sequence import MODES, Sequence, StreamEvent
from gateway.watch import PairWatch

log = logging.getLogger(__name__)

MAX_CACHE_SALT_CHARS = 256

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
GUIDE_COMPILE_TIMEOUT_S = 60.0   # a structured output's grammar, compiled by each target at admission
MODE_BY_ENUM = {gateway_pb2.DECODE_MODE_DDTREE: "ddtree", gateway_pb2.DECODE_MODE_DFLASH: "dflash",
                gateway_pb2.DECODE_MODE_AR: "ar"}


def _stop_fields(stop_reason: str | int | None) -> dict:
    """GenerateResponse's stop_string / stop_token_id for what ended a request."""
    if isinstance(stop_reason, str):
        return {"stop_string": stop_reason}
    return {} if stop_reason is None else {"stop_token_id": stop_reason}


@dataclass
class GatewayConfig:
    """What `ddtree-serve gateway` was started with."""

    pairs: list[PairAddress]
    mode: str = "ddtree"
    budget: int = 0               # 0: chosen for the first target's device (ddtree_serve.decoding.config.default_budget)
    tokenizer_dir: str | None = None
    max_waiting: int = 4096
    scheduling_policy: str = "fcfs"   # gateway.scheduler.SCHEDULING_POLICIES
    preemption_threshold: int | None = None   # priority policy: PairQueue.preemption_threshold (None: no preemption)
    reasoning_parser: str = ""        # HTTP chat answers: reasoning split from content (gateway/reasoning.py; "": off)
    transport: str = "inline"
    engine: EngineConfig = field(default_factory=EngineConfig)
    drain_s: float = 20.0             # SIGTERM: how long running requests get to finish
    watch_interval_s: float = 1.0     # pair health checks (also renew this gateway's sequence leases)
    step_streams: bool = True         # Draft and Verify as messages on long-lived streams (False: unary calls)
    step_sockets: bool = False        # the step calls on the services' step sockets (--step-transport socket)
    step_spin_us: int = 0             # poll each step-socket answer this long first (0: off; BackendPair)
    backend_wait_s: float = 900.0     # start-up: how long each target and drafter may take to serve


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Validates requests into Sequences, hands them to the scheduler and streams their events back."""

    def __init__(self, cfg: GatewayConfig, metrics_factory=None, client_interceptors=()):
        if cfg.engine.max_verify_nodes < 0:
            raise ValueError(f"max_verify_nodes must be >= 0 (0: no cap), got {cfg.engine.max_verify_nodes}")
        if cfg.engine.guided_overdraft < 1:
            raise ValueError(f"guided_overdraft must be >= 1, got {cfg.engine.guided_overdraft}")
        if cfg.engine.max_prefill_tokens < 0:
            raise ValueError(f"max_prefill_tokens must be >= 0 (0: no limit), got {cfg.engine.max_prefill_tokens}")
        if cfg.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {cfg.mode!r}")
        if cfg.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {cfg.scheduling_policy!r}")
        if cfg.reasoning_parser and cfg.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {cfg.reasoning_parser!r}")
        if cfg.preemption_threshold is not None and (cfg.scheduling_policy != "priority" or cfg.preemption_threshold < 0):
            raise ValueError("a preemption threshold needs --scheduling-policy priority and a value >= 0, got "
                             f"{cfg.preemption_threshold} under {cfg.scheduling_policy}")
        self.cfg = cfg
        self.metrics_factory = metrics_factory
        self.metrics = None
        self.client_interceptors = list(client_interceptors)
        self.ready = asyncio.Event()
        self.pairs: list[BackendPair] = []
        self.engines: list[PairEngine] = []
        self.scheduler: Scheduler | None = None
        self.tokenizer = None
        self.specials: list[str] = []
        self.watches: list[PairWatch] = []
        self.host = None            # the ServiceHost, for health changes (set by serve)
        self.draining = False
        # Tokenization runs here, not on the event loop: a long prompt must not stall every other stream.
        self.tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def connect(self) -> None:
        """Connects every pair, loads the tokenizer, starts one engine per pair."""
        self.pairs = [BackendPair(addr, index=i, client_interceptors=self.client_interceptors,
                                  step_streams=self.cfg.step_streams, step_sockets=self.cfg.step_sockets,
                                  step_spin_us=self.cfg.step_spin_us)
                      for i, addr in enumerate(self.cfg.pairs)]
        await asyncio.gather(*(p.connect(self.cfg.backend_wait_s, transport=self.cfg.transport) for p in self.pairs))
        first = self.pairs[0]
        for p in self.pairs[1:]:
            if p.target_info.vocab_size != first.target_info.vocab_size:
                raise RuntimeError("all pairs must serve the same model (vocab sizes differ)")
        self.tokenizer = await self._load_tokenizer(first)
        self.specials = limits.special_token_strings(self.tokenizer)
        self.model_name = first.target_info.model_name
        if self.cfg.budget <= 0:
            self.cfg.budget = default_budget(first.target_info.device)
            log.info("default DDTree budget %d for device %s", self.cfg.budget, first.target_info.device)
        if self.cfg.engine.batch_budgets is None:
            self.cfg.engine.batch_budgets = default_batch_budgets(first.target_info.device)
            log.info("DDTree budget ceilings by batch size for device %s: %s", first.target_info.device,
                     ", ".join(f"{b}+ -> {c}" for b, c in self.cfg.engine.batch_budgets) or "none")
        if self.metrics_factory is not None:
            self.metrics = self.metrics_factory(self.model_name)
        queues = []
        for p in self.pairs:
            admission = AdmissionLimits(max_running=min(p.target_info.max_batch, p.drafter_info.max_batch),
                                        max_reserved_tokens=p.target_info.cache.capacity_tokens or 1 << 62)
            queues.append(PairQueue(admission, policy=self.cfg.scheduling_policy,
                                    preemption_threshold=self.cfg.preemption_threshold))
        self.scheduler = Scheduler(queues, max_waiting=self.cfg.max_waiting)
        self.engines = [PairEngine(p, q, self.cfg.engine, self.metrics) for p, q in zip(self.pairs, queues)]
        for e in self.engines:
            e.start()
        self.watches = [PairWatch(p, e, self._health_changed, interval_s=self.cfg.watch_interval_s)
                        for p, e in zip(self.pairs, self.engines)]
        for w in self.watches:
            w.start()
        self.ready.set()

    @property
    def healthy(self) -> bool:
        """Every pair's target answers as the instance we attached, and we are not shutting down."""
        return not self.draining and all(p.target_ok for p in self.pairs)

    async def _health_changed(self) -> None:
        if self.host is None:
            return
        if self.healthy:
            await self.host.mark_serving()
        else:
            await self.host.mark_not_serving()

    async def _load_tokenizer(self, pair: BackendPair):
        if self.cfg.tokenizer_dir:
            return AutoTokenizer.from_pretrained(self.cfg.tokenizer_dir)
        files = await pair.target.TokenizerFiles(target_pb2.InfoRequest(), timeout=60)
        tmp = Path(tempfile.mkdtemp(prefix="ddtree-tokenizer-"))
        try:  # the tokenizer is read whole into memory: the folder is not needed afterwards
            for name, data in files.files.items():
                (tmp / Path(name).name).write_bytes(data)
            return AutoTokenizer.from_pretrained(str(tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    async def drain(self) -> None:
        """SIGTERM: stop admitting, let running requests finish for drain_s, end the rest cleanly, release all."""
        self.draining = True
        if self.scheduler is None:
            return await self.close()
        for q in self.scheduler.queues:
            while q.waiting:
                q.waiting.popleft().fail(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.drain_s
        log.info("draining %d running requests (up to %.0f s)", self.scheduler.num_running, self.cfg.drain_s)
        while self.scheduler.num_running and loop.time() < deadline:
            await asyncio.sleep(0.1)
        ended = 0
        for q in self.scheduler.queues:
            for seq in list(q.running):
                if not seq.finish_reason:
                    # A final message with finish_reason "abort": the client sees a clean end, not a reset.
                    seq.finish_reason = "abort"
                    seq.emit([])
                    ended += 1
            q.wakeup.set()
        # The engines release the ended sequences at their next step boundary; a sequence leaves the running set
        # when its Release RPCs go out, and stopping the engines before the answers would cancel them.
        deadline = loop.time() + 5.0
        while ((self.scheduler.num_running or any(e.releases_in_flight for e in self.engines))
               and loop.time() < deadline):
            await asyncio.sleep(0.05)
        log.info("drained (%d requests ended early)", ended)
        await self.close()

    async def close(self) -> None:
        for w in self.watches:
            await w.stop()
        for e in self.engines:
            await e.stop()
        for p in self.pairs:
            await p.close()

    # ---- request validation -------------------------------------------------------------------------------
    @property
    def max_seq_len(self) -> int:
        return min(p.target_info.max_seq_len for p in self.pairs)

    async def _tokenize(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    async def _prompt_ids(self, request) -> list[int]:
        limits.check_prompt_size(request, self.max_seq_len)   # before any tokenization
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            ids = list(request.token_ids.ids)
        elif kind == "chat":
            ids = await self._chat_ids(request.chat)
            if not request.cache_breakpoint and self.pairs[0].target_info.state_snapshots:
                request.cache_breakpoint = await self._system_prefix_len(request.chat, ids)
        elif kind == "text":
            if request.apply_chat_template:
                ids = (await self._tokenize(self._render_chat, [{"role": "user", "content": request.text}])
                       if request.text else [])
            else:
                ids = await self._tokenize(self._encode, request.text) if request.text else []
        else:
            ids = []
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.pairs[0].target_info.vocab_size
        bad = [t for t in ids if t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary [0, {vocab}): {bad[:8]}")
        return ids

    async def _chat_ids(self, chat: gateway_pb2.ChatMessages) -> list[int]:
        """Token ids of chat messages through the chat template, with the request's chat options."""
        messages = [limits.chat_message(m) for m in chat.messages]
        if not messages:
            return []
        options = dict(add_generation_prompt=not (chat.no_generation_prompt or chat.continue_final_message),
                       continue_final_message=chat.continue_final_message,
                       **limits.chat_template_kwargs(chat.template_kwargs_json))
        if chat.tools_json:
            options["tools"] = limits.json_list(chat.tools_json, "tools")
        return await self._tokenize(self._render_chat, messages, options)

    async def _system_prefix_len(self, chat: gateway_pb2.ChatMessages, ids: list[int]) -> int:
        """The tokens of a chat's leading system (or developer) messages as the template renders them alone, when
        they are a prefix of its prompt and other messages follow: the prefix other chats share; else 0."""
        messages = [limits.chat_message(m) for m in chat.messages]
        k = next((i for i, m in enumerate(messages) if m["role"] not in ("system", "developer")), len(messages))
        if k == 0 or k == len(messages):
            return 0
        options = dict(add_generation_prompt=False, **limits.chat_template_kwargs(chat.template_kwargs_json))
        if chat.tools_json:
            options["tools"] = limits.json_list(chat.tools_json, "tools")
        prefix = await self._tokenize(self._render_chat, messages[:k], options)
        return len(prefix) if len(prefix) < len(ids) and ids[:len(prefix)] == prefix else 0

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def _render_chat(self, messages: list[dict], options: dict | None = None) -> list[int]:
        """Token ids of messages through the chat template; options: apply_chat_template keywords (default: an
        assistant turn opened for the answer)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        limits.check_chat_messages(messages, self.specials)
        options = options or {"add_generation_prompt": True}
        if "tools" in options:
            limits.check_no_control_tokens("tools", json.dumps(options["tools"]), self.specials)
        if options.get("continue_final_message") and messages[-1]["role"] != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, **options)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    async def _make_sequence(self, request) -> Sequence:
        if request.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {request.max_tokens}")
        if request.priority and self.cfg.scheduling_policy != "priority":
            raise ValueError(f"priority {request.priority} given, but priority scheduling is off (the gateway runs "
                             f"--scheduling-policy {self.cfg.scheduling_policy})")
        limits.check_stops(list(request.stop), list(request.stop_token_ids))
        prompt_ids = await self._prompt_ids(request)
        info = self.pairs[0].target_info
        # The limit the target really serves (the model's own context may be shorter than --max-seq-len).
        if len(prompt_ids) + request.max_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({request.max_tokens}) exceeds the "
                             f"model's context limit of {self.max_seq_len} tokens")
        sampling = sampling_from_proto(request.sampling)
        if request.bad_words:
            check_bad_words(list(request.bad_words))
            words = await self._tokenize(bad_word_token_ids, self.tokenizer, list(request.bad_words))
            sampling = dataclasses.replace(sampling, bad_words=tuple(dict.fromkeys(
                sampling.bad_words + tuple(map(tuple, words)))))
            sampling.validate()
        sampling.check_vocab(info.vocab_size)
        if request.mode == gateway_pb2.DECODE_MODE_DEFAULT:
            mode = self.cfg.mode
        elif request.mode in MODE_BY_ENUM:
            mode = MODE_BY_ENUM[request.mode]
        else:
            raise ValueError(f"unknown decode mode {request.mode}")
        budget = request.budget or self.cfg.budget
        max_budget = info.max_tree_nodes - 1
        if budget < 0 or budget > max_budget:
            raise ValueError(f"budget must be in [1, {max_budget}], got {request.budget}")
        if request.max_tokens > 0 and not all(0 <= t < info.vocab_size for t in request.stop_token_ids):
            raise ValueError("stop_token_ids out of vocabulary")
        stops = set(request.stop_token_ids)
        if not request.ignore_eos:
            stops |= set(info.eos_token_ids)
        if sampling.min_tokens > request.max_tokens:
            raise ValueError(f"min_tokens ({sampling.min_tokens}) must be <= max_tokens ({request.max_tokens})")
        sampling = dataclasses.replace(sampling, min_tokens_blocked=tuple(sorted(stops)) if sampling.min_tokens else ())
        sampling.validate()   # again, with the stops min_tokens holds back
        guide = await self._guide(request, sampling) if request.HasField("guide") else None
        if len(request.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise ValueError(f"cache_salt is over the {MAX_CACHE_SALT_CHARS}-character limit")
        if request.cache_breakpoint < 0:
            raise ValueError(f"cache_breakpoint must be >= 0, got {request.cache_breakpoint}")
        # kept only where the target keeps snapshots and the prefix is worth one (as prefix caching's minimum)
        snapshot_at = request.cache_breakpoint if (
            info.state_snapshots and MIN_REUSED_TOKENS <= request.cache_breakpoint < len(prompt_ids)) else 0
        request_id = request.request_id or get_request_id() or uuid.uuid4().hex
        return Sequence(request_id=request_id, prompt_ids=prompt_ids, max_tokens=request.max_tokens,
                        sampling=sampling, mode=mode, budget=budget if mode == "ddtree" else 0,
                        stop_token_ids=frozenset(stops),
                        detokenizer=IncrementalDetokenizer(
                            self.tokenizer, list(request.stop), include_stop=request.include_stop_str_in_output,
                            min_tokens=sampling.min_tokens, skip_special_tokens=not request.keep_special_tokens),
                        logprobs=logprobs_wanted(request.logprobs, request.top_logprobs),
                        prompt_logprobs=logprobs_wanted(request.prompt_logprobs, request.prompt_top_logprobs),
                        guide=guide, cache_salt=request.cache_salt, priority=request.priority,
                        snapshot_at=snapshot_at)

    async def _guide(self, request, sampling) -> GuideSpec:
        """The request's structured output, its grammar parsed here (the target compiles it against its vocabulary);
        ValueError when it is invalid or cannot be served."""
        if not self.pairs[0].target_info.structured_outputs:
            raise ValueError("structured outputs are not available: the target has no grammar compiler (xgrammar) "
                             "or no tokenizer in its checkpoint")
        # each of these can leave a node no token at all, where the grammar allows only what they remove
        for name, used in (("min_tokens", sampling.min_tokens > 0), ("allowed_token_ids", sampling.allowed_token_ids),
                           ("bad_words", sampling.bad_words)):
            if used:
                raise ValueError(f"structured outputs are not supported together with {name}")
        spec = guide_from_proto(request.guide)
        spec.check_start_after(self.pairs[0].target_info.vocab_size)
        await self._tokenize(spec.grammar)
        # Compiled by the targets now, in this request's own time: their Prefill then finds it ready. A target that
        # cannot answer now compiles it at the Prefill instead, if it serves this request at all.
        answers = await asyncio.gather(*(pair.target.PrepareGuide(guide_proto(spec), timeout=GUIDE_COMPILE_TIMEOUT_S)
                                         for pair in self.pairs if pair.target_ok), return_exceptions=True)
        failures = [a for a in answers if isinstance(a, BaseException)]
        refused = [f for f in failures
                   if isinstance(f, grpc.aio.AioRpcError) and f.code() == grpc.StatusCode.INVALID_ARGUMENT]
        if refused or (failures and len(failures) == len(answers)):
            raise (refused or failures)[0]
        return spec

    # ---- public RPCs --------------------------------------------------------------------------------------
    def _stats(self, seq: Sequence) -> gateway_pb2.GenerationStats:
        now = time.perf_counter()
        return gateway_pb2.GenerationStats(
            prompt_tokens=len(seq.prompt_ids), generated_tokens=len(seq.output_ids), steps=seq.stats.steps,
            accepted_tokens=seq.stats.accepted_tokens, mean_acceptance_length=seq.stats.mean_acceptance_length,
            draft_tokens=seq.stats.draft_tokens,
            ttft_seconds=(seq.first_token_at - seq.arrival) if seq.first_token_at else 0.0,
            e2e_seconds=now - seq.arrival, mode=seq.mode if seq.drafting else "ar", budget=seq.budget,
            requested_mode=seq.mode, drafter_fallback=not seq.drafting, cached_prompt_tokens=seq.cached_tokens)

    def stream(self, request):
        """(Sequence, StreamEvent) pairs of one GenerateRequest; the HTTP front drives the engine through this."""
        return self._events(request, None)

    async def _events(self, request, context):
        require_ready(self.ready)
        if self.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        seq = await self._make_sequence(request)
        set_request_id(seq.request_id)  # this handler's task: its log lines carry the id
        self.scheduler.submit(seq)
        log.info("request %s: %d prompt tokens, max_tokens %d, mode %s", seq.request_id, len(seq.prompt_ids),
                 seq.max_tokens, seq.mode)
        try:
            while True:
                event: StreamEvent = await seq.events.get()
                if event.error is not None:
                    raise RequestError(*event.error)
                yield seq, event
                if event.finished:
                    return
        finally:
            if not seq.finish_reason:  # client went away, deadline passed, or server stopping
                seq.cancelled = True
                for q in self.scheduler.queues:
                    q.wakeup.set()
                log.info("request %s cancelled after %d tokens", seq.request_id, len(seq.output_ids))

    async def GenerateStream(self, request, context):
        try:
            async for seq, event in self._events(request, context):
                scored = event.prompt_logprobs is not None
                yield gateway_pb2.GenerateResponse(
                    request_id=seq.request_id, token_ids=event.token_ids, text=event.text, finished=event.finished,
                    finish_reason=event.finish_reason, stats=self._stats(seq) if event.finished else None,
                    logprobs=event.logprobs or [], prompt_logprobs=event.prompt_logprobs if scored else [],
                    prompt_token_ids=seq.prompt_ids if scored else [], **_stop_fields(event.stop_reason))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - map to a status like the unary methods
            from ddtree_serve.plumbing.rpc import status_for

            code, message = status_for(exc)
            log.warning("GenerateStream failed: %s %s", code.name, message)
            await context.abort(code, message)

    @grpc_errors
    async def Generate(self, request, context):
        ids, text, logprobs, prompt, last = [], [], [], None, None
        async for seq, event in self._events(request, context):
            ids.extend(event.token_ids)
            text.append(event.text)
            logprobs.extend(event.logprobs or [])
            prompt = event.prompt_logprobs if prompt is None else prompt
            last = (seq, event)
        seq, event = last
        return gateway_pb2.GenerateResponse(request_id=seq.request_id, token_ids=ids, text="".join(text),
                                            finished=True, finish_reason=event.finish_reason, stats=self._stats(seq),
                                            logprobs=logprobs, prompt_logprobs=prompt or [],
                                            prompt_token_ids=seq.prompt_ids if prompt is not None else [],
                                            **_stop_fields(event.stop_reason))

    @grpc_errors
    async def Tokenize(self, request, context):
        require_ready(self.ready)
        limit = self.max_seq_len * limits.MAX_CHARS_PER_TOKEN
        if len(request.text) > limit:
            raise ValueError(f"text of {len(request.text)} characters is over the {limit}-character limit")
        if request.apply_chat_template:
            ids = await self._tokenize(self._render_chat, [{"role": "user", "content": request.text}])
        else:
            ids = await self._tokenize(self._encode, request.text)
        return gateway_pb2.TokenizeResponse(ids=ids)

    @grpc_errors
    async def ModelInfo(self, request, context):
        require_ready(self.ready)
        pairs = []
        from ddtree_serve.proto import drafter_pb2

        async def info(call, request):
            try:
                return await call(request, timeout=5)
            except grpc.aio.AioRpcError:
                return None   # a service that is down shows as an empty cache, not a failed ModelInfo

        for p in self.pairs:
            t = await info(p.target.Info, target_pb2.InfoRequest())
            d = await info(p.drafter.Info, drafter_pb2.DrafterInfoRequest())
            pairs.append(gateway_pb2.BackendPair(
                target=p.address.target, drafter=p.address.drafter, target_cache=t.cache if t else None,
                drafter_cache=d.cache if d else None, target_instance_id=t.instance_id if t else "",
                drafter_instance_id=d.instance_id if d else "", healthy=p.target_ok,
                target_quantize=t.quantize if t else "", target_memory=t.memory if t else None))
        first = self.pairs[0]
        return gateway_pb2.ModelInfoResponse(
            model_name=first.target_info.model_name, drafter_name=first.drafter_info.model_name,
            vocab_size=first.target_info.vocab_size, max_seq_len=self.max_seq_len,
            block_size=first.drafter_info.block_size, default_mode=self.cfg.mode, default_budget=self.cfg.budget,
            running_requests=self.scheduler.num_running, waiting_requests=self.scheduler.num_waiting, pairs=pairs)


async def serve(cfg: GatewayConfig, host: str, port: int, metrics_port: int | None = None,
                ready_file: str | None = None, http_port: int | None = None, api_key: str | None = None,
                reflection: bool | None = None, unix_socket: str | None = None) -> None:
    """Runs the gateway until SIGTERM: health turns SERVING once every pair is connected. With http_port, the
    OpenAI-compatible HTTP front runs in the same event loop, on the same engines."""
    # The HTTP front serves /metrics too, so it needs a registry even without a separate metrics port.
    want_registry = metrics_port is not None or http_port is not None
    registry, interceptors, client_interceptors = metrics_hooks("gateway", metrics_port if metrics_port is not None
                                                                else (0 if want_registry else None))
    metrics_factory = None
    if registry is not None:
        from ddtree_serve.plumbing.metrics import GatewayMetrics

        metrics_factory = lambda model_name: GatewayMetrics(registry, model_name=model_name)  # noqa: E731
    servicer = GatewayServicer(cfg, metrics_factory, client_interceptors)
    log.info("gateway: pairs %s", [(p.target, p.drafter) for p in cfg.pairs])
    http = None
    if http_port is not None:
        from gateway.http_api import HttpFront

        http = HttpFront(servicer, host, http_port, registry=registry, api_key=api_key)

    async def start() -> None:
        if http is not None:  # HTTP first, so /health answers 503 while the pairs connect
            await http.start()
        # The C tree builder compiles (once per source, cached) now, off the loop, not in the first step.
        await asyncio.to_thread(ddtree_native.library)
        await servicer.connect()

    async def on_stop() -> None:
        if http is not None:
            await http.stop()
        await servicer.drain()
    await run_service("gateway", SERVICE_NAME, servicer, gateway_pb2_grpc.add_GatewayServicer_to_server,
                      [*interceptors, limits.MalformedRequestInterceptor()], host, port, start=start,
                      on_stop=on_stop, registry=registry, metrics_port=metrics_port, ready_file=ready_file,
                      public=True, reflection=reflection, on_host=lambda h: setattr(servicer, "host", h),
                      max_receive_bytes=limits.MAX_REQUEST_BYTES, unix_socket=unix_socket)
