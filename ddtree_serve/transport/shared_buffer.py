"""Staging buffers the target shares with its drafter once, so feature rows then travel as byte offsets.

`shm`: POSIX shared memory (both services on one host; CPU tensors). `cuda-ipc`: a CUDA allocation of the
target, opened in the drafter through torch's IPC handle (same GPU, or peer-accessible GPUs visible to both
processes). Rows are laid out at aligned offsets; the drafter answers a push only once it has stored the
rows, so the sender reuses the buffer for its next push without a ring.
"""
from __future__ import annotations

import _posixshmem
import mmap
import os
import re
import uuid
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

from ddtree_serve.proto import drafter_pb2
from ddtree_serve.transport import SHARED_BUFFER_TRANSPORTS
from ddtree_serve.transport.base import FeatureRows, dtype_name, wire_dtype

SHARED_KINDS = SHARED_BUFFER_TRANSPORTS
ROW_ALIGN = 256                # byte alignment of every run of rows (any dtype view is aligned)
HEADER_BYTES = 16              # an early push's per-sequence header: accepted rows, next token (int64 each)
OPENED_BUFFERS = 4             # buffers a drafter keeps open (a restarted target brings a new one)
SHM_PREFIX = "ddtree-"
# The only shm names a drafter opens: the ones StagingBuffer makes. Anything else (another program's segment,
# /dev/shm paths) is refused before shm_open.
SHM_NAME = re.compile(r"ddtree-[0-9a-f]{32}")


@dataclass(frozen=True)
class Piece:
    """Rows [row_begin, row_end) of rows[index], stored at byte `offset` of the buffer."""

    index: int
    row_begin: int
    row_end: int
    offset: int


def _align(n: int) -> int:
    return (n + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN


def plan_pieces(row_counts: list[int], row_bytes: int, capacity: int) -> list[list[Piece]]:
    """Splits runs of rows into pushes that fit the buffer; a run longer than one buffer spans several pushes."""
    if row_bytes <= 0 or capacity < row_bytes:
        raise ValueError(f"a staging buffer of {capacity} bytes cannot hold one {row_bytes}-byte row")
    pushes: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for index, count in enumerate(row_counts):
        begin = 0
        while begin < count:
            room = (capacity - used) // row_bytes
            if room == 0:
                pushes.append(current)
                current, used = [], 0
                continue
            end = min(count, begin + room)
            current.append(Piece(index, begin, end, used))
            used = min(capacity, _align(used + (end - begin) * row_bytes))
            begin = end
    if current:
        pushes.append(current)
    return pushes


def rows_view(buffer: torch.Tensor, offset: int, num_rows: int, feature_dim: int, dtype: str) -> torch.Tensor:
    """The [num_rows, feature_dim] rows stored at `offset` of a uint8 buffer (a view, validated)."""
    torch_dtype, itemsize = wire_dtype(dtype)
    nbytes = num_rows * feature_dim * itemsize
    if num_rows < 0 or offset < 0 or offset % itemsize or offset + nbytes > buffer.numel():
        raise ValueError(f"rows at byte {offset} ({num_rows}x{feature_dim} {dtype}) fall outside the "
                         f"{buffer.numel()}-byte shared buffer")
    return buffer[offset:offset + nbytes].view(torch_dtype).view(num_rows, feature_dim)


def header_view(buffer: torch.Tensor, offset: int) -> torch.Tensor:
    """The (accepted rows, next token) int64 pair an early push's target wrote at `offset` of a uint8 buffer (a
    view, validated)."""
    if offset < 0 or offset % HEADER_BYTES or offset + HEADER_BYTES > buffer.numel():
        raise ValueError(f"an early push's header at byte {offset} falls outside the {buffer.numel()}-byte shared "
                         f"buffer or off its {HEADER_BYTES}-byte grid")
    return buffer[offset:offset + HEADER_BYTES].view(torch.int64)


def copy_piece(buffer: torch.Tensor, piece: Piece, rows: FeatureRows) -> int:
    """Copies one piece of rows into a uint8 buffer at its offset (asynchronously on CUDA); returns its bytes."""
    src = rows.data[piece.row_begin:piece.row_end]
    dst = rows_view(buffer, piece.offset, src.shape[0], src.shape[1], dtype_name(src.dtype))
    dst.copy_(src, non_blocking=src.is_cuda and dst.is_cuda)
    return dst.numel() * dst.element_size()


class StagingBuffer:
    """The sender's side: a uint8 buffer of `size_bytes` and the descriptor that lets a drafter open it."""

    def __init__(self, kind: str, size_bytes: int, device: torch.device):
        if kind not in SHARED_KINDS:
            raise ValueError(f"unknown shared-buffer kind {kind!r}; available: {', '.join(SHARED_KINDS)}")
        self.kind = kind
        self.size_bytes = size_bytes
        self._shm: shared_memory.SharedMemory | None = None
        desc = drafter_pb2.SharedBuffer(kind=kind, buffer_id=uuid.uuid4().hex, size_bytes=size_bytes)
        if kind == "shm":
            self._shm = shared_memory.SharedMemory(name=f"{SHM_PREFIX}{uuid.uuid4().hex}", create=True,
                                                   size=size_bytes)
            self.tensor = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=size_bytes)
            desc.shm_name = self._shm.name
        else:
            if device.type != "cuda":
                raise ValueError(f"cuda-ipc needs the target on a CUDA device, not {device}")
            self.tensor = torch.empty(size_bytes, dtype=torch.uint8, device=device)
            (dev, handle, storage_size, storage_offset, ref_handle, ref_offset, event_handle,
             event_sync) = self.tensor.untyped_storage()._share_cuda_()
            desc.cuda.CopyFrom(drafter_pb2.CudaIpcHandle(
                device=dev, storage_handle=handle, storage_size_bytes=storage_size,
                storage_offset_bytes=storage_offset, ref_counter_handle=ref_handle, ref_counter_offset=ref_offset,
                event_handle=event_handle or b"", event_sync_required=bool(event_sync)))
        self.descriptor = desc

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def write(self, piece: Piece, rows: FeatureRows) -> int:
        """Copies one piece of rows into the buffer (asynchronously on CUDA); returns its byte count."""
        return copy_piece(self.tensor, piece, rows)

    def close(self) -> None:
        """Frees the buffer (shm: unlinks the name; a drafter holding it open keeps its mapping)."""
        self.tensor = None
        if self._shm is not None:
            self._shm.unlink()
            try:
                self._shm.close()
            except BufferError:
                pass   # a view of the rows is still alive somewhere: the map goes with it
            self._shm = None


