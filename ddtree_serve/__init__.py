"""ddtree-serve: lossless DFlash + DDTree speculative decoding as gRPC microservices (shared code)."""
__version__ = "0.1.0"
