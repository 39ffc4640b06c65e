"""What waking up costs on this host: an answer's trip over a Unix socket to a receiver asleep in epoll vs spinning.

Every engine step crosses between the three processes several times, and each crossing ends with a process that
was waiting on a socket: asleep in the kernel (the event loop's epoll), woken by the sender. On bare metal that
wake-up costs a few microseconds; on a virtual machine with idle vCPUs it can cost far more (the sleeping vCPU
halts, and the hypervisor must wake it). This measures it alone, with none of the services' code: an echo server
process that works (spins) --hold-ms on each request (the peer's forward) and answers, and a
client that sends a --payload-byte frame and waits for the answer either in its event loop (`loop.sock_recv`, the
services' way) or spinning on a non-blocking recv (a busy-poll, SGLang's scheduler's way). Reported: the time
beyond the hold per round trip, median and p90, rounds alternating between the two ways (ratios within one run).

    python -m bench.socket_wakeup [--calls 400] [--hold-ms 1] [--payload 2048] [--rounds 3]

Writes <out-dir>/socket-wakeup-<hardware>.{md,json}.
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common

_LEN = struct.Struct(">I")
WAYS = ("event loop", "spin")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.socket_wakeup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=400, help="timed round trips per way and round")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hold-ms", type=float, default=1.0, help="the server's work (busy) before each answer")
    p.add_argument("--payload", type=int, default=2048, help="bytes each way")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    p.add_argument("--serve", metavar="PATH", help=argparse.SUPPRESS)   # the server process
    return p.parse_args(argv)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def serve(path: str, hold_s: float) -> None:
    """Echo server: each frame back after hold_s of busy work, waiting for the next one asleep in the kernel."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    conn, _ = listener.accept()
    try:
        while True:
            header = _recv_exactly(conn, _LEN.size)
            payload = _recv_exactly(conn, _LEN.unpack(header)[0])
            end = time.perf_counter() + hold_s   # busy: a sleep's own timer slack is not the wake-up measured
            while time.perf_counter() < end:
                pass
            conn.sendall(header + payload)
    except ConnectionError:
        pass


def spin_recv_exactly(sock: socket.socket, n: int) -> bytes:
    """n bytes from a non-blocking socket, polling without ever sleeping."""
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except BlockingIOError:
            continue
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


async def loop_recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    """n bytes through the event loop (asleep in epoll until they come)."""
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


async def round_trips(sock: socket.socket, way: str, calls: int, frame: bytes, hold_s: float) -> list[float]:
    """Seconds beyond the hold of each of `calls` round trips, waiting `way`."""
    loop = asyncio.get_running_loop()
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        await loop.sock_sendall(sock, frame)
        if way == "spin":
            header = spin_recv_exactly(sock, _LEN.size)
            spin_recv_exactly(sock, _LEN.unpack(header)[0])
        else:
            header = await loop_recv_exactly(loop, sock, _LEN.size)
            await loop_recv_exactly(loop, sock, _LEN.unpack(header)[0])
        out.append(time.perf_counter() - t0 - hold_s)
    return out


async def client(path: str, args: argparse.Namespace) -> dict[str, list[float]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    for _ in range(200):
        try:
            sock.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.05)
    sock.setblocking(False)
    frame = _LEN.pack(args.payload) + b"x" * args.payload
    hold_s = args.hold_ms / 1e3
    samples: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in range(args.rounds):
        for way in WAYS if r % 2 == 0 else WAYS[::-1]:
            await round_trips(sock, way, args.warmup, frame, hold_s)
            samples[way] += await round_trips(sock, way, args.calls, frame, hold_s)
    sock.close()
    return samples


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.serve:
        serve(args.serve, args.hold_ms / 1e3)
        return
    from ddtree_serve.plumbing.event_loop import default_event_loop, loop_factory, run as run_loop

    path = str(Path(tempfile.mkdtemp(prefix="wakeup-")) / "echo.sock")
    server = subprocess.Popen([sys.executable, "-m", "bench.socket_wakeup", "--serve", path,
                               "--hold-ms", str(args.hold_ms)])
    try:
        samples = run_loop(client(path, args))
    finally:
        server.kill()
        server.wait()
    hw = common.hardware("cpu", "float32", None)
    loop_name = loop_factory(default_event_loop())[0]
    rows = {}
    for way, xs in samples.items():
        xs = sorted(xs)
        rows[way] = {"median_us": round(statistics.median(xs) * 1e6, 1),
                     "p90_us": round(xs[int(0.9 * (len(xs) - 1))] * 1e6, 1), "n": len(xs)}
    ratio = rows["spin"]["median_us"] / rows["event loop"]["median_us"]
    lines = ["# Waking up on an answer: a receiver asleep in its event loop against one spinning", "",
             f"- Command: `{common.command_line('bench.socket_wakeup')}`", f"- Date: {common.now_utc()}",
             f"- Hardware: {hw['cpu_model']} ({hw['usable_cpus']} usable CPUs), Python {hw['python']}, event loop {loop_name}", f"- Work: {args.payload} bytes each way, the server holding each request "
             f"{args.hold_ms} ms (busy); {args.rounds} rounds x {args.calls} timed round trips per way, alternating",
             "- Cells: round trip minus the hold (µs): the two trips, the two wake-ups, the copies", "",
             "| client waits | median | p90 |", "|---|---|---|"]
    lines += [f"| {way} | {r['median_us']} | {r['p90_us']} |" for way, r in rows.items()]
    lines += ["", f"spin / event loop (median): {ratio:.3f}"]
    text = "\n".join(lines) + "\n"
    print(text)
    common.write_outputs(args.out_dir, f"socket-wakeup-{common.hardware_tag(hw)}",
                         {"command": common.command_line("bench.socket_wakeup"), "date": common.now_utc(),
                          "hardware": hw, "event_loop": loop_name, "args": vars(args), "ways": rows,
                          "spin_over_event_loop": ratio}, text)


if __name__ == "__main__":
    main()
