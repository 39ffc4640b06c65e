"""At temperature > 0, speculative decoding (chain and DDTree) samples exactly the target's distribution.

A goodness-of-fit test on a tiny vocabulary: many independently seeded sequences each take a prefill token and
one speculative step through the real runners and tree builders; the empirical joint of the first two generated
tokens, and of the second and third, are compared with the exact distributions computed from the target, also
with a logit bias, the three penalties and min-p (each token's distribution depends on the tokens before it), and
under a grammar (each token's distribution is the target's over the tokens the grammar allows there).
"""
from __future__ import annotations

import itertools

import pytest
import torch
import transformers
from scipy.stats import chisquare

from ddtree_serve.decoding.config import SamplingParams
from ddtree_serve.decoding.ddtree import build_chain, build_ddtree_batch
from ddtree_serve.decoding.logits_processing import TokenHistory, adjust_logits
from ddtree_serve.decoding.sampling import target_probs
from drafter_svc.runner import DraftItem, DrafterConfig, DrafterRunner
from target_svc.runner import PrefillItem, TargetConfig, TargetRunner, VerifyItem
from tests.fixtures.tiny_drafter import make_tiny_drafter

VOCAB = 8
TEMPERATURE = 1.3
PROMPT = [1, 2, 3, 4]
DRAWS = 3000
BATCH = 250


@pytest.fixture(scope="module")
def tiny_vocab_pair(tmp_path_factory):
    """A random Qwen3 target over 8 tokens, and a random drafter for it."""
    root = tmp_path_factory.mktemp("tiny-vocab")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=128, tie_word_embeddings=False, eos_token_id=None,
                                      bos_token_id=None, pad_token_id=None)
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaky but not degenerate: several tokens carry real mass
    model.save_pretrained(root / "target")
    make_tiny_drafter(root / "drafter", root / "target", seed=3)
    return root / "target", root / "drafter", model


# A bias, every penalty and min-p: the next token's distribution depends on the tokens generated before it.
ADJUSTED = dict(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5, min_p=0.05,
                logit_bias=((2, 1.5), (5, -1.0)))


# One character a token: the first three tokens come from {a, b, c}, then {a, d, e, h}, then {b, c, f, g}.
GRAMMAR_ALLOWS = ([0, 1, 2], [0, 3, 4, 7], [1, 2, 5, 6])


def compiled_grammar():
    """The grammar of GRAMMAR_ALLOWS over the 8-token vocabulary 'a'..'h' (xgrammar, raw one-character tokens)."""
    xgr = pytest.importorskip("xgrammar")
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(list("abcdefgh"), stop_token_ids=[]), max_threads=1)
    return compiler.compile_grammar("root ::= [abc] [adeh] [bcfg] [a-h]*")


def _params(adjusted: bool, **kw) -> SamplingParams:
    return SamplingParams(temperature=TEMPERATURE, **(ADJUSTED if adjusted else {}), **kw)


def _next_token_probs(logits: torch.Tensor, contexts: list[list[int]], params: SamplingParams) -> torch.Tensor:
    """[N, V] float64: the distribution of the token after each context (prompt + generated) one token at a time."""
    rows = []
    for row, ctx in zip(logits, contexts):
        history = TokenHistory.empty(VOCAB, "cpu")
        history.add_prompt(PROMPT)
        history.add_output(ctx[len(PROMPT):])
        rows.append(target_probs(adjust_logits(row[None], params, history), params)[0])
    return torch.stack(rows).double()


