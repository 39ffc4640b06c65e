"""Tool calls: tools validated, Hermes blocks read out of an answer (whole or streamed, the same calls), and the
forced choices' schemas hold an answer to calls."""
from __future__ import annotations

import json
import random

import pytest

from gateway.tool_calls import (CallDelta, HermesStream, RequiredCallsStream, ToolCall, check_tools, forced_calls,
                                forced_guide, parse_hermes)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ANSWER = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> Done.')


def test_hermes_blocks_become_calls_and_the_rest_stays_content():
    content, calls = parse_hermes(ANSWER)
    assert content == "Let me look. \n Done."
    assert calls == [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", "{}")]


def test_a_block_that_is_not_a_calls_json_stays_text():
    text = "<tool_call>not json</tool_call> and <tool_call>[1, 2]</tool_call>"
    assert parse_hermes(text) == (text, [])
    assert parse_hermes("no calls here") == ("no calls here", [])


def _merged(deltas) -> list[ToolCall]:
    """Streamed call deltas put together by index, as an OpenAI client does."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.name is not None:
            assert d.index == len(calls)   # a call's head comes first, indices in order
            calls[d.index] = [d.name, ""]
        calls[d.index][1] += d.arguments
    return [ToolCall(name, args) for name, args in calls.values()]


def test_a_streamed_answer_gives_the_same_calls_and_content_in_any_split():
    rng = random.Random(0)
    whole_content, whole_calls = parse_hermes(ANSWER)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(ANSWER)), rng.randint(1, 12)))
        pieces = [ANSWER[a:b] for a, b in zip([0] + cuts, cuts + [len(ANSWER)])]
        stream, content, deltas = HermesStream(), [], []
        for i, piece in enumerate(pieces):
            text, done = stream.feed(piece, final=i == len(pieces) - 1)
            assert "<tool_call>" not in text and "</tool_call>" not in text
            content.append(text)
            deltas += done
        assert _merged(deltas) == whole_calls and "".join(content) == "Let me look. \n Done."


def test_a_calls_name_goes_out_as_soon_as_it_is_read_and_its_arguments_as_they_come():
    stream = HermesStream()
    assert stream.feed('Sure. <tool_call>{"name": "get_wea') == ("Sure. ", [])
    text, deltas = stream.feed('ther", "arguments": {"city": "Pa')
    assert text == "" and [(d.index, d.name, d.arguments) for d in deltas] == [(0, "get_weather", ""),
                                                                              (0, None, '{"city": "Pa')]
    text, deltas = stream.feed('ris {x}", "n": [1, {"k": "}"}]}}</tool_call> ok')
    assert text == " ok" and [(d.name, d.arguments) for d in deltas] == [(None, 'ris {x}", "n": [1, {"k": "}"}]}')]
    assert json.loads('{"city": "Pa' + 'ris {x}", "n": [1, {"k": "}"}]}') == {"city": "Paris {x}",
                                                                             "n": [1, {"k": "}"}]}


def test_a_block_with_another_head_goes_out_whole_when_it_closes_and_a_cut_off_call_stays_begun():
    stream = HermesStream()
    assert stream.feed('<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}') == ("", [])
    text, deltas = stream.feed("</tool_call>", final=True)
    assert text == "" and [(d.index, d.name, d.arguments) for d in deltas] == [(0, "get_weather", '{"city": "Oslo"}')]
    cut = HermesStream()
    text, deltas = cut.feed('<tool_call>{"name": "get_time", "arguments": {"a', final=True)
    assert text == "" and [(d.name, d.arguments) for d in deltas] == [("get_time", ""), (None, '{"a')]


def test_a_streamed_tail_that_might_open_a_block_is_held_until_it_does_not():
    stream = HermesStream()
    assert stream.feed("Hello <tool") == ("Hello ", [])
    assert stream.feed("box>") == ("<toolbox>", [])
    assert stream.feed("<tool_call>{bad", final=True) == ("<tool_call>{bad", [])


@pytest.mark.parametrize("tools, choice, fragment", [
    ([{"type": "function"}], "auto", "tools[0] must be"),
    ([{"type": "retrieval", "function": {"name": "x"}}], "auto", "tools[0] must be"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "function.name must be"),
    ([WEATHER, WEATHER], "auto", "distinct"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
    ([WEATHER], "sometimes", "tool_choice must be"),
    ([], "required", "needs tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "auto", "parameters must be"),
])
def test_bad_tools_and_choices_are_refused_with_the_reason(tools, choice, fragment):
    with pytest.raises(ValueError) as info:
        check_tools(tools, choice)
    assert fragment in str(info.value)


def test_forced_schemas_parse_and_hold_an_answer_to_calls():
    xgr = pytest.importorskip("xgrammar")
    functions = check_tools([WEATHER, TIME], "required")
    required = forced_guide(functions, "required")
    named = forced_guide(functions, {"type": "function", "function": {"name": "get_weather"}})
    assert forced_guide(functions, "auto") is None and forced_guide(functions, None) is None
    for spec in (required, named):
        spec.grammar()   # xgrammar takes both schemas
    assert json.loads(named.spec) == WEATHER["function"]["parameters"] and not named.any_whitespace
    assert "maxItems" not in json.loads(required.spec)
    assert json.loads(forced_guide(functions, "required", parallel=False).spec)["maxItems"] == 1
    answer = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    assert forced_calls(answer, "required") == [ToolCall("get_time", "{}"),
                                                ToolCall("get_weather", '{"city": "Oslo"}')]
    named_choice = {"type": "function", "function": {"name": "get_weather"}}
    assert forced_calls('{"city": "Rome"}', named_choice) == [ToolCall("get_weather", '{"city": "Rome"}')]
    assert forced_calls('{"city": "Ro', named_choice) == []   # cut off by max_tokens
    del xgr


def test_a_call_in_openai_shape_has_an_id_a_type_and_streamed_its_pieces_carry_its_index():
    out = ToolCall("f", "{}").as_json()
    assert out["type"] == "function" and out["id"].startswith("call_") and "index" not in out
    assert out["function"] == {"name": "f", "arguments": "{}"}
    head, more = CallDelta(1, "", "f").as_json(), CallDelta(1, '{"a": 1}').as_json()
    assert head["id"].startswith("call_") and head["type"] == "function" and head["function"] == {"name": "f",
                                                                                               "arguments": ""}
    assert more == {"index": 1, "function": {"arguments": '{"a": 1}'}}


def test_required_calls_stream_each_calls_head_then_its_parameters_in_any_split():
    answer = '[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{"city":"O}slo"}}]'
    want = forced_calls(answer, "required")
    rng = random.Random(1)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(answer)), rng.randint(1, 10)))
        stream, deltas = RequiredCallsStream(), []
        for a, b in zip([0] + cuts, cuts + [len(answer)]):
            deltas += stream.feed(answer[a:b])
        got = _merged(deltas)
        assert [(c.name, json.loads(c.arguments)) for c in got] == [(c.name, json.loads(c.arguments)) for c in want]
