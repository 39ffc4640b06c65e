"""Waiting queues and admission: which requests a backend pair takes into its running batch, and when."""
from __future__ import annotations

import asyncio
import bisect
from collections import deque
from dataclasses import dataclass, field

from gateway.sequence import Sequence, Status

# How a pair's waiting queue is ordered (vLLM's --scheduling-policy): arrival order, or each request's priority
# (lowest first; equal priorities in arrival order).
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class AdmissionLimits:
    """Caps that keep a pair's target inside its KV cache: sequences (slots) and reserved tokens."""

    max_running: int
    max_reserved_tokens: int


@dataclass
class PairQueue:
    """One pair's waiting queue and running batch."""

    limits: AdmissionLimits
    policy: str = "fcfs"
    # Under the priority policy (SGLang's --priority-scheduling-preemption-threshold): a waiting request that does
    # not fit preempts running ones whose priority value exceeds its own by more than this. None: never.
    preemption_threshold: int | None = None
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        if self.preemption_threshold is not None and (self.policy != "priority" or self.preemption_threshold < 0):
            raise ValueError("preemption needs the priority policy and a threshold >= 0")

    def enqueue(self, seq: Sequence) -> None:
        """Adds a request to the waiting queue in the policy's order: last (fcfs), or by priority value, equal
        values in arrival order (priority; a preempted request goes back ahead of later arrivals of its priority)."""
        if self.policy == "priority":
            at = bisect.bisect_right([(s.priority, s.arrival) for s in self.waiting], (seq.priority, seq.arrival))
            self.waiting.insert(at, seq)
        else:
            self.waiting.append(seq)

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def reserved_tokens(self) -> int:
        """Tokens the running sequences may still occupy (prompt + max_tokens each)."""
        return sum(len(s.prompt_ids) + s.max_tokens for s in self.running)

    def _fits(self, seq: Sequence, running: int, reserved: int) -> bool:
        return running < self.limits.max_running and reserved + len(seq.prompt_ids) + seq.max_tokens <= \
            self.limits.max_reserved_tokens

    def preemption_victims(self) -> list[Sequence]:
        """The running sequences to preempt so that waiting requests fit, taken in queue order as admit() would: for
        each that does not fit, the fewest running ones whose priority value exceeds its own by more than the
        threshold, lowest priority (then latest arrival) first; up to the first that preempting cannot make fit."""
        if self.preemption_threshold is None:
            return []
        running, reserved = len(self.running), self.reserved_tokens()
        victims: list[Sequence] = []
        for head in self.waiting:
            if head.cancelled:
                continue
            if not self._fits(head, running, reserved):
                candidates = sorted((s for s in self.running if s not in victims and s.status == Status.RUNNING
                                     and not s.finish_reason and not s.cancelled and s.preemptible
                                     and s.priority - head.priority > self.preemption_threshold),
                                    key=lambda s: (s.priority, s.arrival), reverse=True)
                chosen = []
                for s in candidates:
                    if self._fits(head, running, reserved):
                        break
                    chosen.append(s)
                    running, reserved = running - 1, reserved - len(s.prompt_ids) - s.max_tokens
                if not self._fits(head, running, reserved):
                    break
                victims += chosen
            running, reserved = running + 1, reserved + len(head.prompt_ids) + head.max_tokens
        return victims

    def admit(self) -> list[Sequence]:
        """Moves waiting sequences into the running batch in queue order while the limits allow (no overtaking: a
        request that does not fit holds back the ones behind it, so a long prompt is never starved)."""
        admitted = []
        reserved = self.reserved_tokens()
        while self.waiting:
            seq = self.waiting[0]
            if seq.cancelled:
                self.waiting.popleft()
                seq.status = Status.FINISHED
                continue
            if not self._fits(seq, len(self.running), reserved):
                break
            self.waiting.popleft()
            reserved += len(seq.prompt_ids) + seq.max_tokens
            seq.status = Status.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted


