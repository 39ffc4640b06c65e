"""bench.grpc_stream_hop: both kinds of round trip run against a real echo server process and are reported."""
from __future__ import annotations

import json

from bench import grpc_stream_hop


def test_the_bench_times_unary_calls_and_stream_messages_over_tcp_and_a_unix_socket(tmp_path):
    grpc_stream_hop.main(["--calls", "20", "--warmup", "5", "--rounds", "2", "--payload", "64", "--unix",
                          "--out-dir", str(tmp_path)])
    (found,) = tmp_path.glob("grpc-stream-hop-*.json")
    results = json.loads(found.read_text())["results"]
    assert set(results) == {"tcp", "unix"}
    for row in results.values():
        assert row["unary"]["median_us"] > 0 and row["stream"]["median_us"] > 0
        assert row["stream_over_unary"] == round(row["stream"]["median_us"] / row["unary"]["median_us"], 3)
    assert results["unix"]["raw_socket"]["median_us"] > 0 and "raw_socket" not in results["tcp"]
