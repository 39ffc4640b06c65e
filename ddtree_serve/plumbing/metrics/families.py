"""The Prometheus metric families of the three services (gateway, target, drafter).

Every service builds its own CollectorRegistry and passes it in; nothing here registers into the global one.
Names follow vLLM where vLLM has one (`vllm:*`, counters declared without `_total`, which the client appends),
and use the `ddtree_` prefix otherwise.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.process_collector import ProcessCollector

ENGINE = "ddtree-serve"

# Buckets. Speculative steps emit several tokens at once, so inter-token latency goes well below vLLM's 10 ms floor.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025,
                0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
SEGMENT_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005,
                   0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 1.0)
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02,
               0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TREE_BUCKETS = (0, 1, 2, 4, 8, 15, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024)
ACCEPT_BUCKETS = tuple(float(i) for i in range(1, 18))   # 1 .. block_size + 1 tokens per step
TOKEN_COUNT_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
BYTES_BUCKETS = (256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)

_C = TypeVar("_C")


def new_registry() -> CollectorRegistry:
    """A fresh registry for one service (never the process-global default one)."""
    return CollectorRegistry()


def get_or_create(registry: CollectorRegistry, name: str, make: Callable[[], _C]) -> _C:
    """The collector called `name` in registry, made on first use.

    Several interceptors of one service share a registry (e.g. one client interceptor per backend channel);
    the registry refuses duplicate names, so the second one reuses the family the first created.
    """
    try:
        return make()
    except ValueError:
        # prometheus_client has no public lookup by name; this mapping has been stable since 0.4.
        existing = registry._names_to_collectors.get(name)  # noqa: SLF001
        if existing is None:
            raise
        return existing  # type: ignore[return-value]


class _ServiceMetrics:
    """Shared parts: the registry, process metrics and GPU-memory gauges."""

    service = ""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        self.model_name = model_name
        # Process CPU/RSS/fds; a custom registry does not get them by default.
        get_or_create(registry, "process_cpu_seconds", lambda: ProcessCollector(registry=registry))
        self.gpu_memory_allocated = Gauge("ddtree_gpu_memory_allocated_bytes",
                                          "GPU memory held by tensors of this process (torch.cuda.memory_allocated).",
                                          ["model_name", "device"], registry=registry)
        self.gpu_memory_reserved = Gauge("ddtree_gpu_memory_reserved_bytes",
                                         "GPU memory reserved by torch's caching allocator.",
                                         ["model_name", "device"], registry=registry)
        # Peaks since start (the allocator tracks them): what a card must hold, which a scrape's snapshot misses.
        self.gpu_memory_peak_allocated = Gauge("ddtree_gpu_memory_peak_allocated_bytes",
                                               "Peak GPU memory held by tensors of this process "
                                               "(torch.cuda.max_memory_allocated).",
                                               ["model_name", "device"], registry=registry)
        self.gpu_memory_peak_reserved = Gauge("ddtree_gpu_memory_peak_reserved_bytes",
                                              "Peak GPU memory reserved by torch's caching allocator "
                                              "(torch.cuda.max_memory_reserved).",
                                              ["model_name", "device"], registry=registry)

    def track_gpu_memory(self, device: Any) -> bool:
        """Exports torch's allocated/reserved bytes (now and peak) for `device` at scrape time; False (no-op) unless
        it is CUDA."""
        try:
            import torch
        except ImportError:  # the gateway image may run without torch
            return False
        dev = torch.device(device)
        if dev.type != "cuda" or not torch.cuda.is_available():
            return False
        label = str(dev)
        self.gpu_memory_allocated.labels(self.model_name, label).set_function(lambda: torch.cuda.memory_allocated(dev))
        self.gpu_memory_reserved.labels(self.model_name, label).set_function(lambda: torch.cuda.memory_reserved(dev))
        self.gpu_memory_peak_allocated.labels(self.model_name, label).set_function(
            lambda: torch.cuda.max_memory_allocated(dev))
        self.gpu_memory_peak_reserved.labels(self.model_name, label).set_function(
            lambda: torch.cuda.max_memory_reserved(dev))
        return True


class GatewayMetrics(_ServiceMetrics):
    """Request-level (vLLM names) and step-level (ddtree_) metrics of the gateway's engine."""

    service = "gateway"

    def __init__(self, registry: CollectorRegistry, model_name: str, engine: str = ENGINE) -> None:
        super().__init__(registry, model_name)
        self.engine = engine
        ln = ["model_name", "engine"]
        r = registry
        self.num_requests_running = Gauge("vllm:num_requests_running", "Number of requests in the running batch.",
                                          ln, registry=r)
        self.num_requests_waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting for admission.",
                                          ln, registry=r)
        self.time_to_first_token = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.",
                                             ln, buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.",
                                             ln, buckets=ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram("vllm:e2e_request_latency_seconds",
                                             "End-to-end request latency in seconds.", ln,
                                             buckets=REQUEST_BUCKETS, registry=r)
        self.request_queue_time = Histogram("vllm:request_queue_time_seconds",
                                            "Time a request spent waiting before admission, in seconds.", ln,
                                            buckets=REQUEST_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request.",
                                               ln, buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Generated tokens per finished request.", ln,
                                                   buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens.", ln, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated (emitted) tokens.", ln, registry=r)
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.", ln, registry=r)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits",
                                         "Prompt tokens served from the prefix cache (not run).", ln, registry=r)
        self.prefix_held_back = Counter("ddtree_prefix_held_back",
                                        "Prompt lookups deferred a step to copy the rows of a prompt in flight that "
                                        "shares their prefix.", ln, registry=r)
        self.num_preemptions = Counter("vllm:num_preemptions",
                                       "Running requests preempted for a waiting one of higher priority (run again "
                                       "from their tokens later).", ln, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       ln + ["finished_reason"], registry=r)
        self.spec_decode_num_drafts = Counter("vllm:spec_decode_num_drafts",
                                              "Drafts verified (one per sequence per speculative step).", ln, registry=r)
        self.spec_decode_num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens",
                                                    "Draft tokens verified (tree nodes, root excluded).", ln,
                                                    registry=r)
        self.spec_decode_num_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens",
                                                       "Draft tokens accepted (bonus token excluded).", ln, registry=r)
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by depth (position 0 = depth 1).",
            ln + ["position"], registry=r)
        lm = ["model_name", "mode"]
        self.step_batch_size = Histogram("ddtree_step_batch_size", "Sequences per speculative step.", lm,
                                         buckets=BATCH_BUCKETS, registry=r)
        self.tree_size = Histogram("ddtree_tree_size_nodes", "Draft tree nodes per sequence per step (root excluded).",
                                   lm, buckets=TREE_BUCKETS, registry=r)
        self.acceptance_length = Histogram("ddtree_acceptance_length",
                                           "Tokens committed per sequence per step, bonus included.", lm,
                                           buckets=ACCEPT_BUCKETS, registry=r)
        self.draft_seconds = Histogram("ddtree_draft_seconds", "Draft phase of a step (drafter RPC), seconds.", lm,
                                       buckets=STEP_BUCKETS, registry=r)
        self.tree_build_seconds = Histogram("ddtree_tree_build_seconds", "Tree construction of a step, seconds.", lm,
                                            buckets=STEP_BUCKETS, registry=r)
        self.verify_seconds = Histogram("ddtree_verify_seconds", "Verify phase of a step (target RPC), seconds.", lm,
                                        buckets=STEP_BUCKETS, registry=r)
        self.step_seconds = Histogram("ddtree_step_seconds", "Whole speculative step, seconds.", lm,
                                      buckets=STEP_BUCKETS, registry=r)
        self.steps = Counter("ddtree_steps", "Speculative steps run.", lm, registry=r)
        self.step_segment_seconds = Histogram(
            "ddtree_step_segment_seconds", "A step's segments between the processes (gateway/step_timeline.py: "
            "one-way trips, handlers, the feature push), from the services' wall-clock stamps; seconds.",
            lm + ["segment"], buckets=SEGMENT_BUCKETS, registry=r)
        self._segment_children: dict[tuple[str, str], Histogram] = {}
        self.drafter_fallbacks = Counter("ddtree_drafter_fallbacks", "Requests that continued autoregressively "
                                         "because the drafter failed.", ["model_name"], registry=r)

    def observe_drafter_fallback(self) -> None:
        """Counts one request that lost its drafter and continued autoregressively."""
        self.drafter_fallbacks.labels(self.model_name).inc()

    def set_queue(self, running: int, waiting: int) -> None:
        """Current running-batch and waiting-queue sizes."""
        self.num_requests_running.labels(self.model_name, self.engine).set(running)
        self.num_requests_waiting.labels(self.model_name, self.engine).set(waiting)

    def observe_prompt(self, prompt_tokens: int, cached_tokens: int | None = None) -> None:
        """Counts prefilled prompt tokens (call when a request's prefill is done); cached_tokens: those served from
        the prefix cache (None: prefix caching is off, nothing was looked up)."""
        self.prompt_tokens.labels(self.model_name, self.engine).inc(prompt_tokens)
        if cached_tokens is not None:
            self.prefix_cache_queries.labels(self.model_name, self.engine).inc(prompt_tokens)
            self.prefix_cache_hits.labels(self.model_name, self.engine).inc(cached_tokens)

    def observe_prompts_held_back(self, n: int) -> None:
        """Counts n prompts held back a step for the rows of a prompt in flight sharing their prefix."""
        self.prefix_held_back.labels(self.model_name, self.engine).inc(n)

    def observe_preempted(self, n: int) -> None:
        """Counts n running requests preempted."""
        self.num_preemptions.labels(self.model_name, self.engine).inc(n)

    def observe_first_token(self, ttft_s: float) -> None:
        """Records TTFT and counts the first generated token."""
        self.time_to_first_token.labels(self.model_name, self.engine).observe(ttft_s)
        self.generation_tokens.labels(self.model_name, self.engine).inc()

    def observe_tokens(self, interval_s: float, n: int) -> None:
        """A step emitted n tokens for one request, interval_s after its previous emission: ITL gets interval/n n times."""
        if n <= 0:
            return
        itl = self.inter_token_latency.labels(self.model_name, self.engine)
        share = interval_s / n
        # Observing the share n times keeps the histogram per-token, as SGLang does for multi-token steps.
        for _ in range(n):
            itl.observe(share)
        self.generation_tokens.labels(self.model_name, self.engine).inc(n)

    def observe_step(self, batch_size: int, tree_sizes: Sequence[int], accepted_per_seq: Sequence[int],
                     draft_s: float, tree_s: float, verify_s: float, step_s: float, mode: str = "ddtree") -> None:
        """One step over the batch: tree_sizes = nodes per sequence (root excluded), accepted_per_seq = draft tokens
        accepted per sequence (bonus excluded). Sequences with an empty tree (AR) count no draft."""
        if len(tree_sizes) != len(accepted_per_seq):
            raise ValueError("tree_sizes and accepted_per_seq must have one entry per sequence")
        lm = (self.model_name, mode)
        self.steps.labels(*lm).inc()
        self.step_batch_size.labels(*lm).observe(batch_size)
        self.draft_seconds.labels(*lm).observe(draft_s)
        self.tree_build_seconds.labels(*lm).observe(tree_s)
        self.verify_seconds.labels(*lm).observe(verify_s)
        self.step_seconds.labels(*lm).observe(step_s)
        tree_h, acc_h = self.tree_size.labels(*lm), self.acceptance_length.labels(*lm)
        drafts = draft_tokens = accepted = 0
        per_pos: dict[int, int] = {}
        for size, acc in zip(tree_sizes, accepted_per_seq):
            tree_h.observe(size)
            acc_h.observe(acc + 1)
            if size <= 0:
                continue
            drafts += 1
            draft_tokens += size
            accepted += acc
            for pos in range(acc):
                per_pos[pos] = per_pos.get(pos, 0) + 1
        vl = (self.model_name, self.engine)
        if drafts:
            self.spec_decode_num_drafts.labels(*vl).inc(drafts)
            self.spec_decode_num_draft_tokens.labels(*vl).inc(draft_tokens)
            self.spec_decode_num_accepted_tokens.labels(*vl).inc(accepted)
        for pos, count in per_pos.items():
            self.spec_decode_num_accepted_tokens_per_pos.labels(*vl, str(pos)).inc(count)

    def observe_segments(self, segments: dict[str, float], mode: str = "ddtree") -> None:
        """One step's segments (name -> seconds, gateway/step_timeline.py)."""
        for name, seconds in segments.items():
            child = self._segment_children.get((mode, name))
            if child is None:   # labels() locks and validates on every call: looked up once per (mode, segment)
                child = self._segment_children[(mode, name)] = self.step_segment_seconds.labels(self.model_name,
                                                                                                mode, name)
            child.observe(seconds)

    def observe_finished(self, reason: str, prompt_tokens: int, generation_tokens: int, e2e_s: float,
                         queue_s: float) -> None:
        """A request finished ("stop" | "length" | "eos" | "abort" | "error"). Token counters are not touched here:
        they grow as tokens are emitted (observe_prompt / observe_first_token / observe_tokens)."""
        vl = (self.model_name, self.engine)
        self.request_success.labels(*vl, reason).inc()
        self.e2e_request_latency.labels(*vl).observe(e2e_s)
        self.request_queue_time.labels(*vl).observe(queue_s)
        self.request_prompt_tokens.labels(*vl).observe(prompt_tokens)
        self.request_generation_tokens.labels(*vl).observe(generation_tokens)


