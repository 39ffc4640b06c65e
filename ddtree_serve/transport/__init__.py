"""Context-feature transports, target -> drafter (see base.py for the interface).

The transport names live here, importable without torch or gRPC (the launcher's argument parser needs
only them); the implementations load on first use of one of their names.
"""
from __future__ import annotations

import importlib

SHARED_BUFFER_TRANSPORTS = ("shm", "cuda-ipc")
TRANSPORTS = ("inline", *SHARED_BUFFER_TRANSPORTS, "nccl")

_LAZY = {
    "FeatureRows": "base", "FeatureSender": "base", "decode_rows": "base", "encode_rows": "base",
    "payload_bytes": "base", "InlineFeatureSender": "inline", "SharedBufferFeatureSender": "shared",
    "OpenedBuffers": "shared_buffer", "rows_view": "shared_buffer", "NcclFeatureSender": "nccl",
    "NcclReceiver": "nccl", "NcclSetupError": "nccl_protocol", "NcclLinkLost": "nccl_protocol",
}


def __getattr__(name: str):
    """Loads an implementation name on first access (PEP 562)."""
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_sender(kind: str, drafter_address: str, interceptors=(), on_sent=None, step_socket: str = ""):
    """Builds the sender for a transport name chosen at start-up (client interceptors, delivery callback, the
    drafter's step socket when the pushes go there)."""
    common = dict(interceptors=list(interceptors), on_sent=on_sent, step_socket=step_socket)
    if kind == "inline":
        from ddtree_serve.transport.inline import InlineFeatureSender

        return InlineFeatureSender(drafter_address, **common)
    if kind in SHARED_BUFFER_TRANSPORTS:
        from ddtree_serve.transport.shared import SharedBufferFeatureSender

        return SharedBufferFeatureSender(drafter_address, **common, name=kind)
    if kind == "nccl":   # not usable until `await sender.establish(device)` has formed the communicator
        from ddtree_serve.transport.nccl import NcclFeatureSender

        return NcclFeatureSender(drafter_address, **common)
    raise ValueError(f"unknown transport {kind!r}; available: {', '.join(TRANSPORTS)}")


__all__ = ["SHARED_BUFFER_TRANSPORTS", "TRANSPORTS", "FeatureRows", "FeatureSender", "InlineFeatureSender",
           "NcclFeatureSender", "NcclLinkLost", "NcclReceiver", "NcclSetupError", "OpenedBuffers", "SharedBufferFeatureSender", "decode_rows", "encode_rows", "make_sender",
           "payload_bytes", "rows_view"]
