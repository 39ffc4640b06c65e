"""The OpenAI-compatible HTTP front: /v1/models, /v1/completions, /v1/chat/completions, /tokenize, /detokenize,
/health, /metrics.

It runs in the gateway's own event loop (uvicorn as a task) and turns each HTTP request into the same
GenerateRequest the gRPC API takes, so both share validation, the scheduler and the engines.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ddtree_serve.decoding.logprobs import MAX_TOP_LOGPROBS
from ddtree_serve.plumbing.messages import guide_proto
from ddtree_serve.proto import common_pb2, gateway_pb2
from ddtree_serve.plumbing.rpc import status_for
from gateway.limits import MAX_CHARS_PER_TOKEN
from gateway.tool_calls import HermesStream, ToolCall, check_tools, forced_calls, forced_guide, parse_hermes

log = logging.getLogger(__name__)

MODE_ENUMS = {"ddtree": gateway_pb2.DECODE_MODE_DDTREE, "dflash": gateway_pb2.DECODE_MODE_DFLASH,
              "ar": gateway_pb2.DECODE_MODE_AR}
# gRPC status -> (HTTP status, OpenAI error type), as vLLM and OpenAI report them.
HTTP_FOR_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
OPEN_PATHS = ("/health", "/metrics")  # no API key needed, as in vLLM: probes and scrapers
MAX_SAMPLES = 16   # n per request: each sample is a sequence of its own (a cache slot, a share of each step)
MAX_PROMPTS = 64   # prompts of one /v1/completions request (each its own sequence, or n of them)


# Fields that OpenAI or vLLM take, that would change the answer, and that this server does not implement, each with
# "does this value ask for it": such a request gets a 400 naming the field, never an answer that ignored it (unknown
# fields that change nothing, such as user or metadata, are accepted and ignored).
_UNHONOURED: dict[str, Callable[[Any], bool]] = {
    "use_beam_search": bool,
    "functions": bool,   # the tools' predecessor: send tools
}


# ---- request schemas (fields OpenAI defines that we honour, plus the ddtree extensions) ---------------------------
class _Common(BaseModel):
    # Unknown fields (user, metadata, ...) are accepted and ignored, as OpenAI-compatible servers do.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    logprobs: Any = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None   # token id (as a string) -> bias
    # vLLM's extensions
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = None   # vLLM's: each prompt token's {id: {logprob, rank, decoded_token}}
    # ddtree-serve extensions (pass them in the openai client's extra_body)
    top_k: int | None = None
    mode: Literal["ddtree", "dflash", "ar"] | None = None
    budget: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None   # an assistant's earlier calls
    tool_call_id: str | None = None                  # a tool message: the call it answers
    name: str | None = None


class _ChatOptions(BaseModel):
    """vLLM's chat-template options."""

    chat_template_kwargs: dict[str, Any] | None = None   # the template's switches, e.g. {"enable_thinking": false}
    add_generation_prompt: bool = True
    continue_final_message: bool = False   # the answer continues the last (assistant) message


class ChatCompletionRequest(_Common, _ChatOptions):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None   # false: tool_choice required makes one call
    top_logprobs: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(_ChatOptions):
    """vLLM's /tokenize: a text prompt, or chat messages rendered with the model's chat template."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids back to text."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict:
        """The JSON body OpenAI clients parse."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def api_error_for(exc: BaseException) -> ApiError:
    """Maps the gateway's exceptions (validation ValueErrors, RequestErrors, downstream gRPC errors) to ApiError."""
    if isinstance(exc, ApiError):
        return exc
    code, message = status_for(exc)
    status, type_ = HTTP_FOR_STATUS.get(code, (500, "internal_server_error"))
    return ApiError(status, message, type_, code=code.name.lower())


