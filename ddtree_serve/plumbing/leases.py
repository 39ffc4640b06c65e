"""Sequence leases: each sequence in a target or drafter belongs to the gateway session that created it, and is
freed once that session has not been heard from for `lease_s` (the gateway died, or someone squatted a slot).

A session is the `x-ddtree-session` metadata of the caller (ddtree_serve/plumbing/auth.py). Any call from a session
renews all of its sequences, so a gateway keeps its leases alive simply by stepping, or by its health watch
when idle. Another session touching a leased sequence gets PERMISSION_DENIED.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


class LeaseError(PermissionError):
    """A session touched a sequence leased to another session."""


@dataclass
class LeaseTable:
    """seq id -> owning session and last use; session -> when it was last heard from.

    A sequence lapses when it has not been used for `lease_s` and its owner (if any) has been silent as long."""

    lease_s: float
    clock: Callable[[], float] = time.monotonic
    owner: dict[str, str] = field(default_factory=dict)
    used: dict[str, float] = field(default_factory=dict)
    seen: dict[str, float] = field(default_factory=dict)

    def heard_from(self, session: str) -> None:
        """Renews every lease of `session`."""
        self.seen[session] = self.clock()

    def touch(self, seq_ids: Iterable[str]) -> None:
        """Marks ids as used now without claiming them (the drafter's feature pushes come from the target)."""
        now = self.clock()
        for seq_id in seq_ids:
            self.used[seq_id] = now

    def check(self, session: str, seq_ids: Iterable[str]) -> list[str]:
        """Raises LeaseError if any id is leased to another session; renews the session and the ids."""
        seq_ids = list(seq_ids)
        for seq_id in seq_ids:
            holder = self.owner.get(seq_id)
            if holder is not None and holder != session:
                raise LeaseError(f"sequence {seq_id!r} belongs to another session")
        self.heard_from(session)
        self.touch(seq_ids)
        return seq_ids

    def claim(self, session: str, seq_ids: Iterable[str]) -> None:
        """Leases ids to `session` (raising LeaseError for one another session holds) and renews them."""
        for seq_id in self.check(session, seq_ids):
            self.owner[seq_id] = session

    def drop(self, seq_ids: Iterable[str]) -> None:
        """Forgets released ids."""
        for seq_id in seq_ids:
            self.owner.pop(seq_id, None)
            self.used.pop(seq_id, None)

    def lapsed(self) -> list[str]:
        """Ids unused and unrenewed for longer than the lease (the caller frees them, then `drop`s them)."""
        cutoff = self.clock() - self.lease_s
        for s in [s for s, t in self.seen.items() if t < cutoff]:
            del self.seen[s]   # a lapsed session stays lapsed: a late call from it starts afresh
        ids = set(self.owner) | set(self.used)
        return sorted(i for i in ids if self.used.get(i, 0.0) < cutoff and self.owner.get(i) not in self.seen)
