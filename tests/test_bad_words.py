"""bad_words as vLLM tokenizes them: the word alone and, where it is another token sequence of the same length,
after a space."""
from __future__ import annotations

from pathlib import Path

import pytest

from ddtree_serve.decoding.config import MAX_BAD_WORD_TOKENS
from gateway.bad_words import MAX_BAD_WORDS, bad_word_token_ids, check_bad_words
from tests.fixtures import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_tokenizer(Path(tmp_path_factory.mktemp("tok")))


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_word_gives_its_own_tokens_and_its_word_initial_form(tokenizer):
    bare, spaced = _encode(tokenizer, "ab"), _encode(tokenizer, " ab")
    assert len(bare) == len(spaced) and bare[0] != spaced[0]   # the fixture's tokenizer: 'a','b' and ' a','b'
    assert bad_word_token_ids(tokenizer, ["ab"]) == [bare, spaced]
    assert bad_word_token_ids(tokenizer, ["   ab"]) == [bare, spaced]   # leading spaces stripped first


def test_a_spaced_form_of_another_length_is_left_out(tokenizer):
    word = next(w for w in ("hello", "world", "the", "x1")
                if len(_encode(tokenizer, w)) != len(_encode(tokenizer, " " + w)))
    assert bad_word_token_ids(tokenizer, [word]) == [_encode(tokenizer, word)]


def test_too_many_blank_or_too_long_words_are_refused(tokenizer):
    with pytest.raises(ValueError, match="at most 128"):
        check_bad_words(["a"] * (MAX_BAD_WORDS + 1))
    with pytest.raises(ValueError, match="non-blank"):
        check_bad_words(["ok", " \n"])
    with pytest.raises(ValueError, match=f"at most {MAX_BAD_WORD_TOKENS}"):
        bad_word_token_ids(tokenizer, ["a b " * 20])
