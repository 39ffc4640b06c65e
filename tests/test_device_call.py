"""bench/device_call.sh, the wrapper of one call on a lent GPU machine: which sections it runs on which card."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _call(tmp_path: Path, card: str, sections: list[str], **env: str) -> subprocess.CompletedProcess:
    """Runs the wrapper in a scratch tree whose bench/h200.sh records its arguments and QUANTS, on a machine whose
    nvidia-smi names `card`."""
    tree, bin_dir, out = tmp_path / "tree", tmp_path / "bin", tmp_path / "out"
    (tree / "bench").mkdir(parents=True)
    bin_dir.mkdir()
    shutil.copy(ROOT / "bench" / "device_call.sh", tree / "bench")
    (tree / "bench" / "h200.sh").write_text('mkdir -p "$1/r"; shift; echo "ran: $* QUANTS=${QUANTS:-}" > '
                                            f'"{tmp_path}/ran.txt"\n')
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho '{card}'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    full_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), **env}
    return subprocess.run(["bash", "bench/device_call.sh", *sections], cwd=tree, env=full_env, capture_output=True,
                          text=True, timeout=60)


def test_the_card_asked_for_runs_the_sections_given(tmp_path):
    done = _call(tmp_path, "NVIDIA H200", ["int8tune", "int8"], NEED_GPU="H200", QUANTS="none int8",
                 ELSE_SECTIONS="pdltests", ELSE_QUANTS="int8pdlk")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ran.txt").read_text().strip() == "ran: int8tune int8 QUANTS=none int8"
    assert (tmp_path / "out" / "x" / "h200-results.tgz").is_file()


def test_another_card_exits_3_before_running_anything(tmp_path):
    done = _call(tmp_path, "NVIDIA H100 80GB HBM3", ["int8"], NEED_GPU="H200")
    assert done.returncode == 3 and "NOT H200" in done.stdout
    assert not (tmp_path / "ran.txt").exists()


def test_another_card_runs_the_fallback_sections_and_quants_where_given(tmp_path):
    done = _call(tmp_path, "NVIDIA H100 80GB HBM3", ["int8tune", "int8"], NEED_GPU="H200", QUANTS="none int8",
                 ELSE_SECTIONS="pdltests int8", ELSE_QUANTS="none int8pdlk")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ran.txt").read_text().strip() == "ran: pdltests int8 QUANTS=none int8pdlk"
