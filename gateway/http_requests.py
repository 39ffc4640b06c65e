"""The OpenAI-compatible API's request bodies: their schemas (the fields OpenAI and vLLM define that this server
honours, plus the ddtree extensions), their checks, and their translation into the gateway's GenerateRequest;
errors in OpenAI's shape."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

import grpc
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ddtree_serve.decoding.logprobs import MAX_TOP_LOGPROBS
from ddtree_serve.plumbing.messages import guide_proto
from ddtree_serve.plumbing.rpc import status_for
from ddtree_serve.proto import common_pb2, gateway_pb2
from gateway.tool_calls import ToolCall, check_tools, forced_calls, forced_guide, parse_hermes

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
class GenerationRequest(BaseModel):
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
    cache_salt: str | None = None   # vLLM's: prefix caching shares cached prompt rows within one salt only
    priority: int = 0   # vLLM's: with --scheduling-policy priority, lower values are admitted first


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None   # an assistant's earlier calls
    tool_call_id: str | None = None                  # a tool message: the call it answers
    name: str | None = None


class ChatOptions(BaseModel):
    """vLLM's chat-template options."""

    chat_template_kwargs: dict[str, Any] | None = None   # the template's switches, e.g. {"enable_thinking": false}
    add_generation_prompt: bool = True
    continue_final_message: bool = False   # the answer continues the last (assistant) message


class ChatCompletionRequest(GenerationRequest, ChatOptions):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None   # false: tool_choice required makes one call
    top_logprobs: int | None = None


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(ChatOptions):
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


def content_text(content: str | list[dict[str, Any]] | None) -> str:
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


def check_body(body: GenerationRequest) -> None:
    """Refuses (ApiError 400) what a chat or completion body asks out of range, or asks of a field not honoured."""
    if not 1 <= body.n <= MAX_SAMPLES:
        raise ApiError(400, f"n must be in [1, {MAX_SAMPLES}], got {body.n}", param="n")
    wanted = wanted_logprobs(body)
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


def generate_request(body: GenerationRequest, max_tokens: int | None,
                     default_max: int | None) -> gateway_pb2.GenerateRequest:
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
    wanted = wanted_logprobs(body)
    req = gateway_pb2.GenerateRequest(sampling=sampling, stop=stop, ignore_eos=body.ignore_eos,
                                      stop_token_ids=body.stop_token_ids or [], budget=body.budget or 0,
                                      include_stop_str_in_output=body.include_stop_str_in_output,
                                      keep_special_tokens=not body.skip_special_tokens,
                                      bad_words=body.bad_words or [],
                                      mode=MODE_ENUMS.get(body.mode, gateway_pb2.DECODE_MODE_DEFAULT),
                                      logprobs=wanted is not None, top_logprobs=wanted or 0)
    if body.prompt_logprobs is not None:
        req.prompt_logprobs, req.prompt_top_logprobs = True, body.prompt_logprobs
    guide = guide_of(body)
    if guide is not None:
        req.guide.CopyFrom(guide)
    req.cache_salt = body.cache_salt or ""
    if not -2**31 <= body.priority < 2**31:
        raise ApiError(400, f"priority {body.priority} is out of range (a 32-bit integer)", param="priority")
    req.priority = body.priority
    req.max_tokens = max_tokens if max_tokens is not None else (default_max or 0)
    return req


def chat_messages(messages: list[ChatMessage], options: ChatOptions) -> gateway_pb2.ChatMessages:
    """The messages and the chat options as the gateway's ChatMessages."""
    if options.add_generation_prompt and options.continue_final_message:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true",
                       param="continue_final_message")
    chat = gateway_pb2.ChatMessages(continue_final_message=options.continue_final_message,
                                    no_generation_prompt=not options.add_generation_prompt,
                                    template_kwargs_json=json.dumps(options.chat_template_kwargs)
                                    if options.chat_template_kwargs else "")
    for m in messages:
        chat.messages.add(role=m.role, content=content_text(m.content), name=m.name or "",
                          tool_call_id=m.tool_call_id or "",
                          tool_calls_json=json.dumps(m.tool_calls) if m.tool_calls else "")
    return chat


def add_tools(req: gateway_pb2.GenerateRequest, body: ChatCompletionRequest) -> None:
    """The body's tools into the chat prompt, and for tool_choice required or named the structured output that
    holds the answer to the calls (ApiError 400 when the tools or the choice are malformed)."""
    if not body.tools and body.tool_choice in (None, "none"):
        return
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


