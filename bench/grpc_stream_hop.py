"""Is a message on a long-lived bidirectional stream cheaper than a unary call? Bare grpc.aio, two processes.

The services make three unary calls per engine step (Draft, Verify, PushFeatures); a long-lived stream per pair
is one of the ways to cut the hop (docs/ENGINE.md). This measures the transport alone, with none of the services'
code: a server process with two echo methods (unary, and stream-stream answering each message as it arrives),
and a client timing round trips of a `--payload`-byte message both ways, in alternating rounds (ratios within one
run). Both over TCP loopback and, with --unix, over a Unix domain socket, where the server process also echoes
length-prefixed frames on a bare asyncio Unix socket: what a hop costs without gRPC (the event loops' wake-ups on
both sides remain).

    python -m bench.grpc_stream_hop [--calls 2000] [--payload 2048] [--rounds 3] [--unix]

Writes <out-dir>/grpc-stream-hop-<hardware>.{md,json}.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench import common

SERVICE = "hop.Hop"
UNARY, STREAM = f"/{SERVICE}/Unary", f"/{SERVICE}/Stream"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.grpc_stream_hop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help="timed round trips per kind and round")
    p.add_argument("--warmup", type=int, default=200, help="untimed round trips before each kind")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--payload", type=int, default=2048, help="bytes each way (a Draft answer at budget 64: ~2 KB)")
    p.add_argument("--unix", action="store_true", help="also over a Unix domain socket")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    p.add_argument("--serve", metavar="ADDRESS", help=argparse.SUPPRESS)   # the server process
    return p.parse_args(argv)


def raw_path(address: str) -> str | None:
    """The bare socket's path beside a unix: gRPC address (None over TCP)."""
    return address[len("unix:"):] + ".raw" if address.startswith("unix:") else None


async def echo_frames(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers every length-prefixed frame with itself until the client leaves."""
    try:
        while True:
            header = await reader.readexactly(4)
            writer.write(header + await reader.readexactly(struct.unpack(">I", header)[0]))
    except asyncio.IncompleteReadError:
        writer.close()


async def serve(address: str) -> None:
    """Echo server: Unary answers its request; Stream answers every message it reads; over a Unix socket, the bare
    socket beside it echoes frames."""

    async def unary(request: bytes, context) -> bytes:
        return request

    async def stream(requests, context):
        async for request in requests:
            yield request

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.stream_stream_rpc_method_handler(stream)})])
    port = server.add_insecure_port(address)
    await server.start()
    if raw_path(address):
        await asyncio.start_unix_server(echo_frames, raw_path(address))
    print(f"ready {port}", flush=True)
    await server.wait_for_termination()


async def time_raw(path: str, payload: bytes, calls: int, warmup: int) -> list[float]:
    """Round-trip times in µs of `calls` frames on the bare socket (after `warmup` untimed ones)."""
    reader, writer = await asyncio.open_unix_connection(path)
    frame, out = struct.pack(">I", len(payload)) + payload, []
    for i in range(warmup + calls):
        t0 = time.perf_counter_ns()
        writer.write(frame)
        await reader.readexactly(len(frame))
        if i >= warmup:
            out.append((time.perf_counter_ns() - t0) / 1e3)
    writer.close()
    return out


async def time_kind(channel: grpc.aio.Channel, kind: str, payload: bytes, calls: int, warmup: int) -> list[float]:
    """Round-trip times in µs of `calls` messages (after `warmup` untimed ones)."""
    out = []
    if kind == "unary":
        call = channel.unary_unary(UNARY)
        for i in range(warmup + calls):
            t0 = time.perf_counter_ns()
            await call(payload)
            if i >= warmup:
                out.append((time.perf_counter_ns() - t0) / 1e3)
        return out
    stream = channel.stream_stream(STREAM)()
    for i in range(warmup + calls):
        t0 = time.perf_counter_ns()
        await stream.write(payload)
        await stream.read()
        if i >= warmup:
            out.append((time.perf_counter_ns() - t0) / 1e3)
    await stream.done_writing()
    return out


async def measure(address: str, args) -> dict[str, list[float]]:
    """Per kind, the round trips of every round (kinds alternate within a round)."""
    payload = bytes(args.payload)
    kinds = ["unary", "stream", *(["raw"] if raw_path(address) else [])]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    async with grpc.aio.insecure_channel(address) as channel:
        for r in range(args.rounds):
            for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:   # the order turns every round
                if kind == "raw":
                    times[kind] += await time_raw(raw_path(address), payload, args.calls, args.warmup)
                else:
                    times[kind] += await time_kind(channel, kind, payload, args.calls, args.warmup)
    return times


def start_server(address: str) -> tuple[subprocess.Popen, int]:
    """The echo server in its own process, and the port it bound (address 127.0.0.1:0 picks a free one)."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.grpc_stream_hop", "--serve", address],
                            stdout=subprocess.PIPE, text=True, cwd=common.REPO)
    words = proc.stdout.readline().split()
    if not words or words[0] != "ready":
        proc.kill()
        raise RuntimeError("the echo server did not start")
    return proc, int(words[1])