def _content_text(content: str | list[dict[str, Any]] | None) -> str:
    """A message's text: a string, or the text parts of a content list."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise ApiError(400, f"content parts of type {part.get('type')!r} are not supported (text only)",
                           param="messages")
        parts.append(part.get("text", ""))
    return "".join(parts)


class HttpFront:
    """The FastAPI app and the uvicorn server that runs it inside the gateway's event loop."""

    def __init__(self, servicer, host: str, port: int, registry=None, api_key: str | None = None):
        self.servicer = servicer
        self.host, self.port = host, port
        self.registry = registry
        self.api_key = api_key or None
        self.created = int(time.time())
        self.app = self._build_app()
        self._server = None
        self._task: asyncio.Task | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Binds and starts serving (raises when the port cannot be bound)."""
        import uvicorn

        class _Server(uvicorn.Server):
            # The gRPC host owns SIGTERM/SIGINT and stops us through stop(); uvicorn must not take the signals.
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        # Streams still open at shutdown get 5 s (the gRPC side's grace), then are cut.
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=5)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(), name="http-front")
        while not self._server.started:
            if self._task.done():  # bind failed: uvicorn logged why and exited
                raise RuntimeError(f"HTTP front could not start on {self.host}:{self.port}")
            await asyncio.sleep(0.05)
        log.info("OpenAI-compatible HTTP on http://%s:%d/v1", self.host, self.port)

    async def stop(self) -> None:
        """Stops accepting, lets running responses end (uvicorn's own grace), returns."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # ---- helpers ------------------------------------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return getattr(self.servicer, "model_name", "") or "ddtree-serve"

    def _check_ready(self) -> None:
        if not self.servicer.ready.is_set():
            raise ApiError(503, "model is still loading", "service_unavailable", code="unavailable")

    def _check_model(self, model: str | None) -> None:
        if model and model != self.model_id:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.model_id}`.",
                           "not_found_error", code="model_not_found", param="model")

    def _check_common(self, body: _Common) -> None:
        self._check_model(body.model)
        if not 1 <= body.n <= MAX_SAMPLES:
            raise ApiError(400, f"n must be in [1, {MAX_SAMPLES}], got {body.n}", param="n")
        wanted = _logprobs_wanted(body)
        if wanted is not None and not 0 <= wanted <= MAX_TOP_LOGPROBS:
            name = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
            raise ApiError(400, f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {wanted}", param=name)
        if isinstance(body, ChatCompletionRequest) and body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        for key in body.logit_bias or {}:
            if not (key.strip().isdigit() and int(key) < 1 << 31):
                raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        if body.allowed_token_ids is not None and not (body.allowed_token_ids and
                                                       all(0 <= t < 1 << 31 for t in body.allowed_token_ids)):
            raise ApiError(400, "allowed_token_ids must be a non-empty list of token ids", param="allowed_token_ids")
        if body.prompt_logprobs is not None:
            if not 0 <= body.prompt_logprobs <= MAX_TOP_LOGPROBS:
                raise ApiError(400, f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.prompt_logprobs}",
                               param="prompt_logprobs")
            if body.stream:   # as vLLM: they come with the whole answer
                raise ApiError(400, "prompt_logprobs are not available when stream is enabled",
                               param="prompt_logprobs")
        if body.repetition_penalty is not None and body.repetition_penalty <= 0:
            # on the wire 0 means "off": refuse it here, as vLLM does
            raise ApiError(400, f"repetition_penalty must be > 0, got {body.repetition_penalty}",
                           param="repetition_penalty")
        for name, value in (body.model_extra or {}).items():
            asks = _UNHONOURED.get(name)
            if asks is not None and asks(value):
                raise ApiError(400, f"{name} is not supported (this server would ignore it)", param=name)
        if body.top_k == -1:   # vLLM's spelling of "no top-k"
            body.top_k = 0
        if body.seed is not None and not 0 <= body.seed < 1 << 64:
            raise ApiError(400, f"seed must be in [0, 2**64), got {body.seed}", param="seed")
        for name in ("max_tokens", "budget", "top_k", "min_tokens"):
            value = getattr(body, name)
            if value is not None and not 0 <= value < 1 << 31:
                raise ApiError(400, f"{name} must be in [0, 2**31), got {value}", param=name)
        mct = getattr(body, "max_completion_tokens", None)
        if mct is not None and not 0 <= mct < 1 << 31:
            raise ApiError(400, f"max_completion_tokens must be in [0, 2**31), got {mct}", param="max_completion_tokens")

    def _request(self, body: _Common, max_tokens: int | None, default_max: int | None) -> gateway_pb2.GenerateRequest:
        """The GenerateRequest for an HTTP body whose prompt is already set on `req` by the caller."""
        temperature = 1.0 if body.temperature is None else body.temperature  # OpenAI's default
        sampling = common_pb2.SamplingParams(temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p,
                                             top_k=body.top_k or 0, seed=body.seed or 0,
                                             has_seed=body.seed is not None, min_p=body.min_p or 0.0,
                                             presence_penalty=body.presence_penalty or 0.0,
                                             frequency_penalty=body.frequency_penalty or 0.0,
                                             repetition_penalty=body.repetition_penalty or 1.0,
                                             logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
                                             min_tokens=body.min_tokens or 0,
                                             allowed_token_ids=body.allowed_token_ids or [])
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        wanted = _logprobs_wanted(body)
        req = gateway_pb2.GenerateRequest(sampling=sampling, stop=stop, ignore_eos=body.ignore_eos,
                                          stop_token_ids=body.stop_token_ids or [], budget=body.budget or 0,
                                          include_stop_str_in_output=body.include_stop_str_in_output,
                                          keep_special_tokens=not body.skip_special_tokens,
                                          bad_words=body.bad_words or [],
                                          mode=MODE_ENUMS.get(body.mode, gateway_pb2.DECODE_MODE_DEFAULT),
                                          logprobs=wanted is not None, top_logprobs=wanted or 0)
        if body.prompt_logprobs is not None:
            req.prompt_logprobs, req.prompt_top_logprobs = True, body.prompt_logprobs
        guide = _guide(body)
        if guide is not None:
            req.guide.CopyFrom(guide)
        req.max_tokens = max_tokens if max_tokens is not None else (default_max or 0)
        return req

    async def _finish_prompt(self, req: gateway_pb2.GenerateRequest, max_tokens: int | None) -> int:
        """Tokenizes the prompt once (as token ids from then on); fills the default max_tokens; returns its length."""
        ids = await self.servicer._prompt_ids(req)   # size-capped, tokenized off the event loop
        req.token_ids.ids[:] = ids
        if max_tokens is None and req.max_tokens <= 0:
            # like vLLM: no max_tokens means "up to the context limit"
            req.max_tokens = max(1, self.servicer.max_seq_len - len(ids))
        return len(ids)

    def _logprobs_json(self, chat: bool, token_ids: list[int], logprobs: list, offset: int = 0,
                       top: int | None = None) -> tuple[dict, int]:
        """Tokens' log-probs (TokenLogprob messages; at most `top` alternatives each) in OpenAI's shape -> (the
        choice's "logprobs", the text offset after them): chat's {"content": [{token, logprob, bytes,
        top_logprobs}]}, completions' {tokens, token_logprobs, top_logprobs, text_offset}; each token's text is its
        own decoding."""
        decode = self.servicer.tokenizer.decode
        pairs = list(zip(token_ids, logprobs))

        def entry(token_id: int, logprob: float) -> dict:
            text = decode([token_id])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        if chat:
            return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in
                                                                          zip(lp.top_ids, lp.top_logprobs)]}
                                for t, lp in pairs]}, offset
        tokens, offsets = [], []
        for t, _ in pairs:
            tokens.append(decode([t]))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [lp.logprob for _, lp in pairs],
                "top_logprobs": [{decode([i]): v for i, v in list(zip(lp.top_ids, lp.top_logprobs))[:top]}
                                 for _, lp in pairs],
                "text_offset": offsets}, offset

    def _echo_logprobs_json(self, seq, prompt_logprobs: list, top: int) -> tuple[dict, int]:
        """The echoed prompt's tokens and log-probs in completions' shape, `top` alternatives each -> (that dict, the
        text offset after them): the first token has no log-prob (null, as OpenAI gives it)."""
        first = self.servicer.tokenizer.decode(seq.prompt_ids[:1])
        rest, end = self._logprobs_json(False, seq.prompt_ids[1:], prompt_logprobs, len(first), top)
        return {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
                "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}, end

    def _prompt_logprobs_json(self, seq, prompt_logprobs: list, top: int) -> list:
        """vLLM's prompt_logprobs: null for the first prompt token, then per token {id: {logprob, rank,
        decoded_token}} for the token itself and its `top` likeliest alternatives (ranked 1..top)."""
        decode = self.servicer.tokenizer.decode
        out: list[dict | None] = [None]
        for token, lp in zip(seq.prompt_ids[1:], prompt_logprobs):
            entry = {str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": decode([token])}}
            for rank, (i, v) in enumerate(list(zip(lp.top_ids, lp.top_logprobs))[:top], start=1):
                entry.setdefault(str(i), {"logprob": v, "rank": rank, "decoded_token": decode([i])})
            out.append(entry)
        return out

    @staticmethod
    def _ddtree_stats(seq) -> dict:
        s = seq.stats
        return {"mode": seq.mode if seq.drafting else "ar", "requested_mode": seq.mode, "budget": seq.budget,
                "drafter_fallback": not seq.drafting, "steps": s.steps, "accepted_tokens": s.accepted_tokens,
                "draft_tokens": s.draft_tokens, "mean_acceptance_length": round(s.mean_acceptance_length, 4),
                "ttft_seconds": round(seq.first_token_at - seq.arrival, 4) if seq.first_token_at else 0.0,
                "e2e_seconds": round(time.perf_counter() - seq.arrival, 4)}

    @staticmethod
    def _usage(seqs: list, n: int) -> dict:
        """Token counts of a request's sequences (n samples of each prompt, in order): each prompt once, every
        sample's completion."""
        prompt, completion = sum(len(s.prompt_ids) for s in seqs[::n]), sum(len(s.output_ids) for s in seqs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def _run(self, reqs: list[gateway_pb2.GenerateRequest], chat: bool, body: _Common,
                   echoes: list[str] | None = None) -> Any:
        """Answers one HTTP request of one prompt or several (body.n samples of each; choice p * n + i is prompt
        p's sample i, as vLLM numbers them): a JSON body, or server-sent events when body.stream. echoes: each
        prompt's text, which completions' echo puts before its answers (with the prompt's log-probs, if asked)."""
        gens = [self.servicer.stream(r) for req in reqs for r in _samples(req, body.n)]
        echo = [e for e in echoes for _ in range(body.n)] if echoes is not None else None
        # Every sample admitted at once; validation errors surface here, before any byte is sent.
        firsts = await asyncio.gather(*(g.__anext__() for g in gens), return_exceptions=True)
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:
            for g in gens:
                await g.aclose()
            raise failed
        created = int(time.time())
        rid = ("chatcmpl-" if chat else "cmpl-") + firsts[0][0].request_id
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(self._sse(gens, firsts, rid, created, chat, include_usage, body, echo,
                                               _logprobs_wanted(body) or 0),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        tasks = [asyncio.ensure_future(_collect(g, f)) for g, f in zip(gens, firsts)]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:   # one sample failed, or the client left: the others are cancelled (caches freed)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        choices, seqs = [], []
        wanted_top = _logprobs_wanted(body)
        wanted = wanted_top is not None
        prompt_scores = None
        for i, (seq, finish_reason, content, ids, logprobs) in enumerate(results):
            choice = {"index": i, "finish_reason": finish_reason, "stop_reason": _stop_reason(seq, body),
                      "logprobs": self._logprobs_json(chat, ids, logprobs)[0] if wanted else None}
            if echo is not None:
                if wanted:
                    prompt_part, offset = self._echo_logprobs_json(seq, firsts[i][1].prompt_logprobs, wanted_top)
                    answer_part = self._logprobs_json(False, ids, logprobs, offset)[0]
                    choice["logprobs"] = {k: prompt_part[k] + answer_part[k] for k in prompt_part}
                content = echo[i] + content
            if chat:
                content, calls = _answer_calls(_tool_mode(body), body, content)
                choice["message"] = {"role": "assistant", "content": content}
                if calls:
                    choice["message"]["tool_calls"] = [c.as_json() for c in calls]
                    choice["finish_reason"] = "tool_calls" if finish_reason == "stop" else finish_reason
            else:
                choice["text"] = content
            if body.prompt_logprobs is not None and (not chat or prompt_scores is None):
                # vLLM puts them in each completion choice, once in a chat answer
                prompt_scores = self._prompt_logprobs_json(seq, firsts[i][1].prompt_logprobs or [],
                                                           body.prompt_logprobs)
                if not chat:
                    choice["prompt_logprobs"] = prompt_scores
            if len(results) > 1:
                choice["ddtree"] = self._ddtree_stats(seq)
            choices.append(choice)
            seqs.append(seq)
        answer = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                  "model": self.model_id, "choices": choices, "usage": self._usage(seqs, body.n),
                  "ddtree": self._ddtree_stats(seqs[0])}
        if chat and prompt_scores is not None:
            answer["prompt_logprobs"] = prompt_scores
        return JSONResponse(answer)

    async def _sse(self, gens, firsts, rid: str, created: int, chat: bool, include_usage: bool, body: _Common,
                   echo: list[str] | None = None, echo_top: int = 0) -> AsyncIterator[str]:
        """The event stream: one chunk per engine emission of each sample (its index; with echo, the prompt's text
        first, with echo_top alternatives per token when log-probs were asked), each sample's finish reason,
        optional usage, then [DONE]."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        # vLLM's continuous_usage_stats: every chunk carries its sample's token counts so far
        continuous = include_usage and bool((body.stream_options or {}).get("continuous_usage_stats"))
        sample_seqs = [first[0] for first in firsts]

        def chunk(index: int, text: str | None, finish_reason: str | None, role: bool = False,
                  logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                if tool_calls:
                    delta["tool_calls"] = tool_calls
                choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
            else:
                choice = {"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": logprobs}
            payload = {"id": rid, "object": obj, "created": created, "model": self.model_id, "choices": [choice]}
            if include_usage:
                payload["usage"] = self._usage([sample_seqs[index]], 1) if continuous else None
            return payload

        def line(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        # One task per sample feeds a queue, so the samples' chunks go out as they come.
        events: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, gen, first) -> None:
            try:
                seq, event = first
                while True:
                    events.put_nowait((index, seq, event, None))
                    if event.finished:
                        return
                    seq, event = await gen.__anext__()
            except Exception as exc:  # noqa: BLE001 - handed to the stream, which reports it
                events.put_nowait((index, None, None, exc))

        pumps = [asyncio.create_task(pump(i, g, f)) for i, (g, f) in enumerate(zip(gens, firsts))]
        mode = _tool_mode(body)
        splitters = [HermesStream() for _ in gens] if mode == "auto" else None
        forced_text: dict[int, list[str]] = {i: [] for i in range(len(gens))}   # mode "forced": held to the end
        called: set[int] = set()   # samples that made tool calls

        def tool_split(index: int, text: str, finished: bool) -> tuple[str, list[dict]]:
            """The content to stream now and the tool-call deltas completed now, of one sample's new text."""
            if mode == "auto":
                splitter = splitters[index]
                first = splitter.calls
                content, calls = splitter.feed(text, final=finished)
                return content, [c.as_json(first + k) for k, c in enumerate(calls)]
            if mode == "forced":
                forced_text[index].append(text)
                if not finished:
                    return "", []
                whole = "".join(forced_text[index])
                calls = forced_calls(whole, body.tool_choice)
                return ("" if calls else whole), [c.as_json(k) for k, c in enumerate(calls)]
            return text, []
        try:
            try:
                if chat:
                    for i in range(len(gens)):
                        yield line(chunk(i, None, None, role=True))
                finished: dict[int, Any] = {}
                offsets = [0] * len(gens)   # each sample's text so far, for completions' text_offset
                echoed: set[int] = set()    # samples whose prompt went out (echo)
                while len(finished) < len(gens):
                    index, seq, event, exc = await events.get()
                    if exc is not None:
                        raise exc
                    if echo is not None and index not in echoed:   # its first event: the prompt goes first
                        echoed.add(index)
                        prompt_part = None
                        if event.prompt_logprobs is not None:   # asked for with the answer's log-probs
                            prompt_part, offsets[index] = self._echo_logprobs_json(seq, event.prompt_logprobs,
                                                                                   echo_top)
                        yield line(chunk(index, echo[index], None, logprobs=prompt_part))
                    text, calls = tool_split(index, event.text, event.finished) if chat else (event.text, [])
                    if calls:
                        called.add(index)
                    if event.logprobs:   # a chunk for every token with a log-prob, text or not
                        logprobs, offsets[index] = self._logprobs_json(chat, event.token_ids, event.logprobs,
                                                                       offsets[index])
                        yield line(chunk(index, text, None, logprobs=logprobs, tool_calls=calls))
                    elif text or calls:
                        yield line(chunk(index, text, None, tool_calls=calls))
                    if event.finished:
                        finished[index] = seq
                        reason = event.finish_reason
                        final = chunk(index, None, "tool_calls" if index in called and reason == "stop" else reason)
                        final["choices"][0]["stop_reason"] = _stop_reason(seq, body)
                        final["ddtree"] = self._ddtree_stats(seq)
                        yield line(final)
                if include_usage:
                    seqs = [finished[i] for i in range(len(gens))]
                    yield line({"id": rid, "object": obj, "created": created, "model": self.model_id,
                                "choices": [], "usage": self._usage(seqs, body.n)})
            except Exception as exc:  # noqa: BLE001 - headers are sent: the error goes in the stream, as vLLM does
                err = api_error_for(exc)
                log.warning("stream %s failed: %s", rid, err.message)
                yield line(err.body())
            yield "data: [DONE]\n\n"
        finally:   # done, failed, or the client went away: unfinished samples are cancelled (their caches freed)
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for g in gens:
                await g.aclose()

    # ---- the app ------------------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="ddtree-serve", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ApiError)
        async def _api_error(_request: Request, exc: ApiError):
            return exc.response()

        @app.exception_handler(RequestValidationError)
        async def _validation_error(_request: Request, exc: RequestValidationError):
            first = exc.errors()[0] if exc.errors() else {}
            where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
            return ApiError(400, f"{where}: {first.get('msg', 'invalid request')}" if where else
                            str(first.get("msg", "invalid request")), param=where or None).response()

        @app.exception_handler(Exception)
        async def _any_error(_request: Request, exc: Exception):
            err = api_error_for(exc)
            if err.status >= 500:
                log.error("HTTP request failed: %s", err.message, exc_info=exc)
            return err.response()

        async def auth(request: Request) -> None:
            """Bearer API key on /v1/* when --api-key is set."""
            if not self.api_key:
                return
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                raise ApiError(401, "Incorrect API key provided (send Authorization: Bearer <key>).",
                               "authentication_error", code="invalid_api_key")

        guarded = [Depends(auth)]

        @app.get("/health")
        async def health():
            """200 once every pair is connected, 503 before."""
            if not self.servicer.ready.is_set():
                return PlainTextResponse("loading", status_code=503)
            return PlainTextResponse("ok")

        @app.get("/metrics")
        async def metrics():
            """The gateway's Prometheus metrics (the same registry as --metrics-port)."""
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            if self.registry is None:
                raise ApiError(404, "metrics are off", "not_found_error")
            return PlainTextResponse(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models", dependencies=guarded)
        async def models():
            """The one model this gateway serves."""
            self._check_ready()
            info = self.servicer.pairs[0].target_info
            return {"object": "list", "data": [{
                "id": self.model_id, "object": "model", "created": self.created, "owned_by": "ddtree-serve",
                "max_model_len": info.max_seq_len, "root": self.model_id, "parent": None}]}

        @app.post("/v1/chat/completions", dependencies=guarded)
        async def chat_completions(body: ChatCompletionRequest):
            """Chat: the messages rendered with the model's chat template."""
            return await self._guard(self._chat(body))

        @app.post("/v1/completions", dependencies=guarded)
        async def completions(body: CompletionRequest):
            """Plain completion of a text prompt or of token ids."""
            return await self._guard(self._completion(body))

        @app.post("/tokenize", dependencies=guarded)
        async def tokenize(body: TokenizeRequest):
            """The prompt's token ids, as the completions endpoints would see them (vLLM's shape)."""
            return await self._guard(self._tokenize(body))

        @app.post("/detokenize", dependencies=guarded)
        async def detokenize(body: DetokenizeRequest):
            """Token ids back to text (vLLM's shape)."""
            return await self._guard(self._detokenize(body))

        return app

    async def _guard(self, coro):
        """Every failure becomes an OpenAI-shaped error response, never a traceback."""
        try:
            return await coro
        except ApiError as exc:
            return exc.response()
        except Exception as exc:  # noqa: BLE001 - validation ValueErrors, gRPC errors, bugs: all get a status
            err = api_error_for(exc)
            if err.status >= 500:
                log.error("HTTP request failed: %s", err.message, exc_info=exc)
            return err.response()

    async def _chat(self, body: ChatCompletionRequest):
        """Chat: the messages rendered with the model's chat template."""
        self._check_ready()
        self._check_common(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        req = self._request(body, max_tokens, None)
        req.chat.CopyFrom(_chat_messages(body.messages, body))
        if body.tools or body.tool_choice not in (None, "none"):
            try:
                functions = check_tools(body.tools or [], body.tool_choice)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="tools") from None
            req.chat.tools_json = json.dumps(body.tools or [])
            forced = forced_guide(functions, body.tool_choice, parallel=body.parallel_tool_calls is not False)
            if forced is not None:
                if req.HasField("guide"):
                    raise ApiError(400, "tool_choice required or named holds the answer to tool calls: not with a "
                                        "structured output", param="tool_choice")
                req.guide.CopyFrom(guide_proto(forced))
        await self._finish_prompt(req, max_tokens)
        return await self._run([req], chat=True, body=body)

    async def _tokenize(self, body: TokenizeRequest):
        self._check_ready()
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give either prompt or messages", param="prompt")
        servicer = self.servicer
        if body.messages is not None:
            chat = _chat_messages(body.messages, body)
            if body.tools:
                chat.tools_json = json.dumps(body.tools)
            ids = await servicer._chat_ids(chat)
        else:
            limit = servicer.max_seq_len * MAX_CHARS_PER_TOKEN
            if len(body.prompt) > limit:
                raise ApiError(400, f"prompt of {len(body.prompt)} characters is over the {limit}-character limit",
                               param="prompt")
            ids = await servicer._tokenize(servicer._encode, body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": servicer.max_seq_len, "tokens": ids}

    async def _detokenize(self, body: DetokenizeRequest):
        self._check_ready()
        self._check_model(body.model)
        vocab = self.servicer.pairs[0].target_info.vocab_size
        if len(body.tokens) > self.servicer.max_seq_len:
            raise ApiError(400, f"{len(body.tokens)} tokens; at most max_model_len ({self.servicer.max_seq_len})",
                           param="tokens")
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"token ids must lie in [0, {vocab})", param="tokens")
        text = await self.servicer._tokenize(self.servicer.tokenizer.decode, body.tokens)
        return {"prompt": text}

    async def _completion(self, body: CompletionRequest):
        """Plain completion of a text prompt or of token ids."""
        self._check_ready()
        self._check_common(body)
        if body.suffix or (body.best_of or 1) != 1:
            raise ApiError(400, "suffix and best_of are not supported", param="suffix" if body.suffix else "best_of")
        prompts = body.prompt
        if not (isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))):
            prompts = [prompts]   # one text, or one list of token ids
        if not 1 <= len(prompts) <= MAX_PROMPTS:
            raise ApiError(400, f"a batch of {len(prompts)} prompts; 1 to {MAX_PROMPTS} per request", param="prompt")
        reqs, echoes = [], []
        wanted = _logprobs_wanted(body)
        for prompt in prompts:
            req = self._request(body, body.max_tokens, 16)  # OpenAI's completions default
            if isinstance(prompt, str):
                req.text = prompt
            else:
                req.token_ids.ids.extend(prompt)
            await self._finish_prompt(req, body.max_tokens if body.max_tokens is not None else 16)
            if body.echo:
                # the prompt as given; token ids as their text
                echoes.append(prompt if isinstance(prompt, str) else self.servicer.tokenizer.decode(list(prompt)))
                if wanted is not None:
                    req.prompt_logprobs = True
                    req.prompt_top_logprobs = max(wanted, req.prompt_top_logprobs)
            reqs.append(req)
        return await self._run(reqs, chat=False, body=body, echoes=echoes if body.echo else None)


def _chat_messages(messages: list[ChatMessage], options: _ChatOptions) -> gateway_pb2.ChatMessages:
    """The messages and the chat options as the gateway's ChatMessages."""
    if options.add_generation_prompt and options.continue_final_message:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true",
                       param="continue_final_message")
    chat = gateway_pb2.ChatMessages(continue_final_message=options.continue_final_message,
                                    no_generation_prompt=not options.add_generation_prompt,
                                    template_kwargs_json=json.dumps(options.chat_template_kwargs)
                                    if options.chat_template_kwargs else "")
    for m in messages:
        chat.messages.add(role=m.role, content=_content_text(m.content), name=m.name or "",
                          tool_call_id=m.tool_call_id or "",
                          tool_calls_json=json.dumps(m.tool_calls) if m.tool_calls else "")
    return chat


def _tool_mode(body: _Common) -> str | None:
    """How a chat answer's tool calls are read: "auto" (the Hermes blocks in the text), "forced" (the whole answer
    is the calls' JSON) or None (no tools, or tool_choice none)."""
    if not isinstance(body, ChatCompletionRequest) or not body.tools or body.tool_choice == "none":
        return None
    return "auto" if body.tool_choice in (None, "auto") else "forced"


def _answer_calls(mode: str | None, body, content: str) -> tuple[str | None, list[ToolCall]]:
    """(the message content, its tool calls) of a whole chat answer."""
    if mode == "auto":
        content, calls = parse_hermes(content)
        return content or (None if calls else content), calls
    if mode == "forced":
        calls = forced_calls(content, body.tool_choice)
        return (None if calls else content), calls
    return content, []


def _samples(req: gateway_pb2.GenerateRequest, n: int) -> list[gateway_pb2.GenerateRequest]:
    """The request n times; with a seed, sample i draws from seed + i (each reproducible, none the same)."""
    out = [req]
    for i in range(1, n):
        sample = gateway_pb2.GenerateRequest()
        sample.CopyFrom(req)
        if req.sampling.has_seed:
            sample.sampling.seed = (req.sampling.seed + i) % (1 << 64)
        out.append(sample)
    return out


async def _collect(gen, first) -> tuple[Any, str, str, list[int], list]:
    """(the sequence, its finish reason, its whole text, its token ids, their log-probs if reported) of one
    sample's stream."""
    seq, event = first
    text, ids, logprobs = [event.text], list(event.token_ids), list(event.logprobs or [])
    async with contextlib.aclosing(gen):
        while not event.finished:
            seq, event = await gen.__anext__()
            text.append(event.text)
            ids.extend(event.token_ids)
            logprobs.extend(event.logprobs or [])
    return seq, event.finish_reason, "".join(text), ids, logprobs


def _guide(body: _Common) -> common_pb2.Guide | None:
    """The body's structured output as a Guide (None: free text); a 400 when it is malformed or given twice."""
    found = []
    fmt = body.response_format
    if fmt is not None and fmt.get("type", "text") != "text":
        if fmt.get("type") == "json_object":
            found.append(("response_format", "json_object", ""))
        elif fmt.get("type") == "json_schema" and isinstance((fmt.get("json_schema") or {}).get("schema"), dict):
            found.append(("response_format", "json", json.dumps(fmt["json_schema"]["schema"])))
        else:
            raise ApiError(400, "response_format must be text, json_object, or json_schema with a json_schema.schema "
                                "object", param="response_format")
    vllm = {k: v for k, v in (body.structured_outputs or {}).items() if v is not None and v is not False}
    compact = bool(vllm.pop("disable_any_whitespace", False))
    for legacy in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{legacy}")
        if value is not None:
            vllm[legacy] = value
    if vllm.get("json_object"):
        found.append(("structured_outputs", "json_object", ""))
    for kind in ("json", "regex", "choice", "grammar"):
        value = vllm.get(kind)
        if value is None:
            continue
        if kind in ("json", "choice") and not isinstance(value, str):
            value = json.dumps(value)
        if not isinstance(value, str):
            raise ApiError(400, f"structured output {kind} must be a string", param="structured_outputs")
        found.append(("structured_outputs", kind, value))
    unknown = set(vllm) - {"json", "regex", "choice", "grammar", "json_object"}
    if unknown:
        raise ApiError(400, f"structured_outputs {sorted(unknown)[0]!r} is not supported", param="structured_outputs")
    if len(found) > 1:
        raise ApiError(400, "give one structured output: response_format, structured_outputs or guided_* name "
                            f"{len(found)}", param=found[1][0])
    return common_pb2.Guide(kind=found[0][1], spec=found[0][2], compact_json=compact) if found else None


def _stop_reason(seq, body: _Common) -> str | int | None:
    """vLLM's stop_reason: the stop string or one of the request's stop_token_ids that ended it; None for EOS."""
    reason = seq.stop_reason
    if isinstance(reason, int) and reason not in (body.stop_token_ids or ()):
        return None
    return reason


def _logprobs_wanted(body: _Common) -> int | None:
    """The alternatives per token a body asks log-probs with, None for none: chat's logprobs (bool) and
    top_logprobs, completions' logprobs (a count)."""
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    if body.logprobs is None or body.logprobs is False:
        return None
    if isinstance(body.logprobs, bool) or not isinstance(body.logprobs, int):
        raise ApiError(400, f"logprobs must be an integer count, got {body.logprobs!r}", param="logprobs")
    return body.logprobs
