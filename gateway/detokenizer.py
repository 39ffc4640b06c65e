"""Incremental detokenization with stop strings, as a streaming client expects it.

Each update decodes only a window of the last tokens (as TGI and vLLM do): the ids from `prefix_offset` on, less
what the ids from `prefix_offset` to `read_offset` decoded to. Decoding the whole output every step instead costs
time in its length, on every step of every sequence (quadratic over a response, on the gateway's loop). The
window starts one token before the new ones, so a tokenizer that drops a leading space at the start of a decode
still shows it; a window that ends inside a multi-byte character ("\ufffd") is kept open until it completes.

As vLLM's: `include_stop` keeps the stop string in the text; before `min_tokens` tokens no stop string ends the
text (one must end in a token at index min_tokens - 1 or later); `skip_special_tokens=False` decodes them too."""
from __future__ import annotations

import re


class IncrementalDetokenizer:
    """Turns committed tokens into text deltas; holds back text that might be a partial UTF-8 char or stop string."""

    def __init__(self, tokenizer, stop_strings: list[str] | tuple[str, ...] = (), include_stop: bool = False,
                 min_tokens: int = 0, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.skip_special_tokens = skip_special_tokens
        self.stop_reason = ""  # the stop string that ended the text
        self._floor = 0        # a stop string must end past this many characters (the text before min_tokens)
        # One alternation scans the new text once for all stop strings (the gateway caps their number and length).
        self._stop_re = re.compile("|".join(map(re.escape, self.stop_strings))) if self.stop_strings else None
        self._window = max((len(s) for s in self.stop_strings), default=0)
        self.ids: list[int] = []
        self.text = ""         # decoded text of self.ids (truncated at a stop string once hit)
        self.sent = 0          # characters of self.text already streamed
        self.stopped = False
        self._stable = ""      # text of ids[:read_offset], final
        self._text_ids = 0     # how many of ids self.text is the decode of (take_text decodes only when behind)
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self) -> str:
        """The text of all ids so far, decoding only the window since the last complete character."""
        window = self.ids[self._prefix_offset:]
        if not window:
            return self._stable
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        prefix = decode(self.ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        full = decode(window, skip_special_tokens=skip)
        if full.startswith(prefix):
            text = self._stable + full[len(prefix):]
        else:   # the window's tail changed its head (a tokenizer's clean-up across the boundary): decode it all
            text = decode(self.ids, skip_special_tokens=skip)
        if not text.endswith("\ufffd"):
            self._stable = text
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return text

    def extend(self, tokens: list[int]) -> int | None:
        """Adds tokens; the index of the one that completes a stop string (the text is then cut right before it,
        and the tokens after it are not added), else None. One decode for all of them: a step commits up to 16
        tokens a sequence, and a decode after each one cost 3.2x as much (bench.detokenize: 53 -> 16 us a
        sequence a step at 8 tokens, on the gateway's loop)."""
        if not self.stop_strings or not tokens:
            self.ids.extend(tokens)
            return None
        if len(self.ids) < self.min_tokens:   # the min_tokens floor moves token by token (once per request)
            for i, token in enumerate(tokens):
                if self.stop_hit(token):
                    return i
            return None
        saved = (len(self.ids), self.text, self._text_ids, self._stable, self._prefix_offset, self._read_offset)
        prev_len = len(self.text)
        self.ids.extend(tokens)
        text = self._decode()
        if self._first_stop(text, max(0, prev_len - self._window)) is None:
            self.text, self._text_ids = text, len(self.ids)
            return None
        # Rare: a stop string appeared. Token by token from where the step began, to find the one that completed it.
        n, self.text, self._text_ids, self._stable, self._prefix_offset, self._read_offset = saved
        del self.ids[n:]
        for i, token in enumerate(tokens):
            if self.stop_hit(token):
                return i
        return None   # only seen in the text of all of them, not after any one: they are all added

    def stop_hit(self, token: int) -> bool:
        """Adds one token; True when a stop string now appears (the text is cut right before it)."""
        self.ids.append(token)
        if not self.stop_strings:
            return False
        prev_len = len(self.text)
        self.text, self._text_ids = self._decode(), len(self.ids)
        if len(self.ids) < self.min_tokens:
            self._floor = len(self.text)
            return False
        hit = self._first_stop(self.text, max(0, prev_len - self._window))
        if hit:
            self.text = self.text[:hit.end() if self.include_stop else hit.start()]
            self.stop_reason = hit.group()
            self.stopped = True
        return self.stopped

    def _first_stop(self, text: str, start: int) -> re.Match | None:
        """The leftmost stop string in text[start:] that ends past the min_tokens floor."""
        hit = self._stop_re.search(text, start)
        while hit is not None and hit.end() <= self._floor:   # overlapping matches: retry one character on
            hit = self._stop_re.search(text, hit.start() + 1)
        return hit

    def take_text(self, final: bool = False) -> str:
        """Returns the text not yet streamed; keeps back an incomplete character or a possible stop-string start."""
        if not self.stopped and self._text_ids != len(self.ids):
            self.text, self._text_ids = self._decode(), len(self.ids)
        end = len(self.text)
        if not final and not self.stopped:
            if self.text.endswith("\ufffd"):
                end -= 1
            for s in self.stop_strings:  # a stop string may be completed by the next token
                for k in range(min(len(s) - 1, end), 0, -1):
                    if self.text[:end].endswith(s[:k]):
                        end = min(end, len(self.text[:end]) - k)
                        break
        end = max(end, self.sent)
        delta = self.text[self.sent:end]
        self.sent = end
        return delta
