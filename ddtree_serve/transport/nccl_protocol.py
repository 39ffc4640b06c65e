"""The nccl transport's protocol, without a GPU: the handshake's checks, the push header and its layout, the order
in which pushes pair up, and when the send buffer may be reused.

One push = a PushFeatures header (seq ids, starts, row counts, byte offsets, dtype, element count) plus one NCCL
send of that many elements from the target (rank 0) to the drafter (rank 1). The drafter answers the header only
once it holds the rows; that answer is the acknowledgement that lets the target overwrite its send buffer.
Nothing here imports cupy (CPU paths never do); the communicator itself is in nccl.py.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch

from ddtree_serve.proto import drafter_pb2
from ddtree_serve.transport.base import FeatureRows, dtype_name, wire_dtype
from ddtree_serve.transport.shared_buffer import Piece, plan_pieces

TARGET_RANK, DRAFTER_RANK, WORLD_SIZE = 0, 1, 2
UNIQUE_ID_BYTES = 128            # sizeof(ncclUniqueId)
DEFAULT_JOIN_TIMEOUT_S = 60.0     # both ranks must have joined by then (first init loads NCCL's plugins)


class NcclSetupError(RuntimeError):
    """The communicator cannot be formed (no cupy, no CUDA, one GPU for both ranks, peer absent, timeout)."""


class NcclLinkLost(RuntimeError):
    """The communicator was aborted: the rows of this push (and of later ones) do not reach the drafter."""


def cupy_package() -> str:
    """The CuPy wheel matching this torch's CUDA (cupy-cuda12x or cupy-cuda13x)."""
    major = (torch.version.cuda or "12").split(".")[0]
    return f"cupy-cuda{major}x"


def missing_nccl_package() -> str | None:
    """Why NCCL cannot be used from Python here (with the package to install), or None; imports nothing on CPU."""
    hint = f"install {cupy_package()} (pip install 'ddtree-serve[gpu]'; cupy-cuda12x or cupy-cuda13x both work)"
    if importlib.util.find_spec("cupy") is None:
        return f"transport nccl needs CuPy with NCCL, which is not installed: {hint}"
    return None


def nccl_refusal(own_device: str, own_uuid: str, peer_device: str, peer_uuid: str,
                 missing_package: str | None) -> str | None:
    """Why a target on `own_device` cannot form an NCCL pair with a drafter on `peer_device`, or None.

    Devices are compared by GPU UUID: in containers both services may call their GPU cuda:0."""
    reasons = []
    if missing_package:
        reasons.append(missing_package)
    if torch.device(own_device).type != "cuda":
        reasons.append(f"transport nccl needs the target on a CUDA device (it runs on {own_device})")
    if peer_device and torch.device(peer_device).type != "cuda":
        reasons.append(f"transport nccl needs the drafter on a CUDA device (it runs on {peer_device})")
    if own_uuid and own_uuid == peer_uuid:
        reasons.append(f"transport nccl needs the target and the drafter on different GPUs, but both run on GPU "
                       f"{own_uuid} (NCCL refuses two ranks on one GPU; use --transport cuda-ipc there)")
    return "; ".join(reasons) or None


def device_uuid(device: str | torch.device) -> str:
    """The UUID of a CUDA device as the driver reports it ("" for CPU or when torch cannot tell)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return ""
    props = torch.cuda.get_device_properties(device.index if device.index is not None else torch.cuda.current_device())
    return str(getattr(props, "uuid", ""))


def uid_to_bytes(uid) -> bytes:
    """cupy's unique id (a tuple of C chars, signed on x86, unsigned on Arm) -> 128 bytes for the handshake."""
    raw = bytes(int(c) & 0xFF for c in uid)
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, not {len(raw)}")
    return raw


def uid_from_bytes(raw: bytes, signed_char: bool = True) -> tuple[int, ...]:
    """128 handshake bytes -> the tuple cupy's NcclCommunicator takes (C char values of this platform)."""
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, not {len(raw)}")
    return tuple(b - 256 if signed_char and b > 127 else b for b in raw)


@dataclass(frozen=True)
class NcclTransfer:
    """What one NCCL transfer moves: `count` elements of `dtype` (`itemsize` bytes each)."""

    dtype: str
    itemsize: int
    count: int

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize


@dataclass(frozen=True)
class NcclPush(NcclTransfer):
    """One NCCL send: `pieces` of rows at byte offsets of the payload."""

    pieces: list[Piece] = field(default_factory=list)


