"""Inline transport: feature bytes ride inside a PushFeatures RPC to the drafter (works everywhere, CPU too)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from ddtree_serve.proto import drafter_pb2
from ddtree_serve.transport.base import FeatureRows, encode_rows
from ddtree_serve.transport.push import PushSender


@dataclass
class InlineFeatureSender(PushSender):
    """Serializes the rows into the message."""

    name: str = "inline"

    async def _send(self, rows: list[FeatureRows]) -> None:
        t0 = time.perf_counter()
        msgs = []
        for r in rows:
            dtype, raw = encode_rows(r.data)
            msgs.append(r.message(dtype=dtype, data=raw))
        batch = drafter_pb2.FeatureBatch(rows=msgs, feature_dim=int(rows[0].data.shape[1]))
        await self._push(batch)
        self._delivered(sum(len(m.data) for m in msgs), time.perf_counter() - t0)
