"""TargetRunner: greedy loops and tree verification reproduce transformers' generate; cache and validation."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import transformers

from ddtree_serve.decoding.config import SamplingParams
from ddtree_serve.plumbing.cuda_graphs import tree_node_buckets
from target_svc import runner as runner_module
from target_svc.runner import PrefillItem, TargetConfig, TargetRunner, VerifyItem
from tests.conftest import ADJUSTED_SAMPLING, hf_greedy
from tests.fixtures import make_tiny_llama, make_tiny_qwen3, make_tiny_qwen3_5
from tests.fixtures.trees import random_tree_along

MAKERS = {
    "qwen3": lambda d: make_tiny_qwen3(d, seed=21),
    "llama": lambda d: make_tiny_llama(d, seed=22),
    "qwen3_5": lambda d: make_tiny_qwen3_5(d, seed=23, multimodal_wrapper=True),
}
VOCAB = 320
N_NEW = 64


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """model_dir per architecture, built once per module."""
    return {name: make(tmp_path_factory.mktemp(name)) for name, make in MAKERS.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    """transformers' own model per architecture (the losslessness oracle), eos disabled for fixed lengths."""
    refs = {}
    for name, path in checkpoints.items():
        config = transformers.AutoConfig.from_pretrained(path)
        model = getattr(transformers, config.architectures[0]).from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        refs[name] = model
    return refs


def _runner(path, **kw) -> TargetRunner:
    sizes = {"max_batch": 4, "max_seq_len": 256, "max_tree_nodes": 32, **kw}
    return TargetRunner(TargetConfig(model_dir=str(path), **sizes))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _root_only(seq_id: str, token: int) -> VerifyItem:
    return VerifyItem(seq_id, torch.tensor([token]), torch.tensor([-1]))


def _random_tree(root: int, truth: list[int], rng: random.Random, n_nodes: int) -> tuple[list[int], list[int]]:
    return random_tree_along(root, truth, rng, n_nodes, VOCAB)


def _verify_along(runner: TargetRunner, generated: dict[str, list[int]], truth: dict[str, list[int]],
                  rng: random.Random, on_output=None, keep_nodes: int = 0) -> list[int]:
    """Verifies one random tree per sequence along its truth per step, all sequences in one batch, until each has
    N_NEW tokens; extends generated in place, calls on_output(item, output) after each; returns the accepted path
    lengths."""
    accepted_lengths = []
    while min(len(g) for g in generated.values()) < N_NEW:
        items = []
        for sid, gen in generated.items():
            tokens, parents = _random_tree(gen[-1], truth[sid][len(gen):], rng, rng.randint(1, 24))
            items.append(VerifyItem(sid, torch.tensor(tokens), torch.tensor(parents), keep_nodes=keep_nodes))
        for it, out in zip(items, runner.verify(items)):
            generated[it.seq_id] += out.accepted_tokens + [out.next_token]
            accepted_lengths.append(len(out.accepted_nodes))
            if on_output is not None:
                on_output(it, out)
    return accepted_lengths


@pytest.mark.parametrize("arch", sorted(MAKERS))
def test_greedy_root_only_steps_equal_hf_generate(arch, checkpoints, references):
    runner = _runner(checkpoints[arch])
    prompt = _prompt(19, seed=1)
    out = runner.prefill([PrefillItem("s", prompt, SamplingParams())])[0]
    assert out.context_len == len(prompt)
    generated = [out.next_token]
    while len(generated) < N_NEW:
        step = runner.verify([_root_only("s", generated[-1])])[0]
        assert step.accepted_nodes == [0] and step.accepted_tokens == []
        assert step.context_len == len(prompt) + len(generated)
        generated.append(step.next_token)
    assert generated == hf_greedy(references[arch], prompt, N_NEW)


