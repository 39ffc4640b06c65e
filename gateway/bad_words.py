"""vLLM's bad_words: each word as the token sequences it can be generated as, at the start of the text and after
a space."""
from __future__ import annotations

from ddtree_serve.decoding.config import MAX_BAD_WORD_TOKENS

MAX_BAD_WORDS = 128   # strings per request (each gives one or two token sequences)
MAX_BAD_WORD_CHARS = 256


def check_bad_words(words: list[str]) -> None:
    """Caps their number and length; refuses blank ones (they name no token)."""
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"at most {MAX_BAD_WORDS} bad_words, got {len(words)}")
    for word in words:
        if not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
            raise ValueError(f"bad_words must be non-blank strings of at most {MAX_BAD_WORD_CHARS} characters")


def bad_word_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """The token sequences of each word as vLLM tokenizes them: the word (its leading spaces stripped) on its own,
    and with one leading space where that gives a different first token in as many tokens (a word-initial form)."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        for ids in (bare, spaced) if spaced[0] != bare[0] and len(spaced) == len(bare) else (bare,):
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise ValueError(f"bad word {word[:40]!r} is {len(ids)} tokens; at most {MAX_BAD_WORD_TOKENS}")
            out.append(ids)
    return out
