"""Prefix caching, the gateway's part: which parked sequence's cached rows a new prompt can start from.

A finished sequence is released with keep_prefix, so the target and the drafter park its slot with its rows
(target_svc/kv_cache.py, drafter_svc/runner.py) until a new sequence adopts it or the slot is needed. This index
remembers the tokens of those rows and, for a new prompt, names the parked sequence sharing the longest prefix
with it; the services check the claim against their own records and answer how much they really reused. On a
hybrid target, whose recurrent states stand at a context's end only, it also remembers the state snapshots the
target keeps inside contexts (at a chat's system prompt): a prompt that starts with a snapshot's tokens copies
those rows and starts from it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ddtree_serve.prefix_match import common_prefix_len, reusable_rows

# Shorter matches are not worth the Adopt round trip and the parked slot they consume.
MIN_REUSED_TOKENS = 16


@dataclass(frozen=True)
class PrefixHit:
    """A sequence and how many leading prompt tokens its rows can stand for; copy: it is running, so its rows are
    copied into the new sequence's slot (else its parked slot is adopted)."""

    seq_id: str
    rows: int
    copy: bool = False


@dataclass
class _Entry:
    salt: str
    tokens: np.ndarray   # int64: a take compares arrays, not Python lists (an admission's cost on the event loop)
    running: bool
    source: str          # the sequence whose rows these are (an entry's key is its own)
    snapshot: bool = False   # a state snapshot at len(tokens) inside source's context (copied, never adopted)


class PrefixIndex:
    """The cached tokens of parked sequences and of running ones' prompts, most recently added last, at most
    `capacity` of them; per cache salt (requests with different salts never share rows)."""

    def __init__(self, capacity: int, min_tokens: int = MIN_REUSED_TOKENS):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.min_tokens = min_tokens
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, seq_id: str, tokens: list[int], salt: str = "", running: bool = False) -> None:
        """Remembers a sequence's cached tokens: parked (its slot kept after its release), or running (its prompt,
        once prefilled); the oldest entry goes past capacity (a parked one's slot is the first the services evict
        too)."""
        if len(tokens) < self.min_tokens:
            self._entries.pop(seq_id, None)
            return
        self._put(seq_id, _Entry(salt, np.asarray(tokens, dtype=np.int64), running, seq_id))

    def add_snapshot(self, seq_id: str, tokens: list[int], salt: str = "") -> None:
        """Remembers a state snapshot the target keeps at len(tokens) inside seq_id's context (tokens: the ones
        before it)."""
        if len(tokens) >= self.min_tokens:
            self._put(f"{seq_id}@{len(tokens)}", _Entry(salt, np.asarray(tokens, dtype=np.int64), True, seq_id, True))

    def _put(self, key: str, entry: _Entry) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def take(self, prompt: list[int], salt: str = "", whole: bool = False, adopter: str = "") -> PrefixHit | None:
        """The entry whose tokens start the prompt the furthest (at least min_tokens), None when none qualifies.
        whole (a target keeping recurrent state at a context's end only): parked entries and state snapshots only,
        all of whose tokens start the prompt. A parked entry is removed (its slot is adopted once; the snapshots in
        its context go with it to the adopter, `adopter`); a running one or a snapshot stays (its rows are
        copied)."""
        best: PrefixHit | None = None
        best_key = ""
        ids = np.asarray(prompt, dtype=np.int64)
        for key, entry in self._entries.items():
            if entry.salt != salt or (whole and entry.running and not entry.snapshot) or \
                    (entry.snapshot and not whole):
                continue
            rows = reusable_rows(entry.tokens, ids, len(prompt), whole)
            if rows >= self.min_tokens and (best is None or rows >= best.rows):   # ties: the most recent
                best, best_key = PrefixHit(entry.source, rows, copy=entry.running), key
        if best is not None and not best.copy:
            del self._entries[best_key]
            if adopter:
                self._move_snapshots(best.seq_id, adopter)
        return best

    def _move_snapshots(self, source: str, to: str) -> None:
        """source's slot went to `to` (adopted whole): its snapshots are to's now."""
        for key in [k for k, e in self._entries.items() if e.snapshot and e.source == source]:
            entry = self._entries.pop(key)
            self._entries[f"{to}@{len(entry.tokens)}"] = _Entry(entry.salt, entry.tokens, True, to, True)

    def discard(self, seq_id: str) -> None:
        """Forgets a sequence's entries, its snapshots' too (its services lost it)."""
        for key in [k for k, e in self._entries.items() if e.source == seq_id]:
            del self._entries[key]

    def clear(self) -> None:
        """Forgets every entry (a service restarted: its parked slots are gone)."""
        self._entries.clear()


@dataclass(frozen=True)
class PendingPrompt:
    """A prompt about to be prefilled (or being prefilled), as the in-batch prefix check sees it."""

    tokens: list[int]
    salt: str = ""


def held_back_for_shared_prefixes(newcomers: list[PendingPrompt], in_flight: list[PendingPrompt],
                                  min_tokens: int = MIN_REUSED_TOKENS) -> list[int]:
    """Indices of the newcomers to hold back one step: each would reuse at least min_tokens rows (same salt) of a
    prompt in flight or of an earlier newcomer that is not held back, whose rows it can copy once that prompt is
    prefilled, instead of running the same prefix beside it (SGLang's in-batch prefix caching). The first of any
    group of newcomers sharing a prefix always runs, so every held-back one has a prompt ahead of it in flight."""
    ahead = [(np.asarray(p.tokens, dtype=np.int64), p.salt) for p in in_flight]
    held = []
    for i, p in enumerate(newcomers):
        ids = np.asarray(p.tokens, dtype=np.int64)
        if any(salt == p.salt and reusable_rows(tokens, ids, len(ids), whole=False) >= min_tokens
               for tokens, salt in ahead):
            held.append(i)
        else:
            ahead.append((ids, p.salt))
    return held


def held_back_for_snapshots(newcomers: list[tuple[list[int], int, str]],
                            in_flight: list[tuple[list[int], str]]) -> list[int]:
    """Indices of the newcomers to hold back one step on a hybrid target with state snapshots: each (prompt tokens,
    its snapshot point or 0, salt) whose prompt starts with all the tokens before a snapshot still to be taken by a
    prompt in flight (those tokens, salt) or by an earlier newcomer that is not held back; once taken, the snapshot
    serves it (the hybrid form of held_back_for_shared_prefixes: a system prompt run once by prompts admitted
    together)."""
    ahead = [(np.asarray(tokens, dtype=np.int64), salt) for tokens, salt in in_flight]
    held = []
    for i, (tokens, at, salt) in enumerate(newcomers):
        ids = np.asarray(tokens, dtype=np.int64)
        if any(s == salt and len(a) < len(ids) and common_prefix_len(a, ids) == len(a) for a, s in ahead):
            held.append(i)
        elif at:
            ahead.append((ids[:at], salt))
    return held
