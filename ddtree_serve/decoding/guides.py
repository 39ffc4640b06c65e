"""Structured outputs: a grammar (a JSON schema, any JSON object, a regex, a list of choices, an EBNF grammar or a
structural tag: free text in which each trigger opens a tagged part whose body must match its schema, the form tool
calls take) that every generated token must keep the text inside of, as vLLM's `structured_outputs` and OpenAI's
`response_format` ask.

The grammar is xgrammar's. In a draft tree each node's logits are masked with the tokens the grammar allows after
that node's own path (xgrammar walks the tree, accepting and rolling back tokens), so the target's choice at every
node is the one it would make generating token by token under the grammar: speculative decoding stays lossless.
Once the grammar has ended (it accepted a stop token) nothing is masked any more. A guide may start after a
trigger (GuideSpec.start_after: a thinking model's end-of-reasoning tag): until those tokens are generated nothing is
masked, and from the next token on the grammar holds, in a tree below each node whose path completes the trigger.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from torch import Tensor

GUIDE_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_GUIDE_CHARS = 64 * 1024   # a schema, regex, grammar or choice list (the grammar's compile cost grows with it)
MAX_CHOICES = 256
MAX_START_AFTER = 16   # tokens of a trigger the grammar starts after


@dataclass(frozen=True)
class GuideSpec:
    """What the output must match: kind is one of GUIDE_KINDS; spec is the JSON schema's text, the regex, the EBNF
    grammar, the choices as a JSON list of strings, or the structural tag's JSON ("" for json_object)."""

    kind: str
    spec: str = ""
    any_whitespace: bool = True   # JSON kinds: any whitespace between tokens (False: compact, `, ` and `: ` only)
    # The grammar holds from the token after these ids are generated (() from the first); not part of the grammar
    start_after: tuple[int, ...] = field(default=(), compare=False)

    def check_start_after(self, vocab_size: int) -> None:
        """ValueError unless the trigger is at most MAX_START_AFTER token ids of the vocabulary."""
        if len(self.start_after) > MAX_START_AFTER:
            raise ValueError(f"a structured output's start_after is at most {MAX_START_AFTER} tokens")
        if any(not 0 <= t < vocab_size for t in self.start_after):
            raise ValueError(f"a structured output's start_after ids must lie in [0, {vocab_size})")

    def grammar(self):
        """The xgrammar Grammar (ValueError with the parser's message when the spec is not valid)."""
        import xgrammar as xgr

        if self.kind not in GUIDE_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(GUIDE_KINDS)}, got {self.kind!r}")
        if len(self.spec) > MAX_GUIDE_CHARS:
            raise ValueError(f"a structured output's {self.kind} is at most {MAX_GUIDE_CHARS} characters")
        try:
            if self.kind == "json_object":
                if self.any_whitespace:
                    return xgr.Grammar.builtin_json_grammar()
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
            if self.kind == "json":
                json.loads(self.spec)
                return xgr.Grammar.from_json_schema(self.spec, any_whitespace=self.any_whitespace)
            if self.kind == "regex":
                return xgr.Grammar.from_regex(self.spec)
            if self.kind == "grammar":
                return xgr.Grammar.from_ebnf(self.spec)
            if self.kind == "structural_tag":
                return structural_tag_grammar(json.loads(self.spec))
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(self.spec)))
        except (RuntimeError, ValueError, TypeError) as exc:
            message = str(exc).split(": ", 1)[-1] if "/project/" in str(exc) else str(exc)
            raise ValueError(f"invalid structured output {self.kind}: {message}") from None


def structural_tag_grammar(tag):
    """The xgrammar Grammar of a structural tag: xgrammar's own form ({"type": "structural_tag", "format": {...}}) or
    the older one OpenAI-compatible servers take ({"structures": [{"begin", "schema", "end"}], "triggers": [...]})."""
    import xgrammar as xgr

    if not isinstance(tag, dict):
        raise ValueError("a structural tag is a JSON object")
    if "format" in tag:
        return xgr.Grammar.from_structural_tag(json.dumps({**tag, "type": "structural_tag"}))
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not (isinstance(structures, list) and structures and isinstance(triggers, list) and triggers
            and all(isinstance(t, str) and t for t in triggers)):
        raise ValueError("a structural tag needs a format, or non-empty structures and triggers")
    if not all(isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
               and isinstance(s.get("schema"), (dict, bool)) for s in structures):
        raise ValueError("each structure of a structural tag needs a begin and an end string and a schema")
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
             for s in structures]
    return xgr.Grammar.from_structural_tag(items, triggers)


def choice_ebnf(choices) -> str:
    """An EBNF grammar whose sentences are exactly the given strings."""
    if not (isinstance(choices, list) and 1 <= len(choices) <= MAX_CHOICES
            and all(isinstance(c, str) and c for c in choices)):
        raise ValueError(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """BoolTensor[T, V] of xgrammar's int32 bitmask [T, ceil(V / 32)] (bit j of word w: token 32 w + j), on the
    bitmask's device."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def grammar_kept_nodes(bitmask: Tensor, tokens: list[int], parents: list[int], keep: int = 0) -> list[int]:
    """The nodes of a draft tree worth verifying under its grammar, in tree order (root first): those whose token
    the grammar allows after their parent's path, under kept parents only (a refused node and its subtree can never
    be accepted), at most `keep` of them (0: all). bitmask: SequenceGuide.tree_mask's rows for this tree. In tree
    order every kept node's parent is kept before it, so any prefix of the result is itself a tree."""
    if len(tokens) == 1:
        return [0]
    par, tok = torch.tensor(parents[1:], dtype=torch.long), torch.tensor(tokens[1:], dtype=torch.long)
    allowed = [0] + ((bitmask[par, tok >> 5].long() >> (tok & 31)) & 1).tolist()   # the one word each node needs
    kept, is_kept = [0], [True] + [False] * (len(tokens) - 1)
    for i in range(1, len(tokens)):
        if keep and len(kept) >= keep:
            break
        if allowed[i] and is_kept[parents[i]]:
            is_kept[i] = True
            kept.append(i)
    return kept