def exact_distributions(model, adjusted: bool = False, guided: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """p(t1, t2) and p(t2, t3), each [V, V], under the target at TEMPERATURE (with ADJUSTED's bias, penalties and
    min-p; or masked to GRAMMAR_ALLOWS at each position)."""
    params = _params(adjusted)
    pairs = list(itertools.product(range(VOCAB), repeat=2))
    contexts = [[PROMPT], [PROMPT + [a] for a in range(VOCAB)], [PROMPT + [a, b] for a, b in pairs]]
    with torch.no_grad():
        logits = [model(torch.tensor(c)).logits[:, -1].float() for c in contexts]
    if guided:
        for rows, allowed in zip(logits, GRAMMAR_ALLOWS):
            banned = torch.ones(VOCAB, dtype=torch.bool)
            banned[allowed] = False
            rows[:, banned] = float("-inf")
    p1, p2, p3 = (_next_token_probs(rows, c, params) for rows, c in zip(logits, contexts))
    joint12 = p1[0][:, None] * p2
    joint23 = (joint12[:, :, None] * p3.reshape(VOCAB, VOCAB, VOCAB)).sum(0)
    return joint12, joint23


def speculative_samples(target_dir, drafter_dir, mode: str, adjusted: bool = False,
                        guide=None) -> tuple[list[list[int]], int]:
    """First three generated tokens of DRAWS sequences (prefill token, then speculative steps), and drafts accepted."""
    target = TargetRunner(TargetConfig(model_dir=str(target_dir), device="cpu", dtype=torch.float32, max_batch=BATCH,
                                       max_seq_len=64, max_tree_nodes=65))
    drafter = DrafterRunner(DrafterConfig(drafter_dir=str(drafter_dir), target_model_dir=str(target_dir),
                                          device="cpu", dtype=torch.float32, max_batch=BATCH, max_seq_len=64))
    target.set_feature_layers(drafter.target_layer_ids)
    samples, accepted = [], 0
    for start in range(0, DRAWS, BATCH):
        ids = [f"s{start + i}" for i in range(BATCH)]
        params = [_params(adjusted, seed=1000 + start + i) for i in range(BATCH)]
        outs = target.prefill([PrefillItem(s, PROMPT, p, True, guide=guide) for s, p in zip(ids, params)])
        generated = {o.seq_id: [o.next_token] for o in outs}
        ctx = {o.seq_id: o.context_len for o in outs}
        for o in outs:
            drafter.add_context(o.seq_id, 0, o.features)
        while any(len(g) < 3 for g in generated.values()):
            items = [DraftItem(s, generated[s][-1], ctx[s]) for s in ids]
            logprobs, topk = drafter.draft(items, top_k=VOCAB if mode == "ddtree" else 1, max_depth=4)
            roots = [generated[s][-1] for s in ids]
            batch = (build_ddtree_batch(logprobs, topk, roots, [12] * len(ids), [4] * len(ids)) if mode == "ddtree"
                     else build_chain(logprobs, topk, roots, [4] * len(ids)))
            results = target.verify([VerifyItem(s, t.tokens, t.parents) for s, t in zip(ids, batch.unbind())])
            for r in results:
                accepted += len(r.accepted_tokens)
                generated[r.seq_id] += r.accepted_tokens + [r.next_token]
                drafter.add_context(r.seq_id, ctx[r.seq_id], r.features)
                ctx[r.seq_id] = r.context_len
        for s in ids:
            samples.append(generated[s][:3])
            target.release(s)
            drafter.release(s)
    return samples, accepted


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value, pooling cells whose expected count is below 5 into one; 0 if an impossible cell
    (probability 0) was drawn, and impossible cells left out otherwise."""
    possible = probs.flatten() > 0
    if counts.flatten()[~possible].sum() > 0:
        return 0.0
    expected = probs.flatten()[possible] * counts.sum()
    counts = counts.flatten()[possible].double()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts[~small]
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected[~small]
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


def assert_fits(samples: list[list[int]], joint12: torch.Tensor, joint23: torch.Tensor) -> None:
    """The samples' joints of (t1, t2) and (t2, t3) fit the exact ones (chi-square p > 1e-3)."""
    counts12 = torch.zeros(VOCAB, VOCAB)
    counts23 = torch.zeros(VOCAB, VOCAB)
    for t1, t2, t3 in samples:
        counts12[t1, t2] += 1
        counts23[t2, t3] += 1
    assert chi2_pvalue(counts12, joint12) > 1e-3
    assert chi2_pvalue(counts23, joint23) > 1e-3


@pytest.mark.parametrize("mode, adjusted", [("dflash", False), ("ddtree", False), ("dflash", True), ("ddtree", True)],
                         ids=["dflash", "ddtree", "dflash-penalised", "ddtree-penalised"])
def test_sampled_tokens_follow_the_target_distribution(tiny_vocab_pair, mode, adjusted):
    target_dir, drafter_dir, model = tiny_vocab_pair
    joint12, joint23 = exact_distributions(model, adjusted)
    if adjusted:   # the adjustments really change the distribution being tested
        assert (joint12 - exact_distributions(model)[0]).abs().max() > 0.02
    samples, accepted = speculative_samples(target_dir, drafter_dir, mode, adjusted)
    assert accepted > DRAWS // 10  # drafts really were accepted, so the walk is what is being tested
    assert_fits(samples, joint12, joint23)


@pytest.mark.parametrize("mode", ["dflash", "ddtree"])
def test_sampled_tokens_under_a_grammar_follow_the_targets_distribution_over_what_it_allows(tiny_vocab_pair, mode):
    target_dir, drafter_dir, model = tiny_vocab_pair
    joint12, joint23 = exact_distributions(model, guided=True)
    samples, accepted = speculative_samples(target_dir, drafter_dir, mode, guide=compiled_grammar())
    assert accepted > DRAWS // 20   # drafts the grammar allows were accepted: the masked walk is being tested
    assert all(t1 in GRAMMAR_ALLOWS[0] and t2 in GRAMMAR_ALLOWS[1] and t3 in GRAMMAR_ALLOWS[2]
               for t1, t2, t3 in samples)
    assert_fits(samples, joint12, joint23)


def test_goodness_of_fit_rejects_a_wrong_distribution(tiny_vocab_pair):
    """The test has power: the same samples against a distribution at another temperature are rejected."""
    _, _, model = tiny_vocab_pair
    joint12, _ = exact_distributions(model)
    g = torch.Generator().manual_seed(0)
    flat = torch.multinomial(torch.softmax(torch.log(joint12.flatten()) * 1.5, -1).float(), DRAWS, True, generator=g)
    counts = torch.bincount(flat, minlength=VOCAB * VOCAB).reshape(VOCAB, VOCAB).double()
    assert chi2_pvalue(counts, joint12) < 1e-6
