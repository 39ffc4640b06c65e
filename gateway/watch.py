"""The gateway's watch over one target/drafter pair: notices outages and restarts, re-attaches, reports health.

Every `interval_s` it asks both services for their Info. That call also renews this gateway's sequence leases
(ddtree_serve/plumbing/leases.py). A new instance id means the service restarted and lost its sequences: a restarted
target fails the pair's running requests (their KV cache is gone) and a restarted drafter turns them
autoregressive; either way the drafter is re-attached so new requests speculate again.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from ddtree_serve.plumbing.background import BackgroundTask
from ddtree_serve.proto import drafter_pb2, target_pb2
from gateway.backends import BackendPair

log = logging.getLogger(__name__)


class PairWatch(BackgroundTask):
    """Keeps `pair.target_ok` / `pair.drafter_ok` true to life and calls `on_change` when either flips."""

    def __init__(self, pair: BackendPair, engine, on_change: Callable[[], Awaitable[None]],
                 interval_s: float = 1.0, timeout_s: float = 2.0):
        self.pair = pair
        self.engine = engine
        self.on_change = on_change
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.target_instance = pair.target_info.instance_id
        self.drafter_instance = pair.drafter_info.instance_id
        self.task_name = f"watch-{pair.index}"

    async def run(self) -> None:
        """Checks forever; one failed check never ends the watch."""
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the watch must outlive any one bad answer
                log.exception("pair %d: health check failed", self.pair.index)
            await asyncio.sleep(self.interval_s)

    async def _info(self, method, request):
        try:
            return await method(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError:
            return None

    async def check(self) -> None:
        """One round: both Infos, restart handling, re-attach when needed."""
        pair = self.pair
        before = (pair.target_ok, pair.drafter_ok)
        t, d = await asyncio.gather(self._info(pair.target.Info, target_pb2.InfoRequest()),
                                    self._info(pair.drafter.Info, drafter_pb2.DrafterInfoRequest()))
        attach = False
        if t is None:
            if pair.target_ok:
                log.error("pair %d: target %s unreachable", pair.index, pair.address.target)
            pair.target_ok = False
        else:
            if t.instance_id != self.target_instance:
                log.warning("pair %d: target %s restarted; its sequences are lost", pair.index, pair.address.target)
                self.target_instance = t.instance_id
                await self.engine.lost_target("the target restarted and lost this request's state")
                attach = True
            pair.target_ok = True
        if d is None:
            if pair.drafter_ok:
                log.error("pair %d: drafter %s unreachable or stalled; speculation off", pair.index,
                          pair.address.drafter)
            pair.drafter_ok = False
        else:
            if d.instance_id != self.drafter_instance:
                log.warning("pair %d: drafter %s restarted", pair.index, pair.address.drafter)
                self.drafter_instance = d.instance_id
                self.engine.lost_drafter()
                attach = True
            attach = attach or not pair.drafter_ok
        if attach and t is not None and d is not None:
            try:
                await pair.attach()
                log.info("pair %d: drafter re-attached; speculation on", pair.index)
            except grpc.aio.AioRpcError as exc:
                pair.drafter_ok = False
                log.error("pair %d: re-attach failed: %s %s", pair.index, exc.code().name, exc.details())
        if (pair.target_ok, pair.drafter_ok) != before:
            await self.on_change()
