"""bench.socket_wakeup: round trips to a real echo server process, the answer awaited in the loop and polled."""
from __future__ import annotations

import json

from bench import socket_wakeup


def test_the_bench_times_both_ways_of_waiting_against_a_server_that_works_before_it_answers(tmp_path):
    socket_wakeup.main(["--calls", "20", "--warmup", "5", "--rounds", "2", "--hold-ms", "2", "--payload", "64",
                        "--out-dir", str(tmp_path)])
    (found,) = tmp_path.glob("socket-wakeup-*.json")
    data = json.loads(found.read_text())
    assert set(data["ways"]) == {"event loop", "spin"}
    for row in data["ways"].values():
        assert row["n"] == 40 and 0 < row["median_us"] <= row["p90_us"]
    assert data["spin_over_event_loop"] == data["ways"]["spin"]["median_us"] / data["ways"]["event loop"]["median_us"]
    assert (tmp_path / found.name.replace(".json", ".md")).read_text().count("| spin |") == 1
