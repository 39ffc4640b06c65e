"""CPU lists, pinning a process, and the disjoint CPU sets of a local stack."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ddtree_serve.plumbing.cpu_affinity import format_cpu_list, parse_cpu_list, split_cpus


def test_cpu_lists_read_and_write_the_kernels_syntax():
    assert parse_cpu_list("0-2,5") == (0, 1, 2, 5)
    assert parse_cpu_list("3, 1") == (1, 3)
    assert format_cpu_list((5, 0, 1, 2, 7, 8)) == "0-2,5,7-8"


@pytest.mark.parametrize("bad", ["", "a", "2-", "3-1", "1,,2", "-1"])
def test_a_malformed_cpu_list_is_refused(bad):
    with pytest.raises(ValueError):
        parse_cpu_list(bad)


def test_services_get_disjoint_cpus_in_order_or_none_when_too_few():
    got = split_cpus(tuple(range(8)), {"gateway": 2, "target": 3, "drafter": 3})
    assert got == {"gateway": (0, 1), "target": (2, 3, 4), "drafter": (5, 6, 7)}
    assert split_cpus((0, 1), {"gateway": 2, "target": 1}) is None


PINNED = """
import os, threading
from ddtree_serve.plumbing.cpu_affinity import pin_process
started = threading.Event(); done = threading.Event(); seen = {}
def worker():
    started.set(); done.wait(); seen['early'] = os.sched_getaffinity(0)
t = threading.Thread(target=worker); t.start(); started.wait()
pin_process((CPU,))
late = threading.Thread(target=lambda: seen.__setitem__('late', os.sched_getaffinity(0))); late.start(); late.join()
done.set(); t.join()
print(sorted(seen['early']), sorted(seen['late']), sorted(os.sched_getaffinity(0)))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_pinning_moves_running_threads_and_the_ones_started_later():
    cpu = max(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", PINNED.replace("CPU", str(cpu))], capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout
    assert out.split() and out.strip() == f"[{cpu}] [{cpu}] [{cpu}]"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_pinning_to_a_cpu_the_process_may_not_use_is_refused():
    from ddtree_serve.plumbing.cpu_affinity import pin_process

    with pytest.raises(ValueError, match="not available"):
        pin_process((max(os.sched_getaffinity(0)) + 1000,))


def test_a_pinned_local_stack_gives_each_service_its_own_cpus(monkeypatch, tmp_path):
    from launch.local_stack import PIN_SHARES, LocalStack

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    stack = LocalStack(model=str(tmp_path), drafter=str(tmp_path), pin_cpus=True, log_dir=str(tmp_path))
    cmds = stack.commands()
    given = {name: parse_cpu_list(cmd[cmd.index("--cpus") + 1]) for name, cmd in cmds.items()}
    assert {name: len(c) for name, c in given.items()} == PIN_SHARES
    assert sorted(c for cpus in given.values() for c in cpus) == list(range(16 - sum(PIN_SHARES.values()), 16))


def test_pinning_a_local_stack_on_too_few_cpus_is_refused(monkeypatch, tmp_path):
    from launch.local_stack import LocalStack

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(ValueError, match="takes 8 CPUs"):
        LocalStack(model=str(tmp_path), drafter=str(tmp_path), pin_cpus=True, log_dir=str(tmp_path))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_a_service_asked_for_cpus_it_may_not_use_exits_with_one_line(tmp_path):
    bad = max(os.sched_getaffinity(0)) + 1000
    res = subprocess.run([sys.executable, "-m", "launch.cli", "target", "--model", str(tmp_path), "--cpus", str(bad)],
                         capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 2
    assert f"--cpus: CPUs {bad} are not available" in res.stderr and "Traceback" not in res.stderr
