"""torch.compile for the small pure functions a step calls (norms, RoPE, gates), with the plain function as the
fallback: the services compile their elementwise glue on CUDA and run it plain elsewhere."""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from ddtree_serve import switches

log = logging.getLogger(__name__)

# "on": compile with dynamo's automatic dynamic shapes (each dim a constant until a call changes it, so the feature
# widths, which never change, stay constants: aligned, vectorised loads), instead of every dim symbolic (a width
# Triton cannot prove a multiple of 16 loads an element at a time). Off by default until timed on a GPU.
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
        dynamic = None if switches.switched_on(STATIC_WIDTHS_ENV) else True
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
