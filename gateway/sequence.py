"""Per-request state in the gateway: what was asked, what was generated, and how it is streamed out."""
from __future__ import annotations

import asyncio
import enum
import time
import uuid
from dataclasses import dataclass, field

import grpc

from ddtree_serve.decoding.config import SamplingParams
from ddtree_serve.decoding.guides import GuideSpec
from gateway.detokenizer import IncrementalDetokenizer

MODES = ("ddtree", "dflash", "ar")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class StreamEvent:
    """One message to the client: new tokens/text, or the end (with a finish reason or an error)."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str = ""
    stop_reason: str | int | None = None   # with finish_reason "stop": the stop string, or the stop token
    error: tuple[grpc.StatusCode, str] | None = None
    logprobs: list | None = None   # common_pb2.TokenLogprob per token_ids entry, when the request asked for them
    prompt_logprobs: list | None = None   # on the first event, when asked: common_pb2.TokenLogprob per prompt token


@dataclass
class SequenceStats:
    """Speculation counters of one request (verify steps only; the prefill's first token is not a step)."""

    steps: int = 0
    drafted_steps: int = 0      # steps that verified at least one draft node
    accepted_tokens: int = 0
    draft_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per drafted verify step, bonus included (vLLM's 1 + accepted / drafts)."""
        return 1.0 + self.accepted_tokens / self.drafted_steps if self.drafted_steps else 1.0


@dataclass
class Sequence:
    """A request as the engine sees it. The target's cache holds `context_len` tokens; `bonus` is the next root."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    mode: str
    budget: int
    stop_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    logprobs: int = -1             # >= 0: each token's log-prob and this many alternatives (the target reports them)
    prompt_logprobs: int = -1      # >= 0: each prompt token's log-prob and this many alternatives, on the first event
    prompt_scores: list = field(default_factory=list)   # the target's prompt log-probs, gathered chunk by chunk
    guide: GuideSpec | None = None   # structured output: the grammar the target keeps every token inside
    cache_salt: str = ""           # prefix caching: only sequences of the same salt share cached rows
    priority: int = 0              # --scheduling-policy priority: admitted lowest first (ties: arrival order)
    seq_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    prefilled: int = 0             # prompt tokens the target holds (prompts are prefilled in chunks across steps)
    prefix_checked: bool = False   # prefix caching: a sequence to start from was looked for
    reuse_from: str = ""           # that sequence ("" none), and the leading prompt tokens its rows may give
    reuse_rows: int = 0
    reuse_copy: bool = False       # its rows are copied (it is running), not its slot adopted
    cached_tokens: int = 0         # prompt tokens the target served from it (not run)
    snapshot_at: int = 0           # a hybrid target keeps its states after this many tokens (0: none; a system prompt)
    # Preemption (gateway/scheduler.py): outputs generated before the last one; the target prefills them after the
    # prompt and counts them as output, and generation goes on from there
    resumed: int = 0
    context_len: int = 0
    bonus: int = -1
    drafting: bool = True          # false after the drafter failed for this sequence: AR from then on
    cancelled: bool = False
    finish_reason: str = ""
    stop_reason: str | int | None = None   # the stop string or stop token (EOS included) that ended it
    stats: SequenceStats = field(default_factory=SequenceStats)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    scheduled_at: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.output_ids)

    @property
    def prefill_ids(self) -> list[int]:
        """The tokens a prefill runs: the prompt, and after a preemption the outputs generated before it."""
        return self.prompt_ids + self.output_ids[:self.resumed] if self.resumed else self.prompt_ids

    @property
    def prefill_done(self) -> bool:
        return self.prefilled == len(self.prompt_ids) + self.resumed

    @property
    def preemptible(self) -> bool:
        """Whether preemption may stop it and run it again from its tokens: greedy or unseeded (a seeded sample
        stream is reproduced by an uninterrupted run only)."""
        return self.sampling.greedy or self.sampling.seed is None

    def preempt(self) -> None:
        """Back to waiting, to be run again from its prompt and outputs under a new id (the target and drafter
        state of the old one is released); what was streamed stays streamed."""
        self.status = Status.WAITING
        self.seq_id = uuid.uuid4().hex
        self.resumed = len(self.output_ids)
        self.prefilled = self.context_len = 0
        self.bonus = -1
        self.prefix_checked = self.reuse_copy = False
        self.reuse_from, self.reuse_rows = "", 0
        if not self.output_ids:
            self.prompt_scores = []   # prompt log-probs not sent yet: gathered again

    @property
    def speculative(self) -> bool:
        return self.mode != "ar" and self.drafting

    def append(self, tokens: list[int]) -> list[int]:
        """Commits tokens until a stop condition; returns the ones kept and sets finish_reason when done.

        In token order, the first of: a stop token (kept, not detokenized), a stop string completed (kept), the
        length limit reached (kept)."""
        n = min(len(tokens), max(1, self.remaining))   # the first token is always kept
        eos = next((i for i, tok in enumerate(tokens[:n]) if tok in self.stop_token_ids), None)
        text_end = n if eos is None else eos   # the tokens the text sees: up to a stop token, not including it
        hit = self.detokenizer.extend(tokens[:text_end])
        if hit is not None:
            kept, self.finish_reason, self.stop_reason = tokens[:hit + 1], "stop", self.detokenizer.stop_reason
        elif eos is not None:
            kept, self.finish_reason, self.stop_reason = tokens[:eos + 1], "stop", tokens[eos]
        else:
            kept = tokens[:n]
            if kept and len(self.output_ids) + n >= self.max_tokens:
                self.finish_reason = "length"
        self.output_ids.extend(kept)
        return kept

    def emit(self, tokens: list[int], logprobs=None) -> None:
        """Streams the text of newly kept tokens (and the end, if reached); logprobs: the target's for the tokens
        it reported, of which those of the kept ones go out."""
        text = self.detokenizer.take_text(final=bool(self.finish_reason))
        kept_logprobs = list(logprobs)[:len(tokens)] if self.logprobs >= 0 and logprobs is not None else None
        first = len(self.output_ids) == len(tokens)
        prompt = self.prompt_scores if first and self.prompt_logprobs >= 0 else None
        self.events.put_nowait(StreamEvent(token_ids=tokens, text=text, finished=bool(self.finish_reason),
                                           finish_reason=self.finish_reason, stop_reason=self.stop_reason,
                                           logprobs=kept_logprobs,
                                           prompt_logprobs=prompt))

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        """Ends the request with an error status."""
        self.status = Status.FINISHED
        self.finish_reason = "error"
        self.events.put_nowait(StreamEvent([], "", finished=True, finish_reason="error", error=(code, message)))
