"""Tool calling as OpenAI's chat API has it: the tools go into the prompt through the chat template, and the
answer's tool calls come back as `tool_calls`.

With tool_choice "auto" the model decides: its calls are read out of the text in the Hermes format that the Qwen
family (the flagship's) and Hermes models are trained on, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(vLLM's `hermes` parser); streamed, a call's name goes out once read and its arguments as they come. With
"required" or a named function the answer is held to the calls by a structured output (a JSON schema, as vLLM
does): an array of {name, parameters} for "required", the named function's arguments alone otherwise; compact JSON
(no free whitespace, which a model can loop on). "none" leaves the text as it is.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ddtree_serve.decoding.guides import GuideSpec

MAX_TOOLS = 128
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as a JSON text."""

    name: str
    arguments: str
    id: str = ""

    def as_json(self) -> dict:
        """The call as OpenAI's `tool_calls` entry of a whole message (streamed calls go out as CallDelta pieces)."""
        return {"id": self.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def check_tools(tools: list[dict], tool_choice) -> list[dict]:
    """The tools' function definitions, validated (ValueError says what is wrong), and tool_choice against them."""
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools, got {len(tools)}")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        if not isinstance(fn.get("name"), str) or not _NAME.fullmatch(fn["name"]):
            raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        functions.append(fn)
    names = [fn["name"] for fn in functions]
    if len(set(names)) != len(names):
        raise ValueError("tool function names must be distinct")
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or name not in names:
            raise ValueError("tool_choice names a function that is not among the tools")
    elif tool_choice not in (None, "none", "auto", "required"):
        raise ValueError(f"tool_choice must be none, auto, required or a named function, got {tool_choice!r}")
    elif tool_choice == "required" and not functions:
        raise ValueError("tool_choice required needs tools")
    return functions


def forced_guide(functions: list[dict], tool_choice, parallel: bool = True) -> GuideSpec | None:
    """The structured output that holds the answer to tool calls (required, or a named function; one call unless
    parallel); None otherwise."""
    if isinstance(tool_choice, dict):
        fn = next(f for f in functions if f["name"] == tool_choice["function"]["name"])
        return GuideSpec("json", json.dumps(fn.get("parameters") or {"type": "object"}), any_whitespace=False)
    if tool_choice != "required":
        return None
    one_of = [{"type": "object", "properties": {"name": {"type": "string", "enum": [fn["name"]]},
                                                "parameters": fn.get("parameters") or {"type": "object"}},
               "required": ["name", "parameters"]} for fn in functions]
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
    if not parallel:
        calls["maxItems"] = 1
    return GuideSpec("json", json.dumps(calls), any_whitespace=False)


def forced_calls(text: str, tool_choice) -> list[ToolCall]:
    """The calls of an answer held by forced_guide's grammar (it parses; a cut-off answer gives none)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if isinstance(tool_choice, dict):
        return [ToolCall(tool_choice["function"]["name"], json.dumps(value))]
    return [ToolCall(c["name"], json.dumps(c["parameters"])) for c in value]


def _call_of(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], args if isinstance(args, str) else json.dumps(args))


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """(the content outside the tool-call blocks, the calls) of an answer; a block that is not a call's JSON stays
    in the content, as vLLM's hermes parser leaves it."""
    calls, content, end = [], [], 0
    for block in _BLOCK.finditer(text):
        call = _call_of(block.group(1).strip())
        if call is None:
            continue
        content.append(text[end:block.start()])
        end = block.end()
        calls.append(call)
    content.append(text[end:])
    return "".join(content).strip() if calls else text, calls


@dataclass
class CallDelta:
    """A streamed piece of a tool call, as OpenAI streams one: its head (id, name, and the arguments so far) once the
    name is read, then further fragments of its arguments' JSON text; every piece names the call's index."""

    index: int
    arguments: str
    name: str | None = None   # set on a call's first piece only
    id: str = ""

    def as_json(self) -> dict:
        """The piece as a `tool_calls` entry of a streamed delta."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


# A call's opening up to its arguments' object: the name is known from here, and the arguments stream as they come.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"(' + _NAME.pattern + r')"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


class _JsonValueEnd:
    """Where a JSON object's text ends, fed a piece at a time (strings and escapes respected)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped, self.done = 0, False, False, False

    def feed(self, text: str) -> int:
        """How many characters of text belong to the object (all of them until it closes)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class HermesStream:
    """Splits a streamed answer into content deltas and tool-call deltas: content goes out as it comes, less a tail
    that may begin a `<tool_call>`; a call's name goes out once its block has it, then its arguments as they come
    (vLLM's streaming hermes parser). A block whose head is not `{"name": ..., "arguments": {` goes out whole once
    it closes, or stays text when it is not a call."""

    def __init__(self):
        self.pending = ""      # text not yet sent outside a block: a possible block opening
        self.block: str | None = None   # the open block's text so far (None: no block open)
        self.calls = 0         # calls begun so far (each call's index)
        self._args_at = -1     # where the open block's arguments start once its head went out (-1: not yet)
        self._args_sent = 0    # characters of those arguments sent
        self._args_end: _JsonValueEnd | None = None
        self._searched = 0     # characters of the open block already searched for its end (a long block: linear)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        """(content to send now, call deltas to send now) after text; final flushes what is left."""
        content: list[str] = []
        deltas: list[CallDelta] = []
        if self.block is None:
            self.pending += text
        else:
            self.block += text
        while True:
            if self.block is None:
                start = self.pending.find(TOOL_CALL_OPEN)
                if start < 0:
                    keep = 0 if final else _open_prefix(self.pending)
                    content.append(self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                content.append(self.pending[:start])
                self.block, self.pending = self.pending[start + len(TOOL_CALL_OPEN):], ""
            close = self.block.find(TOOL_CALL_CLOSE, max(0, self._searched - len(TOOL_CALL_CLOSE) + 1))
            self._searched = len(self.block)
            body = self.block if close < 0 else self.block[:close]
            self._stream_arguments(body, deltas)
            if close < 0:
                if final and self._args_at < 0:   # a block the answer never closed, no call begun: text
                    content.append(TOOL_CALL_OPEN + self.block)
                if final:
                    self._end_block()
                break
            if self._args_at < 0:
                call = _call_of(body.strip())
                if call is None:
                    content.append(TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE)
                else:
                    deltas.append(CallDelta(self.calls, call.arguments, call.name))
                    self.calls += 1
            self.pending = self.block[close + len(TOOL_CALL_CLOSE):]
            self._end_block()
        return "".join(content), deltas

    def _stream_arguments(self, body: str, deltas: list[CallDelta]) -> None:
        """The open block's head once it is there, and its arguments' text not yet sent."""
        if self._args_at < 0:
            head = _HEAD.match(body)
            if head is None:
                return
            self._args_at, self._args_end = head.end(), _JsonValueEnd()
            deltas.append(CallDelta(self.calls, "", head.group(1)))
            self.calls += 1
        if self._args_end.done:
            return
        new = body[self._args_at + self._args_sent:]
        n = self._args_end.feed(new)
        if n:
            deltas.append(CallDelta(self.calls - 1, new[:n]))
            self._args_sent += n

    def _end_block(self) -> None:
        self.block, self._args_at, self._args_sent, self._args_end, self._searched = None, -1, 0, None, 0


# One call of tool_choice "required"'s array, up to its parameters' object (forced_guide's compact JSON, keys in the
# schema's order).
_REQUIRED_HEAD = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*"(' + _NAME.pattern + r')"\s*,\s*"parameters"\s*:\s*(?=\{)')


class RequiredCallsStream:
    """Tool calls out of tool_choice "required"'s streamed answer (an array of {name, parameters}, held to it by
    forced_guide's grammar): each call's head once its name is read, then its parameters as they come."""

    def __init__(self):
        self.text = ""
        self.calls = 0
        self._state = "head"   # head: waiting for a call's name; args: sending its parameters; tail: its "}"
        self._pos = 0          # where the text not yet read starts
        self._args_end: _JsonValueEnd | None = None

    def feed(self, text: str) -> list[CallDelta]:
        """The call pieces to send now, after text."""
        self.text += text
        deltas: list[CallDelta] = []
        while True:
            if self._state == "head":
                head = _REQUIRED_HEAD.match(self.text, self._pos)
                if head is None:
                    return deltas
                deltas.append(CallDelta(self.calls, "", head.group(1)))
                self.calls += 1
                self._state, self._pos, self._args_end = "args", head.end(), _JsonValueEnd()
            if self._state == "args":
                new = self.text[self._pos:]
                n = self._args_end.feed(new)
                if n:
                    deltas.append(CallDelta(self.calls - 1, new[:n]))
                self._pos += n
                if not self._args_end.done:
                    return deltas
                self._state = "tail"
            close = self.text.find("}", self._pos)
            if close < 0:
                return deltas
            self._state, self._pos = "head", close + 1


def _open_prefix(text: str) -> int:
    """How many characters at the end of text could begin `<tool_call>`."""
    for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_OPEN[:k]):
            return k
    return 0
