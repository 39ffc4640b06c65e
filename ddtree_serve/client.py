"""A small Python client of the gateway's gRPC API, blocking (Client) or asyncio (AsyncClient), with streaming.

    from ddtree_serve.client import Client

    with Client("127.0.0.1:50050") as c:
        for chunk in c.stream("What is the capital of France?", max_tokens=64):
            print(chunk.text, end="", flush=True)
        result = c.generate("Name three prime numbers.", max_tokens=32)
        print(result.text, result.stats["mean_acceptance_length"])
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc

from ddtree_serve.proto import common_pb2, gateway_pb2, gateway_pb2_grpc
from ddtree_serve.plumbing.rpc import CHANNEL_OPTIONS

MODES = {None: gateway_pb2.DECODE_MODE_DEFAULT, "ddtree": gateway_pb2.DECODE_MODE_DDTREE,
         "dflash": gateway_pb2.DECODE_MODE_DFLASH, "ar": gateway_pb2.DECODE_MODE_AR}


@dataclass
class Chunk:
    """One streamed message: the new tokens and their text; the last one has finished, finish_reason and stats."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str = ""
    stats: dict | None = None
    request_id: str = ""
    logprobs: list[dict] = field(default_factory=list)   # per token, when asked: {"logprob", "top": [(id, lp)]}
    # on the first chunk, when asked: the prompt's ids and a log-prob entry per prompt token after the first
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[dict] = field(default_factory=list)
    stop_reason: str | int | None = None   # on the last chunk of a "stop": the stop string or stop token


@dataclass
class Result:
    """A whole generation."""

    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict = field(default_factory=dict)
    request_id: str = ""
    logprobs: list[dict] = field(default_factory=list)   # per token, when asked (Chunk.logprobs)
    prompt_logprobs: list[dict] = field(default_factory=list)   # per prompt token after the first, when asked
    stop_reason: str | int | None = None   # with finish_reason "stop": the stop string or stop token that ended it

    def as_dict(self) -> dict:
        """The result as plain JSON-able data."""
        out = {"request_id": self.request_id, "token_ids": self.token_ids, "text": self.text,
               "finish_reason": self.finish_reason, "stop_reason": self.stop_reason, "stats": self.stats}
        if self.logprobs:
            out["logprobs"] = self.logprobs
        if self.prompt_logprobs:
            out["prompt_logprobs"] = self.prompt_logprobs
        return out