@pytest.mark.parametrize("arch,tree_gdn", [(a, "depthwise") for a in sorted(MAKERS)] + [("qwen3_5", "wy")])
def test_batched_random_tree_verify_equals_hf_greedy_and_plain_decoding(arch, tree_gdn, checkpoints, references):
    runner = _runner(checkpoints[arch])
    runner.model.tree_gdn = tree_gdn  # "wy": the one-pass tree form that CUDA graphs capture
    runner.set_feature_layers([0, 2])
    prompts = {f"s{i}": _prompt(n, seed=10 + i) for i, n in enumerate((5, 23, 41))}
    truth = {sid: hf_greedy(references[arch], p, N_NEW + 16) for sid, p in prompts.items()}
    first = runner.prefill([PrefillItem(sid, p, SamplingParams(), want_features=True) for sid, p in prompts.items()])
    generated = {o.seq_id: [o.next_token] for o in first}
    features = {o.seq_id: [o.features] for o in first}

    def check(it: VerifyItem, out) -> None:
        assert out.accepted_tokens == [int(it.tokens[i]) for i in out.accepted_nodes[1:]]
        features[it.seq_id].append(out.features)
        assert out.context_len == len(prompts[it.seq_id]) + len(generated[it.seq_id]) - 1

    accepted_lengths = _verify_along(runner, generated, truth, random.Random(0), check)
    assert min(accepted_lengths) == 1 and max(accepted_lengths) >= 4  # acceptance really varied
    for sid, gen in generated.items():
        assert gen == truth[sid][: len(gen)]

    # Compacted cache (and GDN states) == a cache built by plain one-token decoding of the committed tokens.
    plain = _runner(checkpoints[arch])
    plain.set_feature_layers([0, 2])
    for sid, gen in generated.items():
        out = plain.prefill([PrefillItem(sid, prompts[sid], SamplingParams(), want_features=True)])[0]
        plain_features = [out.features]
        for token in gen[:-1]:
            out = plain.verify([_root_only(sid, token)])[0]
            plain_features.append(out.features)
        assert out.next_token == gen[-1]
        committed = prompts[sid] + gen[:-1]
        ours, theirs = runner.model.cache, plain.model.cache
        a, b, n = ours.slot(sid), theirs.slot(sid), len(committed)
        torch.testing.assert_close(ours.k[:, a, :n], theirs.k[:, b, :n], atol=1e-4, rtol=0)
        torch.testing.assert_close(ours.v[:, a, :n], theirs.v[:, b, :n], atol=1e-4, rtol=0)
        for mine, other in zip(ours.linear, theirs.linear):
            torch.testing.assert_close(mine.conv[a], other.conv[b], atol=1e-4, rtol=0)
            torch.testing.assert_close(mine.rec[a], other.rec[b], atol=1e-4, rtol=0)
        # Features of accepted rows, in path order, are the rows of the committed sequence.
        torch.testing.assert_close(torch.cat(features[sid]), torch.cat(plain_features), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_penalised_biased_greedy_tree_verify_equals_hf_generate_with_the_same_processors(arch, checkpoints,
                                                                                          references):
    """Every accepted node is chosen under its own context (prompt, emitted tokens, its root path): random trees
    along transformers' answer reproduce it exactly, and differ from the unadjusted answer."""
    runner = _runner(checkpoints[arch])
    prompts = {f"p{i}": _prompt(n, seed=40 + i) for i, n in enumerate((9, 26))}
    truth = {sid: hf_greedy(references[arch], p, N_NEW + 16, ADJUSTED_SAMPLING) for sid, p in prompts.items()}
    first = runner.prefill([PrefillItem(sid, p, ADJUSTED_SAMPLING) for sid, p in prompts.items()])
    generated = {o.seq_id: [o.next_token] for o in first}
    assert max(_verify_along(runner, generated, truth, random.Random(1))) >= 4
    for sid, gen in generated.items():
        assert gen == truth[sid][: len(gen)]
        assert gen != hf_greedy(references[arch], prompts[sid], len(gen))


def test_min_tokens_greedy_tree_verify_equals_hf_generate_with_min_new_tokens(checkpoints, references):
    """The tokens the plain answer starts with, held back as stop tokens for 10 tokens: random trees along
    transformers' answer under min_new_tokens reproduce it, and it avoids them where the plain one has them."""
    runner = _runner(checkpoints["qwen3"])
    prompt = _prompt(12, seed=50)
    plain = hf_greedy(references["qwen3"], prompt, N_NEW)
    params = SamplingParams(min_tokens=10, min_tokens_blocked=tuple(sorted(set(plain[:3]))))
    truth = hf_greedy(references["qwen3"], prompt, N_NEW + 16, params)
    assert not set(truth[:10]) & set(plain[:3]) and truth != plain
    (out,) = runner.prefill([PrefillItem("m", prompt, params)])
    generated = {"m": [out.next_token]}
    _verify_along(runner, generated, {"m": truth}, random.Random(3))
    assert generated["m"][:N_NEW] == truth[:N_NEW]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_bad_words_greedy_tree_verify_equals_hf_generate_with_vllms_bad_words(arch, checkpoints, references):
    """Bad words of one, two and three tokens taken from the plain answer: random trees along transformers' answer
    under vLLM's rule (generated tokens only) reproduce it, and it leaves the plain answer where a word completes."""
    runner = _runner(checkpoints[arch])
    prompt = _prompt(11, seed=60)
    plain = hf_greedy(references[arch], prompt, N_NEW)
    params = SamplingParams(bad_words=(tuple(plain[2:4]), (plain[7],), tuple(plain[10:13])))
    truth = hf_greedy(references[arch], prompt, N_NEW + 16, params)
    assert truth[:3] == plain[:3] and truth[3] != plain[3]
    (out,) = runner.prefill([PrefillItem("w", prompt, params)])
    generated = {"w": [out.next_token]}
    assert max(_verify_along(runner, generated, {"w": truth}, random.Random(4))) >= 4
    assert generated["w"][:N_NEW] == truth[:N_NEW]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("kind, spec", [
    ("json", '{"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", '
             '"items": {"type": "string"}}}, "required": ["name", "tags"]}'),
    ("regex", "[a-z]+( [a-z]+)*[.]"),
])
def test_guided_greedy_tree_verify_equals_hf_generate_token_by_token_under_the_grammar(arch, kind, spec, checkpoints,
                                                                                      references):
    """Each tree node's logits masked with what the grammar allows after its own root path: random trees along
    transformers' answer under the same grammar reproduce it, and it is not the free answer."""
    from tests.conftest import compile_guide

    guide = compile_guide(checkpoints[arch], kind, spec)
    runner = _runner(checkpoints[arch])
    prompt = _prompt(10, seed=70)
    truth = hf_greedy(references[arch], prompt, N_NEW + 16, guide=guide)
    assert truth[:N_NEW] != hf_greedy(references[arch], prompt, N_NEW)
    (out,) = runner.prefill([PrefillItem("g", prompt, guide=guide)])
    generated = {"g": [out.next_token]}
    assert max(_verify_along(runner, generated, {"g": truth}, random.Random(5))) >= 3
    assert generated["g"][:N_NEW] == truth[:N_NEW]


def _resume_setup(case: str, checkpoints, references):
    """(architecture, sampling, guide, prompt, transformers' answer) of one adjusted-choice case."""
    from tests.conftest import compile_guide

    arch = "qwen3_5" if case == "penalties, hybrid" else "qwen3"
    prompt = _prompt(10, seed=80)
    sampling, guide = SamplingParams(), None
    if case.startswith("penalties"):   # output-only penalties, strong: counting the earlier outputs shows
        sampling = SamplingParams(frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=1.2)
    elif case == "min_tokens":
        plain = hf_greedy(references[arch], prompt, 12)
        sampling = SamplingParams(min_tokens=12, min_tokens_blocked=tuple(sorted(set(plain[:4]))))
    else:
        guide = compile_guide(checkpoints[arch], "regex", "[a-z]+( [a-z]+)*[.]")
    return arch, sampling, guide, prompt, hf_greedy(references[arch], prompt, 40, sampling, guide=guide)


@pytest.mark.parametrize("case", ["penalties", "penalties, hybrid", "min_tokens", "grammar"])
def test_a_resumed_sequence_counts_its_earlier_outputs_as_output_and_continues_transformers_answer(case, checkpoints,
                                                                                                  references):
    """Preemption runs a sequence again from its prompt and the tokens it had generated (outputs_from marks
    them, in two chunks here): its penalties, min_tokens and grammar go on as if it had never stopped, where the
    same tokens taken as prompt would change the answer."""
    arch, sampling, guide, prompt, truth = _resume_setup(case, checkpoints, references)
    done = 5   # tokens generated before the preemption
    tokens = prompt + truth[:done]
    runner = _runner(checkpoints[arch])
    runner.prefill([PrefillItem("r", tokens[:8], sampling, more=True, guide=guide, outputs_from=len(prompt))])
    (out,) = runner.prefill([PrefillItem("r", tokens[8:], sampling, start=8, outputs_from=len(prompt))])
    generated = {"r": truth[:done] + [out.next_token]}
    _verify_along_until(runner, generated, 32)
    assert generated["r"][:32] == truth[:32]
    history = runner.seqs["r"].history
    assert history is None or history.emitted == len(generated["r"])
    if case in ("penalties", "min_tokens"):   # the same tokens as prompt: nothing to penalise, min_tokens from zero
        as_prompt = _runner(checkpoints[arch])
        (first,) = as_prompt.prefill([PrefillItem("p", tokens, sampling, guide=guide)])
        plain = {"p": truth[:done] + [first.next_token]}
        _verify_along_until(as_prompt, plain, 32)
        assert plain["p"][:32] != truth[:32]


def _verify_along_until(runner: TargetRunner, generated: dict[str, list[int]], n: int) -> None:
    """Root-only steps (plain decoding) until each sequence has n tokens."""
    while min(len(g) for g in generated.values()) < n:
        for sid, out in zip(generated, runner.verify([_root_only(sid, g[-1]) for sid, g in generated.items()])):
            generated[sid] += out.accepted_tokens + [out.next_token]


def test_a_resumed_guided_sequence_whose_outputs_break_its_grammar_is_refused(checkpoints):
    from tests.conftest import compile_guide

    guide = compile_guide(checkpoints["qwen3"], "regex", "[a-z]+( [a-z]+)*[.]")
    runner = _runner(checkpoints["qwen3"])
    with pytest.raises(ValueError, match="outside its guide"):   # ids 4-6 are no lowercase words of the regex
        runner.prefill([PrefillItem("g", _prompt(6, seed=81) + [4, 5, 6], guide=guide, outputs_from=6)])
    assert runner.cache_usage()[0] == 0   # nothing of it stays


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_a_guide_starting_after_a_trigger_leaves_the_answer_free_until_it_then_equals_hf_generate_under_it(
        arch, checkpoints, references):
    """A thinking model's structured output: the grammar holds from the token after two tokens the free answer
    writes (standing for </think>); random trees along transformers' answer under that rule (nodes completing the
    trigger inside the trees) reproduce it: the free answer up to the trigger, then a different, grammatical one."""
    from tests.conftest import compile_guide

    guide = compile_guide(checkpoints[arch], "regex", "[a-z]+( [a-z]+)*[.]")
    prompt = _prompt(10, seed=70)
    free = hf_greedy(references[arch], prompt, N_NEW + 16)
    trigger = tuple(free[3:5])
    assert all(tuple(free[i:i + 2]) != trigger for i in range(3))   # first completed at the 5th token
    truth = hf_greedy(references[arch], prompt, N_NEW + 16, guide=guide, guide_start_after=trigger)
    assert truth[:5] == free[:5] and truth[5:N_NEW] != free[5:N_NEW]
    runner = _runner(checkpoints[arch])
    (out,) = runner.prefill([PrefillItem("g", prompt, guide=guide, guide_start_after=trigger)])
    generated = {"g": [out.next_token]}
    assert max(_verify_along(runner, generated, {"g": truth}, random.Random(6))) >= 3
    assert generated["g"][:N_NEW] == truth[:N_NEW]


@pytest.mark.parametrize("keep_nodes", [0, 6])
def test_a_guided_tree_verifies_only_the_nodes_its_grammar_allows_and_answers_in_the_items_indices(keep_nodes,
                                                                                               checkpoints,
                                                                                               references):
    """Nodes the grammar refuses (random siblings, mostly) are dropped before the forward, then at most keep_nodes
    kept: the answer is unchanged, the accepted nodes are the item's own indices, and fewer nodes are verified."""
    from tests.conftest import compile_guide

    guide = compile_guide(checkpoints["qwen3"], "regex", "[a-z]+( [a-z]+)*[.]")
    runner = _runner(checkpoints["qwen3"])
    prompt = _prompt(10, seed=70)
    truth = hf_greedy(references["qwen3"], prompt, N_NEW + 16, guide=guide)
    (out,) = runner.prefill([PrefillItem("g", prompt, guide=guide)])
    generated, sizes = {"g": [out.next_token]}, []

    def check(item, output):
        tokens = item.tokens.tolist()
        assert [tokens[i] for i in output.accepted_nodes[1:]] == output.accepted_tokens
        assert 1 <= output.verified_nodes <= (keep_nodes or len(tokens))
        sizes.append((output.verified_nodes, len(tokens)))

    _verify_along(runner, generated, {"g": truth}, random.Random(5), check, keep_nodes)
    assert generated["g"][:N_NEW] == truth[:N_NEW]
    assert sum(v for v, _ in sizes) < sum(t for _, t in sizes)


def test_a_logit_bias_outside_the_vocabulary_is_refused_at_prefill(checkpoints):
    runner = _runner(checkpoints["qwen3"])
    with pytest.raises(ValueError, match="logit_bias"):
        runner.prefill([PrefillItem("b", [5, 6], SamplingParams(logit_bias=((VOCAB, 1.0),)))])
    assert "b" not in runner.seqs


PROMPT_SCORING = {"one forward": dict(prefill_verify_chunks=0), "forwards of 7": dict(prefill_verify_chunks=0,
                                                                                    prefill_chunk=7),
                  "verified chains of 8": dict(prefill_verify_chunks=4, max_tree_nodes=8)}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("chunking", sorted(PROMPT_SCORING) + ["forwards of at most 5 scored rows"])
@pytest.mark.parametrize("calls", [1, 3])
def test_prompt_logprobs_are_transformers_log_softmax_of_each_prompt_token(arch, chunking, calls, checkpoints,
                                                                           references, monkeypatch):
    """Each prompt token after the first gets its log-prob under the tokens before it, with the 3 likeliest
    alternatives, however the prompt is chunked within a call or across calls; the first token has none."""
    if chunking == "forwards of at most 5 scored rows":   # the bound on a scoring forward's logits
        monkeypatch.setattr(runner_module, "PROMPT_SCORING_ROWS", 5)
    runner = _runner(checkpoints[arch], **PROMPT_SCORING.get(chunking, PROMPT_SCORING["one forward"]))
    prompt = _prompt(23, seed=31)
    cuts = [0, 9, 16, 23] if calls == 3 else [0, 23]
    got = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        (out,) = runner.prefill([PrefillItem("s", prompt[a:b], SamplingParams(), start=a, more=b < len(prompt),
                                             prompt_logprobs=3)])
        got += out.prompt_logprobs
        assert len(out.prompt_logprobs) == (b - a) - (i == 0)
    with torch.no_grad():
        expected = torch.log_softmax(references[arch](torch.tensor([prompt])).logits[0, :-1].float(), -1)
    assert len(got) == len(prompt) - 1
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in got]),
                               expected.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], atol=1e-4, rtol=0)
    for lp, row in zip(got, expected):
        values, ids = row.topk(3)
        assert [t for t, _ in lp.top] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), values, atol=1e-4, rtol=0)
    assert out.next_token == hf_greedy(references[arch], prompt, 1)[0]


