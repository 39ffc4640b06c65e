"""bench.pyspy_summary: py-spy's folded stacks counted per thread, per top frame and per function anywhere."""
from __future__ import annotations

from bench.pyspy_summary import read_folded

FOLDED = """\
thread (101): MainThread;run (asyncio/runners.py:190);step (gateway/engine.py:121);build (ddtree.py:10) 7
thread (101): MainThread;run (asyncio/runners.py:190);step (gateway/engine.py:122) 3
thread (202): "target-model_0";work (model_thread.py:72);fn (a.py:1);fn (a.py:2) 5
"""


def test_samples_are_counted_per_thread_per_top_frame_and_per_function(tmp_path):
    path = tmp_path / "pyspy-gateway.txt"
    path.write_text(FOLDED)
    p = read_folded(path)
    assert p.total == 15
    assert p.threads == {"MainThread": 10, "target-model_0": 5}
    assert p.self_samples["build (ddtree.py:10)"] == 7 and p.self_samples["step (gateway/engine.py:122)"] == 3
    assert p.inclusive["step (gateway/engine.py)"] == 10     # two lines of one function, counted together
    assert p.inclusive["fn (a.py)"] == 5                     # a function twice in one stack counts once


def test_a_thread_filter_keeps_only_that_threads_samples(tmp_path):
    path = tmp_path / "pyspy-target.txt"
    path.write_text(FOLDED)
    p = read_folded(path, thread="model")
    assert p.total == 5 and set(p.threads) == {"target-model_0"}
