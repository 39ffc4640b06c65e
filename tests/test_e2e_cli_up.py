"""`ddtree-serve up`: the three services as local processes, a prompt answered, everything stopped."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_up_answers_a_prompt_prints_json_and_stops_all(checkpoints):
    target, drafter = checkpoints("llama")
    out = subprocess.run([sys.executable, "-m", "launch.cli", "up", "--model", str(target), "--drafter",
                          str(drafter), "--prompt", "hello there", "--max-tokens", "12", "--json",
                          "--max-seq-len", "256", "--target-args=--prefill-chunk 32"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith("gateway 127.0.0.1:") for line in lines)   # ports printed
    result = json.loads(lines[-1])
    assert 1 <= len(result["token_ids"]) <= 12
    assert result["stats"]["mode"] == "ddtree" and result["stats"]["steps"] >= 1
    assert result["stats"]["budget"] == 16            # no --budget on CPU: the CPU default
    assert result["ar_baseline"]["mode"] == "ar"      # the baseline the speed ratio is printed against
    log_dir = next(line.split(None, 1)[1] for line in lines if line.startswith("logs "))
    assert not Path(log_dir).exists()                 # the temporary log folder went with the services
    # no service outlives the command
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(target) not in ps


def _start_up(checkpoints, env: dict) -> tuple[subprocess.Popen, list[str]]:
    """`up` on the tiny llama pair, read until it prints the generate command (it is ready) -> (process, lines)."""
    target, drafter = checkpoints("llama")
    up = subprocess.Popen([sys.executable, "-m", "launch.cli", "up", "--model", str(target), "--drafter",
                           str(drafter)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    printed = []
    for line in up.stdout:
        printed.append(line)
        if line.strip().startswith("ddtree-serve generate"):
            break
    return up, printed


def test_up_prints_a_generate_command_that_works_as_copied_and_cleans_up_on_ctrl_c(checkpoints, tmp_path):
    env = dict(os.environ, DDTREE_SERVE_CACHE=str(tmp_path), PYTHONUNBUFFERED="1")
    up, printed = _start_up(checkpoints, env)
    try:
        command = shlex.split(printed[-1])
        assert command[:3] == ["ddtree-serve", "generate", "--gateway"], "".join(printed)
        assert (tmp_path / "up.json").exists()        # so that a plain `generate` finds this `up`
        out = subprocess.run([sys.executable, "-m", "launch.cli", *command[1:], "--max-tokens", "8"],
                             capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        assert "tau (mean acceptance length)" in out.stdout
    finally:
        up.send_signal(signal.SIGINT)
        rest = up.communicate(timeout=60)[0]
    assert up.returncode == 0, rest
    log_dir = next(line.split(None, 1)[1].strip() for line in printed if line.startswith("logs "))
    assert not Path(log_dir).exists() and not (tmp_path / "up.json").exists()


def test_up_stops_every_service_and_cleans_up_on_sigterm(checkpoints, tmp_path):
    """`kill`, `timeout` and `docker stop` send SIGTERM: `up` then stops as on Ctrl-C, no service left behind."""
    env = dict(os.environ, DDTREE_SERVE_CACHE=str(tmp_path), PYTHONUNBUFFERED="1")
    up, printed = _start_up(checkpoints, env)
    try:
        services = [int(p) for p in subprocess.run(["ps", "-o", "pid=", "--ppid", str(up.pid)], capture_output=True,
                                                   text=True).stdout.split()]
        assert len(services) == 3, "".join(printed)
    finally:
        up.send_signal(signal.SIGTERM)
        rest = up.communicate(timeout=60)[0]
    assert up.returncode == 0, rest
    alive = [pid for pid in services if Path(f"/proc/{pid}").exists()
             and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert not alive, f"services {alive} outlived `up`"
    log_dir = next(line.split(None, 1)[1].strip() for line in printed if line.startswith("logs "))
    assert not Path(log_dir).exists() and not (tmp_path / "up.json").exists()
