"""bench/trace_lines.py: a profile's operators summed per launching function (a real CPU trace of this file)."""
from __future__ import annotations

import json

import torch
from torch.profiler import ProfilerActivity, profile

from bench.trace_lines import attribute, markdown


def fills_in_a_loop(n: int) -> torch.Tensor:
    x = torch.ones(8, dtype=torch.int32)
    for _ in range(n):
        x = x + torch.zeros(8, dtype=torch.int32)
    return x


def one_matmul() -> torch.Tensor:
    a = torch.randn(16, 16)
    return a @ a


def test_each_op_is_counted_against_the_innermost_matching_function(tmp_path):
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        fills_in_a_loop(37)
        one_matmul()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    summary = attribute(json.loads(path.read_text())["traceEvents"], match=("test_trace_lines.py",))
    loop = next(v for k, v in summary.items() if "fills_in_a_loop" in k)
    assert loop.names["aten::zeros"] == 37 and loop.names["aten::add"] == 37
    mm = next(v for k, v in summary.items() if "one_matmul" in k)
    assert mm.names["aten::matmul"] == 1 and "aten::zeros" not in mm.names
    table = markdown(summary, top=5, kernels=False)
    assert table.splitlines()[2].startswith("| ") and "fills_in_a_loop" in table.splitlines()[2]
