"""bench.priority_scheduling's arithmetic: TTFT per class of request (the bench itself runs the real services)."""
from __future__ import annotations

from bench.common import Result
from bench.priority_scheduling import request, summary


def _result(ttft_s: float) -> Result:
    return Result([], "", "length", {"ttft_seconds": ttft_s}, 0.0, 0.0)


def test_summary_gives_each_class_its_mean_and_worst_ttft_in_ms():
    out = summary([_result(1.0), _result(0.2), _result(3.0), _result(0.4)], [False, True, False, True])
    assert out == {"urgent": {"requests": 2, "mean_ttft_ms": 300.0, "max_ttft_ms": 400.0},
                   "others": {"requests": 2, "mean_ttft_ms": 2000.0, "max_ttft_ms": 3000.0}}


def test_the_bench_requests_carry_their_priority():
    assert request("hi", 8, 16, -1).priority == -1 and request("hi", 8, 16, 0).priority == 0
