"""`ddtree-serve up`: the three services as local processes, a prompt answered, everything stopped."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_up_answers_a_prompt_prints_json_and_stops_all(checkpoints):
    target, drafter = checkpoints("llama")
    out = subprocess.run([sys.executable, "-m", "ddtree_serve.cli", "up", "--model", str(target), "--drafter",
                          str(drafter), "--prompt", "hello there", "--max-tokens", "12", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith("gateway 127.0.0.1:") for line in lines)   # ports printed
    result = json.loads(lines[-1])
    assert 1 <= len(result["token_ids"]) <= 12
    assert result["stats"]["mode"] == "ddtree" and result["stats"]["steps"] >= 1
    # no service outlives the command
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(target) not in ps