def parse_batch_budgets(text: str) -> tuple[tuple[int, int], ...]:
    """"4:16,16:4" -> ((4, 16), (16, 4)): from batch 4 on budgets of at most 16, from 16 on at most 4; "none" -> ().
    ValueError for anything else (batches >= 1 ascending, budgets >= 1)."""
    if text.strip().lower() == "none":
        return ()
    pairs = []
    for part in text.split(","):
        batch, sep, budget = part.partition(":")
        if not sep or not batch.strip().isdigit() or not budget.strip().isdigit():
            raise ValueError(f"{part.strip()!r} is not BATCH:BUDGET")
        pairs.append((int(batch), int(budget)))
    if any(b < 1 or budget < 1 for b, budget in pairs) or [b for b, _ in pairs] != sorted({b for b, _ in pairs}):
        raise ValueError(f"{text!r}: batches >= 1 in ascending order, budgets >= 1")
    return tuple(pairs)


def batch_budget_ceiling(batch_budgets: tuple[tuple[int, int], ...], batch: int) -> int | None:
    """The largest DDTree budget a step of `batch` sequences may use under batch_budgets (None: no ceiling)."""
    ceiling = None
    for from_batch, budget in batch_budgets:
        if batch >= from_batch:
            ceiling = budget
    return ceiling


def step_budgets(requested: dict[str, int], other_nodes: int, max_verify_nodes: int) -> dict[str, int]:
    """The DDTree budget of each sequence this step (seq id -> budget as requested): unchanged while the step's
    trees fit max_verify_nodes (0: no cap) — each tree is its root plus its budget, and the step's other sequences
    (chains, autoregressive ones) bring other_nodes — else one equal share each, rounded down to a power of four
    (the target pads a tree to 4^k + 1 nodes, so 31 would cost as much as 63) and never below 1 nor above what was
    asked. A verify of many rows turns compute-bound: at batch 8 on the H200 a 65-node tree per sequence cost 3.1x
    a one-token step, at batch 1 1.23x (bench/results/h200-tree-attention/)."""
    if not requested or max_verify_nodes <= 0:
        return dict(requested)
    if other_nodes + sum(1 + b for b in requested.values()) <= max_verify_nodes:
        return dict(requested)
    share = (max_verify_nodes - other_nodes) // len(requested) - 1   # budget nodes per tree, root excluded
    capped = 1
    while capped * 4 <= share:
        capped *= 4
    return {seq_id: max(1, min(budget, capped)) for seq_id, budget in requested.items()}


def plan_prefill_chunks(prefilling: list[Sequence], max_tokens: int) -> list[tuple[Sequence, int]]:
    """The next prompt chunk of each sequence still prefilling, oldest first, at most max_tokens run in all (0:
    whole prompts): (sequence, chunk length) pairs; the first sequence always gets a chunk. A first chunk also
    covers the prompt tokens a parked sequence's rows may give it (Sequence.reuse_rows: not run). A resumed
    sequence's prompt is its prompt and earlier outputs (Sequence.prefill_ids). A chunk ends at the sequence's
    snapshot_at, where the target keeps its states."""
    budget = max_tokens or sum(len(s.prompt_ids) + s.resumed - s.prefilled for s in prefilling)
    chunks = []
    for s in prefilling:
        free = s.reuse_rows if s.prefilled == 0 else 0
        n = min(len(s.prompt_ids) + s.resumed - s.prefilled, budget + free)
        if s.prefilled < s.snapshot_at < s.prefilled + n:
            n = s.snapshot_at - s.prefilled
        if n - free <= 0:
            break
        chunks.append((s, n))
        budget -= n - free
    return chunks


class Scheduler:
    """Assigns each new request to the least-loaded pair; each pair's engine admits from its own queue."""

    def __init__(self, queues: list[PairQueue], max_waiting: int = 4096):
        self.queues = queues
        self.max_waiting = max_waiting

    @property
    def num_waiting(self) -> int:
        return sum(len(q.waiting) for q in self.queues)

    @property
    def num_running(self) -> int:
        return sum(len(q.running) for q in self.queues)

    def submit(self, seq: Sequence) -> int:
        """Queues a request; returns the pair index. Raises RuntimeError('capacity ...') when the queue is full."""
        if self.num_waiting >= self.max_waiting:
            raise RuntimeError(f"capacity: {self.num_waiting} requests already waiting")
        index = min(range(len(self.queues)), key=lambda i: self.queues[i].load)
        self.queues[index].enqueue(seq)
        self.queues[index].wakeup.set()
        return index
