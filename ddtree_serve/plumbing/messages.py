"""Conversions between the wire messages and the shared Python types (one place for every service)."""
from __future__ import annotations

from ddtree_serve.decoding.config import SamplingParams
from ddtree_serve.proto import common_pb2


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Proto -> validated SamplingParams (0 means 'off' for top_p / top_k); ValueError when out of range."""
    return SamplingParams.from_wire(p.temperature, p.top_p, p.top_k, p.seed if p.has_seed else None)


def cache_usage_proto(usage: tuple[int, int, int, int]) -> common_pb2.CacheUsage:
    """A runner's (running, max sequences, used tokens, capacity tokens) as the CacheUsage message."""
    running, max_seqs, used, capacity = usage
    return common_pb2.CacheUsage(running_sequences=running, max_sequences=max_seqs, used_tokens=used,
                                 capacity_tokens=capacity)
