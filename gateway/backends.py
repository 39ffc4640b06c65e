"""Clients of one target/drafter pair, and the start-up handshake between them."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc

from ddtree_serve.plumbing import auth
from ddtree_serve.proto import drafter_pb2, drafter_pb2_grpc, target_pb2, target_pb2_grpc
from ddtree_serve.plumbing.metrics.interceptors import message_recorder
from ddtree_serve.plumbing.rpc import CHANNEL_OPTIONS, wait_until_serving
from ddtree_serve.plumbing.step_socket import SocketCalls
from ddtree_serve.plumbing.step_stream import StreamedCalls

log = logging.getLogger(__name__)


class AttachRefused(RuntimeError):
    """The target refused the drafter at start-up (a transport it cannot use, a drafter for another model):
    a misconfiguration, so the gateway stops with this message rather than serving without speculation."""


# Codes that mean "this configuration cannot work"; others (UNAVAILABLE, DEADLINE_EXCEEDED) may pass with time.
REFUSALS = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)


@dataclass
class PairAddress:
    """Where a pair's services listen, as the gateway (and the target, for the drafter) reaches them."""

    target: str
    drafter: str
    drafter_for_target: str = ""   # when the target reaches the drafter by another name (containers)


@dataclass
class BackendPair:
    """Connected stubs plus the facts learned at start-up."""

    address: PairAddress
    index: int = 0
    client_interceptors: list = field(default_factory=list)
    target_info: target_pb2.TargetInfo | None = None
    drafter_info: drafter_pb2.DrafterInfo | None = None
    transport: str = "inline"
    target_ok: bool = False    # the target answers as the instance we attached (see gateway/watch.py)
    drafter_ok: bool = False   # the drafter answers in time: speculation is worth trying
    step_streams: bool = True  # Draft and Verify as messages on long-lived streams (False: unary calls)
    step_sockets: bool = False  # the per-step calls on the services' step sockets (plumbing/step_socket.py)
    # Poll a step socket for the answer up to this long before sleeping in the event loop (SocketCalls.spin_s);
    # 0: off. Pairs share the gateway's event loop, which a poll holds, and a CPU model needs the cores.
    step_spin_us: int = 0
    _verify_calls: StreamedCalls | SocketCalls | None = field(default=None, repr=False)   # made by attach()
    _draft_calls: StreamedCalls | SocketCalls | None = field(default=None, repr=False)
    _step_way: tuple = field(default=(), repr=False)   # how the calls above go (see _make_step_calls)

    async def connect(self, timeout_s: float = 900.0, transport: str = "inline") -> None:
        """Waits for both services to be ready, reads their info and attaches the drafter to the target."""
        await wait_until_serving(self.address.target, timeout_s)
        await wait_until_serving(self.address.drafter, timeout_s)
        # Authenticated (secret + this gateway's session id, which owns the sequences it creates), TLS if set.
        self._target_channel = auth.internal_channel(self.address.target, options=CHANNEL_OPTIONS,
                                                     interceptors=self.client_interceptors)
        self._drafter_channel = auth.internal_channel(self.address.drafter, options=CHANNEL_OPTIONS,
                                                      interceptors=self.client_interceptors)
        self.target = target_pb2_grpc.TargetServiceStub(self._target_channel)
        self.drafter = drafter_pb2_grpc.DrafterServiceStub(self._drafter_channel)
        self.transport = transport
        try:
            await self.attach()
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in REFUSALS:
                raise
            raise AttachRefused(f"pair {self.index}: the target at {self.address.target} refused the drafter at "
                                f"{self.address.drafter} over --transport {transport}: {exc.code().name}: "
                                f"{exc.details()}") from None

    async def attach(self) -> None:
        """Reads both services' info and (re)attaches the drafter to the target (start-up, and after a restart)."""
        self.target_info = await self.target.Info(target_pb2.InfoRequest(), timeout=30)
        self.drafter_info = await self.drafter.Info(drafter_pb2.DrafterInfoRequest(), timeout=30)
        if self.drafter_info.hidden_size != self.target_info.hidden_size:
            raise RuntimeError(f"drafter hidden size {self.drafter_info.hidden_size} != target's "
                               f"{self.target_info.hidden_size}: not a drafter for this target")
        sockets = self.step_sockets and bool(self.target_info.step_socket and self.drafter_info.step_socket)
        if self.step_sockets and not sockets:
            log.warning("pair %d: --step-transport socket, but the target (%r) or the drafter (%r) serves no step "
                        "socket (start them with --step-socket): the step calls stay on gRPC streams", self.index,
                        self.target_info.step_socket, self.drafter_info.step_socket)
        self._make_step_calls(sockets)
        # The target asks the drafter for its feature layers itself; sending them too guards against a mix-up.
        await self.target.AttachDrafter(target_pb2.AttachDrafterRequest(
            drafter_address=self.address.drafter_for_target or self.address.drafter,
            target_layer_ids=list(self.drafter_info.target_layer_ids), transport=self.transport,
            drafter_step_socket=self.drafter_info.step_socket if sockets else ""), timeout=30)
        self.target_ok = self.drafter_ok = True
        log.info("pair %d ready: target %s (%s), drafter %s (block %d, layers %s)", self.index, self.address.target,
                 self.target_info.model_name, self.address.drafter, self.drafter_info.block_size,
                 list(self.drafter_info.target_layer_ids))

    def _make_step_calls(self, sockets: bool) -> None:
        """Draft and Verify as step-socket calls, stream messages or (neither) unary calls. A re-attach keeps the
        calls it already has when they go the same way (closing them would cancel a step in flight; both kinds
        reconnect by themselves after a peer restarts)."""
        way = ("sockets", self.target_info.step_socket, self.drafter_info.step_socket) if sockets else \
            ("streams",) if self.step_streams else ("unary",)
        if way == self._step_way:
            return
        for calls in (self._verify_calls, self._draft_calls):
            if calls is not None:
                calls.close()
        self._verify_calls = self._draft_calls = None
        self._step_way = way
        record = message_recorder(self.client_interceptors)
        if sockets:
            sec = auth.current()
            spin_s = self.step_spin_us / 1e6
            self._verify_calls = SocketCalls(self.target_info.step_socket, "TargetService/Verify",
                                             target_pb2.VerifyResponse, sec.secret, sec.session, record, spin_s)
            self._draft_calls = SocketCalls(self.drafter_info.step_socket, "DrafterService/Draft",
                                            drafter_pb2.DraftResponse, sec.secret, sec.session, record, spin_s)
            log.info("pair %d: step calls on the step sockets, polling %d us for each answer", self.index,
                     round(spin_s * 1e6))
        elif self.step_streams:
            self._verify_calls = StreamedCalls(self.target.VerifyStream, "TargetService/Verify", record)
            self._draft_calls = StreamedCalls(self.drafter.DraftStream, "DrafterService/Draft", record)

    @property
    def polls_steps(self) -> bool:
        """True when a step call polls for its answer, holding the event loop until it is in (step_spin_us)."""
        return isinstance(self._draft_calls, SocketCalls) and self._draft_calls.spin_s > 0

    async def verify(self, request: target_pb2.VerifyRequest, timeout: float) -> target_pb2.VerifyResponse:
        """A step's Verify: a message on the target's VerifyStream (a unary call with step_streams off)."""
        if self._verify_calls is not None:
            return await self._verify_calls(request, timeout)
        return await self.target.Verify(request, timeout=timeout)

    async def draft(self, request: drafter_pb2.DraftRequest, timeout: float) -> drafter_pb2.DraftResponse:
        """A step's Draft: a message on the drafter's DraftStream (a unary call with step_streams off)."""
        if self._draft_calls is not None:
            return await self._draft_calls(request, timeout)
        return await self.drafter.Draft(request, timeout=timeout)

    async def close(self) -> None:
        for calls in (self._verify_calls, self._draft_calls):
            if calls is not None:
                calls.close()
        await self._target_channel.close()
        await self._drafter_channel.close()
