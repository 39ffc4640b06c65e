"""The timing client of bench/rpc_hop.py: round trips of the cheapest real RPCs of running services.

Run by bench/rpc_hop.py as a script (`python -P bench/rpc_hop_client.py SPEC_JSON`) with PYTHONPATH naming the
source tree whose client code (channels, interceptors, the gateway's unpacking of a Draft reply) is measured, so a baseline
checkout is timed with its own client as well as its own services. It therefore imports only what every tree has
(grpc, ddtree_serve's proto, auth, metrics and rpc modules), and the gateway's unpacking of a Draft reply where there is one.
Prints one JSON object: {call: {"rtt_s": [...], "server_s": [...]}}.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree_serve.plumbing import auth
from ddtree_serve.plumbing.metrics import client_interceptors, new_registry
from ddtree_serve.plumbing.rpc import CHANNEL_OPTIONS
from ddtree_serve.proto import (common_pb2, drafter_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc, target_pb2,
                                target_pb2_grpc)

try:   # the gateway's unpacking of a Draft reply, as the measured tree does it
    from ddtree_serve.plumbing.messages import draft_arrays as unpack_draft
except ImportError:
    try:   # a tree from before the gateway kept drafts as numpy arrays
        from gateway.engine import draft_tensors as unpack_draft
    except ImportError:   # a tree from before draft_tensors: its engine's own expression
        import torch

        def unpack_draft(r):
            shape = (r.depth, r.k)
            return (torch.tensor(r.logprobs, dtype=torch.float32).reshape(shape),
                    torch.tensor(r.token_ids, dtype=torch.long).reshape(shape))

try:   # the step calls as messages on long-lived streams, where the measured tree has them
    from ddtree_serve.plumbing.step_stream import StreamedCalls
except ImportError:
    StreamedCalls = None

try:   # the step calls on bare Unix sockets, where the measured tree has them
    from ddtree_serve.plumbing.step_socket import SocketCalls
except ImportError:
    SocketCalls = None

PROMPT = list(range(5, 21))   # 16 ordinary token ids of any vocabulary the bench uses
CONTEXT_ROWS = 16             # drafter context rows a timed Draft sees
STEP_DRAFT = (15, 64)         # depth x top-k of a budget-64 DDTree step's Draft (block 16), the 8B runs' shape


@dataclass
class Spec:
    """What one client run times: the addresses (TCP or unix:), the stack's secret, calls per kind."""

    target: str
    drafter: str
    gateway: str            # "" leaves the gateway's calls out
    secret: str
    feature_dim: int
    calls: int = 300
    warmup: int = 30
    timeout_s: float = 30.0
    event_loop: str = ""    # the client's loop (ddtree_serve.plumbing.event_loop); "" = asyncio (older checkouts)


class Timings:
    """Per-call round trips and, where the reply says, the server's own handler time."""

    def __init__(self) -> None:
        self.calls: dict[str, dict[str, list[float]]] = {}

    async def time(self, name: str, spec: Spec, call) -> None:
        """Awaits call() warmup + calls times; records the timed ones (call returns the server's seconds or None)."""
        for _ in range(spec.warmup):
            await call()
        rtt, server = [], []
        for _ in range(spec.calls):
            t0 = time.perf_counter()
            handler_s = await call()
            rtt.append(time.perf_counter() - t0)
            if handler_s is not None:
                server.append(handler_s)
        self.calls[name] = {"rtt_s": rtt, "server_s": server}


def _channel(address: str) -> grpc.aio.Channel:
    # As the gateway and the target open theirs: the secret and session, the channel options, client metrics.
    return auth.internal_channel(address, options=CHANNEL_OPTIONS,
                                 interceptors=client_interceptors(new_registry(), "gateway"))


async def _health(out: Timings, spec: Spec, name: str, channel: grpc.aio.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)

    async def call():
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=spec.timeout_s)

    await out.time(f"{name} Health.Check", spec, call)


