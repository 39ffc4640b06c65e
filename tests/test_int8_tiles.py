"""The per-GPU int8 tile table (target_svc/int8_tiles.py): how it is read, looked up, merged, and how the launcher
and the sweep use it. Pure Python: no GPU or Triton needed."""
from __future__ import annotations

import json
import os

import pytest

from target_svc import int8_matmul, int8_tiles
from target_svc.int8_matmul import GemvConfig, TileConfig, choose_config
from target_svc.int8_tiles import TunedTile
from tests.test_quantization_backend import INTERPRETER_PATCH, _run_interpreted, needs_triton


def _entry(lo, hi, n=4096, k=4096, kernel="dot", config=(64, 64, 128, 2, False, 8, 3), ms=0.01, default_ms=0.012):
    return {"rows": [lo, hi], "n": n, "k": k, "kernel": kernel, "config": list(config), "ms": ms,
            "default_ms": default_ms}


def _write(path, entries: list[dict]):
    path.write_text(json.dumps({"device": "test", "tiles": entries}))
    return path


def test_a_gpu_name_becomes_its_table_file_stem():
    assert int8_tiles.device_slug("NVIDIA H200") == "nvidia-h200"
    assert int8_tiles.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_an_entry_applies_to_its_rows_and_its_exact_shape_only(tmp_path):
    table = int8_tiles.load_table(_write(tmp_path / "t.json", [_entry(33, 64)]))
    assert int8_tiles.lookup(table, 40, 4096, 4096) == table[0]
    assert int8_tiles.lookup(table, 32, 4096, 4096) is None
    assert int8_tiles.lookup(table, 65, 4096, 4096) is None
    assert int8_tiles.lookup(table, 40, 4096, 12288) is None
    assert int8_tiles.lookup(table, 40, 6144, 4096) is None


def test_the_launcher_takes_a_table_entry_before_its_rule(tmp_path):
    table = int8_tiles.load_table(_write(tmp_path / "t.json", [
        _entry(33, 64), _entry(1, 1, kernel="gemv", config=(32, 512, 2, 4, 2))]))
    assert int8_matmul.kernel_config(64, 4096, 4096, tuned=table) == TileConfig(64, 64, 128, 2, False, 8, 3)
    assert int8_matmul.kernel_config(1, 4096, 4096, tuned=table) == GemvConfig(32, 512, 2, 4, 2)
    assert int8_matmul.kernel_config(17, 4096, 4096, tuned=table) == choose_config(17, 4096, 4096)   # not in it
    assert int8_matmul.kernel_config(64, 4096, 4096, 4, 64, tuned=table) == choose_config(64, 4096, 4096, 4, 64)


def test_the_environment_names_a_table_or_switches_tables_off(tmp_path, monkeypatch):
    path = _write(tmp_path / "t.json", [_entry(1, 16)])
    monkeypatch.setenv(int8_tiles.TILES_ENV, str(path))
    assert int8_tiles.device_table("NVIDIA H200") == int8_tiles.load_table(path)
    monkeypatch.setenv(int8_tiles.TILES_ENV, "off")
    assert int8_tiles.device_table("NVIDIA H200") == ()
    monkeypatch.delenv(int8_tiles.TILES_ENV)
    assert int8_tiles.device_table("a GPU without a table") == ()


def test_a_table_is_read_once_so_every_launch_of_a_shape_takes_the_same_tiles(tmp_path, monkeypatch):
    """A file changed under a running process does not change its launches (a captured graph and an eager call of
    the same shape must agree)."""
    path = _write(tmp_path / "t.json", [_entry(1, 16)])
    monkeypatch.setenv(int8_tiles.TILES_ENV, str(path))
    assert int8_tiles.device_table("x")[0].rows_hi == 16
    _write(path, [_entry(1, 8)])
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert int8_tiles.device_table("x")[0].rows_hi == 16
    assert int8_tiles.load_table(path)[0].rows_hi == 8


@pytest.mark.parametrize("bad, words", [
    (_entry(1, 16, kernel="cublas"), "kernel must be"),
    (_entry(1, 16, config=(64, 64, 128)), "config fields"),
    (_entry(1, 16, config=(64, 0, 128, 1, False, 4, 3)), "positive integers"),
    (_entry(1, 16, config=(64, 64.5, 128, 1, False, 4, 3)), "positive integers"),
    (_entry(9, 4), "lo <= hi"),
    ({"rows": [1, 2], "n": 4096}, "k"),
])
def test_a_malformed_entry_is_refused_with_what_is_wrong(tmp_path, bad, words):
    with pytest.raises(ValueError, match=words):
        int8_tiles.load_table(_write(tmp_path / "t.json", [bad]))


