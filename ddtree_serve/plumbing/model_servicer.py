"""What the two model services (target, drafter) share: a runner on one model thread, readiness, cache gauges."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree_serve.plumbing.cuda_memory_history import MemoryHistory
from ddtree_serve.plumbing.leases import LeaseTable
from ddtree_serve.plumbing.messages import cache_usage_proto
from ddtree_serve.plumbing.model_thread import ModelThread
from ddtree_serve.plumbing.rpc import metrics_hooks, run_service
from ddtree_serve.plumbing.step_socket import StepMethod, StepSocketServer
from ddtree_serve.proto import common_pb2

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ModelServiceConfig:
    """What both model services are started with: where the model runs and how much it holds."""

    device: str = "cpu"
    dtype: str = "float32"
    max_batch: int = 8
    max_seq_len: int = 2048
    enforce_eager: bool = False   # no CUDA-graph capture (debugging, or to compare against eager)
    lazy_graphs: bool = False     # capture each graph on first use instead of all buckets up front
    lease_s: float = 60.0          # a sequence nobody touched for this long is freed (its gateway went silent)
    step_socket: str | None = None  # also serve the per-step calls on this Unix socket (plumbing/step_socket.py)


class ModelServicer:
    """Base of a model servicer: `runner` is built on the model thread so the event loop stays responsive."""

    def __init__(self, thread_name: str, metrics=None, lease_s: float = 60.0) -> None:
        self.metrics = metrics
        self.runner: Any = None
        self.memory_history = MemoryHistory()
        self.ready = asyncio.Event()
        self.model_thread = ModelThread(thread_name)
        self.leases = LeaseTable(lease_s)
        self._reaper: asyncio.Task | None = None
        self.instance_id = uuid.uuid4().hex   # a restarted service is a new instance: its sequences are gone
        self.step_server: StepSocketServer | None = None
        # Messages of the step streams are observed under the unary methods they stand for (plumbing/step_stream.py).
        self.record_message = None
        if metrics is not None:
            from ddtree_serve.plumbing.metrics import ServerMessageSeries

            self.record_message = ServerMessageSeries(metrics.registry, metrics.service).record

    async def load_runner(self, make_runner: Callable[[Any], Any], runner_cfg: Any, device: str, what: str) -> None:
        """Builds the runner on the model thread, starts the GPU-memory gauges and marks the servicer ready."""
        t0 = time.perf_counter()
        # opt-in: an allocator snapshot on the first OOM
        self.memory_history = MemoryHistory.from_env(device, self.model_thread.name)
        self.model_thread.on_error = self.memory_history.on_error
        self.runner = await self.model_thread.run(make_runner, runner_cfg)
        if self.metrics is not None:
            self.metrics.track_gpu_memory(device)
        log.info("%s loaded in %.1f s", what, time.perf_counter() - t0)
        self.ready.set()

    async def start_step_socket(self, path: str | None, methods: list[StepMethod]) -> None:
        """Serves `methods` on the Unix socket at path too (None: not at all), with the internal secret."""
        if path:
            from ddtree_serve.plumbing import auth

            self.step_server = StepSocketServer(path, methods, auth.current().secret, auth.SESSION_HEADER,
                                                self.record_message)
            await self.step_server.start()

    async def close_step_socket(self) -> None:
        """Stops the step socket, if one is served."""
        if self.step_server is not None:
            await self.step_server.close()
            self.step_server = None

    def start_lease_reaper(self) -> None:
        """Frees, every quarter lease, the sequences whose lease lapsed (crashed gateway, squatted slots)."""
        self._reaper = asyncio.create_task(self._reap_lapsed_leases())

    def stop_lease_reaper(self) -> None:
        """Stops the reaper (on shutdown)."""
        if self._reaper is not None:
            self._reaper.cancel()

    async def _reap_lapsed_leases(self) -> None:
        while True:
            await asyncio.sleep(max(0.2, self.leases.lease_s / 4))
            lapsed = self.leases.lapsed()
            if lapsed:
                released = await self.release_lapsed(lapsed)
                log.warning("freed %d sequences whose lease lapsed (their gateway went silent)", released)

    async def release_lapsed(self, seq_ids: list[str]) -> int:
        """Frees sequences whose lease lapsed; returns how many were held (each service knows its own state)."""
        raise NotImplementedError

    def common_info(self, model_dir: str, cfg: ModelServiceConfig, max_seq_len: int | None = None) -> dict[str, Any]:
        """The Info fields both model services report: name, sizes, limits (max_seq_len when the runner serves
        less than configured), cache usage, device, dtype, instance id and the step socket's path."""
        r = self.runner
        return dict(model_name=Path(model_dir).name, vocab_size=r.vocab_size, hidden_size=r.hidden_size,
                    max_seq_len=cfg.max_seq_len if max_seq_len is None else max_seq_len, max_batch=cfg.max_batch,
                    cache=self.observe_cache(), device=cfg.device, dtype=cfg.dtype, instance_id=self.instance_id,
                    step_socket=self.step_server.path if self.step_server is not None else "")

    def observe_cache(self) -> common_pb2.CacheUsage:
        """The runner's cache usage as a message, exported to the cache gauges on the way."""
        usage = self.runner.cache_usage()
        if self.metrics is not None:
            self.metrics.set_cache(*usage)
        return cache_usage_proto(usage)


async def serve_model_service(service: str, service_name: str, model_dir: str, metrics_class: type,
                              make_servicer: Callable[..., Any], add_to_server: Callable, host: str, port: int,
                              metrics_port: int | None, ready_file: str | None, **run_options: Any) -> None:
    """Runs a model servicer until SIGTERM: metrics (when a port is given), load, SERVING.

    make_servicer(metrics, client_interceptors) builds the servicer, which must have async load() and close();
    run_options go to run_service (e.g. reflection).
    """
    registry, interceptors, client_interceptors = metrics_hooks(service, metrics_port)
    metrics = None
    if registry is not None:
        metrics = metrics_class(registry, model_name=Path(model_dir).name)
    servicer = make_servicer(metrics, client_interceptors)
    log.info("%s service: loading %s", service, model_dir)
    await run_service(f"{service} service", service_name, servicer, add_to_server, interceptors, host, port,
                      start=servicer.load, on_stop=servicer.close, registry=registry, metrics_port=metrics_port,
                      ready_file=ready_file, **run_options)