def test_prompt_logprobs_out_of_range_are_refused_before_anything_runs(checkpoints):
    runner = _runner(checkpoints["qwen3"])
    with pytest.raises(ValueError, match="prompt_logprobs"):
        runner.prefill([PrefillItem("p", [5, 6, 7], SamplingParams(), prompt_logprobs=21)])
    assert "p" not in runner.seqs


def test_a_verify_step_builds_its_trees_ancestor_mask_once(checkpoints, monkeypatch):
    """The attention keys, the one-pass GDN layers and the acceptance walk share the step's TreeStructure (each used
    to rebuild the mask by pointer doubling: ~30 small kernels a time on the GPU)."""
    from ddtree_serve.decoding import acceptance, tree_mask

    runner = _runner(checkpoints["qwen3_5"])
    runner.model.tree_gdn = "wy"
    prompts = {"a": _prompt(9, seed=3), "b": _prompt(6, seed=4)}
    first = runner.prefill([PrefillItem(sid, p, SamplingParams()) for sid, p in prompts.items()])
    calls = []
    build = tree_mask.ancestor_mask_batch

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return build(*args, **kwargs)

    monkeypatch.setattr(tree_mask, "ancestor_mask_batch", counted)
    monkeypatch.setattr(acceptance, "ancestor_mask_batch", counted)
    items = [VerifyItem(o.seq_id, torch.tensor([o.next_token, 7, 8, 9]), torch.tensor([-1, 0, 0, 1])) for o in first]
    runner.verify(items)
    assert calls == [torch.Size([2, 4])]


