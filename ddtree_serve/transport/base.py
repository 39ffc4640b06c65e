"""The transport interface: the target sends rows of context features, the drafter receives them in order."""
from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np
import torch

from ddtree_serve.proto import drafter_pb2

_WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BITS_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.float32}


@dataclass
class FeatureRows:
    """Features of positions start .. start + len(data) - 1 of one sequence."""

    seq_id: str
    start: int
    data: torch.Tensor  # [n, F]
    next_token: int | None = None  # the pending token after these rows (the next draft's bonus), when known
    # CUDA: an event recorded once data is written (a verify's rows are ready before its commit has run); None:
    # ready once the work queued so far is done
    ready: torch.cuda.Event | None = None
    draft_top_k: int | None = None   # the top-K the sequence's Drafts ask for (a prompt's push: the gateway's hint)

    @property
    def num_rows(self) -> int:
        return int(self.data.shape[0])

    def message(self, row_begin: int = 0, row_end: int | None = None, **fields) -> drafter_pb2.FeatureRows:
        """The PushFeatures entry for rows [row_begin, row_end); the next token rides on the piece that ends them."""
        row_end = self.num_rows if row_end is None else row_end
        msg = drafter_pb2.FeatureRows(seq_id=self.seq_id, start=self.start + row_begin, num_rows=row_end - row_begin,
                                      **fields)
        if self.next_token is not None and row_end == self.num_rows:
            msg.next_token = self.next_token
            if self.draft_top_k:
                msg.draft_top_k = self.draft_top_k
        return msg


@dataclass
class EarlyRows:
    """One sequence's rows of a verify still running on the device (an early push): data holds an upper bound of
    them, the accepted ones first; header (int64 [2], on the device) is (accepted rows, next token)."""

    seq_id: str
    start: int
    data: torch.Tensor     # [R, F]
    header: torch.Tensor   # int64 [2]
    ready: torch.cuda.Event | None = None   # CUDA: recorded once data and header are written


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a feature dtype."""
    for name, dt in _WIRE_DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported feature dtype {dtype}")


def wire_dtype(name: str) -> tuple[torch.dtype, int]:
    """(torch dtype, bytes per element) of a wire dtype name; ValueError for an unknown one."""
    if name not in _WIRE_DTYPES:
        raise ValueError(f"unknown feature dtype {name!r}")
    dtype = _WIRE_DTYPES[name]
    return dtype, torch.empty((), dtype=dtype).element_size()


def encode_rows(data: torch.Tensor) -> tuple[str, bytes]:
    """Tensor [n, F] -> (dtype name, raw row-major bytes); bf16 travels as its 16-bit pattern."""
    data = data.detach().contiguous().cpu()
    raw = data.view(_BITS_VIEW[data.dtype]).numpy().tobytes()
    return dtype_name(data.dtype), raw


def decode_rows(dtype: str, raw: bytes, num_rows: int, feature_dim: int) -> torch.Tensor:
    """Inverse of encode_rows; validates the byte count."""
    torch_dtype, itemsize = wire_dtype(dtype)
    if len(raw) != num_rows * feature_dim * itemsize:
        raise ValueError(f"feature payload has {len(raw)} bytes, expected {num_rows}x{feature_dim}x{itemsize}")
    bits = torch.from_numpy(np.frombuffer(bytearray(raw), dtype=np.int16 if itemsize == 2 else np.float32))
    return bits.view(torch_dtype).reshape(num_rows, feature_dim)


def payload_bytes(rows, feature_dim: int) -> int:
    """Bytes a FeatureRows message moves: its inline data, or the rows it points to in a shared buffer."""
    if rows.data or rows.dtype not in _WIRE_DTYPES:
        return len(rows.data)
    return max(rows.num_rows, 0) * max(feature_dim, 0) * wire_dtype(rows.dtype)[1]


class FeatureSender(abc.ABC):
    """Target side of a transport. `submit` never blocks the verify path; rows of one sequence stay in order."""

    name: str
    step_socket: str = ""   # the drafter's step socket the pushes go to ("": its gRPC stream)

    def stage_early(self, rows: list[EarlyRows]) -> object | None:
        """Any thread: stages rows of a verify still running so that they go out before its host knows their count
        (see shared.py); returns the staged push for send_staged(), or None when this transport cannot (then the
        rows go as a plain push after the verify)."""
        return None

    def send_staged(self, staged: object) -> None:
        """The event loop: queues a push stage_early made (in submission order with the others)."""
        raise NotImplementedError

    @abc.abstractmethod
    def submit(self, rows: list[FeatureRows]) -> None:
        """Queues rows for delivery (in submission order)."""

    @abc.abstractmethod
    async def flush(self) -> None:
        """Waits until everything submitted so far is delivered (or failed)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Delivers what is queued, then releases the connection."""
