"""`python -m ddtree_serve.plumbing.healthcheck HOST:PORT [SERVICE]`: exit 0 iff the gRPC health service says SERVING."""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

EXIT_SERVING = 0
EXIT_NOT_SERVING = 1
EXIT_UNREACHABLE = 2


def check(address: str, service: str = "", timeout_s: float = 3.0) -> tuple[int, str]:
    """(exit code, human-readable status) of one grpc.health.v1 Check against address."""
    # A blocking one-shot channel: container healthchecks fork this often, so no event loop and no torch import.
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            return EXIT_UNREACHABLE, f"{address}: {getattr(code, 'name', code)}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return (EXIT_SERVING if reply.status == health_pb2.HealthCheckResponse.SERVING else EXIT_NOT_SERVING), status


def main(argv: list[str] | None = None) -> int:
    """CLI entry: prints the status and returns the exit code (0 SERVING, 1 other status, 2 unreachable)."""
    p = argparse.ArgumentParser(prog="python -m ddtree_serve.plumbing.healthcheck", description=__doc__)
    p.add_argument("address", help="HOST:PORT of a gRPC server")
    p.add_argument("service", nargs="?", default="", help="health service name ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer")
    p.add_argument("--quiet", "-q", action="store_true")
    args = p.parse_args(argv)
    rc, status = check(args.address, args.service, args.timeout)
    if not args.quiet:
        print(status, file=sys.stdout if rc == EXIT_SERVING else sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