CHUNKINGS = {
    "forwards of 4": {"prefill_chunk": 4},
    "forwards of 7": {"prefill_chunk": 7},
    # chains of 8 tokens through the verify functions, each fully accepted (the graphed prefill on CUDA)
    "verified chains of 8": {"prefill_verify_chunks": 4, "max_tree_nodes": 8},
    # each prompt one chain of up to 29 nodes: a hybrid's long chain committed whole (its 257-node bucket on CUDA)
    "verified chains of 32": {"prefill_verify_chunks": 1, "max_tree_nodes": 32},
}


@pytest.mark.parametrize("arch", sorted(MAKERS))
@pytest.mark.parametrize("chunking", sorted(CHUNKINGS))
def test_chunked_prefill_equals_one_forward_over_the_whole_prompts(arch, chunking, checkpoints, references):
    prompts = {f"s{i}": _prompt(n, seed=40 + i) for i, n in enumerate((3, 7, 18, 29))}
    items = [PrefillItem(sid, p, SamplingParams(), want_features=True) for sid, p in prompts.items()]
    whole, chunked = _runner(checkpoints[arch], prefill_chunk=0), _runner(checkpoints[arch], **CHUNKINGS[chunking])
    for r in (whole, chunked):
        r.set_feature_layers([1, 0])
    firsts = {}
    for a, b in zip(whole.prefill(items), chunked.prefill(items)):
        assert (b.next_token, b.context_len) == (a.next_token, a.context_len)
        torch.testing.assert_close(b.features, a.features, atol=1e-4, rtol=0)
        n, ours, theirs = a.context_len, chunked.model.cache, whole.model.cache
        sa, sb = theirs.slot(a.seq_id), ours.slot(a.seq_id)
        torch.testing.assert_close(ours.k[:, sb, :n], theirs.k[:, sa, :n], atol=1e-4, rtol=0)
        for mine, other in zip(ours.linear, theirs.linear):
            torch.testing.assert_close(mine.rec[sb], other.rec[sa], atol=1e-4, rtol=0)
            torch.testing.assert_close(mine.conv[sb], other.conv[sa], atol=1e-4, rtol=0)
        firsts[b.seq_id] = b.next_token
    # and decoding continues exactly as transformers' generate()
    tokens = [firsts["s3"]]
    while len(tokens) < 9:
        tokens.append(chunked.verify([_root_only("s3", tokens[-1])])[0].next_token)
    assert tokens == hf_greedy(references[arch], prompts["s3"], 9)


