"""Small helpers both calibration profiles share (bench-only calibrated acceptance)."""
from __future__ import annotations

from collections.abc import Callable


def extend_sorted(row: list[float], k: int) -> list[float]:
    """A sorted log-prob row at k ranks: truncated, or extended past its end by continuing its tail slope (so the
    list stays non-increasing), floored at -1000."""
    if k <= len(row):
        return list(row[:k])
    tail = row[-min(9, len(row)):]
    step = max(1e-3, (tail[0] - tail[-1]) / max(1, len(tail) - 1))
    return list(row) + [max(-1000.0, row[-1] - step * (i + 1)) for i in range(k - len(row))]


def solve_increasing(f: Callable[[float], float], target: float, lo: float, hi: float, tol: float = 1e-12) -> float:
    """The x in [lo, hi] where the increasing function f reaches target (bisection)."""
    for _ in range(200):
        mid = (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo < tol:
            break
    return (lo + hi) / 2