class SequenceGuide:
    """One sequence's grammar state: the tokens allowed next, for one row or every node of a draft tree. With a
    trigger (start_after), free text until the trigger's tokens are generated, the grammar from then on."""

    def __init__(self, compiled, vocab_size: int, start_after: tuple[int, ...] = ()):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._xgr = xgr
        self.start_after = tuple(start_after)
        self.waiting = bool(self.start_after)   # the trigger not generated yet: nothing masked
        self._tail: tuple[int, ...] = ()        # while waiting, the last generated tokens (trigger-long at most)

    @property
    def ended(self) -> bool:
        """True once the grammar accepted a stop token: nothing is masked after that."""
        return not self.waiting and self.matcher.is_terminated()

    def _after(self, tail: tuple[int, ...], token: int) -> tuple[tuple[int, ...], bool]:
        """The waiting tail after one more token, and whether it completes the trigger."""
        tail = (tail + (token,))[-len(self.start_after):]
        return tail, tail == self.start_after

    def row_mask(self) -> Tensor | None:
        """The tokens allowed next as a bitmask (IntTensor[1, ceil(V / 32)], unpack_bitmask's layout; None once
        ended or while waiting for the trigger)."""
        if self.ended or self.waiting:
            return None
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        return bitmask

    def tree_mask(self, tokens: list[int], parents: list[int]) -> Tensor | None:
        """A bitmask IntTensor[T, ceil(V / 32)]: per node, the tokens allowed after its root path (the root's token is
        the last one accepted). A node whose own token its parent does not allow keeps every token: it can never be accepted
        (the parent's choice is masked), so its row is never used; a node past the grammar's end keeps every token
        too. While waiting for the trigger, a node whose path has not completed it keeps every token, and below the
        first node that completes it the grammar holds as from its start. None once ended."""
        if self.ended:
            return None
        if not self.waiting:
            return self._walk(tokens, parents)
        n = len(tokens)
        bitmask = self._xgr.allocate_token_bitmask(n, self.vocab_size)
        bitmask.fill_(-1)
        tails: list[tuple[int, ...] | None] = [self._tail] + [None] * (n - 1)   # None: at or below a trigger node
        for i in range(1, n):   # tree order: a parent comes before its children
            tail = tails[parents[i]]
            if tail is None:
                continue
            tails[i], done = self._after(tail, tokens[i])
            if done:   # the grammar starts here: its subtree walked from the grammar's start
                tails[i] = None
                sub, members = [i], {i}
                for j in range(i + 1, n):
                    if parents[j] in members:
                        sub.append(j)
                        members.add(j)
                index = {old: new for new, old in enumerate(sub)}
                bitmask[sub] = self._walk([tokens[j] for j in sub], [-1] + [index[parents[j]] for j in sub[1:]])
        return bitmask

    def _walk(self, tokens: list[int], parents: list[int]) -> Tensor:
        """The grammar's rows for a tree whose root token the matcher accepted last (tree_mask without a trigger)."""
        n = len(tokens)
        first_child, next_sibling, last_child = [-1] * n, [-1] * n, [-1] * n
        for i in range(1, n):
            p = parents[i]
            if last_child[p] < 0:
                first_child[p] = i
            else:
                next_sibling[last_child[p]] = i
            last_child[p] = i
        bitmask = self._xgr.allocate_token_bitmask(n, self.vocab_size)
        self.matcher.traverse_draft_tree(torch.tensor(first_child, dtype=torch.int64),
                                         torch.tensor(next_sibling, dtype=torch.int64),
                                         torch.tensor(tokens, dtype=torch.int64), bitmask)
        # The walk leaves nodes it does not enter (a token the grammar refuses, or one after its end) with no token
        # allowed; a refused node is never accepted and after the end nothing is masked: both rows allow everything
        # (an all -inf row would make a sample fail).
        bitmask[(bitmask == 0).all(dim=1)] = -1
        return bitmask

    def accept(self, tokens: list[int]) -> None:
        """Advances over committed tokens: the trigger's tail while waiting (the trigger itself is not the grammar's),
        then the grammar (each token one the mask allowed; none after it ended)."""
        for token in tokens:
            if self.waiting:
                self._tail, done = self._after(self._tail, token)
                self.waiting = not done
                continue
            if self.ended:
                return
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")


def apply_guide_mask(logits: Tensor, bitmask: Tensor | None) -> Tensor:
    """logits[T, V] with the tokens the bitmask leaves out at -inf (None: unchanged). The bitmask goes to the
    logits' device packed (V / 8 bytes a row) and is unpacked there."""
    if bitmask is None:
        return logits
    mask = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    return logits.masked_fill(~mask, float("-inf"))