@pytest.mark.parametrize("arch", sorted(MAKERS))
@pytest.mark.parametrize("chunking", ["one forward", "verified chains of 8"])
def test_a_prompt_prefilled_over_several_calls_equals_one_call(arch, chunking, checkpoints, references):
    """Chunks sent in separate calls (start/more), batched with other sequences' chunks, give the same state."""
    long_prompt, short_prompt = _prompt(23, seed=50), _prompt(6, seed=51)
    runner = _runner(checkpoints[arch], **CHUNKINGS.get(chunking, {}))
    runner.set_feature_layers([0])
    sp = SamplingParams()
    a = runner.prefill([PrefillItem("long", long_prompt[:10], sp, True, more=True)])
    assert (a[0].next_token, a[0].context_len, a[0].features.shape[0]) == (-1, 10, 10)
    with pytest.raises(ValueError, match="still being prefilled"):
        runner.verify([_root_only("long", 5)])
    b = runner.prefill([PrefillItem("long", long_prompt[10:20], sp, True, start=10, more=True),
                        PrefillItem("short", short_prompt, sp, True)])
    c = runner.prefill([PrefillItem("long", long_prompt[20:], sp, True, start=20)])
    whole = _runner(checkpoints[arch])
    whole.set_feature_layers([0])
    ref = whole.prefill([PrefillItem("long", long_prompt, sp, True), PrefillItem("short", short_prompt, sp, True)])
    assert c[0].next_token == ref[0].next_token and c[0].context_len == 23
    assert b[1].next_token == ref[1].next_token
    torch.testing.assert_close(torch.cat([a[0].features, b[0].features, c[0].features]), ref[0].features,
                               atol=1e-4, rtol=0)
    tokens = [c[0].next_token]
    while len(tokens) < 8:
        tokens.append(runner.verify([_root_only("long", tokens[-1])])[0].next_token)
    assert tokens == hf_greedy(references[arch], long_prompt, 8)


