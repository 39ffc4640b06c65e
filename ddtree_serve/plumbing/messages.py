"""Conversions between the wire messages and the shared Python types (one place for every service)."""
from __future__ import annotations

import numpy as np
import torch

from ddtree_serve.decoding.config import SamplingParams
from ddtree_serve.decoding.guides import GuideSpec
from ddtree_serve.decoding.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from ddtree_serve.proto import common_pb2, drafter_pb2


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Proto -> validated SamplingParams (0 means 'off' for top_p / top_k / repetition_penalty); ValueError when out
    of range."""
    return SamplingParams.from_wire(p.temperature, p.top_p, p.top_k, p.seed if p.has_seed else None, min_p=p.min_p,
                                    presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                                    repetition_penalty=p.repetition_penalty, logit_bias=dict(p.logit_bias),
                                    min_tokens=p.min_tokens, min_tokens_blocked=list(p.min_tokens_blocked),
                                    allowed_token_ids=list(p.allowed_token_ids),
                                    bad_words=[list(w.ids) for w in p.bad_words])


def sampling_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    """SamplingParams -> its proto (sampling_from_proto's inverse)."""
    return common_pb2.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                     seed=p.seed if p.seed is not None else 0, has_seed=p.seed is not None,
                                     min_p=p.min_p, presence_penalty=p.presence_penalty,
                                     frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
                                     logit_bias=dict(p.logit_bias), min_tokens=p.min_tokens,
                                     min_tokens_blocked=list(p.min_tokens_blocked),
                                     allowed_token_ids=list(p.allowed_token_ids),
                                     bad_words=[common_pb2.TokenSequence(ids=w) for w in p.bad_words])


def guide_from_proto(p: common_pb2.Guide) -> GuideSpec:
    """Guide -> GuideSpec."""
    return GuideSpec(p.kind, p.spec, any_whitespace=not p.compact_json, start_after=tuple(p.start_after))


def guide_proto(g: GuideSpec) -> common_pb2.Guide:
    """GuideSpec -> its proto (guide_from_proto's inverse)."""
    return common_pb2.Guide(kind=g.kind, spec=g.spec, compact_json=not g.any_whitespace, start_after=g.start_after)


def logprobs_proto(logprobs: list[TokenLogprob] | None) -> list[common_pb2.TokenLogprob]:
    """Emitted tokens' log-probs as TokenLogprob messages (none: an empty list)."""
    return [common_pb2.TokenLogprob(logprob=lp.logprob, top_ids=[i for i, _ in lp.top],
                                    top_logprobs=[v for _, v in lp.top], rank=lp.rank) for lp in logprobs or ()]


def logprobs_wanted(logprobs: bool, top_logprobs: int) -> int:
    """A request's logprobs fields as the runners take them: -1 none, else the alternatives per token; ValueError
    for a top_logprobs out of [0, MAX_TOP_LOGPROBS]."""
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
    return top_logprobs if logprobs else -1


def cache_usage_proto(usage: tuple[int, int, int, int]) -> common_pb2.CacheUsage:
    """A runner's (running, max sequences, used tokens, capacity tokens) as the CacheUsage message."""
    running, max_seqs, used, capacity = usage
    return common_pb2.CacheUsage(running_sequences=running, max_sequences=max_seqs, used_tokens=used,
                                 capacity_tokens=capacity)


def draft_result(seq_id: str, logprobs: torch.Tensor | np.ndarray, token_ids: torch.Tensor | np.ndarray
                 ) -> drafter_pb2.DraftResult:
    """One sequence's draft, host tensors or numpy arrays [L, K], as its DraftResult (float32 log-probs, int32 ids,
    raw bytes). Numpy in: no torch op on the way (the drafter's ready drafts, answered on its event loop)."""
    depth, k = (int(n) for n in token_ids.shape)
    return drafter_pb2.DraftResult(seq_id=seq_id, depth=depth, k=k, token_ids=_wire_bytes(token_ids, torch.int32, "<i4"),
                                   logprobs=_wire_bytes(logprobs, torch.float32, "<f4"))


def _wire_bytes(x: torch.Tensor | np.ndarray, torch_dtype: torch.dtype, wire_dtype: str) -> bytes:
    if isinstance(x, torch.Tensor):
        x = x.to(torch_dtype).contiguous().numpy()
    return np.ascontiguousarray(x, dtype=wire_dtype).tobytes()


def draft_arrays(result: drafter_pb2.DraftResult) -> tuple[np.ndarray, np.ndarray]:
    """A DraftResult as (float32 log-probs, int64 token ids), each [depth, k]; ValueError when the sizes disagree."""
    depth, k = result.depth, result.k
    if depth < 0 or k < 0 or len(result.logprobs) != 4 * depth * k or len(result.token_ids) != 4 * depth * k:
        raise ValueError(f"a draft of [{depth}, {k}] carries {len(result.logprobs)} bytes of log-probs and "
                         f"{len(result.token_ids)} of token ids (want {4 * depth * k} each)")
    # astype copies: the arrays are writable (torch.from_numpy warns on the bytes' read-only view)
    logprobs = np.frombuffer(result.logprobs, dtype="<f4").astype(np.float32).reshape(depth, k)
    ids = np.frombuffer(result.token_ids, dtype="<i4").astype(np.int64).reshape(depth, k)
    return logprobs, ids