def summary(values: list[float]) -> dict[str, float]:
    """Median and p90 in µs."""
    q = statistics.quantiles(values, n=10)
    return {"median_us": round(statistics.median(values), 1), "p90_us": round(q[-1], 1)}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.serve:
        asyncio.run(serve(args.serve))
        return
    transports = [("tcp", "127.0.0.1:0")]
    tmp = tempfile.TemporaryDirectory(prefix="grpc-hop-")
    if args.unix:
        transports.append(("unix", f"unix:{Path(tmp.name) / 'hop.sock'}"))
    rows, results = [], {}
    for name, address in transports:
        proc, port = start_server(address)
        if name == "tcp":
            address = f"127.0.0.1:{port}"
        try:
            times = asyncio.run(measure(address, args))
        finally:
            proc.kill()
            proc.wait()
        unary, stream = summary(times["unary"]), summary(times["stream"])
        ratio = round(stream["median_us"] / unary["median_us"], 3)
        results[name] = {"unary": unary, "stream": stream, "stream_over_unary": ratio}
        raw_cell = "–"
        if "raw" in times:
            raw = results[name]["raw_socket"] = summary(times["raw"])
            results[name]["raw_over_stream"] = round(raw["median_us"] / stream["median_us"], 3)
            raw_cell = f"{raw['median_us']} / {raw['p90_us']} ({results[name]['raw_over_stream']} x stream)"
        rows.append([name, f"{unary['median_us']} / {unary['p90_us']}", f"{stream['median_us']} / {stream['p90_us']}",
                     ratio, raw_cell])
    tmp.cleanup()
    hw = common.hardware("cpu", "-", None)
    data = {"bench": "grpc_stream_hop", "command": common.command_line("bench.grpc_stream_hop"),
            "date": common.now_utc(), "hardware": hw, "grpcio": grpc.__version__, "payload_bytes": args.payload,
            "calls": args.calls, "rounds": args.rounds, "results": results}
    lines = ["# A unary call against a message on a long-lived stream (bare grpc.aio, two processes)", "",
             f"- Command: `{data['command']}`", f"- Date: {data['date']}",
             f"- Hardware: {hw['cpu_model']} ({hw['usable_cpus']} usable CPUs); grpcio {grpc.__version__}, "
             f"Python {hw['python']}",
             f"- Work: {args.payload} bytes each way; per round and kind {args.warmup} untimed then {args.calls} "
             f"timed round trips, {args.rounds} rounds, kinds alternating", "- Cells: median / p90 round trip (µs)", "",
             common.md_table(["transport", "unary call", "stream message", "stream / unary",
                             "bare asyncio socket (unix only)"], rows)]
    print("\n".join(lines))
    common.write_outputs(args.out_dir, f"grpc-stream-hop-{common.hardware_tag(hw)}", data, "\n".join(lines))


if __name__ == "__main__":
    main()