def test_prompts_longer_than_the_verified_chains_allow_are_prefilled_by_forwards(checkpoints, monkeypatch):
    """prefill_verify_chunks bounds the chain route: 2 chains of 8 take a 16-token prompt, not a 17-token one."""
    runner = _runner(checkpoints["qwen3"], prefill_verify_chunks=2, max_tree_nodes=8)
    routes = []
    for route in ("_prefill_as_chains", "_prefill_forwards"):
        original = getattr(runner, route)
        monkeypatch.setattr(runner, route, lambda *a, _f=original, _r=route: routes.append(_r) or _f(*a))
    runner.prefill([PrefillItem("a", _prompt(16, seed=3), SamplingParams())])
    runner.prefill([PrefillItem("b", _prompt(17, seed=4), SamplingParams())])
    assert routes == ["_prefill_as_chains", "_prefill_forwards"]
    # without graphs (this CPU runner) the default takes no chains at all
    assert _runner(checkpoints["qwen3"]).cfg.prefill_verify_chunks is None
    default = _runner(checkpoints["qwen3"])
    monkeypatch.setattr(default, "_prefill_as_chains", lambda *a: pytest.fail("chains without graphs"))
    default.prefill([PrefillItem("c", _prompt(5, seed=5), SamplingParams())])


def test_with_graphs_a_hybrid_chunks_its_prompt_chains_by_its_own_fixed_cost(checkpoints):
    """With graphs of node buckets up to 257: a lone 70-token prompt goes as one 257-node chain, dense or hybrid;
    two 66-token prompts as one 257-node chain on a dense target, as two 65-node ones on a hybrid (its forwards'
    fixed cost is lower)."""
    buckets = SimpleNamespace(node_buckets=tree_node_buckets(257), batch_buckets=(1, 2, 4))
    chunks = {}
    for arch in ("qwen3", "qwen3_5"):
        runner = _runner(checkpoints[arch], max_tree_nodes=257)
        runner.graphs = buckets   # the buckets are all _prefill_chunk reads of the graphs
        chunks[arch] = (runner._prefill_chunk(70, 1), runner._prefill_chunk(66, 2))
    assert chunks == {"qwen3": (257, 257), "qwen3_5": (257, 65)}