def test_entries_whose_rows_overlap_for_one_shape_are_refused(tmp_path):
    with pytest.raises(ValueError, match="overlap"):
        int8_tiles.load_table(_write(tmp_path / "t.json", [_entry(1, 16), _entry(16, 32)]))
    assert len(int8_tiles.load_table(_write(tmp_path / "u.json", [_entry(1, 16), _entry(1, 16, n=6144)]))) == 2


def test_a_file_that_is_not_a_table_is_refused_with_its_path(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=str(path)):
        int8_tiles.load_table(path)
    with pytest.raises(ValueError, match="missing.json"):
        int8_tiles.load_table(tmp_path / "missing.json")


def test_merging_keeps_the_faster_entry_for_the_same_rows_and_replaces_overlapping_ones():
    old = (TunedTile(33, 64, 4096, 4096, "dot", (64, 64, 128, 2, False, 8, 3), ms=0.010),
           TunedTile(1, 1, 4096, 4096, "dot", (16, 64, 128, 4, False, 4, 3), ms=0.020))
    slower = TunedTile(33, 64, 4096, 4096, "dot", (64, 128, 64, 1, False, 4, 3), ms=0.011)
    assert int8_tiles.merge(old, [slower]) == sorted(old, key=lambda t: t.rows_lo)
    faster = TunedTile(33, 64, 4096, 4096, "dot", (64, 128, 64, 1, False, 4, 3), ms=0.009)
    assert faster in int8_tiles.merge(old, [faster]) and old[0] not in int8_tiles.merge(old, [faster])
    wider = TunedTile(1, 16, 4096, 4096, "dot", (16, 32, 256, 1, False, 4, 4), ms=0.030)
    merged = int8_tiles.merge(old, [wider])
    assert wider in merged and old[1] not in merged and old[0] in merged


def test_the_rows_of_a_bucket_are_the_rule_s_buckets():
    assert int8_matmul.row_bucket(1) == (1, 16)
    assert int8_matmul.row_bucket(17) == (17, 32)
    assert int8_matmul.row_bucket(64) == (33, 64)
    assert int8_matmul.row_bucket(129)[0] == 129


def test_the_sweep_keeps_a_winner_only_where_it_beats_the_untuned_tiles_by_the_margin():
    from bench.int8_kernel import tuned_entry
    cfg = TileConfig(64, 64, 128, 2, False, 8, 3)
    results = [(0.0100, "a", 1e-3, cfg), (0.0120, "b", 1e-3, TileConfig(64, 128, 64, 1, False, 4, 3))]
    tile = tuned_entry("dot", 64, 0, 4096, 4096, results, 0.0110, 0.03)
    assert tile == TunedTile(33, 64, 4096, 4096, "dot", (64, 64, 128, 2, False, 8, 3), 0.0100, 0.0110)
    assert tuned_entry("dot", 64, 0, 4096, 4096, results, 0.0102, 0.03) is None    # under 3 % saved
    assert tuned_entry("dot", 64, 0, 4096, 4096, [], 0.0110, 0.03) is None
    assert tuned_entry("dot", 64, 40, 4096, 4096, results, 0.0110, 0.03).rows_lo == 41   # 40 rows timed too
    gemv = tuned_entry("gemv", 4, 1, 4096, 4096, [(0.01, "g", 1e-3, GemvConfig(32, 512, 2, 4, 2))], 0.02, 0.03)
    assert (gemv.rows_lo, gemv.rows_hi, gemv.config) == (2, 4, (32, 512, 2, 4, 2))


def test_every_table_shipped_in_the_package_reads_back():
    for path in sorted(int8_tiles.TABLE_DIR.glob("*.json")):
        assert int8_tiles.load_table(path), path


INTERPRETED_TABLE = INTERPRETER_PATCH + """
import torch
from target_svc import int8_matmul as im
from target_svc.quantization import quantize_per_channel
torch.manual_seed(0)
q = quantize_per_channel(torch.randn(64, 256) * 0.05, torch.bfloat16)
x = torch.randn(20, 256).to(torch.bfloat16)
cfg = im.TileConfig(32, 32, 64, 2, False, 4, 2)
assert im.kernel_config(20, 64, 256, tuned=im.tuned_table(x.device)) == cfg, "the table names this tiling"
assert torch.equal(im.matmul(x, q.qweight, q.scales), im.matmul(x, q.qweight, q.scales, None, 8, cfg))
print("ok")
"""


@needs_triton
def test_the_launcher_runs_the_tiling_the_table_names_under_tritons_interpreter(tmp_path):
    path = _write(tmp_path / "t.json", [_entry(17, 32, n=64, k=256, config=(32, 32, 64, 2, False, 4, 2))])
    _run_interpreted(INTERPRETED_TABLE, {int8_tiles.TILES_ENV: str(path)})
