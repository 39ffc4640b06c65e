"""torch.compile for the small pure functions a step calls (norms, RoPE, gates), with the plain function as the
fallback: the services compile their elementwise glue on CUDA and run it plain elsewhere."""
from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

# Names glue functions to compile at constant widths besides those marked with static_widths (comma-separated
# function names, or "all"): an A/B switch for step-cost benches, read when a function is first compiled.
STATIC_WIDTHS_ENV = "DDTREE_GLUE_STATIC_WIDTHS"


def compile_all(fns: tuple[Callable, ...], compiled: bool) -> tuple[Callable, ...]:
    """fns as they are, or (compiled=True) each through torch.compile with the plain function as its fallback."""
    if not compiled:
        return fns
    import torch._dynamo
    import torch._inductor.config

    # Round where the eager code rounds (bf16 casts), so compiled and eager agree to the last bit or two.
    torch._inductor.config.emulate_precision_casts = True
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return tuple(_compiled(f) for f in fns)


def static_widths(fn: Callable) -> Callable:
    """Marks fn to compile with dynamo's automatic dynamic shapes instead of every dim symbolic: a dim turns symbolic
    only once a call changes it, so the feature widths (which never change) stay constants."""
    # Why only some: with a symbolic width Triton cannot prove the halves of a fused [gate | up] row 16-byte
    # aligned and loads an element at a time; on an H100 at the 8B shape SiLU * up over 65 rows took 4.2 us a layer
    # symbolic and 2.6 us constant, but the add + RMSNorm reduction 4.5 us symbolic and 6.1 us constant
    # (bench/results/h100-2026-12-06-1341/). Marked where timed as a gain: the elementwise products and the hybrid's
    # Gated DeltaNet glue, whose per-head gated RMSNorm (a 128-wide reduction) gained too (h100-2026-12-06-1515/).
    fn.__compile_static_widths__ = True
    return fn


def compiles_static(fn: Callable) -> bool:
    """Whether fn compiles at constant widths: marked with static_widths, or named by DDTREE_GLUE_STATIC_WIDTHS."""
    if getattr(fn, "__compile_static_widths__", False):
        return True
    names = {n.strip() for n in os.environ.get(STATIC_WIDTHS_ENV, "").split(",") if n.strip()}
    return "all" in names or fn.__name__ in names


@functools.cache
def _compiled(fn: Callable) -> "CompiledOrPlain":
    # One wrapper per function and process: dynamo keeps its compiled code on the function's code object, so a
    # fresh torch.compile per model would re-trace it (seconds each) and pile up cache entries toward
    # cache_size_limit; the functions are pure, so every model of the process can share one.
    return CompiledOrPlain(fn)


class CompiledOrPlain:
    """torch.compile of fn; if compiling fails (no compiler for this device, an inductor bug), the plain fn."""

    def __init__(self, fn: Callable) -> None:
        self.plain = fn
        dynamic = None if compiles_static(fn) else True
        self.fn = torch.compile(fn, dynamic=dynamic, fullgraph=True)

    def __call__(self, *args):
        try:
            return self.fn(*args)
        except Exception as exc:  # noqa: BLE001 - a slower path beats a dead service
            if self.fn is self.plain:
                raise
            log.warning("compiling %s failed (%s: %s); using the plain PyTorch version", self.plain.__name__,
                        type(exc).__name__, exc)
            self.fn = self.plain
            return self.fn(*args)
