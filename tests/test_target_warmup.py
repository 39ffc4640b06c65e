"""What the target says when its up-front graph warm-up fails (the warm-up itself needs a GPU: tests/test_gpu.py)."""
from __future__ import annotations

import torch

from target_svc.server import warmup_failure


def test_a_warmup_out_of_memory_names_the_bucket_and_the_flags_that_make_room():
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 130.00 MiB.\nmore detail")
    line = warmup_failure(exc, 57, 80)
    assert line.startswith("verify graph warm-up failed at bucket 57 of 80 (the rest capture on first use)")
    assert "Tried to allocate 130.00 MiB." in line and "more detail" not in line
    for flag in ("--max-batch", "--max-seq-len", "--gpu-memory-utilization", "--enforce-eager"):
        assert flag in line


def test_another_warmup_failure_is_reported_without_memory_advice():
    line = warmup_failure(RuntimeError("CUDA error: operation not permitted when stream is capturing"), 3, 80)
    assert "RuntimeError: CUDA error: operation not permitted" in line
    assert "--gpu-memory-utilization" not in line
