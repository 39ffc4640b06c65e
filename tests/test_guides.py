"""Structured outputs: the grammar's masks over a draft tree equal, node by node, the masks of generating each
node's root path token by token; specs are checked before anything runs."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from ddtree_serve.decoding.guides import (GuideSpec, SequenceGuide, apply_guide_mask, choice_ebnf, grammar_kept_nodes,
                                         unpack_bitmask)
from tests.fixtures import make_tiny_tokenizer

xgr = pytest.importorskip("xgrammar")

SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
                     "required": ["name", "n"], "additionalProperties": False})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_tokenizer(Path(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id])
    return xgr.GrammarCompiler(info, max_threads=1)


def _compiled(compiler, spec: GuideSpec):
    return compiler.compile_grammar(spec.grammar())


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_bitmask_unpacks_bit_j_of_word_w_as_token_32w_plus_j():
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 3
    bitmask[1, 1] = 1 << 5
    mask = unpack_bitmask(bitmask, 40)
    assert mask.shape == (2, 40) and mask[0].nonzero().flatten().tolist() == [3]
    assert mask[1].nonzero().flatten().tolist() == [37]
    assert unpack_bitmask(torch.full((1, 2), -1, dtype=torch.int32), 40).all()


def _path_mask(compiled, prefix: list[int], vocab: int) -> torch.Tensor | None:
    guide = SequenceGuide(compiled, vocab)
    for token in prefix:
        if guide.ended or not guide.matcher.accept_token(token):
            return None
    return unpack_bitmask(guide.row_mask(), vocab)


def _tree_along(root: int, spine: list[int], rng: random.Random, vocab: int) -> tuple[list[int], list[int]]:
    """A draft tree: root, the spine's tokens one below the other, random siblings hanging off it."""
    tokens, parents, last = [root], [-1], 0
    for token in spine:
        tokens.append(token)
        parents.append(last)
        last = len(tokens) - 1
        for _ in range(rng.randint(0, 2)):
            tokens.append(rng.randrange(vocab))
            parents.append(rng.randrange(len(tokens) - 1))
    return tokens, parents


def _root_path(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """The tokens from below the root down to node."""
    path = []
    while node > 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("text", ['{"name": "ab", "n": 12}', '{"name": "", "n": -30}'])
def test_each_tree_nodes_mask_is_the_mask_after_its_own_root_path(tokenizer, compiler, text):
    compiled = _compiled(compiler, GuideSpec("json", SCHEMA))
    vocab = len(tokenizer)
    valid = _encode(tokenizer, text)
    rng = random.Random(0)
    for trial in range(12):
        cut = rng.randint(1, len(valid) - 2)
        accepted, rest = valid[:cut], valid[cut:]
        tokens, parents = _tree_along(accepted[-1], rest[:6], rng, vocab)   # along the valid continuation
        guide = SequenceGuide(compiled, vocab)
        guide.accept(accepted)
        tree = unpack_bitmask(guide.tree_mask(tokens, parents), vocab)
        for node in range(len(tokens)):
            want = _path_mask(compiled, accepted + _root_path(tokens, parents, node), vocab)
            if want is not None:   # a node its path makes invalid is never accepted: its row is not used
                assert torch.equal(tree[node: node + 1], want), (trial, node)
        assert torch.equal(unpack_bitmask(guide.row_mask(), vocab), _path_mask(compiled, accepted, vocab))


def test_a_guide_starting_after_a_trigger_masks_each_node_as_its_path_token_by_token(tokenizer, compiler):
    """start_after: a node whose path has not completed the trigger keeps every token; below the node that
    completes it, each node's row is the grammar's after the tokens past the trigger, as token-by-token accept()
    gives it."""
    compiled = _compiled(compiler, GuideSpec("json", SCHEMA))
    vocab = len(tokenizer)
    trigger = tuple(_encode(tokenizer, "</think>"))
    free, answer = _encode(tokenizer, "some thought"), _encode(tokenizer, '{"name": "ab", "n": 12}')
    rng = random.Random(1)
    for cut in range(1, len(free) + len(trigger) + 3):
        path = free + list(trigger) + answer
        accepted, rest = path[:cut], path[cut:]
        tokens, parents = _tree_along(accepted[-1], rest[:8], rng, vocab)
        guide = SequenceGuide(compiled, vocab, start_after=trigger)
        guide.accept(accepted)
        tree = unpack_bitmask(guide.tree_mask(tokens, parents), vocab)
        for node in range(len(tokens)):
            walked = SequenceGuide(compiled, vocab, start_after=trigger)
            try:
                walked.accept(accepted + _root_path(tokens, parents, node))
            except RuntimeError:
                continue   # a node its path makes invalid is never accepted: its row is not used
            row = walked.row_mask()
            want = torch.ones(1, vocab, dtype=torch.bool) if row is None else unpack_bitmask(row, vocab)
            assert torch.equal(tree[node: node + 1], want), (cut, node)


def test_a_guide_waiting_for_its_trigger_masks_nothing_and_the_trigger_is_not_the_grammars(tokenizer, compiler):
    compiled = _compiled(compiler, GuideSpec("choice", json.dumps(["yes"])))
    trigger = tuple(_encode(tokenizer, "</think>"))
    guide = SequenceGuide(compiled, len(tokenizer), start_after=trigger)
    guide.accept(_encode(tokenizer, "no no no") + list(trigger[:-1]))   # free text, and the trigger but its last
    assert guide.waiting and guide.row_mask() is None and not guide.ended
    guide.accept([trigger[-1]])
    allowed = unpack_bitmask(guide.row_mask(), len(tokenizer))[0].nonzero().flatten().tolist()
    assert not guide.waiting and allowed and all("yes".startswith(tokenizer.decode([t])) for t in allowed)


def test_a_trigger_longer_than_allowed_or_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="at most 16"):
        GuideSpec("regex", "a", start_after=tuple(range(17))).check_start_after(320)
    with pytest.raises(ValueError, match="must lie in"):
        GuideSpec("regex", "a", start_after=(5, 320)).check_start_after(320)


