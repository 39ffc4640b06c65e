"""Prefix caching's rules, shared by the gateway, the target and the drafter: how many of a parked sequence's
cached rows a new prompt can reuse, and which parked slot is taken first when none is free."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading token ids a and b share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64)
    return int(differ.argmax()) if differ.any() else n


def reusable_rows(held: Sequence[int], prompt: Sequence[int], limit: int, whole: bool) -> int:
    """Rows of a parked sequence holding `held` that a prompt reuses: their common prefix, at most `limit` and at
    most len(prompt) - 1 (the prompt's last token is always run: its logits give the first sample). whole: the
    cache keeps recurrent state at its end only (Gated DeltaNet layers), so only all of `held` or nothing."""
    n = min(common_prefix_len(held, prompt), limit, len(prompt) - 1)
    if whole and n != len(held):
        return 0
    return max(n, 0)


def reclaim_parked_slot(free_slots: list[int], parked: dict[str, tuple], spare: str = "") -> None:
    """With no free slot left, frees the oldest parked sequence's slot (parked is oldest first, each value's first
    item its slot) but spare's (the one a copy reads from)."""
    if not free_slots:
        victim = next((seq_id for seq_id in parked if seq_id != spare), None)
        if victim is not None:
            free_slots.append(parked.pop(victim)[0])
