"""Freezing the start-up heap: what is alive is out of the collections, what is made later is still collected."""
from __future__ import annotations

import gc
import weakref

from ddtree_serve.plumbing.gc_heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self   # a cycle: only the collector frees it


def test_the_startup_heap_is_frozen_and_later_cycles_are_still_collected(caplog):
    alive = [_Node() for _ in range(100)]
    try:
        with caplog.at_level("INFO"):
            frozen = freeze_startup_heap("test service")
        assert frozen >= len(alive) and gc.get_freeze_count() > 0
        assert "test service" in caplog.text and "frozen" in caplog.text
        later = _Node()
        ref = weakref.ref(later)
        del later
        gc.collect()
        assert ref() is None
    finally:
        gc.unfreeze()
