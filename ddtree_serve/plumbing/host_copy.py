"""Device -> host copies that wait for the GPU without holding Python's GIL.

`t.cpu()` or `t.tolist()` on a CUDA tensor blocks inside the copy until the stream has finished everything queued
before it (a whole forward), and PyTorch holds the GIL while it waits: the service's event loop (gRPC I/O, the
feature pushes, metrics) cannot run for those milliseconds. Here the copies are queued into pinned host memory and
the wait is a CUDA event's, which releases the GIL.
"""
from __future__ import annotations

import torch
from torch import Tensor


def to_host(*tensors: Tensor) -> tuple[Tensor, ...]:
    """CPU tensors equal to tensors (CPU inputs are returned as they are); one GIL-free wait per CUDA device."""
    out: list[Tensor] = []
    pending: dict[torch.device, torch.cuda.Stream] = {}
    for t in tensors:
        if t.device.type != "cuda":
            out.append(t)
            continue
        dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)  # torch caches pinned blocks: cheap after the first
        dst.copy_(t, non_blocking=True)
        out.append(dst)
        pending[t.device] = torch.cuda.current_stream(t.device)
    for device, stream in pending.items():
        done = torch.cuda.Event()
        done.record(stream)
        done.synchronize()  # releases the GIL while the device catches up
    return tuple(out)