class _TransportMetrics:
    """ddtree_transport_* families (target sends, drafter receives context features)."""

    def _init_transport(self, registry: CollectorRegistry) -> None:
        lt = ["model_name", "transport", "direction"]
        self.transport_bytes = Counter("ddtree_transport_bytes", "Context-feature bytes moved between services.",
                                       lt, registry=registry)
        self.transport_seconds = Histogram("ddtree_transport_seconds",
                                           "Time to move one batch of context features, seconds.", lt,
                                           buckets=STEP_BUCKETS, registry=registry)
        self.transport_batch_bytes = Histogram("ddtree_transport_batch_bytes",
                                               "Bytes per context-feature transfer.", lt,
                                               buckets=BYTES_BUCKETS, registry=registry)

    def _observe_transport(self, transport: str, nbytes: int, seconds: float | None, direction: str) -> None:
        labels = (self.model_name, transport, direction)  # type: ignore[attr-defined]
        self.transport_bytes.labels(*labels).inc(nbytes)
        self.transport_batch_bytes.labels(*labels).observe(nbytes)
        if seconds is not None:
            self.transport_seconds.labels(*labels).observe(seconds)


class _CacheMetrics:
    """The four cache gauges a model service exports (KV cache on the target, context cache on the drafter)."""

    def _init_cache(self, registry: CollectorRegistry, used: tuple[str, str], capacity: tuple[str, str],
                    running: tuple[str, str], slots: tuple[str, str]) -> None:
        lm = ["model_name"]
        self.cache_used = Gauge(*used, lm, registry=registry)
        self.cache_capacity = Gauge(*capacity, lm, registry=registry)
        self.running_sequences = Gauge(*running, lm, registry=registry)
        self.max_sequences = Gauge(*slots, lm, registry=registry)

    def set_cache(self, running: int, max_sequences: int, used_tokens: int, capacity_tokens: int) -> None:
        """Cache occupancy, as the runners' cache_usage() returns it."""
        name = self.model_name  # type: ignore[attr-defined]
        self.running_sequences.labels(name).set(running)
        self.max_sequences.labels(name).set(max_sequences)
        self.cache_used.labels(name).set(used_tokens)
        self.cache_capacity.labels(name).set(capacity_tokens)


