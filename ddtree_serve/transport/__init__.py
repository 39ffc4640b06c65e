"""Context-feature transports, target -> drafter (see base.py for the interface)."""
from ddtree_serve.config import TRANSPORTS
from ddtree_serve.transport.base import FeatureRows, FeatureSender, decode_rows, encode_rows, payload_bytes
from ddtree_serve.transport.inline import InlineFeatureSender
from ddtree_serve.transport.shared import SharedBufferFeatureSender
from ddtree_serve.transport.shared_buffer import SHARED_KINDS, OpenedBuffers, rows_view



def make_sender(kind: str, drafter_address: str, interceptors=(), on_sent=None) -> FeatureSender:
    """Builds the sender for a transport name chosen at start-up (client interceptors, delivery callback)."""
    if kind == "inline":
        return InlineFeatureSender(drafter_address, interceptors=list(interceptors), on_sent=on_sent)
    if kind in SHARED_KINDS:
        return SharedBufferFeatureSender(drafter_address, interceptors=list(interceptors), on_sent=on_sent, name=kind)
    raise ValueError(f"unknown transport {kind!r}; available: {', '.join(TRANSPORTS)}")


__all__ = ["FeatureRows", "FeatureSender", "InlineFeatureSender", "OpenedBuffers", "SharedBufferFeatureSender",
           "TRANSPORTS", "decode_rows", "encode_rows", "make_sender", "payload_bytes", "rows_view"]
