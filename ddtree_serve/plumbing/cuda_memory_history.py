"""Where the device memory went when it ran out: an opt-in record of every CUDA allocation, dumped on the OOM.

`DDTREE_CUDA_MEMORY_HISTORY=PATH` makes a model service record torch's allocator history from the moment its
runner starts loading (torch.cuda.memory._record_memory_history, Python stacks) and write a snapshot the first
time its model work runs out of device memory (a graph warm-up or a request), to PATH with the service's name
added to the file's stem (`oom.pickle` -> `oom-target-model.pickle`: the two model services may share the
variable); `python -m bench.memory_snapshot FILE` then sums the live blocks by memory pool and by the line that
allocated them. Off by default: recording costs a little on every allocation. A CPU service ignores it.
"""
from __future__ import annotations

import logging
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV_VAR = "DDTREE_CUDA_MEMORY_HISTORY"
MAX_ENTRIES = 10_000   # allocation events kept (the trace; a pickle of ~MBs); live blocks keep their stacks regardless
# Frames from these folders name the line an allocation is charged to; the first such frame from the top wins.
OWN_CODE = ("target_svc", "drafter_svc", "gateway", "ddtree_serve")


@dataclass
class MemoryHistory:
    """The recording of one service: `path` is where the snapshot goes (None: not recording)."""

    path: Path | None = None
    dumped: bool = False

    @classmethod
    def from_env(cls, device: str, service: str) -> "MemoryHistory":
        """Starts recording when ENV_VAR names a file and the device is CUDA; else a history that does nothing."""
        value = os.environ.get(ENV_VAR, "").strip()
        if not value or not str(device).startswith("cuda") or not torch.cuda.is_available():
            return cls()
        path = snapshot_path(value, service)
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
        log.info("recording CUDA allocations (%s): a snapshot goes to %s on the first out-of-memory", ENV_VAR, path)
        return cls(path)

    def on_error(self, exc: BaseException) -> None:
        """Model thread: writes the snapshot on the first OutOfMemoryError (once; later ones are the same story)."""
        if self.path is None or self.dumped or not isinstance(exc, torch.OutOfMemoryError):
            return
        self.dumped = True
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(self.path))
            log.error("out of device memory: allocator snapshot written to %s (python -m bench.memory_snapshot %s)",
                      self.path, self.path)
        except Exception as dump_error:  # noqa: BLE001 - a diagnostic must never take the service down
            log.error("out of device memory; the allocator snapshot could not be written: %r", dump_error)


def snapshot_path(value: str, service: str) -> Path:
    """Where a service's snapshot goes: the variable's path with the service name added to its stem."""
    path = Path(value)
    return path.with_name(f"{path.stem}-{service}{path.suffix or '.pickle'}")


def live_blocks(snapshot: dict) -> list[tuple[tuple[int, int], dict]]:
    """(pool id, block) of every block in use in a torch.cuda.memory._snapshot() dict."""
    out = []
    for seg in snapshot.get("segments", []):
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        out += [(pool, b) for b in seg.get("blocks", []) if b.get("state") == "active_allocated"]
    return out


def allocating_line(frames: list[dict]) -> str:
    """The first frame of this project's code from the top of an allocation's stack, else the top frame."""
    for f in frames:
        name = f.get("filename", "")
        if any(f"/{part}/" in name for part in OWN_CODE):
            return f"{name.split('/')[-2]}/{name.split('/')[-1]}:{f.get('line')} {f.get('name')}"
    if frames:
        return f"{frames[0].get('filename', '?')}:{frames[0].get('line')} {frames[0].get('name')}"
    return "(no stack: allocated before recording started)"


def summarize(snapshot: dict, top: int = 25) -> dict:
    """Live and reserved bytes per pool ((0, 0) is the default pool; others are CUDA-graph pools) and the `top`
    allocating lines by live bytes."""
    pools: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0, 0])   # live, blocks, reserved
    for seg in snapshot.get("segments", []):
        pools[tuple(seg.get("segment_pool_id", (0, 0)))][2] += int(seg.get("total_size", 0))
    lines: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for pool, block in live_blocks(snapshot):
        size = int(block.get("size", 0))
        pools[pool][0] += size
        pools[pool][1] += 1
        entry = lines[allocating_line(block.get("frames") or [])]
        entry[0] += size
        entry[1] += 1
    ranked = sorted(lines.items(), key=lambda kv: -kv[1][0])[:top]
    return {"pools": [{"pool": "default" if pool == (0, 0) else f"graph pool {pool}", "live_bytes": v[0],
                       "blocks": v[1], "reserved_bytes": v[2]} for pool, v in sorted(pools.items())],
            "lines": [{"where": where, "bytes": v[0], "blocks": v[1]} for where, v in ranked]}
