"""The three services as local processes: used by `ddtree-serve up`, the end-to-end tests and the benchmarks."""
from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # grpc is imported where a channel is made, so importing this module stays light
    import grpc


# sun_path holds 108 bytes on Linux (104 on macOS); a longer socket path cannot be bound.
MAX_SOCKET_PATH = 100
LINKED = ("target", "drafter")   # the services the others call: they get a Unix socket each
# CPUs per service with pin_cpus: the gateway's event loop and HTTP front; each model service's event loop, model
# thread and gRPC threads (ddtree_serve/plumbing/cpu_affinity.py says why pinning pays).
PIN_SHARES = {"gateway": 2, "target": 3, "drafter": 3}


def free_port() -> int:
    """A TCP port that is free right now on loopback."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports free right now on loopback (held open together while chosen: one at a time, the
    system may hand the same port out twice)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class LocalStack:
    """Target, drafter and gateway, each its own `ddtree-serve` process on 127.0.0.1 with free ports.

    With `unix_sockets` (the default) target and drafter also listen on Unix domain sockets in a private
    directory, and the services call each other there (gateway -> target, drafter; target -> drafter): on one
    host that skips the TCP/IP stack on every hop (bench/rpc_hop.py). `address()` stays TCP for outside clients.
    """

    model: str
    drafter: str
    mode: str = "ddtree"
    budget: int = 64
    transport: str = "inline"
    device: str = "cpu"
    drafter_device: str = ""            # the drafter's device when not `device` (nccl: another GPU, e.g. cuda:1)
    dtype: str = "float32"
    metrics: bool = False
    threads: int | None = None          # torch threads per model service (1 keeps a 2-core machine responsive)
    extra: dict[str, list[str]] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    log_dir: str = ""
    http: bool = False                  # the gateway's OpenAI-compatible HTTP front (ports["http"])
    unix_sockets: bool = True           # links between the services over Unix sockets (falls back to TCP if none)
    socket_dir: str = ""                # where the sockets live (default: a fresh private temporary directory)
    step_sockets: bool = False          # the per-step calls on step sockets there too (--step-transport socket)
    api_key: str | None = None          # handed to the gateway in its environment, not its argv (ps shows argv)
    pin_cpus: bool = False              # each service on CPUs of its own (--cpus; PIN_SHARES of the last CPUs)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    # Internal shared secret of the three (the caller's $DDTREE_INTERNAL_SECRET, else a fresh random one).
    secret: str = field(default_factory=lambda: os.environ.get("DDTREE_INTERNAL_SECRET") or secrets.token_hex(16))

    def __post_init__(self) -> None:
        names = ("target", "drafter", "gateway")
        if "http" in self.ports:
            self.http = True
        wanted = [n for n in (*names, *(["http"] if self.http else [])) if not self.ports.get(n)]
        chosen = iter(free_ports(len(wanted) + (len(names) if self.metrics else 0)))
        for name in wanted:
            self.ports[name] = next(chosen)
        self.metrics_ports = {name: next(chosen) for name in names} if self.metrics else {}
        self.own_log_dir = not self.log_dir
        self.cpus = self._pinned_cpus() if self.pin_cpus else {}
        self.own_socket_dir = self.unix_sockets and not self.socket_dir
        if self.own_socket_dir:
            self.socket_dir = tempfile.mkdtemp(prefix="ddtree-sock-")   # mode 0700: only this user may connect
        if self.unix_sockets and len(self.socket_path("drafter")) > MAX_SOCKET_PATH:
            # A deep temporary directory: the links stay on TCP, which works everywhere.
            if self.own_socket_dir:
                shutil.rmtree(self.socket_dir, ignore_errors=True)
            self.unix_sockets = self.own_socket_dir = False
        self.log_dir = self.log_dir or tempfile.mkdtemp(prefix="ddtree-serve-")
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)

    @property
    def http_url(self) -> str:
        """Base URL of the OpenAI-compatible API (with http=True)."""
        return f"http://127.0.0.1:{self.ports['http']}/v1"

    def cleanup(self) -> None:
        """Removes the log folder when this stack made it (a temporary one)."""
        if self.own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    @property
    def gateway(self) -> str:
        return f"127.0.0.1:{self.ports['gateway']}"

    def address(self, name: str) -> str:
        """The TCP address of a service (what outside clients use)."""
        return f"127.0.0.1:{self.ports[name]}"

    def socket_path(self, name: str) -> str:
        """Where a linked service's Unix socket is (meaningful with unix_sockets)."""
        return str(Path(self.socket_dir) / f"{name}.sock")

    def link_address(self, name: str) -> str:
        """The address the other services use to call `name`: its Unix socket when there is one, else TCP."""
        if self.unix_sockets and name in LINKED:
            from ddtree_serve.plumbing.rpc import unix_address

            return unix_address(self.socket_path(name))
        return self.address(name)

    @staticmethod
    def _pinned_cpus() -> dict[str, tuple[int, ...]]:
        """Disjoint CPU sets for the three services from the last CPUs this process may use; ValueError if too few."""
        from ddtree_serve.plumbing.cpu_affinity import split_cpus

        available = tuple(sorted(os.sched_getaffinity(0)))
        need = sum(PIN_SHARES.values())
        got = split_cpus(available[-need:], PIN_SHARES)
        if got is None:
            raise ValueError(f"pinning the services takes {need} CPUs ({PIN_SHARES}); this process may use "
                             f"{len(available)}")
        return got

    def commands(self) -> dict[str, list[str]]:
        """The three command lines."""
        py = [sys.executable, "-m", "launch.cli"]
        threads = ["--threads", str(self.threads)] if self.threads else []
        # Each service stops once this process is gone, even killed outright (ddtree_serve/plumbing/parent_watch.py).
        watch = ["--exit-with-parent"]

        def cpus(name):
            if name not in self.cpus:
                return []
            from ddtree_serve.plumbing.cpu_affinity import format_cpu_list

            return ["--cpus", format_cpu_list(self.cpus[name])]

        def m(name):
            return ["--metrics-port", str(self.metrics_ports[name])] if name in self.metrics_ports else []

        def sock(name):
            if not (self.unix_sockets and name in LINKED):
                return []
            step = ["--step-socket", self.socket_path(f"{name}-steps")] if self.step_sockets else []
            return ["--unix-socket", self.socket_path(name), *step]

        # The target sends features to the drafter's link address; its TCP address stays allowed for tools.
        allowed = dict.fromkeys([self.link_address("drafter"), self.address("drafter")])

        return {
            "target": [*py, "target", "--model", self.model, "--host", "127.0.0.1", "--port", str(self.ports["target"]),
                       *sock("target"), *(a for d in allowed for a in ("--allow-drafter", d)),
                       "--device", self.device, "--dtype", self.dtype, *threads, *cpus("target"), *m("target"), *watch,
                       *self.extra.get("target", [])],
            "drafter": [*py, "drafter", "--drafter", self.drafter, "--target-model", self.model, "--host", "127.0.0.1",
                        "--port", str(self.ports["drafter"]), *sock("drafter"),
                        "--device", self.drafter_device or self.device,
                        "--dtype", self.dtype,
                        *threads, *cpus("drafter"), *m("drafter"), *watch, *self.extra.get("drafter", [])],
            "gateway": [*py, "gateway", "--target", self.link_address("target"),
                        "--drafter", self.link_address("drafter"),
                        "--host", "127.0.0.1", "--port", str(self.ports["gateway"]), "--mode", self.mode,
                        "--budget", str(self.budget), "--transport", self.transport, *cpus("gateway"), *m("gateway"),
                        *watch,
                        *(["--step-transport", "socket"] if self.step_sockets and self.unix_sockets else []),
                        *(["--http-port", str(self.ports["http"])] if self.http else []),
                        *self.extra.get("gateway", [])],
        }

    def env(self) -> dict[str, str]:
        """The services' environment: the stack's secret, and NVLink multicast off before NCCL initialises."""
        return dict(os.environ, PYTHONUNBUFFERED="1", DDTREE_INTERNAL_SECRET=self.secret, NCCL_NVLS_ENABLE="0")

    def start(self, timeout_s: float = 960.0) -> "LocalStack":
        """Starts the processes and waits until the gateway is SERVING (raises if a process dies first); longer than
        the gateway's own wait for its backends (--backend-wait-s), so that its error is the one reported."""
        env = self.env()
        if self.api_key:
            env["DDTREE_API_KEY"] = self.api_key
        for name, cmd in self.commands().items():
            self.spawn(name, cmd, env)
        try:
            asyncio.run(self._wait_ready(timeout_s))
        except BaseException:
            self.stop()
            raise
        return self

    def spawn(self, name: str, cmd: list[str] | None = None, env: dict | None = None) -> subprocess.Popen:
        """Starts (or restarts, after `kill`) one service; its log is appended to."""
        cmd = cmd or self.commands()[name]
        env = env or self.env()
        if self.unix_sockets:   # stop() removes the directory it made; a restarted stack makes it again
            Path(self.socket_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        logf = open(Path(self.log_dir) / f"{name}.log", "a")  # noqa: SIM115 - lives with the process
        self.procs[name] = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        return self.procs[name]

    async def _wait_ready(self, timeout_s: float) -> None:
        from ddtree_serve.plumbing.rpc import wait_until_serving

        task = asyncio.create_task(wait_until_serving(self.gateway, timeout_s=timeout_s))
        while not task.done():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                task.cancel()
                raise RuntimeError(f"{', '.join(dead)} exited during start-up:\n{self.tail_logs()}")
            await asyncio.sleep(0.2)
        await task

    def tail_logs(self, lines: int = 30) -> str:
        """Last lines of each service's log (for failure messages)."""
        out = []
        for name in self.procs:
            path = Path(self.log_dir) / f"{name}.log"
            if path.exists():
                out.append(f"--- {name} ---\n" + "\n".join(path.read_text().splitlines()[-lines:]))
        return "\n".join(out)

    def internal_channel(self, name: str) -> "grpc.aio.Channel":
        """An aio channel to the target or drafter that carries the stack's secret (tests, tools)."""
        import grpc

        from ddtree_serve.plumbing.auth import metadata_interceptors, secret_metadata

        return grpc.aio.insecure_channel(self.address(name),
                                         interceptors=metadata_interceptors(secret_metadata(self.secret)))

    def alive(self) -> dict[str, bool]:
        return {n: p.poll() is None for n, p in self.procs.items()}

    def kill(self, name: str) -> None:
        """Hard-kills one service (fault-injection tests)."""
        self.procs[name].kill()
        self.procs[name].wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every service, then SIGKILL what is still alive."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.own_socket_dir and not any(self.alive().values()):
            shutil.rmtree(self.socket_dir, ignore_errors=True)   # the sockets die with their servers

    def __enter__(self) -> "LocalStack":
        return self.start() if not self.procs else self

    def __exit__(self, *exc) -> None:
        self.stop()
