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


def test_include_stop_keeps_the_stop_string_that_ended_the_text(tokenizer) -> None:
    ids = tokenizer.encode("print(1)\nSTOP here\nmore", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop_strings=["here", "STOP"], include_stop=True)
    deltas, stopped = stream(detok, ids)
    assert stopped and "".join(deltas) == "print(1)\nSTOP"
    assert detok.stop_reason == "STOP"


def test_stop_strings_ending_before_min_tokens_are_passed_over(tokenizer) -> None:
    ids = tokenizer.encode("ab ab ab cd", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids][:4] == ["a", "b", " a", "b"]
    detok = IncrementalDetokenizer(tokenizer, stop_strings=["ab"], min_tokens=3)
    deltas, stopped = stream(detok, ids)
    # the first "ab" ends in token 1, before the third token allows a stop; the second one ends the text
    assert stopped and "".join(deltas) == "ab " and detok.stop_reason == "ab"
    without = IncrementalDetokenizer(tokenizer, stop_strings=["ab"], min_tokens=2)
    assert stream(without, ids)[0] == [""] * 2


def test_special_tokens_are_shown_when_not_skipped(tokenizer) -> None:
    ids = tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    deltas, _ = stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), ids)
    assert "".join(deltas) == "hi" + tokenizer.eos_token


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir), local_files_only=True)


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_streamed_text_equals_the_whole_decode_for_random_token_runs(which, request) -> None:
    """The windowed decode adds up to decoding everything at once, whatever the ids and however many arrive per
    step (multi-byte characters split across steps, special tokens, spaces and punctuation included)."""
    import random

    tokenizer = request.getfixturevalue("tokenizer" if which == "tiny" else "smollm2_tokenizer")

    rng = random.Random(0)
    vocab = len(tokenizer)
    texts = ["caf\u00e9 \u00fcber \u4e2d\u6587 \U0001f600!", " hello , world . x", "a\n\n  b\tc"]
    for trial in range(60):
        if trial % 2:
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        else:
            ids = tokenizer.encode(rng.choice(texts) * rng.randint(1, 3), add_special_tokens=False)
        detok, out, i = IncrementalDetokenizer(tokenizer), [], 0
        while i < len(ids):
            step = ids[i:i + rng.randint(1, 5)]   # several tokens a step, as a verify accepts them
            i += len(step)
            for tok in step:
                detok.stop_hit(tok)
            out.append(detok.take_text(final=i >= len(ids)))
        assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_a_step_decodes_a_window_not_the_whole_output(tokenizer) -> None:
    """The cost of a step does not grow with the length of the output."""
    calls = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    detok = IncrementalDetokenizer(Counting())
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 20, add_special_tokens=False)
    for tok in ids:
        detok.stop_hit(tok)
        detok.take_text()
    assert "".join([detok.text]) == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(calls[-20:]) <= 8, calls[-20:]


def _one_at_a_time(seq, tokens: list[int]) -> list[int]:
    """Sequence.append's rule applied token by token (what a step of several tokens must equal)."""
    kept = []
    for tok in tokens:
        kept += seq.append([tok])
        if seq.finish_reason:
            break
    return kept


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
@pytest.mark.parametrize("include_stop, min_tokens", [(False, 0), (True, 0), (False, 5), (True, 3)])
def test_a_step_of_many_tokens_stops_where_token_by_token_steps_would(which, include_stop, min_tokens,
                                                                      request) -> None:
    """Stop strings, a stop token and the length limit, in steps of 1-16 tokens: the same tokens kept, the same
    finish reason and the same streamed text as one token a step (one decode a step instead of one a token), with
    the stop string kept or not and stop strings ignored before min_tokens or not."""
    import random

    from ddtree_serve.decoding.config import SamplingParams
    from gateway.sequence import Sequence

    tokenizer = request.getfixturevalue("tokenizer" if which == "tiny" else "smollm2_tokenizer")
    rng = random.Random(1)
    words = ["alpha ", "beta ", "STOP", "<end>", "caf\u00e9 ", "\u4e2d ", ". ", "x"]
    for trial in range(80):
        ids = tokenizer.encode("".join(rng.choice(words) for _ in range(rng.randint(3, 25))), add_special_tokens=False)
        stop_ids = frozenset([rng.choice(ids)]) if trial % 3 == 0 else frozenset()
        max_tokens = rng.randint(1, len(ids) + 3)
        stops = rng.choice([[], ["STOP"], ["<end>", "beta al"], ["\u4e2d"]])

        def make() -> Sequence:
            return Sequence("r", [1], max_tokens, SamplingParams(), "ddtree", 64, stop_ids,
                            IncrementalDetokenizer(tokenizer, stops, include_stop, min_tokens))

        chunked, single = make(), make()
        kept_c, kept_s, text_c, text_s, i = [], [], [], [], 0
        while i < len(ids) and not chunked.finish_reason:
            step = ids[i:i + rng.randint(1, 16)]
            i += len(step)
            kept_c += chunked.append(step)
            text_c.append(chunked.detokenizer.take_text(final=bool(chunked.finish_reason) or i >= len(ids)))
        i = 0
        while i < len(ids) and not single.finish_reason:
            kept_s += _one_at_a_time(single, [ids[i]])
            i += 1
            text_s.append(single.detokenizer.take_text(final=bool(single.finish_reason) or i >= len(ids)))
        assert kept_c == kept_s and chunked.output_ids == single.output_ids, (ids, stops, max_tokens)
        assert chunked.finish_reason == single.finish_reason
        assert chunked.stop_reason == single.stop_reason
        assert "".join(text_c) == "".join(text_s)