async def _target(out: Timings, spec: Spec) -> None:
    async with _channel(spec.target) as channel:
        await _health(out, spec, "target", channel)
        stub = target_pb2_grpc.TargetServiceStub(channel)

        async def info():
            await stub.Info(target_pb2.InfoRequest(), timeout=spec.timeout_s)

        await out.time("target Info", spec, info)
        sockets = _socket(await stub.Info(target_pb2.InfoRequest(), timeout=spec.timeout_s), "TargetService/Verify",
                          target_pb2.VerifyResponse)
        seq_id = f"rpc-hop-verify-{time.time_ns()}"
        prefill = await stub.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(
            seq_id=seq_id, prompt_ids=PROMPT, sampling=common_pb2.SamplingParams())]), timeout=spec.timeout_s)
        state = {"next": prefill.results[0].next_token}

        def verify_by(send):
            async def verify():   # the smallest step: a one-node tree (an autoregressive step), no feature push
                reply = await send(target_pb2.VerifyRequest(items=[target_pb2.TreeItem(
                    seq_id=seq_id, tokens=[state["next"]], parents=[-1])]))
                state["next"] = reply.results[0].next_token
                return reply.timings.total_ns / 1e9
            return verify

        stream = _stream(stub, "VerifyStream", "TargetService/Verify")
        try:
            await out.time("target Verify (1 node)", spec, verify_by(lambda r: stub.Verify(r, timeout=spec.timeout_s)))
            if stream is not None:
                await out.time("target Verify (1 node), stream message", spec,
                               verify_by(lambda r: stream(r, spec.timeout_s)))
            if sockets is not None:
                await out.time("target Verify (1 node), step socket", spec,
                               verify_by(lambda r: sockets(r, spec.timeout_s)))
        finally:
            for calls in (stream, sockets):
                if calls is not None:
                    calls.close()
            await stub.Release(target_pb2.ReleaseRequest(seq_ids=[seq_id]), timeout=spec.timeout_s)


def _socket(info, method: str, response_type):
    """SocketCalls to the step socket a service's Info names, None where it serves none (or the tree has none)."""
    path = getattr(info, "step_socket", "")
    if SocketCalls is None or not path:
        return None
    sec = auth.current()
    return SocketCalls(path, method, response_type, sec.secret, sec.session)


def _stream(stub, method: str, label: str):
    """StreamedCalls over stub.<method> (a step call's stream), None where the measured tree has no such stream."""
    if StreamedCalls is None or not hasattr(stub, method):
        return None
    return StreamedCalls(getattr(stub, method), label)


