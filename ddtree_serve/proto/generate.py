"""Generates the Python gRPC stubs from protos/ into this package (never hand-edited, never committed)."""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO_ROOT = PACKAGE_DIR.parent.parent / "protos"
PROTO_NAMES = ("common", "target", "drafter", "gateway")


def stubs_present() -> bool:
    """True when every proto has its _pb2 and _pb2_grpc module, none older than its .proto (edited protos regenerate)."""
    for n in PROTO_NAMES:
        proto = PROTO_ROOT / "ddtree_serve" / "proto" / f"{n}.proto"
        stubs = (PACKAGE_DIR / f"{n}_pb2.py", PACKAGE_DIR / f"{n}_pb2_grpc.py")
        if not all(s.exists() for s in stubs):
            return False
        if proto.exists() and min(s.stat().st_mtime for s in stubs) < proto.stat().st_mtime:
            return False
    return True


def generate_stubs(force: bool = False) -> None:
    """Runs grpc_tools.protoc over protos/ddtree_serve/proto/*.proto."""
    if stubs_present() and not force:
        return
    from grpc_tools import protoc
    import grpc_tools

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    files = [str(PROTO_ROOT / "ddtree_serve" / "proto" / f"{n}.proto") for n in PROTO_NAMES]
    out = str(PACKAGE_DIR.parent.parent)
    rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}",
                      f"--python_out={out}", f"--grpc_python_out={out}", *files])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
