"""The gateway's DDTree pop order in C (ddtree_native.c), compiled on first use; the Python heap otherwise.

The gateway builds every sequence's tree each step on its event loop, on the step's critical path: ~50 us per
budget-64 tree in ddtree_host's heap on a 2-core EPYC, ~4x that on the H200's host, times the batch. The C heap
pops the same nodes in the same order (see the .c file), ~20x faster, on the fixed-point scores every input
reaches (the Python heap sums float32 log-probs as floats and falls back to fixed point on log-probs within 2**-17
of 0, a sharp drafter's top tokens: two thirds of calibrated budget-64 drafts took that ~10x slower path before
the C heap took fixed point, 2026-12-06). It is compiled with the system's C
compiler (`$CC`, else cc) into a cache folder keyed by the source's hash ($DDTREE_NATIVE_CACHE, else
~/.cache/ddtree-serve/native); without a compiler, or with DDTREE_NATIVE_TREE=off, ddtree_host's Python heap
runs, with the same results.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

from ddtree_serve.switches import switched_off

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("ddtree_native.c")
PACKED_BITS = 128   # the C heap's rank key: depth_limit * bit_length(width) must fit


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled builder, or None (disabled, no compiler, a failed build: logged once)."""
    if switched_off("DDTREE_NATIVE_TREE"):
        return None
    source = SOURCE.read_bytes()
    cache = Path(os.environ.get("DDTREE_NATIVE_CACHE") or Path.home() / ".cache" / "ddtree-serve" / "native")
    target = cache / f"ddtree_native-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if not target.exists():
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            log.info("no C compiler: DDTree trees are built by the Python heap")
            return None
        try:
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:   # built aside, then renamed: no half-written file
                out = Path(tmp) / target.name
                subprocess.run([compiler, "-O2", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(out),
                                str(SOURCE), "-lm"], check=True, capture_output=True, timeout=120)
                os.replace(out, target)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log.warning("DDTree's C builder did not compile (%s%s): the Python heap builds the trees", exc,
                        f": {detail.decode(errors='replace')[:300]}" if detail else "")
            return None
    lib = ctypes.CDLL(str(target))
    lib.ddtree_best_first.restype = ctypes.c_int64
    i64, f64, ptr = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
    lib.ddtree_best_first.argtypes = [ptr, i64, f64, i64, i64, i64, i64, i64, ptr]
    return lib


def available(width: int, depth_limit: int) -> bool:
    """Whether the C builder can build a tree of this width and depth (compiled, and its rank key wide enough)."""
    return width.bit_length() * depth_limit <= PACKED_BITS and library() is not None


def best_first(values: np.ndarray, stride: int, width: int, depth_limit: int, n_nodes: int,
               floor: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ddtree_host._best_first over log-probs [n_pos * stride] on the reference's fixed point -> (-scores,
    parents, cells), int64 each, the root first. values: float32 log-probs (quantized in C as _quantize_np would,
    floor: the log-prob floor) or int64 ones quantized already. Only where available(width, depth_limit)."""
    lib, bits = library(), width.bit_length()
    f32 = values.dtype == np.float32
    values = np.ascontiguousarray(values, dtype=np.float32 if f32 else np.int64)
    out = np.empty((3, n_nodes + 1), dtype=np.int64)   # -scores, parents, cells
    written = lib.ddtree_best_first(values.__array_interface__["data"][0], int(f32), floor, stride, width,
                                    depth_limit, n_nodes, bits, out.__array_interface__["data"][0])
    if written == -2:
        raise MemoryError("DDTree's C builder could not allocate its heap")
    return out[0], out[1], out[2]