def test_a_chunk_that_does_not_continue_its_sequence_is_refused(checkpoints):
    runner = _runner(checkpoints["qwen3"])
    sp = SamplingParams()
    with pytest.raises(KeyError, match="no prefilled chunk"):
        runner.prefill([PrefillItem("ghost", [5, 6], sp, start=4)])
    runner.prefill([PrefillItem("s", [5, 6, 7], sp, more=True)])
    with pytest.raises(ValueError, match="holds 3 positions"):
        runner.prefill([PrefillItem("s", [8], sp, start=2)])
    runner.prefill([PrefillItem("s", [8], sp, start=3)])
    with pytest.raises(ValueError, match="prompt is complete"):
        runner.prefill([PrefillItem("s", [9], sp, start=4)])


def test_seeded_sampling_is_reproducible_and_follows_the_seed(checkpoints):
    runner = _runner(checkpoints["qwen3"])
    prompt = _prompt(8, seed=3)

    def sample(seq_id: str, seed: int) -> list[int]:
        params = SamplingParams(temperature=1.5, seed=seed)
        toks = [runner.prefill([PrefillItem(seq_id, prompt, params)])[0].next_token]
        for _ in range(15):
            toks.append(runner.verify([_root_only(seq_id, toks[-1])])[0].next_token)
        runner.release(seq_id)
        return toks

    assert sample("a", 7) == sample("b", 7)
    assert sample("c", 7) != sample("d", 8)


@pytest.mark.parametrize("source", ["running", "parked"])
def test_a_hybrid_prompt_sharing_a_snapshotted_prefix_starts_from_the_snapshot_and_answers_as_hf(source, checkpoints,
                                                                                                 references):
    """Gated DeltaNet state snapshots: A's prompt is prefilled in two chunks, its states kept at the end of the
    shared 20 tokens; B, sharing those 20 (and one more, which does not reach a snapshot), copies A's rows and starts
    from the snapshot, whether A is running or parked: 20 tokens reused, and both answers are transformers'."""
    runner = _runner(checkpoints["qwen3_5"], state_snapshots=2)
    shared = _prompt(20, seed=90)
    prompt_a, prompt_b = shared + _prompt(8, seed=91), shared + _prompt(7, seed=92)
    first = runner.prefill([PrefillItem("a", prompt_a[:20], more=True, snapshot_at=20)])
    assert first[0].snapshot
    (out_a,) = runner.prefill([PrefillItem("a", prompt_a[20:], start=20)])
    generated = {"a": [out_a.next_token]}
    _verify_along_until(runner, generated, 8)
    if source == "parked":
        runner.release("a", park=True)
    (out_b,) = runner.prefill([PrefillItem("b", prompt_b, reuse_from="a", reuse_copy=True, reuse_max=21)])
    assert out_b.reused == 20
    alone = _runner(checkpoints["qwen3_5"])
    alone.prefill([PrefillItem("b", prompt_b)])
    for mine, theirs in zip(runner.model.cache.linear, alone.model.cache.linear):   # the states B runs on
        for x, y in ((mine.conv, theirs.conv), (mine.rec, theirs.rec)):
            torch.testing.assert_close(x[runner.seqs["b"].slot], y[alone.seqs["b"].slot], rtol=1e-4, atol=1e-5)
    generated["b"] = [out_b.next_token]
    if source == "parked":
        del generated["a"]
    _verify_along_until(runner, generated, 24)
    assert generated["b"][:24] == hf_greedy(references["qwen3_5"], prompt_b, 24)
    if source == "running":
        assert generated["a"][:24] == hf_greedy(references["qwen3_5"], prompt_a, 24)