async def _drafter(out: Timings, spec: Spec) -> None:
    row = bytes(4 * spec.feature_dim)   # one float32 row of zeros
    async with _channel(spec.drafter) as channel:
        await _health(out, spec, "drafter", channel)
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)

        async def info():
            await stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=spec.timeout_s)

        await out.time("drafter Info", spec, info)
        drafter_info = await stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=spec.timeout_s)
        socket_pushes = _socket(drafter_info, "DrafterService/PushFeatures", drafter_pb2.PushFeaturesResponse)
        socket_drafts = _socket(drafter_info, "DrafterService/Draft", drafter_pb2.DraftResponse)
        stamp = time.time_ns()
        push_id, draft_id = f"rpc-hop-push-{stamp}", f"rpc-hop-draft-{stamp}"
        held = {"rows": 0}

        def push_by(send):
            async def push():   # one row, inline, as the target pushes an autoregressive step's features
                await send(drafter_pb2.FeatureBatch(feature_dim=spec.feature_dim, rows=[drafter_pb2.FeatureRows(
                    seq_id=push_id, start=held["rows"], num_rows=1, dtype="float32", data=row)]))
                held["rows"] += 1
            return push

        await stub.PushFeatures(drafter_pb2.FeatureBatch(feature_dim=spec.feature_dim, rows=[drafter_pb2.FeatureRows(
            seq_id=draft_id, start=0, num_rows=CONTEXT_ROWS, dtype="float32", data=row * CONTEXT_ROWS)]),
            timeout=spec.timeout_s)

        async def draft():   # the smallest draft: one position, top-1, drafted on request (not prefetched)
            reply = await stub.Draft(drafter_pb2.DraftRequest(items=[drafter_pb2.DraftItem(
                seq_id=draft_id, bonus_token=PROMPT[0], context_len=CONTEXT_ROWS)], top_k=1, max_depth=1),
                timeout=spec.timeout_s)
            return reply.timings.total_ns / 1e9

        def step_draft_by(send):
            async def step_draft():   # a budget-64 step's Draft, unpacked into tensors as the gateway does
                reply = await send(drafter_pb2.DraftRequest(items=[drafter_pb2.DraftItem(
                    seq_id=draft_id, bonus_token=PROMPT[0], context_len=CONTEXT_ROWS)], top_k=STEP_DRAFT[1],
                    max_depth=STEP_DRAFT[0]))
                unpack_draft(reply.results[0])
                return reply.timings.total_ns / 1e9
            return step_draft

        pushes = _stream(stub, "PushFeaturesStream", "DrafterService/PushFeatures")
        drafts = _stream(stub, "DraftStream", "DrafterService/Draft")
        try:
            await out.time("drafter PushFeatures (1 row)", spec,
                           push_by(lambda r: stub.PushFeatures(r, timeout=spec.timeout_s)))
            if pushes is not None:
                await out.time("drafter PushFeatures (1 row), stream message", spec,
                               push_by(lambda r: pushes(r, spec.timeout_s)))
            if socket_pushes is not None:
                await out.time("drafter PushFeatures (1 row), step socket", spec,
                               push_by(lambda r: socket_pushes(r, spec.timeout_s)))
            await out.time("drafter Draft (depth 1, top-1)", spec, draft)
            await out.time("drafter Draft (depth 15, top-64) + unpack", spec,
                           step_draft_by(lambda r: stub.Draft(r, timeout=spec.timeout_s)))
            if drafts is not None:
                await out.time("drafter Draft (depth 15, top-64) + unpack, stream message", spec,
                               step_draft_by(lambda r: drafts(r, spec.timeout_s)))
            if socket_drafts is not None:
                await out.time("drafter Draft (depth 15, top-64) + unpack, step socket", spec,
                               step_draft_by(lambda r: socket_drafts(r, spec.timeout_s)))
        finally:
            for calls in (pushes, drafts, socket_pushes, socket_drafts):
                if calls is not None:
                    calls.close()
            await stub.Release(drafter_pb2.DrafterReleaseRequest(seq_ids=[push_id, draft_id]), timeout=spec.timeout_s)


async def _gateway(out: Timings, spec: Spec) -> None:
    async with grpc.aio.insecure_channel(spec.gateway, options=CHANNEL_OPTIONS) as channel:   # a public client
        await _health(out, spec, "gateway", channel)
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def model_info():
            await stub.ModelInfo(gateway_pb2.ModelInfoRequest(), timeout=spec.timeout_s)

        await out.time("gateway ModelInfo", spec, model_info)


async def measure(spec: Spec) -> dict:
    """Times every call kind of the spec, one kind after another."""
    auth.configure(auth.Security(secret=spec.secret))
    out = Timings()
    await _target(out, spec)
    await _drafter(out, spec)
    if spec.gateway:
        await _gateway(out, spec)
    return out.calls


def run(spec: Spec) -> dict:
    """measure(spec) on the spec's event loop, as the gateway of that stack would run it."""
    if not spec.event_loop:
        return asyncio.run(measure(spec))
    from ddtree_serve.plumbing.event_loop import run as run_on

    return run_on(measure(spec), spec.event_loop)


if __name__ == "__main__":
    print(json.dumps(run(Spec(**json.loads(sys.argv[1])))))
