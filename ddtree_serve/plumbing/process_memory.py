"""A process's device memory as the driver counts it (CUDA context, loaded kernels and local memory included),
which torch's allocator statistics do not see."""

from __future__ import annotations

import subprocess


def process_device_memory(pid: int) -> int | None:
    """Device memory of process pid as nvidia-smi lists it (bytes); None when nvidia-smi is absent or does not
    list the process (e.g. a container whose PID namespace it does not see)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            return int(parts[1]) * 2**20
    return None
