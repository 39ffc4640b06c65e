"""Reasoning outputs (vLLM's --reasoning-parser): a thinking model's chat answer split into its reasoning, the text
inside <think> ... </think>, and its content, the rest.

Qwen3.5 / Qwen3.6 and DeepSeek-R1 chat templates open the block in the prompt, so the answer starts inside it and
only the end tag is generated; older Qwen3 models generate both tags; with thinking switched off
(`enable_thinking: false`) the template closes an empty block in the prompt and the whole answer is content. So
where an answer starts is read from the prompt's end, and a start tag at the answer's very beginning opens the block
too. An answer that never closes its block (cut by max_tokens) is all reasoning. The text is split as it is,
whitespace included: what follows the end tag is content word for word.
"""
from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
# The parsers this gateway knows, by vLLM's names; both read the same tags.
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def starts_in_reasoning(prompt_tail: str) -> bool:
    """Whether an answer to this prompt (its last tokens' text suffices) begins inside a reasoning block: the
    prompt's last start tag is not closed after it."""
    at = prompt_tail.rfind(START)
    return at >= 0 and END not in prompt_tail[at:]


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of tag that text ends with (0: none): text a stream holds back, since
    the next piece may complete the tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ReasoningStream:
    """Splits an answer's text into reasoning and content as it streams; a piece that may be the start of a tag
    is held back until the next one shows whether it is."""

    in_reasoning: bool
    at_start: bool = True   # nothing seen yet: a start tag here opens the block (models that generate it)
    pending: str = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of the text streamed so far that this piece settles (final: all that is left)."""
        buf = self.pending + text
        self.pending = ""
        reasoning, content = [], []
        while buf:
            if self.at_start and not self.in_reasoning:
                stripped = buf.lstrip()
                if START.startswith(stripped) and not final:   # maybe a start tag still coming
                    self.pending = buf
                    break
                self.at_start = False
                if stripped.startswith(START):
                    self.in_reasoning, buf = True, stripped[len(START):]
                    continue
            self.at_start = False
            if not self.in_reasoning:
                content.append(buf)
                break
            at = buf.find(END)
            if at >= 0:
                reasoning.append(buf[:at])
                self.in_reasoning, buf = False, buf[at + len(END):]
                continue
            keep = 0 if final else _partial_tag_suffix(buf, END)
            reasoning.append(buf[:len(buf) - keep])
            self.pending = buf[len(buf) - keep:]
            break
        return "".join(reasoning), "".join(content)


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer, each None when empty (vLLM's non-streaming fields)."""
    reasoning, content = ReasoningStream(in_reasoning).feed(text, final=True)
    return reasoning or None, content or None