def test_a_choice_allows_exactly_its_strings_then_only_the_stop_token(tokenizer, compiler):
    compiled = _compiled(compiler, GuideSpec("choice", json.dumps(["yes", "no"])))
    guide = SequenceGuide(compiled, len(tokenizer))
    guide.accept(_encode(tokenizer, "yes"))
    assert unpack_bitmask(guide.row_mask(), len(tokenizer))[0].nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    guide.accept([tokenizer.eos_token_id])
    assert guide.ended and guide.row_mask() is None and guide.tree_mask([5, 6], [-1, 0]) is None


def test_a_refused_token_is_an_error_not_a_silent_drift(tokenizer, compiler):
    guide = SequenceGuide(_compiled(compiler, GuideSpec("regex", "[0-9]+")), len(tokenizer))
    with pytest.raises(RuntimeError, match="refused token"):
        guide.accept(_encode(tokenizer, "x"))


@pytest.mark.parametrize("spec, fragment", [
    (GuideSpec("json", "{not json"), "invalid structured output json"),
    (GuideSpec("json", '{"type": "bogus"}'), "invalid structured output json"),
    (GuideSpec("regex", "[0-9"), "invalid structured output regex"),
    (GuideSpec("grammar", "root ::= "), "invalid structured output grammar"),
    (GuideSpec("choice", "[]"), "choice must be a list of 1 to 256"),
    (GuideSpec("choice", '["a", 3]'), "choice must be a list"),
    (GuideSpec("yaml", "x"), "kind must be one of"),
    (GuideSpec("regex", "a" * (64 * 1024 + 1)), "at most 65536 characters"),
    (GuideSpec("structural_tag", "[]"), "a structural tag is a JSON object"),
    (GuideSpec("structural_tag", '{"structures": [], "triggers": ["<f>"]}'), "needs a format, or non-empty structures"),
    (GuideSpec("structural_tag", '{"structures": [{"begin": "<f>"}], "triggers": ["<f>"]}'), "needs a begin and an end"),
    (GuideSpec("structural_tag", '{"format": {"type": "nope"}}'), "invalid structured output structural_tag"),
])
def test_bad_specs_are_refused_with_a_reason(spec, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        spec.grammar()


INTEGER_TAG = {"structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}], "triggers": ["<f>"]}
INTEGER_TAG_FORMAT = {"format": {"type": "triggered_tags", "triggers": ["<f>"], "tags": [
    {"begin": "<f>", "content": {"type": "json_schema", "json_schema": {"type": "integer"}}, "end": "</f>"}]}}


@pytest.mark.parametrize("tag", [INTEGER_TAG, INTEGER_TAG_FORMAT], ids=["structures", "format"])
def test_a_structural_tag_leaves_text_free_until_its_trigger_then_holds_the_body_to_its_schema(tokenizer, compiler,
                                                                                                tag):
    guide = SequenceGuide(_compiled(compiler, GuideSpec("structural_tag", json.dumps(tag))), len(tokenizer))
    allowed = lambda: unpack_bitmask(guide.row_mask(), len(tokenizer))[0]   # noqa: E731
    digit, letter = _encode(tokenizer, "7")[0], _encode(tokenizer, "x")[0]
    guide.accept(_encode(tokenizer, "hi x"))
    assert allowed()[letter] and allowed()[digit]             # free text
    guide.accept(_encode(tokenizer, "<f>"))
    assert allowed()[digit] and not allowed()[letter]         # inside the tag: an integer
    with pytest.raises(RuntimeError, match="refused token"):
        guide.accept([letter])
    guide.accept(_encode(tokenizer, "12</f>"))
    assert allowed()[letter]                                  # free again after the end


def test_choices_are_quoted_so_any_string_is_literal():
    ebnf = choice_ebnf(['a "b"', "x\\y", "caf\u00e9", "|"])
    xgr.Grammar.from_ebnf(ebnf)
    assert ebnf.count(" | ") == 3


def test_nodes_the_walk_does_not_enter_allow_every_token(tokenizer, compiler):
    """A node with a token its parent refuses, and a node after the grammar's end: rows that allow everything
    (never an all -inf row a sample would fail on)."""
    digit, letter, eos = _encode(tokenizer, "7")[0], _encode(tokenizer, "x")[0], tokenizer.eos_token_id
    root = _encode(tokenizer, "5")[0]
    guide = SequenceGuide(_compiled(compiler, GuideSpec("regex", "[0-9][0-9]")), len(tokenizer))
    guide.accept([root])
    #  0(root) - 1(digit) - 2(eos) - 3(x)      and 0 - 4(x) - 5(digit)
    mask = unpack_bitmask(guide.tree_mask([root, digit, eos, letter, letter, digit], [-1, 0, 1, 2, 0, 4]),
                          len(tokenizer))
    assert mask[0, digit] and not mask[0, letter] and not mask[0, eos]
    assert mask[1].nonzero().flatten().tolist() == [eos]
    assert mask[2].all() and mask[3].all() and mask[4].all() and mask[5].all()


def test_applying_a_bitmask_leaves_allowed_logits_and_sets_the_rest_to_minus_inf():
    logits = torch.randn(2, 40)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0], bitmask[1, 1] = 0b101, 1 << 7   # row 0: tokens 0 and 2; row 1: token 39
    out = apply_guide_mask(logits, bitmask)
    assert torch.isfinite(out).nonzero().tolist() == [[0, 0], [0, 2], [1, 39]]
    assert out[0, 2] == logits[0, 2] and apply_guide_mask(logits, None) is logits


def test_the_targets_compiler_keeps_the_last_grammars_only(tmp_path):
    from target_svc.grammar_compiler import GrammarCompiler

    make_tiny_tokenizer(tmp_path)
    compiler = GrammarCompiler(tmp_path, 320, [0], threads=1, cache_size=2)
    specs = [GuideSpec("regex", f"[a-c]{{{n}}}") for n in (1, 2, 3)]
    first = compiler.compile(specs[0])
    assert compiler.compile(specs[0]) is first and compiler.compiled(specs[1]) is None
    compiler.compile(specs[1])
    compiler.compile(specs[2])
    assert compiler.compiled(specs[0]) is None and compiler.compiled(specs[2]) is not None


def test_a_trees_kept_nodes_are_those_its_grammar_allows_under_kept_parents_in_order(tokenizer, compiler):
    """Pruning before a verify: a refused node goes with its subtree; the cut keeps a tree (parents first)."""
    d = [_encode(tokenizer, c)[0] for c in "0123456789"]
    letter = _encode(tokenizer, "x")[0]
    guide = SequenceGuide(_compiled(compiler, GuideSpec("regex", "[0-9]{3}")), len(tokenizer))
    guide.accept([d[1]])
    #  0(root 1) - 1(2) - 2(3)     0 - 3(x) - 4(4)     0 - 5(5) - 6(x)     1 - 7(9)
    tokens, parents = [d[1], d[2], d[3], letter, d[4], d[5], letter, d[9]], [-1, 0, 1, 0, 3, 0, 5, 1]
    mask = guide.tree_mask(tokens, parents)
    assert grammar_kept_nodes(mask, tokens, parents) == [0, 1, 2, 5, 7]
    assert grammar_kept_nodes(mask, tokens, parents, keep=3) == [0, 1, 2]
    assert grammar_kept_nodes(mask, [d[1]], [-1]) == [0]
