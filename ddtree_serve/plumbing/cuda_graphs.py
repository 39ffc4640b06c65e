"""CUDA-graph plumbing shared by the model services: shape buckets and functions captured over static buffers.

A step of a model service is hundreds of small kernels; launched one by one from Python they cost far more than
the GPU work itself. A captured graph replays them all with one launch. Graphs need fixed shapes, so inputs are
padded to a bucket (the smallest bucket size >= the real size) and each bucket gets its own graph, captured on
first use. All graphs of one service share a memory pool: only one replays at a time, so their scratch memory
can overlap; a graph's outputs stay valid until the next replay of any graph of the pool.
"""
from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

log = logging.getLogger(__name__)


def pick_bucket(buckets: Sequence[int], size: int) -> int:
    """Smallest bucket >= size; ValueError when size exceeds the largest."""
    for b in buckets:
        if b >= size:
            return b
    raise ValueError(f"size {size} exceeds the largest bucket {buckets[-1]}")


# Attended cache rows are bucketed in powers of two from here up. Attention over padded key rows is not free (the
# decode attention reads every bucketed row: an 8B step over 2305 rows cost ~3 ms more than over ~1024 on the
# H200), so buckets follow the context; every bucket is captured up front, so finer buckets cost start-up only.
MIN_KEY_BUCKET = 512


# A capacity this close above a power of two replaces it as the last bucket: the cache's capacity is max_seq_len plus
# a tree's nodes (8192 + 65), and a bucket for those last 65 rows alone would add graphs for ~1 % less attention.
LAST_KEY_BUCKET_SLACK = 1.125


def key_buckets(capacity: int) -> tuple[int, ...]:
    """Buckets of attended cache rows: MIN_KEY_BUCKET, then powers of two, ending at the capacity."""
    out = power_of_two_buckets(capacity, start=min(capacity, MIN_KEY_BUCKET))
    if len(out) > 1 and capacity <= out[-2] * LAST_KEY_BUCKET_SLACK:
        out = out[:-2] + (capacity,)
    return out


def tree_node_buckets(max_nodes: int, extra: tuple[int, ...] = ()) -> tuple[int, ...]:
    """1 (a decode step), then 4^k + 1 (a budget-4^k tree has 4^k + 1 nodes; a 16-node chain rounds to 17), and
    the extra sizes up to max_nodes (a deployment's own budgets, e.g. 64 for budget-63 trees, 129 for budget 128).

    Every bucket is a graph per batch and key bucket, captured at start-up (the 27B's 80 buckets: ~110 s on the
    H200) and holding its live outputs in the shared pool. Powers of four keep the
    budgets people run (16 and 64, the 16-token chain) exact, and pad the others (8 -> 17, 32 -> 65) at little
    cost: a 65-node verify is ~1.14x a 1-node one on the 8B."""
    out, b = [1], 4
    while b + 1 < max_nodes:
        out.append(b + 1)
        b *= 4
    out.append(max_nodes)
    if any(n < 1 for n in extra):
        raise ValueError(f"graph node sizes must be >= 1, got {extra}")
    return tuple(sorted(set(out) | {n for n in extra if n <= max_nodes}))


# A captured forward's cost in rows: fixed + one per row (batch x nodes) it computes. At the Qwen3-8B shape on an H100
# forwards of 65 and 257 nodes took 7.44 and 11.24 ms: 0.0198 ms a row past a fixed 6.15 ms, 310 rows' worth.
PREFILL_FORWARD_FIXED_ROWS = 310
# The hybrid's (Qwen3.6-27B layout cut to 8 layers, H100, 2026-12-06): 4.094 and 7.081 ms, 0.0156 ms a row past a
# fixed 3.08 ms, ~200 rows' worth; 4.161 and 7.205 ms on a second machine (bench/results/h100-2026-12-06-1700/).
HYBRID_PREFILL_FORWARD_FIXED_ROWS = 200


