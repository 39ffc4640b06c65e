"""A service started with --exit-with-parent stops once its launcher is gone, even when the launcher is killed."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]

# The "service": stops on SIGTERM as the real ones do (writing how it stopped), watching its parent every 50 ms.
SERVICE = """
import signal, sys, time
from ddtree_serve.plumbing.parent_watch import watch_parent
def stop(signum, frame):
    open(sys.argv[1], "w").write("sigterm")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
watch_parent(0.05)
print("watching", flush=True)
time.sleep(60)
"""
# The "launcher": starts the service, says its pid, and waits to be killed.
LAUNCHER = """
import subprocess, sys, time
p = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
p.stdout.readline()
print(p.pid, flush=True)
time.sleep(60)
"""


def _gone(pid: int) -> bool:
    """True once pid has exited (a zombie awaiting its new parent's reap counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_service_whose_launcher_is_killed_outright_stops_through_its_sigterm_path(tmp_path):
    marker = tmp_path / "stopped"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, SERVICE, str(marker)], stdout=subprocess.PIPE,
                                text=True, env=env)
    try:
        service = int(launcher.stdout.readline())
        assert not _gone(service)
        launcher.kill()   # SIGKILL: no cleanup of its own runs
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while not _gone(service) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(service), "the service outlived its launcher"
        assert marker.read_text() == "sigterm"   # it went through its own shutdown, not a kill
    finally:
        launcher.kill()


def test_a_process_without_a_parent_to_watch_starts_no_watch(monkeypatch):
    from ddtree_serve.plumbing import parent_watch

    monkeypatch.setattr(os, "getppid", lambda: 1)
    assert parent_watch.watch_parent(0.05) is None


@pytest.mark.parametrize("service", ["target", "drafter", "gateway"])
def test_every_service_takes_the_flag_and_the_local_stack_sets_it(service, tmp_path):
    from launch.local_stack import LocalStack

    stack = LocalStack(model=str(tmp_path), drafter=str(tmp_path), log_dir=str(tmp_path))
    cmd = stack.commands()[service]
    assert "--exit-with-parent" in cmd
    assert build_parser().parse_args(cmd[cmd.index(service):]).exit_with_parent
    assert not build_parser().parse_args(_required(service)).exit_with_parent   # off unless asked for


def _required(service: str) -> list[str]:
    """The least each service's parser takes."""
    return {"target": ["target", "--model", "m"], "drafter": ["drafter", "--drafter", "d", "--target-model", "m"],
            "gateway": ["gateway", "--target", "t:1", "--drafter", "d:1"]}[service]