def plan_nccl_pushes(rows: list[FeatureRows], buffer_bytes: int) -> list[NcclPush]:
    """Lays a submission out as payloads of at most `buffer_bytes` (aligned runs of rows, as for shared buffers)."""
    feature_dim, dtype = int(rows[0].data.shape[1]), rows[0].data.dtype
    if any(r.data.shape[1] != feature_dim or r.data.dtype != dtype for r in rows):
        raise ValueError("rows of one push must share feature_dim and dtype")
    name = dtype_name(dtype)
    itemsize = wire_dtype(name)[1]
    row_bytes = feature_dim * itemsize
    pushes = []
    for pieces in plan_pieces([r.num_rows for r in rows], row_bytes, buffer_bytes):
        end = max(p.offset + (p.row_end - p.row_begin) * row_bytes for p in pieces)
        pushes.append(NcclPush(dtype=name, itemsize=itemsize, count=end // itemsize, pieces=pieces))   # offsets are itemsize-aligned
    return pushes


def encode_header(push: NcclPush, rows: list[FeatureRows], comm_id: str, push_id: int) -> drafter_pb2.FeatureBatch:
    """The PushFeatures message that announces one NCCL payload."""
    msgs = [rows[p.index].message(p.row_begin, p.row_end, dtype=push.dtype, shared_offset=p.offset)
            for p in push.pieces]
    return drafter_pb2.FeatureBatch(rows=msgs, feature_dim=int(rows[0].data.shape[1]), nccl=drafter_pb2.NcclPayload(
        comm_id=comm_id, push_id=push_id, dtype=push.dtype, count=push.count))


def lost_header(rows: list[FeatureRows], comm_id: str, reason: str) -> drafter_pb2.FeatureBatch:
    """A header with no payload: tells the drafter these rows will never come (so their sequences go `ar`)."""
    msgs = [drafter_pb2.FeatureRows(seq_id=r.seq_id, start=r.start, num_rows=r.num_rows) for r in rows]
    return drafter_pb2.FeatureBatch(rows=msgs, feature_dim=int(rows[0].data.shape[1]),
                                    nccl=drafter_pb2.NcclPayload(comm_id=comm_id, aborted=reason or "aborted"))


@dataclass(frozen=True)
class NcclHeader(NcclTransfer):
    """A validated header: receive the payload as push `push_id` of communicator `comm_id`."""

    comm_id: str = ""
    push_id: int = 0


def decode_header(batch: drafter_pb2.FeatureBatch, buffer_bytes: int) -> NcclHeader:
    """Checks a header against the receive buffer before anything is received; ValueError says what is wrong."""
    p = batch.nccl
    if p.aborted:
        raise NcclLinkLost(f"the target aborted NCCL communicator {p.comm_id}: {p.aborted}")
    _, itemsize = wire_dtype(p.dtype)
    if p.count <= 0 or p.count * itemsize > buffer_bytes:
        raise ValueError(f"an NCCL payload of {p.count} {p.dtype} elements does not fit the {buffer_bytes}-byte "
                         "receive buffer")
    if batch.feature_dim <= 0:
        raise ValueError("feature_dim must be > 0")
    for r in batch.rows:
        end = r.shared_offset + r.num_rows * batch.feature_dim * itemsize
        if r.dtype != p.dtype or r.num_rows <= 0 or r.shared_offset < 0 or r.shared_offset % itemsize \
                or end > p.count * itemsize:
            raise ValueError(f"rows of sequence {r.seq_id} ({r.num_rows} x {batch.feature_dim} {r.dtype} at byte "
                             f"{r.shared_offset}) fall outside the {p.count}-element {p.dtype} payload")
    return NcclHeader(dtype=p.dtype, itemsize=itemsize, count=int(p.count), comm_id=p.comm_id,
                      push_id=int(p.push_id))


@dataclass
class SendLedger:
    """The target's record of its one send buffer: staged into only when no push holds it, freed by the ack."""

    next_push_id: int = 0
    in_flight: int | None = None
    aborted: str = ""

    def begin(self) -> int:
        """Claims the send buffer for the next push; returns its push id."""
        if self.aborted:
            raise NcclLinkLost(self.aborted)
        if self.in_flight is not None:
            raise RuntimeError(f"push {self.in_flight} still holds the send buffer (not acknowledged)")
        self.in_flight, self.next_push_id = self.next_push_id, self.next_push_id + 1
        return self.in_flight

    def acknowledged(self, push_id: int) -> None:
        """The drafter holds push `push_id`'s rows: the buffer may be overwritten."""
        if push_id != self.in_flight:
            raise RuntimeError(f"acknowledgement of push {push_id}, but push {self.in_flight} is in flight")
        self.in_flight = None

    def abort(self, reason: str) -> None:
        """The communicator is gone: no push may use the buffer again (an unmatched send may still read it)."""
        self.aborted = self.aborted or reason

    @property
    def reusable(self) -> bool:
        return self.in_flight is None and not self.aborted


@dataclass
class ReceiveOrder:
    """The drafter's check that pushes arrive in the order their sends were posted (one NCCL stream, FIFO)."""

    expected: int = 0

    def accept(self, push_id: int) -> None:
        """Takes push `push_id` if it is the next one; ValueError otherwise (the pairing of sends is lost)."""
        if push_id != self.expected:
            raise ValueError(f"NCCL push {push_id} arrived where push {self.expected} was expected")
        self.expected += 1
