"""gRPC stubs generated from protos/; made on first import when the build step has not run (source checkouts)."""
from ddtree_serve.proto.generate import generate_stubs, stubs_present

if not stubs_present():
    generate_stubs()

from ddtree_serve.proto import common_pb2, drafter_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc  # noqa: E402
from ddtree_serve.proto import target_pb2, target_pb2_grpc  # noqa: E402

__all__ = ["common_pb2", "target_pb2", "target_pb2_grpc", "drafter_pb2", "drafter_pb2_grpc",
           "gateway_pb2", "gateway_pb2_grpc"]