def _map_shm(name: str, size: int) -> tuple[mmap.mmap, int]:
    """Maps the target's shared memory read-only, without registering it with this process's resource tracker
    (which would unlink it at exit: only its creator owns it). Returns the map and its open descriptor, kept to
    re-check the size before every read: a segment truncated under a map raises SIGBUS on access."""
    if not SHM_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a ddtree staging buffer name")
    fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
    try:
        if os.fstat(fd).st_size < size:
            raise ValueError(f"shared memory {name!r} has {os.fstat(fd).st_size} bytes, not {size}")
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ), fd
    except BaseException:
        os.close(fd)
        raise


class OpenedBuffers:
    """The drafter's side: shared buffers opened by id (least recently used closed first)."""

    def __init__(self, capacity: int = OPENED_BUFFERS):
        self.capacity = capacity
        self._open: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._fds: dict[str, int] = {}   # buffer id -> shm descriptor (size re-checked before reads)

    def is_open(self, desc: drafter_pb2.SharedBuffer) -> bool:
        """Whether the described buffer is open already (get() then only looks it up)."""
        return desc.buffer_id in self._open

    def get(self, desc: drafter_pb2.SharedBuffer) -> torch.Tensor:
        """The uint8 tensor of a described buffer, opening it on first use."""
        if desc.buffer_id in self._open:
            self._open.move_to_end(desc.buffer_id)
            return self._open[desc.buffer_id]
        if desc.size_bytes <= 0:
            raise ValueError(f"shared buffer {desc.buffer_id!r} has no size")
        if desc.kind == "shm":
            try:
                mapped, fd = _map_shm(desc.shm_name, desc.size_bytes)
            except (OSError, ValueError) as exc:
                raise ValueError(f"cannot open shared memory {desc.shm_name!r} (is the target on this host?): "
                                 f"{exc}") from None
            with warnings.catch_warnings():   # read-only on purpose: the drafter never writes the target's rows
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.frombuffer(mapped, dtype=torch.uint8, count=desc.size_bytes)
            self._fds[desc.buffer_id] = fd
        elif desc.kind == "cuda-ipc":
            tensor = _open_cuda_ipc(desc)
        else:
            raise ValueError(f"unknown shared-buffer kind {desc.kind!r}")
        self._open[desc.buffer_id] = tensor
        while len(self._open) > self.capacity:
            old, _ = self._open.popitem(last=False)   # unmapped once no view of it is left
            self._close_fd(old)
        return tensor

    def rows(self, desc: drafter_pb2.SharedBuffer, offset: int, num_rows: int, feature_dim: int,
             dtype: str) -> torch.Tensor:
        """A copy of rows of a described buffer; ValueError (never SIGBUS) if the segment shrank under the map."""
        buffer = self.get(desc)
        view = rows_view(buffer, offset, num_rows, feature_dim, dtype)
        fd = self._fds.get(desc.buffer_id)
        if fd is not None:
            size = os.fstat(fd).st_size
            if size < offset + view.numel() * view.element_size():
                raise ValueError(f"shared memory {desc.shm_name!r} shrank to {size} bytes under its mapping")
            return view.clone()
        return view

    def header(self, desc: drafter_pb2.SharedBuffer, offset: int) -> torch.Tensor:
        """An early push's header in a described buffer (shm: a copy, read after the size check)."""
        view = header_view(self.get(desc), offset)
        fd = self._fds.get(desc.buffer_id)
        if fd is not None:
            if os.fstat(fd).st_size < offset + HEADER_BYTES:
                raise ValueError(f"shared memory {desc.shm_name!r} shrank under its mapping")
            return view.clone()
        return view

    def _close_fd(self, buffer_id: str) -> None:
        fd = self._fds.pop(buffer_id, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Forgets every opened buffer (each is unmapped once no view of it is left)."""
        for buffer_id in list(self._fds):
            self._close_fd(buffer_id)
        self._open.clear()


def _open_cuda_ipc(desc: drafter_pb2.SharedBuffer) -> torch.Tensor:
    if not torch.cuda.is_available():
        raise ValueError("a cuda-ipc buffer needs CUDA in the drafter process")
    h = desc.cuda
    try:
        torch.cuda._lazy_init()  # noqa: SLF001 - what torch's own rebuild_cuda_tensor does first
        storage = torch.UntypedStorage._new_shared_cuda(  # noqa: SLF001
            h.device, h.storage_handle, h.storage_size_bytes, h.storage_offset_bytes, h.ref_counter_handle,
            h.ref_counter_offset, h.event_handle, h.event_sync_required)
    except RuntimeError as exc:
        raise ValueError(f"cannot open the target's CUDA IPC buffer (same GPU or peer access needed): {exc}") \
            from None
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (desc.size_bytes,))
