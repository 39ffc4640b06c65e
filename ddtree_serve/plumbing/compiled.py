"""torch.compile for the small pure functions a step calls (norms, RoPE, gates), with the plain function as the
fallback: the services compile their elementwise glue on CUDA and run it plain elsewhere."""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


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
        self.fn = torch.compile(fn, dynamic=True, fullgraph=True)

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
