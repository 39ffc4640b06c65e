"""Context-feature transports, target -> drafter (see base.py for the interface)."""
from ddtree_serve.transport.base import FeatureRows, FeatureSender, decode_rows, encode_rows
from ddtree_serve.transport.inline import InlineFeatureSender

TRANSPORTS = ("inline",)


def make_sender(kind: str, drafter_address: str, interceptors=(), on_sent=None) -> FeatureSender:
    """Builds the sender for a transport name chosen at start-up (client interceptors, delivery callback)."""
    if kind == "inline":
        return InlineFeatureSender(drafter_address, interceptors=list(interceptors), on_sent=on_sent)
    raise ValueError(f"unknown transport {kind!r}; available: {', '.join(TRANSPORTS)}")


__all__ = ["FeatureRows", "FeatureSender", "InlineFeatureSender", "decode_rows", "encode_rows", "make_sender",
           "TRANSPORTS"]
