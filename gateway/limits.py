"""Bounds on what one public request may cost before it is admitted, and checks that keep it in its own lane.

Everything here runs before tokenization or scheduling, in time proportional to the (already capped) message
size, so an oversized or hostile request is refused in well under a second while others keep their latency.
"""
from __future__ import annotations

import json
import re

import grpc

# gRPC refuses larger public messages itself (RESOURCE_EXHAUSTED) before any of our code runs. 4 MiB is gRPC's own
# default and holds ~500k token ids or a 4 MB prompt: far more than any context window we serve.
MAX_REQUEST_BYTES = 4 * 1024 * 1024
# Characters of prompt text per token of context: tokenizers average 3-5, long whitespace runs more. Text longer
# than this cannot fit the context anyway, so it is refused without tokenizing it.
MAX_CHARS_PER_TOKEN = 32
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


def check_prompt_size(request, max_seq_len: int) -> None:
    """Refuses prompts that cannot fit the context, by counting characters or ids (no tokenization)."""
    kind = request.WhichOneof("prompt")
    if kind == "token_ids" and len(request.token_ids.ids) > max_seq_len:
        raise ValueError(f"prompt has {len(request.token_ids.ids)} token ids; the context limit is {max_seq_len}")
    if kind == "text":
        chars = len(request.text)
    elif kind == "chat":
        chars = sum(len(m.content) + len(m.role) + len(m.tool_calls_json) for m in request.chat.messages)
        chars += len(request.chat.tools_json)
    else:
        return
    limit = max_seq_len * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise ValueError(f"prompt of {chars} characters cannot fit the {max_seq_len}-token context "
                         f"(at most {limit} characters accepted)")


def check_stops(stop: list[str], stop_token_ids: list[int]) -> None:
    """Caps the number and length of stop strings and stop token ids (each costs work on every token)."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(stop_token_ids)}")


def special_token_strings(tokenizer) -> list[str]:
    """The text forms of the tokenizer's control tokens (<|im_start|>, <|endoftext|>, ...)."""
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok.content))
    return sorted((s for s in specials if s), key=len, reverse=True)


def check_no_control_tokens(where: str, text: str, specials: list[str]) -> None:
    """Refuses a control token typed into text the chat template renders (role injection)."""
    for s in specials:
        if s in text:
            raise ValueError(f"{where} contains the control token {s!r}; special tokens are not accepted in chat "
                             "messages")


def check_chat_messages(messages: list[dict], specials: list[str]) -> None:
    """Refuses a control token typed into a message (role injection through the chat template), and odd roles."""
    for i, m in enumerate(messages):
        if m["role"] not in CHAT_ROLES:
            raise ValueError(f"message {i}: role must be one of {sorted(CHAT_ROLES)}, got {m['role'][:32]!r}")
        check_no_control_tokens(f"message {i}", m["content"], specials)
        for key in ("tool_calls", "tool_call_id", "name"):
            if key in m:
                check_no_control_tokens(f"message {i}", json.dumps(m[key]), specials)


def json_list(text: str, name: str) -> list:
    """A JSON list a request carries as text (ValueError when it is not one)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a JSON list")
    return value


def chat_message(m) -> dict:
    """A ChatMessage as the chat template takes it: role and content, and an assistant's tool calls, a tool
    message's call id and a name where given."""
    message = {"role": m.role, "content": m.content}
    if m.tool_calls_json:
        message["tool_calls"] = json_list(m.tool_calls_json, "tool_calls")
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.name:
        message["name"] = m.name
    return message


MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_KWARG_CHARS = 1024
# apply_chat_template's own arguments and the template's fixed inputs: a request may not set them this way
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token", "pad_token", "unk_token",
    "raise_exception",
})
_TEMPLATE_KWARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def chat_template_kwargs(text: str) -> dict:
    """A request's chat-template switches (a JSON object, "" for none) as apply_chat_template keywords: at most 16,
    named like template variables, not apply_chat_template's own arguments, each a JSON scalar."""
    if not text:
        return {}
    try:
        kwargs = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"chat_template_kwargs is not valid JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs must be a JSON object")
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"at most {MAX_TEMPLATE_KWARGS} chat_template_kwargs, got {len(kwargs)}")
    for name, value in kwargs.items():
        if not _TEMPLATE_KWARG_NAME.fullmatch(name) or name in _RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"chat_template_kwargs may not set {name[:64]!r}")
        if not (value is None or isinstance(value, (bool, int, float))
                or (isinstance(value, str) and len(value) <= MAX_TEMPLATE_KWARG_CHARS)):
            raise ValueError(f"chat_template_kwargs[{name!r}] must be a boolean, a number, null or a string of at "
                             f"most {MAX_TEMPLATE_KWARG_CHARS} characters")
    return kwargs


class _Undecodable:
    """Stands in for a request the deserializer rejected, so the handler can answer INVALID_ARGUMENT."""

    def __init__(self, error: str):
        self.error = error


def _safe(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - e.g. a string field that is not valid UTF-8
            return _Undecodable(f"{type(exc).__name__}: {exc}")
    return deserialize


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT (not UNKNOWN) to a request that does not parse, e.g. text that is not UTF-8."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        message = "request does not parse (string fields must be valid UTF-8)"
        if handler.response_streaming:
            inner = handler.unary_stream

            async def unary_stream(request, context):
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
                async for item in inner(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(unary_stream, _safe(handler.request_deserializer),
                                                        handler.response_serializer)
        inner_unary = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
            return await inner_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, _safe(handler.request_deserializer),
                                                   handler.response_serializer)
