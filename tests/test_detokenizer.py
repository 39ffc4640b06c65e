"""Incremental detokenization: streamed deltas add up to the decoded text, stop strings cut it, no split chars."""
from __future__ import annotations

from pathlib import Path

import pytest

from gateway.detokenizer import IncrementalDetokenizer
from tests.fixtures import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_tokenizer(Path(tmp_path_factory.mktemp("tok")))


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], bool]:
    """Feeds ids one at a time as the engine does; returns the deltas and whether a stop string ended it."""
    deltas = []
    for i, tok in enumerate(ids):
        stopped = detok.stop_hit(tok)
        deltas.append(detok.take_text(final=stopped or i == len(ids) - 1))
        if stopped:
            return deltas, True
    return deltas, False


def test_deltas_join_to_the_whole_decoded_text(tokenizer) -> None:
    text = "def add(a, b):\n    return a + b\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, stopped = stream(IncrementalDetokenizer(tokenizer), ids)
    assert not stopped
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_multibyte_character_is_never_streamed_in_halves(tokenizer) -> None:
    text = "caf\u00e9 \u00fcber \u4e2d\u6587"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, _ = stream(IncrementalDetokenizer(tokenizer), ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_a_stop_string_ends_the_text_right_before_it(tokenizer) -> None:
    ids = tokenizer.encode("print(1)\nSTOP here\nmore", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop_strings=["STOP"])
    deltas, stopped = stream(detok, ids)
    assert stopped
    assert "".join(deltas) == "print(1)\n"


def test_a_possible_stop_string_start_is_held_back_until_resolved(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop_strings=["<end>"])
    for tok in tokenizer.encode("x = 1 <en", add_special_tokens=False):
        detok.stop_hit(tok)
    assert "<en" not in detok.take_text()
    hits = [detok.stop_hit(tok) for tok in tokenizer.encode("d> tail", add_special_tokens=False)]
    assert hits[-1]
    assert detok.take_text(final=True) == ""
    assert detok.text == "x = 1 "


def test_held_back_text_is_released_when_the_stream_ends(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop_strings=["<end>"])
    for tok in tokenizer.encode("ok <e", add_special_tokens=False):
        detok.stop_hit(tok)
    early = detok.take_text()
    assert early + detok.take_text(final=True) == "ok <e"


def test_special_tokens_are_not_streamed(tokenizer) -> None:
    ids = tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    deltas, _ = stream(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(deltas) == "hi"