def tool_mode(body: GenerationRequest) -> str | None:
    """How a chat answer's tool calls are read: "auto" (the Hermes blocks in the text), "forced" (the whole answer
    is the calls' JSON) or None (no tools, or tool_choice none)."""
    if not isinstance(body, ChatCompletionRequest) or not body.tools or body.tool_choice == "none":
        return None
    return "auto" if body.tool_choice in (None, "auto") else "forced"


def answer_calls(mode: str | None, body, content: str) -> tuple[str | None, list[ToolCall]]:
    """(the message content, its tool calls) of a whole chat answer."""
    if mode == "auto":
        content, calls = parse_hermes(content)
        return content or (None if calls else content), calls
    if mode == "forced":
        calls = forced_calls(content, body.tool_choice)
        return (None if calls else content), calls
    return content, []


def samples(req: gateway_pb2.GenerateRequest, n: int) -> list[gateway_pb2.GenerateRequest]:
    """The request n times; with a seed, sample i draws from seed + i (each reproducible, none the same)."""
    out = [req]
    for i in range(1, n):
        sample = gateway_pb2.GenerateRequest()
        sample.CopyFrom(req)
        if req.sampling.has_seed:
            sample.sampling.seed = (req.sampling.seed + i) % (1 << 64)
        out.append(sample)
    return out


def guide_of(body: GenerationRequest) -> common_pb2.Guide | None:
    """The body's structured output as a Guide (None: free text); a 400 when it is malformed or given twice."""
    found = []
    fmt = body.response_format
    if fmt is not None and fmt.get("type", "text") != "text":
        if fmt.get("type") == "json_object":
            found.append(("response_format", "json_object", ""))
        elif fmt.get("type") == "json_schema" and isinstance((fmt.get("json_schema") or {}).get("schema"), dict):
            found.append(("response_format", "json", json.dumps(fmt["json_schema"]["schema"])))
        elif fmt.get("type") == "structural_tag":   # vLLM's: structures + triggers, or xgrammar's format
            found.append(("response_format", "structural_tag", json.dumps({k: v for k, v in fmt.items() if k != "type"})))
        else:
            raise ApiError(400, "response_format must be text, json_object, json_schema with a json_schema.schema "
                                "object, or structural_tag", param="response_format")
    vllm = {k: v for k, v in (body.structured_outputs or {}).items() if v is not None and v is not False}
    compact = bool(vllm.pop("disable_any_whitespace", False))
    for legacy in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{legacy}")
        if value is not None:
            vllm[legacy] = value
    if vllm.get("json_object"):
        found.append(("structured_outputs", "json_object", ""))
    for kind in ("json", "regex", "choice", "grammar", "structural_tag"):
        value = vllm.get(kind)
        if value is None:
            continue
        if kind in ("json", "choice", "structural_tag") and not isinstance(value, str):
            value = json.dumps(value)
        if not isinstance(value, str):
            raise ApiError(400, f"structured output {kind} must be a string", param="structured_outputs")
        found.append(("structured_outputs", kind, value))
    unknown = set(vllm) - {"json", "regex", "choice", "grammar", "json_object", "structural_tag"}
    if unknown:
        raise ApiError(400, f"structured_outputs {sorted(unknown)[0]!r} is not supported", param="structured_outputs")
    if len(found) > 1:
        raise ApiError(400, "give one structured output: response_format, structured_outputs or guided_* name "
                            f"{len(found)}", param=found[1][0])
    return common_pb2.Guide(kind=found[0][1], spec=found[0][2], compact_json=compact) if found else None


def stop_reason(seq, body: GenerationRequest) -> str | int | None:
    """vLLM's stop_reason: the stop string or one of the request's stop_token_ids that ended it; None for EOS."""
    reason = seq.stop_reason
    if isinstance(reason, int) and reason not in (body.stop_token_ids or ()):
        return None
    return reason


def wanted_logprobs(body: GenerationRequest) -> int | None:
    """The alternatives per token a body asks log-probs with, None for none: chat's logprobs (bool) and
    top_logprobs, completions' logprobs (a count)."""
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    if body.logprobs is None or body.logprobs is False:
        return None
    if isinstance(body.logprobs, bool) or not isinstance(body.logprobs, int):
        raise ApiError(400, f"logprobs must be an integer count, got {body.logprobs!r}", param="logprobs")
    return body.logprobs