def test_a_released_sequences_snapshots_go_with_its_slot(checkpoints):
    runner = _runner(checkpoints["qwen3_5"], state_snapshots=1)
    shared = _prompt(20, seed=90)
    runner.prefill([PrefillItem("a", shared, more=True, snapshot_at=20)])
    runner.prefill([PrefillItem("a", [5, 6], start=20)])
    runner.release("a")   # not parked: its rows are gone
    (out,) = runner.prefill([PrefillItem("b", shared + [9], reuse_from="a", reuse_copy=True, reuse_max=20)])
    assert out.reused == 0 and runner.model.cache.snapshots == {}


def test_release_and_cache_usage(checkpoints):
    runner = _runner(checkpoints["llama"], max_batch=2)
    assert runner.cache_usage() == (0, 2, 0, 2 * 256)
    runner.prefill([PrefillItem("a", _prompt(10, 1)), PrefillItem("b", _prompt(4, 2))])
    assert runner.cache_usage() == (2, 2, 14, 512)
    runner.release("a")
    assert runner.cache_usage() == (1, 2, 4, 512)
    with pytest.raises(KeyError):
        runner.release("a")


@pytest.fixture(scope="module")
def busy_runner(checkpoints):
    """A runner with one live sequence 's' (pending token known) and one free slot."""
    runner = _runner(checkpoints["qwen3"], max_batch=2, max_seq_len=64, max_tree_nodes=8)
    out = runner.prefill([PrefillItem("s", _prompt(60, 4))])[0]
    return runner, out.next_token


@pytest.mark.parametrize(
    "prompt, message",
    [([], "empty prompt"), ([5, VOCAB], "token ids"), ([5, -1], "token ids"), ([7] * 64, "prompt too long")],
)
def test_prefill_rejects_bad_prompts(busy_runner, prompt, message):
    runner, _ = busy_runner
    with pytest.raises(ValueError, match=message):
        runner.prefill([PrefillItem("new", prompt)])
    assert runner.cache_usage()[0] == 1  # nothing was admitted


def test_prefill_rejects_bad_sampling_params(busy_runner):
    runner, _ = busy_runner
    with pytest.raises(ValueError, match="temperature"):
        runner.prefill([PrefillItem("new", [5, 6], SamplingParams(temperature=float("nan")))])


def test_prefill_without_free_slot_raises_capacity(busy_runner):
    runner, _ = busy_runner
    with pytest.raises(RuntimeError, match="^capacity"):
        runner.prefill([PrefillItem("x", [5]), PrefillItem("y", [6])])
    assert runner.cache_usage()[0] == 1  # all or nothing


@pytest.mark.parametrize(
    "tokens, parents, message",
    [
        ([None, 9], [-1, 1], "malformed"),
        ([None, 9], [0, 0], "malformed"),
        ([None, 9, 10], [-1, 0, 2], "malformed"),
        ([3], [-1], "pending bonus"),
        ([None, 9, 9], [-1, 0, 0], "distinct"),
        ([None, VOCAB], [-1, 0], "token ids"),
        ([None] * 9, [-1] + list(range(8)), "tree too big"),
        ([None] + list(range(10, 17)), [-1] + list(range(7)), "remaining capacity"),
        ([None, 9], [-1], "one parent per token"),
    ],
)
def test_verify_rejects_bad_trees(busy_runner, tokens, parents, message):
    runner, pending = busy_runner
    tokens = [pending if t is None else t for t in tokens]
    with pytest.raises(ValueError, match=message):
        runner.verify([VerifyItem("s", torch.tensor(tokens), torch.tensor(parents))])
    assert runner.cache_usage()[2] == 60  # the failed call changed nothing


def test_verify_unknown_sequence_raises_key_error(busy_runner):
    runner, _ = busy_runner
    with pytest.raises(KeyError):
        runner.verify([_root_only("nope", 1)])