def prefill_chunk(rest: int, node_buckets: tuple[int, ...], batch: int = 1,
                  fixed_rows: int = PREFILL_FORWARD_FIXED_ROWS) -> int:
    """Positions in the next chunk of prompts prefilled through the captured verify graphs: the node bucket whose
    forwards take the `rest` positions of `batch` (padded) prompts at the least estimated cost, each forward
    costing fixed_rows + batch x its nodes (one prompt of 70 tokens: one 257-node forward, not 65 + 5; eight: the
    65-node bucket, the padding of eight 257-node rows costing more than a second forward)."""
    def cost(nodes: int) -> int:
        return -(-rest // nodes) * (fixed_rows + batch * nodes)

    return min(node_buckets, key=lambda nodes: (cost(nodes), nodes))


def power_of_two_buckets(limit: int, start: int = 1) -> tuple[int, ...]:
    """start, 2*start, 4*start, ... below limit, then limit itself (so every size up to limit has a bucket)."""
    if limit < 1:
        raise ValueError(f"bucket limit must be >= 1, got {limit}")
    out, b = [], max(1, start)
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return tuple(out)


class SharedOutput:
    """One flat buffer that the graphs of every bucket write an output into, viewed at each bucket's shape.

    A graph's outputs live as long as the graph: one buffer of the largest size instead of one per bucket (at a
    248k vocabulary, per-bucket logits alone ran to gigabytes). Allocated on first use."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self.buffer: Tensor | None = None

    def view(self, *shape: int) -> Tensor:
        """The buffer's first prod(shape) elements as a contiguous tensor of that shape."""
        n = math.prod(shape)
        if n > self.numel:
            raise ValueError(f"shape {shape} exceeds the shared output's {self.numel} elements")
        if self.buffer is None:
            self.buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        return self.buffer[:n].view(*shape)


@dataclass
class CapturedFunction:
    """`fn(*static_inputs) -> outputs` recorded once; calling it copies new inputs in and replays."""

    graph: torch.cuda.CUDAGraph
    static_inputs: tuple[Tensor, ...]
    outputs: object  # whatever fn returned: tensors (or tuples of them) living in the graph's pool
    empty: bool = False  # the capture recorded no kernel (work on another stream would run once, never replay)

    @classmethod
    def capture(cls, fn: Callable[..., object], example_inputs: Sequence[Tensor], pool, warmup: int = 2,
                stream: torch.cuda.Stream | None = None) -> "CapturedFunction":
        """Runs fn `warmup` times on a side stream (lazy inits, autotuning), then records it. Pass the same side
        stream to every capture: the allocator caches freed blocks per stream, so a fresh stream per capture
        could not reuse what the previous captures' warm-up runs freed. (Running the warm-ups inside the graph pool
        saved nothing on the H200: torch.cuda.graph empties the allocator's cache before it records.)"""
        static = tuple(x.clone() for x in example_inputs)
        device = static[0].device
        stream = stream or torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn(*static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.cuda.graph(graph, pool=pool):
                outputs = fn(*static)
        empty = any("CUDA Graph is empty" in str(w.message) for w in caught)
        for w in caught:
            if "CUDA Graph is empty" not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return cls(graph, static, outputs, empty)

    def __call__(self, *inputs: Tensor) -> object:
        """Copies inputs into the static buffers (same shapes) and replays; returns the static outputs."""
        for dst, src in zip(self.static_inputs, inputs):
            dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return self.outputs


class GraphCache:
    """Captured functions keyed by bucket, captured lazily, sharing one memory pool."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pool = None  # made at the first capture, so that a CPU process can hold a GraphCache
        self.warmup_stream: torch.cuda.Stream | None = None   # every capture's warm-up runs, likewise
        self.graphs: dict[Hashable, CapturedFunction] = {}
        self.capture_seconds = 0.0
        self.empty_keys: list[Hashable] = []   # captures that recorded nothing (logged; the GPU tests want none)

    def get(self, key: Hashable, fn: Callable[..., object], example_inputs: Callable[[], Sequence[Tensor]]) -> CapturedFunction:
        """The graph for key, capturing fn over example_inputs() the first time."""
        captured = self.graphs.get(key)
        if captured is None:
            inputs = example_inputs()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
                self.warmup_stream = torch.cuda.Stream(device=inputs[0].device)
            t0 = time.perf_counter()
            captured = CapturedFunction.capture(fn, inputs, self.pool, stream=self.warmup_stream)
            elapsed = time.perf_counter() - t0
            self.capture_seconds += elapsed
            self.graphs[key] = captured
            if captured.empty:
                self.empty_keys.append(key)
                log.warning("%s: the graph for %s captured no kernel", self.name, key)
            log.info("%s: captured graph %s in %.2f s (%d graphs)", self.name, key, elapsed, len(self.graphs))
        return captured
