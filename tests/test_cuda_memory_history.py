"""The opt-in allocator record: inert without CUDA, and the snapshot summary that says where memory went."""
from __future__ import annotations

import pickle
from pathlib import Path

import torch

from bench import memory_snapshot
from ddtree_serve.plumbing.cuda_memory_history import (ENV_VAR, MemoryHistory, allocating_line, snapshot_path,
                                                       summarize)

MIB = 2**20


def _frames(*where):
    return [{"filename": f, "line": line, "name": name} for f, line, name in where]


SNAPSHOT = {"segments": [
    {"segment_pool_id": (0, 0), "total_size": 64 * MIB, "blocks": [
        {"size": 40 * MIB, "state": "active_allocated", "frames": _frames(
            ("/usr/lib/python3/site-packages/torch/nn/functional.py", 10, "linear"),
            ("/work/main/target_svc/model.py", 254, "_hybrid_layers"))},
        {"size": 8 * MIB, "state": "inactive", "frames": []},
        {"size": 16 * MIB, "state": "active_allocated", "frames": []}]},
    {"segment_pool_id": (1, 2), "total_size": 32 * MIB, "blocks": [
        {"size": 20 * MIB, "state": "active_allocated", "frames": _frames(
            ("/work/main/target_svc/model.py", 254, "_hybrid_layers"))},
        {"size": 12 * MIB, "state": "active_pending_free", "frames": []}]}]}


def test_without_the_variable_or_cuda_nothing_is_recorded_or_dumped(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert MemoryHistory.from_env("cuda", "target-model").path is None
    monkeypatch.setenv(ENV_VAR, "/tmp/never-written.pickle")
    history = MemoryHistory.from_env("cpu", "target-model")
    assert history.path is None
    history.on_error(torch.OutOfMemoryError("x"))   # inert: no snapshot, no error
    assert not history.dumped


def test_each_service_writes_its_own_file():
    assert snapshot_path("/out/oom.pickle", "target-model") == Path("/out/oom-target-model.pickle")
    assert snapshot_path("/out/oom", "drafter-model") == Path("/out/oom-drafter-model.pickle")


def test_an_allocation_is_charged_to_the_first_line_of_this_projects_code():
    frames = _frames(("/x/torch/functional.py", 1, "linear"), ("/work/main/target_svc/model.py", 254, "f"),
                     ("/work/main/target_svc/runner.py", 9, "g"))
    assert allocating_line(frames) == "target_svc/model.py:254 f"
    assert allocating_line(_frames(("/x/torch/functional.py", 1, "linear"))) == "/x/torch/functional.py:1 linear"
    assert allocating_line([]).startswith("(no stack")


def test_the_summary_sums_live_blocks_per_pool_and_per_line():
    s = summarize(SNAPSHOT)
    pools = {p["pool"]: p for p in s["pools"]}
    assert pools["default"] == {"pool": "default", "live_bytes": 56 * MIB, "blocks": 2, "reserved_bytes": 64 * MIB}
    assert pools["graph pool (1, 2)"]["live_bytes"] == 20 * MIB and pools["graph pool (1, 2)"]["blocks"] == 1
    assert s["lines"][0] == {"where": "target_svc/model.py:254 _hybrid_layers", "bytes": 60 * MIB, "blocks": 2}
    assert s["lines"][1]["bytes"] == 16 * MIB and s["lines"][1]["where"].startswith("(no stack")


def test_the_snapshot_cli_writes_the_tables(tmp_path, capsys):
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(SNAPSHOT))
    memory_snapshot.main([str(path), "--out-dir", str(tmp_path)])
    md = (tmp_path / "memory-snapshot-oom.md").read_text()
    assert "| target_svc/model.py:254 _hybrid_layers | 60.000 | 2 |" in md
    assert "| default | 56.000 | 2 | 64.000 |" in md
    assert "target_svc/model.py:254" in capsys.readouterr().out
