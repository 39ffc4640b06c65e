"""Service plumbing shared by the three services: gRPC bootstrap, request ids and logging, metrics, health."""
