"""The layering of the non-test code: every import points down (shared -> services -> launcher), no circles.

Layers, lowest first: ddtree_serve.switches (environment on/off flags) < ddtree_serve.kernels (GPU kernels) <
ddtree_serve.decoding (algorithms) < ddtree_serve.proto < ddtree_serve.plumbing < ddtree_serve.transport < the
shared package's own modules (client, default_model, rope) < the services (target_svc, drafter_svc, gateway: none
imports another) < launch (the composition root). Imports inside functions count.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ddtree_serve", "target_svc", "drafter_svc", "gateway", "launch")
SERVICES = ("target_svc", "drafter_svc", "gateway")
SHARED_ORDER = ("ddtree_serve.switches", "ddtree_serve.kernels", "ddtree_serve.decoding", "ddtree_serve.proto",
                "ddtree_serve.plumbing", "ddtree_serve.transport")
SERVICE_RANK = len(SHARED_ORDER) + 1   # above the shared package's own modules (rank len(SHARED_ORDER))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """{module: project modules it imports} over the hand-written sources (generated stubs left out)."""
    modules = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if not p.name.endswith(
        ("_pb2.py", "_pb2_grpc.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def layer(module: str) -> tuple[int, str]:
    """(rank, unit): rank orders the layers; units of equal rank must not import each other."""
    top = module.split(".")[0]
    if top == "launch":
        return 10, "launch"
    if top in SERVICES:
        return SERVICE_RANK, top
    for rank, prefix in enumerate(SHARED_ORDER):
        if module == prefix or module.startswith(prefix + "."):
            return rank, prefix
    if module == "ddtree_serve":
        return 0, module   # the package's __init__ imports nothing of the project
    return len(SHARED_ORDER), "ddtree_serve"   # client.py, default_model.py: built on the subpackages


def test_every_import_points_down_and_no_service_imports_another() -> None:
    bad = []
    for src, targets in import_graph().items():
        for dst in targets:
            (rs, us), (rd, ud) = layer(src), layer(dst)
            if rd > rs or (rd == rs and rs == SERVICE_RANK and us != ud):
                bad.append(f"{src} -> {dst}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_the_import_graph_has_no_circle() -> None:
    graph = import_graph()
    # A package imports its own submodules through __init__; count only arrows between distinct files.
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + "."):
                continue
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not circles, "\n".join(circles)


def test_nothing_imports_the_launcher() -> None:
    users = [src for src, targets in import_graph().items() if any(t.split(".")[0] == "launch" for t in targets)
             and not src.startswith("launch")]
    assert users == []