class TargetMetrics(_ServiceMetrics, _CacheMetrics, _TransportMetrics):
    """Forward passes, KV-cache use, GPU memory and feature transport of the target service."""

    service = "target"

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        super().__init__(registry, model_name)
        r, lo = registry, ["model_name", "op"]
        self.forward_seconds = Histogram("ddtree_target_forward_seconds",
                                         "Target forward (op = prefill | verify), seconds.", lo,
                                         buckets=STEP_BUCKETS, registry=r)
        self.batch_size = Histogram("ddtree_target_batch_size", "Sequences per target call.", lo,
                                    buckets=BATCH_BUCKETS, registry=r)
        self.forward_tokens = Histogram("ddtree_target_forward_tokens",
                                        "Tokens (prompt tokens or tree nodes incl. roots) per target forward.", lo,
                                        buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self._init_cache(r, used=("ddtree_kv_cache_used_tokens", "KV-cache tokens in use."),
                         capacity=("ddtree_kv_cache_capacity_tokens", "KV-cache capacity in tokens."),
                         running=("ddtree_target_running_sequences", "Sequences holding a KV-cache slot."),
                         slots=("ddtree_target_max_sequences", "KV-cache slots."))
        self._init_transport(r)
        # The memory plan (target_svc/memory_plan.py), set once at load: bytes by part, sequences by kind.
        self.memory_plan_bytes = Gauge("ddtree_target_memory_plan_bytes",
                                       "Target memory plan in bytes, by part (weights, kv_per_token, "
                                       "states_per_sequence, slot, cache, budget, workspace).",
                                       ["model_name", "part"], registry=r)
        self.memory_plan_sequences = Gauge("ddtree_target_memory_plan_sequences",
                                           "Sequences of max_seq_len in the memory plan, by kind (held, fit, "
                                           "requested).", ["model_name", "kind"], registry=r)
        # The verify graphs' background capture (target_svc/server.py _warm_up): requests meanwhile wait behind
        # one capture each, so a benchmark waits for pending 0 before it times anything.
        self.graph_buckets = Gauge("ddtree_target_graph_buckets",
                                   "Verify graph buckets of the warm-up, by state (pending, captured, eager).",
                                   ["model_name", "state"], registry=r)
        self.set_graph_buckets(0, 0, 0)
        # Structured outputs' grammars, prepared at admission (target_svc/grammar_compiler.py)
        self.grammar_compile_seconds = Histogram("ddtree_target_grammar_compile_seconds",
                                                 "Structured-output grammar compiles, seconds (cache hits not "
                                                 "counted).", ["model_name"], buckets=STEP_BUCKETS, registry=r)
        self.grammars_prepared = Counter("ddtree_target_grammars_prepared_total",
                                         "Structured-output grammars asked for, by result (compiled, cached, "
                                         "invalid).", ["model_name", "result"], registry=r)
        self.verify_nodes_pruned = Counter("ddtree_target_verify_nodes_pruned_total",
                                           "Draft-tree nodes dropped before a verify forward: refused by a "
                                           "structured output's grammar (with their subtrees), or past keep_nodes.",
                                           ["model_name"], registry=r)
        self.prefix_reused = Counter("ddtree_target_prefix_reused_tokens_total",
                                     "Prompt tokens served from parked sequences' cache rows (prefix caching) "
                                     "instead of being run.", ["model_name"], registry=r)
        self.verify_pushes = Counter("ddtree_target_verify_feature_pushes_total",
                                     "Verified sequences' feature pushes, by when they went (early: while the verify "
                                     "ran, transport/shared.py; after_verify: once its results were on the host).",
                                     ["model_name", "when"], registry=r)

    def observe_prefix_reused(self, tokens: int) -> None:
        """Prompt tokens a Prefill served from parked sequences' rows (prefix caching) instead of running them."""
        if tokens:
            self.prefix_reused.labels(self.model_name).inc(tokens)

    def observe_verify_pruned(self, nodes: int) -> None:
        """Draft-tree nodes a Verify dropped before its forward: refused by a structured output's grammar, or past a
        tree's keep_nodes."""
        if nodes:
            self.verify_nodes_pruned.labels(self.model_name).inc(nodes)

    def observe_verify_pushes(self, early: int, after_verify: int) -> None:
        """One Verify's feature pushes: sequences pushed early and after the verify."""
        if early:
            self.verify_pushes.labels(self.model_name, "early").inc(early)
        if after_verify:
            self.verify_pushes.labels(self.model_name, "after_verify").inc(after_verify)

    def observe_grammar(self, result: str, seconds: float | None = None) -> None:
        """One grammar asked for: result "compiled" (taking seconds), "cached" or "invalid"."""
        self.grammars_prepared.labels(self.model_name, result).inc()
        if seconds is not None:
            self.grammar_compile_seconds.labels(self.model_name).observe(seconds)

    def set_graph_buckets(self, pending: int, captured: int, eager: int) -> None:
        """The warm-up's progress: buckets still to capture, captured, and left eager (capture ran out of memory)."""
        for state, value in (("pending", pending), ("captured", captured), ("eager", eager)):
            self.graph_buckets.labels(self.model_name, state).set(value)

    def set_memory_plan(self, plan: Any) -> None:
        """Exports a target_svc.memory_plan.MemoryPlan (budget 0 when not enforced)."""
        parts = {"weights": plan.weight_bytes, "kv_per_token": plan.kv_bytes_per_token,
                 "states_per_sequence": plan.state_bytes_per_sequence, "slot": plan.slot_bytes,
                 "cache": plan.cache_bytes, "budget": plan.budget_bytes or 0, "workspace": plan.workspace_bytes}
        for part, value in parts.items():
            self.memory_plan_bytes.labels(self.model_name, part).set(value)
        for kind, value in (("held", plan.max_batch), ("fit", plan.fit_batch), ("requested", plan.requested_batch)):
            self.memory_plan_sequences.labels(self.model_name, kind).set(value)

    def observe_forward(self, op: str, batch_size: int, seconds: float, num_tokens: int | None = None) -> None:
        """One batched forward: op is "prefill" or "verify"; num_tokens = prompt tokens or tree nodes incl. roots."""
        self.forward_seconds.labels(self.model_name, op).observe(seconds)
        self.batch_size.labels(self.model_name, op).observe(batch_size)
        if num_tokens is not None:
            self.forward_tokens.labels(self.model_name, op).observe(num_tokens)

    def observe_transport(self, transport: str, nbytes: int, seconds: float | None = None) -> None:
        """Features pushed to the drafter over `transport` ("inline" | "cuda-ipc" | "nccl"); seconds if timed."""
        self._observe_transport(transport, nbytes, seconds, "send")


class DrafterMetrics(_ServiceMetrics, _CacheMetrics, _TransportMetrics):
    """Draft forwards, context-cache use, GPU memory and received feature bytes of the drafter service."""

    service = "drafter"

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        super().__init__(registry, model_name)
        r, lm = registry, ["model_name"]
        self.forward_seconds = Histogram("ddtree_drafter_forward_seconds", "Drafter block forward, seconds.", lm,
                                         buckets=STEP_BUCKETS, registry=r)
        self.batch_size = Histogram("ddtree_drafter_batch_size", "Sequences per draft call.", lm,
                                    buckets=BATCH_BUCKETS, registry=r)
        self.prefetched = Counter("ddtree_drafter_prefetched_drafts_total",
                                  "Drafts asked for, by whether the draft made when the features arrived answered "
                                  "them (hit) or a forward ran for the request (miss).", lm + ["outcome"], registry=r)
        self._init_cache(r, used=("ddtree_drafter_context_cache_used_tokens",
                                  "Context-feature rows held in the drafter's cache."),
                         capacity=("ddtree_drafter_context_cache_capacity_tokens",
                                   "Context-feature rows the drafter's cache can hold."),
                         running=("ddtree_drafter_running_sequences", "Sequences with a drafter context cache."),
                         slots=("ddtree_drafter_max_sequences", "Drafter context-cache slots."))
        self._init_transport(r)

    def observe_draft(self, batch_size: int, seconds: float) -> None:
        """One batched draft forward."""
        self.forward_seconds.labels(self.model_name).observe(seconds)
        self.batch_size.labels(self.model_name).observe(batch_size)

    def observe_prefetch(self, hits: int, misses: int) -> None:
        """Sequences of one Draft answered from drafts made on push (hits) and drafted on request (misses)."""
        if hits:
            self.prefetched.labels(self.model_name, "hit").inc(hits)
        if misses:
            self.prefetched.labels(self.model_name, "miss").inc(misses)

    def observe_transport_received(self, transport: str, nbytes: int, seconds: float | None = None) -> None:
        """Features received from the target over `transport`; seconds if timed."""
        self._observe_transport(transport, nbytes, seconds, "recv")
