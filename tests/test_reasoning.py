"""Reasoning outputs (gateway/reasoning.py): where an answer starts, and its split into reasoning and content,
whole and streamed in pieces of any size."""
from __future__ import annotations

import pytest

from gateway.reasoning import REASONING_PARSERS, ReasoningStream, split_reasoning, starts_in_reasoning
from launch import cli


@pytest.mark.parametrize("prompt_tail, inside", [
    ("<|im_start|>assistant\n<think>\n", True),                       # Qwen3.5 / 3.6: the template opens it
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),        # enable_thinking: false closes it
    ("<|im_start|>assistant\n", False),                               # older Qwen3: the model opens it
    ("<think>a</think> then user asks\n<think>\n", True),             # only the last block counts
])
def test_an_answer_starts_inside_reasoning_when_the_prompts_last_block_is_open(prompt_tail, inside):
    assert starts_in_reasoning(prompt_tail) is inside


@pytest.mark.parametrize("text, inside, expected", [
    ("weigh it</think>\n\nIt is 4.", True, ("weigh it", "\n\nIt is 4.")),
    ("no block at all", False, (None, "no block at all")),
    ("<think>hm</think>Four.", False, ("hm", "Four.")),               # generated start tag
    ("\n<think>hm</think>Four.", False, ("hm", "Four.")),             # after leading whitespace too
    ("cut short by max_tokens", True, ("cut short by max_tokens", None)),
    ("x</think>", True, ("x", None)),
    ("say <think> later</think>", False, (None, "say <think> later</think>")),   # not at the start: content
])
def test_a_whole_answer_splits_into_reasoning_and_content(text, inside, expected):
    assert split_reasoning(text, inside) == expected


@pytest.mark.parametrize("text, inside", [
    ("weigh it</think>\n\nIt is 4 </thin or < /think>.", True),
    ("<think>hm</think>Four.", False),
    ("<thinking is a word", False),
    ("no close <", True),
])
@pytest.mark.parametrize("piece", [1, 2, 3, 7])
def test_a_streamed_answer_splits_as_the_whole_one_does_whatever_its_pieces(text, inside, piece):
    stream = ReasoningStream(inside)
    reasoning, content = "", ""
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)]
    for i, p in enumerate(pieces):
        r, c = stream.feed(p, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    assert (reasoning or None, content or None) == split_reasoning(text, inside)


def test_a_partial_end_tag_is_held_back_until_the_next_piece_settles_it():
    stream = ReasoningStream(True)
    assert stream.feed("think</thi") == ("think", "")
    assert stream.feed("nk>Four") == ("", "Four")


def test_the_gateway_flag_offers_exactly_the_parsers_the_gateway_knows():
    action = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices["gateway"]._actions
                  if a.dest == "reasoning_parser")
    assert tuple(action.choices) == ("none", *REASONING_PARSERS)