def build_request(prompt: str | None = None, *, prompt_ids: list[int] | None = None,
                  messages: list[dict] | None = None, chat: bool = True, max_tokens: int = 128,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                  mode: str | None = None, budget: int = 0, stop: list[str] | None = None,
                  ignore_eos: bool = False, logprobs: bool = False, top_logprobs: int = 0,
                  prompt_logprobs: int | None = None, min_p: float = 0.0,
                  presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                  logit_bias: dict[int, float] | None = None, min_tokens: int = 0,
                  allowed_token_ids: list[int] | None = None, stop_token_ids: list[int] | None = None,
                  include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                  bad_words: list[str] | None = None, chat_template_kwargs: dict | None = None,
                  continue_final_message: bool = False,
                  structured_output: tuple[str, str] | None = None,
                  tools: list[dict] | None = None, cache_salt: str = "",
                  priority: int = 0) -> gateway_pb2.GenerateRequest:
    """A GenerateRequest: token ids, chat messages, or a text prompt (as one chat message unless chat=False);
    logprobs: each token's log-prob in the answer, with top_logprobs alternatives; prompt_logprobs: each prompt
    token's (after the first), with that many alternatives; min_p, the penalties, logit_bias (token id -> bias),
    min_tokens, allowed_token_ids, stop_token_ids, include_stop_str_in_output, skip_special_tokens and bad_words
    as vLLM takes them; chat_template_kwargs (e.g. {"enable_thinking": False}) and continue_final_message shape
    the chat prompt as in vLLM; structured_output: (kind, spec) of a grammar the answer keeps to: ("json", a JSON
    schema's text), ("json_object", ""), ("regex", r), ("choice", a JSON list of strings), ("grammar", EBNF) or ("structural_tag", its JSON);
    tools (OpenAI's list) and messages' tool_calls / tool_call_id / name go to the chat template (the text comes
    back as the model writes it: the HTTP API is the one that reads tool calls out of it); cache_salt and priority
    as vLLM's (priority needs the gateway's --scheduling-policy priority)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of ddtree, dflash, ar, got {mode!r}")
    req = gateway_pb2.GenerateRequest(
        max_tokens=max_tokens, mode=MODES[mode], budget=budget, stop=stop or [], ignore_eos=ignore_eos,
        stop_token_ids=stop_token_ids or [], include_stop_str_in_output=include_stop_str_in_output,
        keep_special_tokens=not skip_special_tokens, bad_words=bad_words or [], cache_salt=cache_salt,
        priority=priority,
        logprobs=logprobs, top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs is not None,
        prompt_top_logprobs=prompt_logprobs or 0,
        sampling=common_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed or 0,
                                           has_seed=seed is not None, min_p=min_p, presence_penalty=presence_penalty,
                                           frequency_penalty=frequency_penalty,
                                           repetition_penalty=repetition_penalty, logit_bias=logit_bias or {},
                                           min_tokens=min_tokens, allowed_token_ids=allowed_token_ids or []))
    if structured_output is not None:
        req.guide.kind, req.guide.spec = structured_output
    if prompt_ids is not None:
        req.token_ids.ids.extend(prompt_ids)
    elif messages is not None or chat:
        for m in messages if messages is not None else [{"role": "user", "content": prompt or ""}]:
            req.chat.messages.add(role=m["role"], content=m.get("content") or "", name=m.get("name") or "",
                                  tool_call_id=m.get("tool_call_id") or "",
                                  tool_calls_json=json.dumps(m["tool_calls"]) if m.get("tool_calls") else "")
        req.chat.tools_json = json.dumps(tools) if tools else ""
        req.chat.continue_final_message = continue_final_message
        req.chat.template_kwargs_json = json.dumps(chat_template_kwargs) if chat_template_kwargs else ""
    else:
        req.text = prompt or ""
    return req


def stats_dict(s: gateway_pb2.GenerationStats) -> dict:
    """GenerationStats as a dict, with tokens_per_second added."""
    return {"prompt_tokens": s.prompt_tokens, "generated_tokens": s.generated_tokens, "steps": s.steps,
            "accepted_tokens": s.accepted_tokens, "mean_acceptance_length": round(s.mean_acceptance_length, 4),
            "draft_tokens": s.draft_tokens, "ttft_seconds": round(s.ttft_seconds, 4),
            "e2e_seconds": round(s.e2e_seconds, 4), "mode": s.mode, "requested_mode": s.requested_mode,
            "drafter_fallback": s.drafter_fallback, "budget": s.budget, "cached_prompt_tokens": s.cached_prompt_tokens,
            "tokens_per_second": round(s.generated_tokens / s.e2e_seconds, 2) if s.e2e_seconds else 0.0}


def _logprob_dicts(entries) -> list[dict]:
    return [{"logprob": lp.logprob, "top": list(zip(lp.top_ids, lp.top_logprobs))} for lp in entries]


def _chunk(msg: gateway_pb2.GenerateResponse) -> Chunk:
    return Chunk(token_ids=list(msg.token_ids), text=msg.text, finished=msg.finished,
                 finish_reason=msg.finish_reason, stats=stats_dict(msg.stats) if msg.finished else None,
                 request_id=msg.request_id, logprobs=_logprob_dicts(msg.logprobs),
                 prompt_token_ids=list(msg.prompt_token_ids), prompt_logprobs=_logprob_dicts(msg.prompt_logprobs),
                 stop_reason=_stop_reason(msg))


def _stop_reason(msg: gateway_pb2.GenerateResponse) -> str | int | None:
    if msg.stop_string:
        return msg.stop_string
    return msg.stop_token_id if msg.HasField("stop_token_id") else None


def _collect(chunks) -> Result:
    ids, text, logprobs, prompt, last = [], [], [], [], None
    for c in chunks:
        ids.extend(c.token_ids)
        text.append(c.text)
        logprobs.extend(c.logprobs)
        prompt.extend(c.prompt_logprobs)
        last = c
    return Result(ids, "".join(text), last.finish_reason, last.stats or {}, last.request_id, logprobs, prompt,
                  last.stop_reason)


def _request(prompt, request, kw) -> gateway_pb2.GenerateRequest:
    if request is not None:
        if prompt is not None or kw:
            raise TypeError("give either a prepared request or a prompt with options, not both")
        return request
    return build_request(prompt, **kw)


class Client:
    """Blocking client. Errors are grpc.RpcError with the gateway's status (INVALID_ARGUMENT for bad requests)."""

    def __init__(self, address: str = "127.0.0.1:50050", timeout_s: float = 600.0):
        self.address = address
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)

    def stream(self, prompt: str | None = None, *, request=None, **kw) -> Iterator[Chunk]:
        """Yields chunks as the gateway commits tokens; kw as build_request."""
        for msg in self._stub.GenerateStream(_request(prompt, request, kw), timeout=self.timeout_s):
            yield _chunk(msg)

    def generate(self, prompt: str | None = None, *, request=None, **kw) -> Result:
        """The whole generation (streamed underneath)."""
        return _collect(self.stream(prompt, request=request, **kw))

    def model_info(self) -> gateway_pb2.ModelInfoResponse:
        """Model, drafter, defaults and load of the gateway."""
        return self._stub.ModelInfo(gateway_pb2.ModelInfoRequest(), timeout=30)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client (grpc.aio); the same methods as Client, awaited."""

    def __init__(self, address: str = "127.0.0.1:50050", timeout_s: float = 600.0):
        self.address = address
        self.timeout_s = timeout_s
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)

    async def stream(self, prompt: str | None = None, *, request=None, **kw) -> AsyncIterator[Chunk]:
        """Yields chunks as the gateway commits tokens; kw as build_request."""
        async for msg in self._stub.GenerateStream(_request(prompt, request, kw), timeout=self.timeout_s):
            yield _chunk(msg)

    async def generate(self, prompt: str | None = None, *, request=None, **kw) -> Result:
        """The whole generation (streamed underneath)."""
        return _collect([c async for c in self.stream(prompt, request=request, **kw)])

    async def model_info(self) -> gateway_pb2.ModelInfoResponse:
        """Model, drafter, defaults and load of the gateway."""
        return await self._stub.ModelInfo(gateway_pb2.ModelInfoRequest(), timeout=30)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
