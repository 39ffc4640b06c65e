"""Device -> host copies that wait for the GPU without holding Python's GIL.

`t.cpu()` or `t.tolist()` on a CUDA tensor blocks inside the copy until the stream has finished everything queued
before it (a whole forward), and PyTorch holds the GIL while it waits: the service's event loop (gRPC I/O, the
feature pushes, metrics) cannot run for those milliseconds. Here the copies are queued into pinned host memory and
the wait is a CUDA event's, which releases the GIL.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PendingHostCopy:
    """Host copies queued on their devices' streams; wait() returns them once the copies are done."""

    tensors: tuple[Tensor, ...]
    done: tuple[torch.cuda.Event, ...]

    def wait(self) -> tuple[Tensor, ...]:
        """The host tensors, after a GIL-free wait for each device's copies."""
        for event in self.done:
            event.synchronize()  # releases the GIL while the device catches up
        return self.tensors


def start_host_copy(*tensors: Tensor) -> PendingHostCopy:
    """Queues copies of tensors into pinned host memory now (CPU inputs pass as they are): work queued on the
    stream after this call does not delay them."""
    out: list[Tensor] = []
    streams: dict[torch.device, torch.cuda.Stream] = {}
    for t in tensors:
        if t.device.type != "cuda":
            out.append(t)
            continue
        dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)  # torch caches pinned blocks: cheap after the first
        dst.copy_(t, non_blocking=True)
        out.append(dst)
        streams[t.device] = torch.cuda.current_stream(t.device)
    done = []
    for stream in streams.values():
        event = torch.cuda.Event()
        event.record(stream)
        done.append(event)
    return PendingHostCopy(tuple(out), tuple(done))


def to_host(*tensors: Tensor) -> tuple[Tensor, ...]:
    """CPU tensors equal to tensors (CPU inputs are returned as they are); one GIL-free wait per CUDA device."""
    return start_host_copy(*tensors).wait()
