"""Which CPUs a service's threads run on (`--cpus`), and disjoint sets for the services of one host.

A step crosses the three processes several times, and each crossing wakes a thread that slept through the previous
forward. Left to the scheduler, that thread often wakes on another CPU than last time, with cold L1/L2 caches: the
gateway's host work per step (parse the Draft answer, build the tree, pack the Verify) took 33 us warm and ~390 us
after its caches were evicted, on the CI box (docs/ENGINE.md). Pinned to a few CPUs of its own, each service wakes
where its working set still is. Measured once on an H100 host (bench/results/h100-overhead-2026-12-05-1436/): on top
of the gateway's whole-wait poll it changed nothing measurable (0.80 vs 0.81 ms outside the forwards a step).
"""
from __future__ import annotations

import os
from pathlib import Path


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-2,5' -> (0, 1, 2, 5): the kernel's cpu-list syntax; ValueError for anything else or an empty list."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (e.g. 0-3,6)")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"not a CPU list: {text!r} ({part} runs backwards)")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: tuple[int, ...] | list[int]) -> str:
    """(0, 1, 2, 5) -> '0-2,5'."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(_run_text(run))
            run = []
        run.append(c)
    if run:
        out.append(_run_text(run))
    return ",".join(out)


def _run_text(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def pin_process(cpus: tuple[int, ...]) -> None:
    """Every thread of this process (and the ones it starts later) onto `cpus`; ValueError for CPUs it may not use."""
    allowed = os.sched_getaffinity(0)
    if not set(cpus) <= allowed:
        raise ValueError(f"CPUs {format_cpu_list(sorted(set(cpus) - allowed))} are not available to this process "
                         f"(it may use {format_cpu_list(sorted(allowed))})")
    tasks = Path("/proc/self/task")
    tids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:   # a thread that ended meanwhile
            pass


def split_cpus(available: tuple[int, ...], shares: dict[str, int]) -> dict[str, tuple[int, ...]] | None:
    """Disjoint runs of `available` CPUs, shares[name] each, in order; None when there are not enough."""
    if sum(shares.values()) > len(available):
        return None
    out, at = {}, 0
    for name, n in shares.items():
        out[name] = tuple(available[at:at + n])
        at += n
    return out
