"""CUDA paths (run on the GPU machine; skipped where there is no GPU): the same lossless guarantees on the device."""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import random
from pathlib import Path

import grpc
import pytest
import torch
import transformers

from ddtree_serve.decoding.config import SamplingParams
from ddtree_serve.decoding.ddtree import build_ddtree_batch
from ddtree_serve.proto import gateway_pb2_grpc
from drafter_svc.runner import DraftItem, DrafterConfig, DrafterRunner
from target_svc.runner import PREFILL_VERIFY_CHUNKS, PrefillItem, TargetConfig, TargetRunner, VerifyItem
from tests.conftest import (ADJUSTED_SAMPLING, GrammarLogits, adjusted_generate_kwargs, compile_guide, make_request,
                            prompts_for, reference_model, run_streams, start_stack)
from tests.fixtures.trees import random_tree_along

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_SCHEMA = ('{"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}, '
              '"required": ["name", "n"]}')


def hf_greedy_on(device: str, model_dir, prompt: list[int], n: int, dtype=torch.float32,
                 sampling: SamplingParams | None = None, guide=None) -> list[int]:
    """transformers' greedy generate() on `device`, from a fresh copy (the cached CPU oracle stays untouched); with
    sampling, its logit bias and penalties applied; with guide (a compiled grammar), kept to it."""
    model = copy.deepcopy(reference_model(str(model_dir))).to(device=device, dtype=dtype)
    extra = adjusted_generate_kwargs(sampling, len(prompt)) if sampling is not None else {}
    if guide is not None:
        extra["logits_processor"] = transformers.LogitsProcessorList([GrammarLogits(guide, len(prompt))])
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=device), do_sample=False, max_new_tokens=n,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                             pad_token_id=0, **extra)
    return out[0, len(prompt):].tolist()


def speculative_greedy(target_dir, drafter_dir, prompt: list[int], n: int, dtype: torch.dtype,
                       enforce_eager: bool = False, runners: list | None = None,
                       prefill_verify_chunks: int | None = None, sampling: SamplingParams = SamplingParams()
                       ) -> tuple[list[int], int]:
    """Runners on cuda: prefill, then DDTree steps (budget 32) until n tokens; returns tokens and accepted drafts.
    The runners are appended to `runners` when given (to inspect their graphs)."""
    target = TargetRunner(TargetConfig(model_dir=str(target_dir), device="cuda", dtype=dtype, max_batch=2,
                                       max_seq_len=256, max_tree_nodes=65, enforce_eager=enforce_eager,
                                       prefill_verify_chunks=prefill_verify_chunks))
    drafter = DrafterRunner(DrafterConfig(drafter_dir=str(drafter_dir), target_model_dir=str(target_dir),
                                          device="cuda", dtype=dtype, max_batch=2, max_seq_len=256,
                                          enforce_eager=enforce_eager))
    if runners is not None:
        runners += [target, drafter]
    target.set_feature_layers(drafter.target_layer_ids)
    (out,) = target.prefill([PrefillItem("a", prompt, sampling, True)])
    drafter.add_context("a", 0, out.features)
    tokens, ctx, accepted = [out.next_token], out.context_len, 0
    while len(tokens) < n:
        depth = min(15, n - len(tokens) - 1)
        if depth > 0:
            lp, ids = drafter.draft([DraftItem("a", tokens[-1], ctx)], top_k=32, max_depth=depth)
            tree = build_ddtree_batch(lp, ids, [tokens[-1]], [32], [depth]).tree(0)
            tree_tokens, parents = tree.tokens, tree.parents
        else:
            tree_tokens, parents = torch.tensor([tokens[-1]]), torch.tensor([-1])
        (r,) = target.verify([VerifyItem("a", tree_tokens, parents)])
        drafter.add_context("a", ctx, r.features)
        tokens += r.accepted_tokens + [r.next_token]
        accepted += len(r.accepted_tokens)
        ctx = r.context_len
    return tokens[:n], accepted


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_cuda_float32_runners_equal_transformers_greedy(checkpoints, kind):
    target, drafter = checkpoints(kind)
    prompt = prompts_for(target, [9], seed=4)[0]
    tokens, _ = speculative_greedy(target, drafter, prompt, 48, torch.float32)
    assert tokens == hf_greedy_on("cuda", target, prompt, 48)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_cuda_bfloat16_runners_generate_valid_tokens(checkpoints, kind):
    target, drafter = checkpoints(kind)
    prompt = prompts_for(target, [9], seed=4)[0]
    tokens, _ = speculative_greedy(target, drafter, prompt, 32, torch.bfloat16)
    vocab = reference_model(str(target)).config.get_text_config().vocab_size
    assert len(tokens) == 32 and all(0 <= t < vocab for t in tokens)
    # bf16 kernels differ from transformers' own, so exact equality is not expected; the first tokens agree
    assert tokens[:4] == hf_greedy_on("cuda", target, prompt, 4, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_steps_equal_eager_steps(checkpoints, dtype):
    """Graph-captured verify and draft (padded to buckets) give the eager path's greedy tokens exactly."""
    target, drafter = checkpoints("qwen3")
    for prompt in prompts_for(target, [9, 30], seed=8):
        runners = []
        graphed, accepted_g = speculative_greedy(target, drafter, prompt, 48, dtype, runners=runners)
        # the same functions eagerly, prompts included (as chains; plain forwards would round differently in bf16)
        eager, accepted_e = speculative_greedy(target, drafter, prompt, 48, dtype, enforce_eager=True,
                                               prefill_verify_chunks=PREFILL_VERIFY_CHUNKS)
        assert graphed == eager and accepted_g == accepted_e
        target_runner, drafter_runner = runners
        graphs = target_runner.graphs
        assert graphs.forwards.graphs and graphs.walks.graphs and graphs.commits.graphs
        assert drafter_runner.graphs.cache.graphs
        # every bucket's forward wrote the one shared logits buffer; no bucket still holds its traces
        assert {g.outputs[0].data_ptr() for g in graphs.forwards.graphs.values()} == {graphs._logits_out.buffer.data_ptr()}
        # every walk read the shared features (no static copy of its own: its inputs are the packed trees, the
        # choices and the forward's ancestor mask) and wrote the one shared rows buffer
        assert all(len(g.static_inputs) == 3 for g in graphs.walks.graphs.values())
        rows = {g.outputs[1].data_ptr() for g in graphs.walks.graphs.values() if g.outputs[1] is not None}
        assert rows == {graphs._rows_out.buffer.data_ptr()}
        assert not graphs._traces
        drafts = [g for key, g in drafter_runner.graphs.cache.graphs.items() if key[0] != "context"]
        shared_logits = drafter_runner.graphs.logits_out.buffer.data_ptr()
        assert {g.outputs[0].data_ptr() for g in drafts} == {shared_logits}
        # a capture that records no kernel would replay nothing: every cache names its empty captures
        caches = (graphs.forwards, graphs.walks, graphs.commits, drafter_runner.graphs.cache)
        assert {c.name: c.empty_keys for c in caches if c.empty_keys} == {}


@pytest.mark.parametrize("adjustment", ["bias_and_penalties", "bad_words", "json_schema"])
def test_cuda_penalised_biased_greedy_through_graphs_equals_eager_and_transformers(checkpoints, adjustment):
    """Logit bias and penalties (or bad words of one to three tokens, taken from the plain answer, or a JSON
    schema's grammar) applied to the captured verify's logits, each node under its own path: random trees along
    transformers' answer (with the same processors, float32, on the GPU) reproduce it exactly, graphed and eagerly,
    and it differs from the unadjusted answer."""
    target, _ = checkpoints("qwen3")
    prompt = prompts_for(target, [9], seed=4)[0]
    vocab = reference_model(str(target)).config.get_text_config().vocab_size
    sampling = ADJUSTED_SAMPLING
    if adjustment == "bad_words":
        plain = hf_greedy_on("cuda", target, prompt, 48)
        sampling = SamplingParams(bad_words=(tuple(plain[3:5]), (plain[10],), tuple(plain[20:23])))
    guide = None
    if adjustment == "json_schema":
        pytest.importorskip("xgrammar")
        sampling, guide = SamplingParams(), compile_guide(target, "json", GPU_SCHEMA)
    truth = hf_greedy_on("cuda", target, prompt, 96, sampling=sampling, guide=guide)

    def run(enforce_eager: bool) -> tuple[list[int], int, TargetRunner]:
        runner = TargetRunner(TargetConfig(model_dir=str(target), device="cuda", dtype=torch.float32, max_batch=2,
                                           max_seq_len=256, max_tree_nodes=65, enforce_eager=enforce_eager,
                                           prefill_verify_chunks=PREFILL_VERIFY_CHUNKS))
        (out,) = runner.prefill([PrefillItem("a", prompt, sampling, guide=guide)])
        tokens, rng, deepest = [out.next_token], random.Random(2), 1
        while len(tokens) < 48:
            tree, parents = random_tree_along(tokens[-1], truth[len(tokens):], rng, rng.randint(1, 40), vocab)
            (r,) = runner.verify([VerifyItem("a", torch.tensor(tree), torch.tensor(parents))])
            tokens += r.accepted_tokens + [r.next_token]
            deepest = max(deepest, len(r.accepted_nodes))
        return tokens[:48], deepest, runner

    graphed, deepest, runner = run(enforce_eager=False)
    eager, _, _ = run(enforce_eager=True)
    assert runner.graphs.walks.graphs and deepest >= 4
    assert graphed == eager == truth[:48]
    assert truth[:48] != hf_greedy_on("cuda", target, prompt, 48)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_cuda_prompt_logprobs_from_captured_chains_equal_transformers_log_softmax(checkpoints, kind):
    """Prompt log-probs read off the captured chain prefill's logits (two calls, the second continuing the first)
    equal transformers' float32 log-softmax on the GPU: within 1e-3 for the dense model, as the generated tokens'
    do; for the hybrid within 0.05, since its Gated DeltaNet kernels multiply in TF32 (CHUNK_TOL's reasoning; H100
    runs saw 0.014 and 0.026 at most)."""
    target, _ = checkpoints(kind)
    prompt = prompts_for(target, [40], seed=12)[0]
    runner = TargetRunner(TargetConfig(model_dir=str(target), device="cuda", dtype=torch.float32, max_batch=2,
                                       max_seq_len=256, max_tree_nodes=65))
    got = []
    for a, b in ((0, 17), (17, 40)):
        (out,) = runner.prefill([PrefillItem("a", prompt[a:b], SamplingParams(), start=a, more=b < 40,
                                             prompt_logprobs=2)])
        got += out.prompt_logprobs
    assert runner.graphs is not None and runner.graphs.forwards.graphs
    model = copy.deepcopy(reference_model(str(target))).to("cuda")
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt], device="cuda")).logits[0, :-1].float(), -1).cpu()
    # The hybrid's Gated DeltaNet kernels (fla's, ours and transformers') multiply in TF32: 0.026 apart at most on
    # an H100 (log-probs of logits ~20 in size, the sharpened test head), so 0.05 for it; 1e-3 for the dense one.
    tol = {"atol": 1e-3 if kind == "qwen3" else 5e-2, "rtol": 0}
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in got]),
                               ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], **tol)
    torch.testing.assert_close(torch.tensor([[v for _, v in lp.top] for lp in got]), ref.topk(2).values, **tol)


def test_cuda_graph_verify_matches_eager_logits_in_a_padded_batch(checkpoints):
    """Three sequences (bucket 4) through the captured forward: logits within bf16 rounding of eager."""
    from target_svc.verify import VerifyBatch, VerifyShape, verify_forward

    target, _ = checkpoints("qwen3")
    runner = TargetRunner(TargetConfig(model_dir=str(target), device="cuda", dtype=torch.bfloat16, max_batch=4,
                                       max_seq_len=256, max_tree_nodes=65))
    prompts = prompts_for(target, [5, 17, 40], seed=9)
    outs = runner.prefill([PrefillItem(f"s{i}", p, SamplingParams()) for i, p in enumerate(prompts)])
    parents = torch.tensor([-1, 0, 0, 1, 2, 3, 3])
    trees = [(torch.tensor([o.next_token, 11, 12, 13, 14, 15, 16]), parents) for o in outs]
    ctx = [o.context_len for o in outs]
    slots = [runner.seqs[f"s{i}"].slot for i in range(3)]
    scratch = runner.model.cache.spec.scratch_slot
    exact = VerifyBatch.pack(trees, ctx, slots, VerifyShape(3, 7, max(ctx) + 7), scratch)
    want = verify_forward(runner.model, exact.packed.cuda(), 7, max(ctx) + 7, ())[0]
    shape = runner.graphs.shape_for(3, 7, max(ctx) + 7)
    assert (shape.batch, shape.nodes) == (4, 17)   # 3 rows -> 4, 7 nodes -> the next 4^k + 1 bucket
    bucketed = VerifyBatch.pack(trees, ctx, slots, shape, scratch)
    got = runner.graphs.forward(bucketed, bucketed.packed.cuda(), ())[0][:3, :7]
    # bf16: padded shapes may pick other GEMM tilings; stated tolerance 2% of the largest logit
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.95


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_nodes,one_a_call", [(65, False), (257, True)],
                         ids=["65-node buckets, prompts together", "257-node bucket, a prompt a call"])
def test_cuda_graphed_chain_prefill_equals_the_eager_forwards(checkpoints, kind, dtype, max_nodes, one_a_call,
                                                               monkeypatch):
    """Prompts prefilled as fully accepted chains through the captured verify graphs (the default on CUDA for up to
    PREFILL_VERIFY_CHUNKS chunks of 65; each chunk the node bucket of least estimated cost, so a lone prompt of 70
    or 130 tokens takes one 257-node forward, dense or hybrid) against forward_block prefill: features and
    linear-attention states within 2e-4 (float32) or 2 % (bfloat16: other GEMM tilings) of their largest
    magnitude; in float32 the same first tokens and, decoding on, transformers' greedy tokens."""

    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")   # fla's chunked prefill kernel: IEEE float32 products

    target, _ = checkpoints(kind)
    prompts = prompts_for(target, [5, 40, 70, 130], seed=12)   # 1 to 3 chains of 65
    assert max(len(p) for p in prompts) <= PREFILL_VERIFY_CHUNKS * 65

    def run(chains: bool):
        runner = TargetRunner(TargetConfig(model_dir=str(target), device="cuda", dtype=dtype, max_batch=4,
                                           max_seq_len=256, max_tree_nodes=max_nodes,
                                           prefill_verify_chunks=None if chains else 0))
        assert runner.graphs is not None
        runner.set_feature_layers([0, 1])
        items = [PrefillItem(f"s{i}", p, SamplingParams(), True) for i, p in enumerate(prompts)]
        outs = [runner.prefill([it])[0] for it in items] if one_a_call else runner.prefill(items)
        return runner, outs

    (graphed, got), (eager, want) = run(True), run(False)
    assert graphed.graphs.forwards.graphs and not eager.graphs.forwards.graphs
    if one_a_call:
        assert any(shape.nodes == 257 for shape in graphed.graphs.forwards.graphs)
    tol = 2e-4 if dtype == torch.float32 else 2e-2

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return (a.float() - b.float()).abs().max().item() <= tol * b.float().abs().max().item()

    for a, b in zip(got, want):
        assert a.context_len == b.context_len and close(a.features, b.features)
        if dtype == torch.float32:
            assert a.next_token == b.next_token
    for mine, ref in zip(graphed.model.cache.linear, eager.model.cache.linear):
        assert close(mine.rec[:4], ref.rec[:4]) and close(mine.conv[:4], ref.conv[:4])
    # and decoding goes on from the graphed prefill as transformers' greedy does (float32)
    if dtype == torch.float32:
        prompt, out = prompts[2], got[2]
        tokens = [out.next_token]
        while len(tokens) < 12:
            (r,) = graphed.verify([VerifyItem("s2", torch.tensor([tokens[-1]]), torch.tensor([-1]))])
            tokens.append(r.next_token)
        assert tokens == hf_greedy_on("cuda", target, prompt, 12)


def _hybrid_model(target_dir, dtype: torch.dtype, compiled: bool, device: str = "cuda"):
    """A fused hybrid TargetModel whose glue runs compiled (HybridKernels through torch.compile) or plain."""
    from target_svc.hybrid_layers import HybridKernels
    from target_svc.loader import load_target
    from target_svc.model import TargetModel

    model = TargetModel(load_target(str(target_dir), device, dtype), 2, 128, 8, fused=True)
    assert model.hybrid is not None
    model.hybrid_kernels = HybridKernels.make(compiled=compiled)
    for w in model.hybrid:
        if w.gdn is not None:
            w.gdn.glue.kernels = model.hybrid_kernels
    return model


def _hybrid_glue_run(model, device: str) -> dict[str, torch.Tensor]:
    """Prefill chains, a tree (one-pass WY) with its commit, then a decode step: every output, in float32."""
    ids = torch.randint(4, 300, (2, 20), generator=torch.Generator().manual_seed(1)).to(device)
    parents = (torch.arange(20, device=device) - 1).expand(2, 20).contiguous()
    valid = torch.arange(20, device=device)[None, :] < torch.tensor([[20], [13]], device=device)
    slots, ctx = torch.tensor([0, 1], device=device), torch.zeros(2, dtype=torch.long, device=device)
    out = {}
    out["prefill logits"], out["prefill features"] = model.forward_block(ids, parents, valid, ctx, slots,
                                                                        feature_layers=(0, 2), chain=True)
    ctx = torch.tensor([20, 13], device=device)
    tree = torch.tensor([[-1, 0, 0, 1, 2, 3, 3]] * 2, device=device)
    tree_ids = torch.randint(4, 300, (2, 7), generator=torch.Generator().manual_seed(2)).to(device)
    out["tree logits"], _ = model.forward_block(tree_ids, tree, torch.ones(2, 7, dtype=torch.bool, device=device),
                                                ctx, slots, key_len=27)
    path, path_len = torch.tensor([[0, 1, 3], [0, 2, 4]], device=device), torch.tensor([3, 2], device=device)
    model.commit_block(path, path_len, slots, ctx)
    for i, state in enumerate(model.cache.linear):
        out[f"committed recurrent state {i}"] = state.rec
    ctx = ctx + path_len
    step = torch.full((2, 1), -1, device=device)
    out["decode-step logits"], _ = model.forward_block(tree_ids[:, :1], step,
                                                       torch.ones(2, 1, dtype=torch.bool, device=device), ctx,
                                                       slots, key_len=int(ctx.max()) + 1)
    # rows of the shorter prompt past its end are padding: their values are not outputs
    out["prefill logits"], out["prefill features"] = (t * valid[..., None] for t in (out["prefill logits"],
                                                                                      out["prefill features"]))
    return {k: v.float() for k, v in out.items()}


def _mean_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().mean().item()


@torch.no_grad()
def test_cuda_drafter_compiled_glue_equals_the_plain_functions_in_float32(checkpoints):
    """DFlashDraftModel.compile_glue (what the drafter runner does on CUDA): a block over context features and a
    cached past, within 1e-4 of the largest hidden value of the plain forward (stated tolerance: Triton's
    reductions sum in another order than ATen's), and no function fell back to its plain version."""
    from drafter_svc.dflash_model import DFlashAttention, DFlashDraftModel, RMSNorm

    _, drafter_dir = checkpoints("qwen3")
    model = DFlashDraftModel.from_pretrained(drafter_dir, device="cuda", dtype=torch.float32)
    cfg, gen = model.config, torch.Generator(device="cuda").manual_seed(0)
    noise = torch.randn(2, cfg.block_size, cfg.hidden_size, device="cuda", generator=gen)
    feats = torch.randn(2, 11, cfg.feature_dim, device="cuda", generator=gen)
    positions = torch.arange(11 + cfg.block_size, device="cuda")
    want = model(noise, feats, positions)
    model.compile_glue()
    got = model(noise, feats, positions)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    wrappers = [m.fn for m in model.modules() if isinstance(m, RMSNorm)][:1]
    wrappers += [m.norm_rope for m in model.modules() if isinstance(m, DFlashAttention)][:1]
    assert all(w.fn is not w.plain for w in wrappers), "torch.compile fell back to the plain functions"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_cuda_compiled_hybrid_glue_equals_the_plain_functions(checkpoints, dtype):
    """The hybrid layers' compiled glue (target_svc/hybrid_layers.py) against the same fused forward with the plain
    functions: prefill chains, a tree (one-pass WY) with its commit, then a decode step. (The compiled glue inside
    captured graphs: test_cuda_float32_runners_equal_transformers_greedy[qwen3_5], fused by default on CUDA.)"""
    from ddtree_serve.plumbing.compiled import CompiledOrPlain

    target_dir, _ = checkpoints("qwen3_5")
    compiled_model = _hybrid_model(target_dir, dtype, compiled=True)
    plain = _hybrid_glue_run(_hybrid_model(target_dir, dtype, compiled=False), "cuda")
    compiled = _hybrid_glue_run(compiled_model, "cuda")
    if dtype == torch.float32:
        # Stated tolerance: 1e-4 of the largest value (Triton's reductions sum in another order than ATen's).
        for what, want in plain.items():
            assert (compiled[what] - want).abs().max().item() <= 1e-4 * want.abs().max().item(), what
            if what.endswith("logits"):
                assert torch.equal(compiled[what].argmax(-1), want.argmax(-1)), what
    else:
        # bf16: a fused kernel keeps some intermediates in float32 where eager rounds them, and a tiny random model
        # amplifies each flipped rounding layer by layer, so bf16 is judged against float32: the compiled glue must
        # be as close to the float32 forward as the plain bf16 functions are (mean |error| within 1.25x of
        # theirs, stated tolerance) and pick the same greedy tokens as float32 as often, within 5 points.
        ref = _hybrid_glue_run(_hybrid_model(target_dir, torch.float32, compiled=False), "cuda")
        for what, want in ref.items():
            assert _mean_error(compiled[what], want) <= 1.25 * _mean_error(plain[what], want) + 1e-6, what
            if what.endswith("logits"):
                agree = [(out[what].argmax(-1) == want.argmax(-1)).float().mean().item() for out in (plain, compiled)]
                assert agree[1] >= agree[0] - 0.05, what
    kernels = compiled_model.hybrid_kernels
    fell_back = [n for n in kernels.__dataclass_fields__ if getattr(kernels, n).fn is getattr(kernels, n).plain]
    assert all(isinstance(getattr(kernels, n), CompiledOrPlain) for n in kernels.__dataclass_fields__)
    assert not fell_back, f"torch.compile failed for {fell_back}"


@pytest.mark.parametrize("transport", ["inline", "cuda-ipc", "cuda-ipc --no-early-push"])
def test_cuda_services_equal_transformers_greedy(checkpoints, transport):
    """Through the services on the GPU; cuda-ipc's verify rows go as early pushes (the drafter's store and draft
    queued behind the target's interprocess event) unless --no-early-push."""
    target, drafter = checkpoints("qwen3")
    prompts = prompts_for(target, [5, 13, 8], seed=6)
    transport, *flags = transport.split()
    stack = start_stack(target, drafter, device="cuda", transport=transport, extra={"target": flags})
    try:
        results = run_streams(stack.gateway, [make_request(p, 40, mode) for p, mode in
                                              zip(prompts, ["ddtree", "dflash", "ar"])])
    finally:
        stack.stop()
    for prompt, result in zip(prompts, results):
        assert result["token_ids"] == hf_greedy_on("cuda", target, prompt, 40)
        assert result["stats"].steps > 0


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_cuda_follow_up_turns_from_parked_rows_equal_transformers_greedy(checkpoints, kind):
    """Prefix caching on the GPU (cuda-ipc, captured graphs): a follow-up turn whose prompt starts with the last
    turn's tokens starts from its parked rows (prefilled from there through the captured chains) and still gives
    transformers' greedy answer to the whole prompt, in every mode."""
    target, drafter = checkpoints(kind)
    first, extra = prompts_for(target, [40, 9], seed=8)
    stack = start_stack(target, drafter, device="cuda", transport="cuda-ipc")
    try:
        for mode in ("ddtree", "dflash", "ar"):
            (turn1,) = run_streams(stack.gateway, [make_request(first, 24, mode)])
            follow_up = first + turn1["token_ids"] + extra
            (turn2,) = run_streams(stack.gateway, [make_request(follow_up, 32, mode)])
            assert turn2["token_ids"] == hf_greedy_on("cuda", target, follow_up, 32), f"{kind} {mode}"
            assert turn2["stats"].cached_prompt_tokens >= len(first), f"{kind} {mode}"
    finally:
        stack.stop()


def test_cuda_chats_under_one_system_prompt_start_from_its_state_snapshot(checkpoints):
    """Gated DeltaNet state snapshots on the GPU (cuda-ipc, captured graphs): a token-id prompt naming its shared
    prefix (cache_breakpoint) leaves a snapshot there; two later prompts under it, one after the other and two at
    once, copy those rows and start from it (their cached tokens are the prefix), and every answer is transformers'
    greedy output on the GPU."""
    target, drafter = checkpoints("qwen3_5")
    shared, *tails = prompts_for(target, [48, 7, 9, 5, 6], seed=12)
    stack = start_stack(target, drafter, device="cuda", transport="cuda-ipc",
                        extra={"target": ["--gdn-state-snapshots", "4"]})
    try:
        requests = [make_request(shared + t, 24, "ddtree", cache_breakpoint=48) for t in tails]
        first, second = (run_streams(stack.gateway, [r])[0] for r in requests[:2])
        together = run_streams(stack.gateway, requests[2:])
    finally:
        stack.stop()
    assert [r["stats"].cached_prompt_tokens for r in (first, second, *together)] == [0, 48, 48, 48]
    for r, tail in zip((first, second, *together), tails):
        assert r["token_ids"] == hf_greedy_on("cuda", target, shared + tail, 24)


def test_cuda_logprobs_through_the_captured_verify_equal_transformers_log_softmax(checkpoints):
    """Log-probs read off the captured verify graph's logits (and the prefill's): each generated token's equals
    transformers' float32 log-softmax over the same ids on the GPU, within a stated 1e-3 (cuBLAS sums in another
    order than the graph's kernels); the top-2 alternatives are the row's two largest."""
    from ddtree_serve.client import Client

    target, drafter = checkpoints("qwen3")
    prompt = prompts_for(target, [9], seed=11)[0]
    stack = start_stack(target, drafter, device="cuda")
    try:
        with Client(stack.gateway) as client:
            result = client.generate(prompt_ids=prompt, max_tokens=24, ignore_eos=True, mode="ddtree", budget=16,
                                     logprobs=True, top_logprobs=2)
    finally:
        stack.stop()
    ids = result.token_ids
    assert len(result.logprobs) == len(ids) == 24 and result.stats["steps"] > 0
    model = copy.deepcopy(reference_model(str(target))).to("cuda")
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids[:-1]], device="cuda")).logits[0, len(prompt) - 1:]
    ref = torch.log_softmax(logits.float(), dim=-1)
    got = [lp["logprob"] for lp in result.logprobs]
    assert got == pytest.approx(ref[torch.arange(len(ids)), ids].tolist(), abs=1e-3)
    for row, lp in zip(ref, result.logprobs):
        assert [v for _, v in lp["top"]] == pytest.approx(row.topk(2).values.tolist(), abs=1e-3)


def test_cuda_ipc_buffer_opened_in_another_process_reads_what_was_staged(tmp_path):
    """The drafter side of cuda-ipc, in a second process: it sees the rows the target staged on the GPU."""
    import subprocess
    import sys

    from ddtree_serve.transport import FeatureRows
    from ddtree_serve.transport.shared_buffer import StagingBuffer, plan_pieces

    rows = FeatureRows("s", 0, torch.arange(12, dtype=torch.bfloat16, device="cuda").reshape(3, 4))
    staging = StagingBuffer("cuda-ipc", 4096, torch.device("cuda"))
    [[piece]] = plan_pieces([3], 8, 4096)
    staging.write(piece, rows)
    torch.cuda.synchronize()
    (tmp_path / "desc.bin").write_bytes(staging.descriptor.SerializeToString())
    script = (
        "import sys, torch\n"
        "from ddtree_serve.proto import drafter_pb2\n"
        "from ddtree_serve.transport import OpenedBuffers, rows_view\n"
        "desc = drafter_pb2.SharedBuffer.FromString(open(sys.argv[1], 'rb').read())\n"
        "buf = OpenedBuffers().get(desc)\n"
        "print(rows_view(buf, 0, 3, 4, 'bfloat16').float().sum().item())\n")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "desc.bin")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip()) == sum(range(12))
    staging.close()


def test_cuda_ipc_early_push_is_read_only_after_the_targets_event(tmp_path):
    """An early push leaves the target before its rows exist: here they are written behind a ~10 s kernel. The
    other process opens the buffer and the interprocess event, waits on the event on its stream and reads the
    rows and the header as written, not the zeros that were there when the message was made."""
    import subprocess
    import sys

    from ddtree_serve.transport.base import EarlyRows
    from ddtree_serve.transport.shared import SharedBufferFeatureSender

    sender = SharedBufferFeatureSender(drafter_address="unix:/nonexistent/ddtree.sock", name="cuda-ipc",
                                       staging_bytes=1 << 20)
    rows = torch.zeros(3, 4, dtype=torch.bfloat16, device="cuda")
    header = torch.zeros(2, dtype=torch.long, device="cuda")
    sender._buffer_for(rows.device)   # noqa: SLF001 - opened before the slow kernel, as after a first push
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e10))   # noqa: SLF001 - ~10 s of clock cycles on the compute stream
    rows.copy_(torch.arange(12, dtype=torch.bfloat16, device="cuda").view(3, 4))
    header.copy_(torch.tensor([2, 77], device="cuda"))
    ready = torch.cuda.Event()
    ready.record()
    push = sender.stage_early([EarlyRows("s", 0, rows, header, ready)])
    assert push is not None and push.batch.ready_event
    (tmp_path / "batch.bin").write_bytes(push.batch.SerializeToString())
    script = (
        "import sys, torch\n"
        "from ddtree_serve.proto import drafter_pb2\n"
        "from ddtree_serve.transport import OpenedBuffers\n"
        "batch = drafter_pb2.FeatureBatch.FromString(open(sys.argv[1], 'rb').read())\n"
        "opened = OpenedBuffers()\n"
        "m = batch.rows[0]\n"
        "data = opened.rows(batch.shared, m.shared_offset, m.num_rows, batch.feature_dim, m.dtype)\n"
        "head = opened.header(batch.shared, m.header_offset)\n"
        "torch.cuda.current_stream(data.device).wait_event(torch.cuda.Event.from_ipc_handle(data.device, "
        "batch.ready_event))\n"
        "print(data.float().sum().item(), head.tolist())\n")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "batch.bin")], capture_output=True,
                         text=True, timeout=300)
    torch.cuda.synchronize()
    sender._release()   # noqa: SLF001
    assert out.returncode == 0, out.stderr
    total, head = out.stdout.split(maxsplit=1)
    assert float(total) == sum(range(12)) and head.strip() == "[2, 77]"


# ---- the nccl transport: target on cuda:0, drafter on cuda:1 ------------------------------------------------------
def _has_cupy() -> bool:
    import importlib.util

    return importlib.util.find_spec("cupy") is not None


needs_two_gpus_and_cupy = pytest.mark.skipif(
    torch.cuda.device_count() < 2 or not _has_cupy(),
    reason="needs 2 CUDA devices and cupy (pip install 'ddtree-serve[gpu]' or cupy-cuda13x)")


@needs_two_gpus_and_cupy
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nccl_comm_moves_a_payload_from_one_gpu_to_another_process_on_the_other(dtype):
    """NcclComm itself, no services: rank 1 in a second process on cuda:1 receives what rank 0 sends from cuda:0."""
    import subprocess
    import sys
    import threading

    from ddtree_serve.transport.nccl import NcclComm, new_unique_id

    uid = new_unique_id()
    script = (
        "import sys, torch\n"
        "from ddtree_serve.transport.nccl import NcclComm\n"
        f"comm = NcclComm(bytes.fromhex(sys.argv[1]), 1, torch.device('cuda:1'))\n"
        f"buf = torch.zeros(1000, dtype=torch.{dtype}, device='cuda:1')\n"
        f"comm.recv(buf, 1000, '{dtype}', 0).synchronize()\n"
        "print(buf.float().sum().item())\n")
    peer = subprocess.Popen([sys.executable, "-c", script, uid.hex()], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    comms = []
    joiner = threading.Thread(target=lambda: comms.append(NcclComm(uid, 0, torch.device("cuda:0"))))
    joiner.start()
    joiner.join(120)
    assert comms, "rank 0 did not join within 120 s"
    payload = torch.arange(1000, device="cuda:0").to(getattr(torch, dtype)) % 7
    comms[0].send(payload, 1000, dtype, 1).synchronize()
    out, err = peer.communicate(timeout=120)
    assert peer.returncode == 0, err
    assert float(out.strip()) == payload.float().sum().item()
    comms[0].abort()


@needs_two_gpus_and_cupy
def test_nccl_services_on_two_gpus_equal_transformers_greedy(checkpoints):
    target, drafter = checkpoints("qwen3")
    prompts = prompts_for(target, [5, 13, 8], seed=6)
    stack = start_stack(target, drafter, device="cuda:0", drafter_device="cuda:1", transport="nccl")
    try:
        results = run_streams(stack.gateway, [make_request(p, 40, mode) for p, mode in
                                              zip(prompts, ["ddtree", "dflash", "ar"])])
        target_log = (Path(stack.log_dir) / "target.log").read_text()
    finally:
        stack.stop()
    assert "NCCL communicator" in target_log and "formed" in target_log
    for prompt, result in zip(prompts, results):
        assert result["token_ids"] == hf_greedy_on("cuda", target, prompt, 40)
    # the features really came over NCCL: the speculative requests kept speculating
    assert [r["stats"].drafter_fallback for r in results[:2]] == [False, False]
    assert results[0]["stats"].mode == "ddtree" and results[0]["stats"].accepted_tokens > 0


@needs_two_gpus_and_cupy
def test_killing_the_drafter_mid_stream_over_nccl_leaves_the_target_serving_losslessly(checkpoints):
    target, drafter = checkpoints("llama")
    stack = start_stack(target, drafter, device="cuda:0", drafter_device="cuda:1", transport="nccl")
    try:
        prompt = prompts_for(target, [7], seed=13)[0]

        async def scenario():
            async with grpc.aio.insecure_channel(stack.gateway) as channel:
                ids, final = [], None
                async for msg in gateway_pb2_grpc.GatewayStub(channel).GenerateStream(make_request(prompt, 40),
                                                                                      timeout=120):
                    ids.extend(msg.token_ids)
                    final = msg
                    if len(ids) >= 4 and stack.alive()["drafter"]:
                        stack.kill("drafter")
                return ids, final.stats

        ids, stats = asyncio.run(scenario())
        assert ids == hf_greedy_on("cuda", target, prompt, 40)
        assert stack.alive()["target"] and stack.alive()["gateway"]
        assert (stats.requested_mode, stats.mode, stats.drafter_fallback) == ("ddtree", "ar", True)
        again = run_streams(stack.gateway, [make_request(prompt, 10)])[0]
        assert again["token_ids"] == hf_greedy_on("cuda", target, prompt, 10)
    finally:
        stack.stop()


@pytest.mark.skipif(not _has_cupy(), reason="needs cupy (pip install 'ddtree-serve[gpu]' or cupy-cuda13x)")
def test_nccl_with_target_and_drafter_on_one_gpu_stops_the_gateway_at_start_up(checkpoints):
    """NCCL refuses two ranks on one GPU: the target says so at attach time, and the gateway stops with that line."""
    from launch.local_stack import LocalStack

    target, drafter = checkpoints("qwen3")
    stack = LocalStack(model=str(target), drafter=str(drafter), threads=1, device="cuda:0", transport="nccl")
    try:
        with pytest.raises(RuntimeError, match="gateway exited during start-up"):
            stack.start(timeout_s=300)
        assert stack.procs["gateway"].returncode == 2
        assert "different GPUs" in (Path(stack.log_dir) / "gateway.log").read_text()
        assert "transport nccl refused" in (Path(stack.log_dir) / "target.log").read_text()
    finally:
        stack.stop()
        stack.cleanup()


# ---- Gated DeltaNet through fla-core's kernels (the gpu extra): target_svc/gdn_kernels.py --------------------------
def _fla_kernels_usable() -> bool:
    from target_svc import gdn_kernels

    return torch.cuda.is_available() and gdn_kernels.available("cuda")


needs_fla = pytest.mark.skipif(
    not _fla_kernels_usable(),
    reason="needs fla-core (pip install 'ddtree-serve[gpu]' or the fla_core wheel) and DDTREE_GDN_KERNELS not off")

# Tolerances, as a fraction of the reference's largest magnitude (a layout or head-mapping mistake is off by O(1)):
# - the recurrent kernel does the reference's fp32 arithmetic in another summation order: ~1e-6 seen, 1e-4 allowed;
# - the chunked kernel runs its fp32 products through tl.dot, i.e. as TF32 on the tensor cores (10-bit mantissa,
#   unit roundoff 4.9e-4); emulating that in the reference at this shape gives 1.2e-3 to 2.2e-3 on outputs and
#   states (T = 7..300): 1e-2 allowed.
RECURRENT_TOL = 1e-4
CHUNK_TOL = 1e-2


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-12)).item()


def _gdn_inputs_27b(batch: int, tokens: int, random_state: bool, seed: int):
    """q, k, v, g, beta, state at the 27B's GDN heads (16 key x 128, 48 value x 128) as the reference hands them over.

    The conv output is rounded to bf16 (the model dtype) before the fp32 recurrence, as in _conv_taps; decays as
    the layer makes them, -exp(A_log) * softplus(.), from slow heads (long memory) to fast ones."""
    from target_svc.gated_deltanet import _l2norm

    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    hk, hv, d = 16, 48, 128
    q = _l2norm(randn(batch, tokens, hk, d).bfloat16().float()) * d**-0.5
    k = _l2norm(randn(batch, tokens, hk, d).bfloat16().float())
    v = randn(batch, tokens, hv, d).bfloat16().float()
    g = -torch.linspace(-4.0, 1.0, hv, device="cuda").exp() * torch.nn.functional.softplus(randn(batch, tokens, hv))
    beta = torch.sigmoid(randn(batch, tokens, hv).bfloat16()).float()
    state = randn(batch, hv, d, d) * 0.1 if random_state else torch.zeros(batch, hv, d, d, device="cuda")
    return q, k, v, g, beta, state


@needs_fla
@pytest.mark.parametrize("batch", [1, 8])
def test_fla_decode_step_equals_reference_at_27b_heads_and_replays_in_a_cuda_graph(batch):
    from ddtree_serve.plumbing.cuda_graphs import CapturedFunction
    from target_svc.gated_deltanet import stepwise_delta_rule
    from target_svc.gdn_kernels import recurrent_delta_rule

    args = _gdn_inputs_27b(batch, 1, random_state=True, seed=batch)
    want_o, want_s = stepwise_delta_rule(*args)
    got_o, got_s = recurrent_delta_rule(*args)
    assert got_o.shape == want_o.shape == (batch, 1, 48, 128) and got_s.shape == want_s.shape == (batch, 48, 128, 128)
    assert got_o.dtype == got_s.dtype == torch.float32
    assert _rel_err(got_o, want_o) <= RECURRENT_TOL and _rel_err(got_s, want_s) <= RECURRENT_TOL
    # Captured (no host sync, no autotuning at replay): a replay on new inputs is the eager call, bit for bit.
    graphed = CapturedFunction.capture(recurrent_delta_rule, args, pool=None)
    fresh = _gdn_inputs_27b(batch, 1, random_state=True, seed=100 + batch)
    replay_o, replay_s = graphed(*fresh)
    eager_o, eager_s = recurrent_delta_rule(*fresh)
    torch.cuda.synchronize()
    assert torch.equal(replay_o, eager_o) and torch.equal(replay_s, eager_s)


@needs_fla
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("random_state", [False, True])
def test_fla_prefill_chains_equal_reference_at_27b_heads(tokens, random_state):
    from target_svc.gated_deltanet import stepwise_delta_rule
    from target_svc.gdn_kernels import chunk_delta_rule, delta_rule, recurrent_delta_rule

    args = _gdn_inputs_27b(2, tokens, random_state, seed=tokens)
    want_o, want_s = stepwise_delta_rule(*args)
    for name, fn, tol in (("recurrent", recurrent_delta_rule, RECURRENT_TOL), ("chunk", chunk_delta_rule, CHUNK_TOL),
                          ("dispatch", delta_rule, CHUNK_TOL)):
        got_o, got_s = fn(*args)
        assert got_o.shape == want_o.shape and got_s.shape == want_s.shape, name
        err_o, err_s = _rel_err(got_o, want_o), _rel_err(got_s, want_s)
        assert err_o <= tol and err_s <= tol, f"{name}: output {err_o:.2e}, state {err_s:.2e} > {tol}"


def _gdn_layer_27b_heads(seed: int):
    """A bf16 Gated DeltaNet layer with the 27B's heads (hidden 1024: the heads are what the kernels see)."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(hidden_size=1024, num_hidden_layers=1, layer_types=["linear_attention"],
                               linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                               linear_value_head_dim=128, linear_conv_kernel_dim=4, hidden_act="silu",
                               rms_norm_eps=1e-6)
    layer = Qwen3_5GatedDeltaNet(config, layer_idx=0).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lin in (layer.in_proj_qkv, layer.in_proj_z, layer.in_proj_b, layer.in_proj_a, layer.out_proj):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) / lin.weight.shape[1] ** 0.5)
        layer.conv1d.weight.copy_(torch.randn(layer.conv1d.weight.shape, generator=gen) * 0.5)
        layer.A_log.copy_(torch.empty(48).uniform_(-3.0, 1.0, generator=gen))
        layer.dt_bias.copy_(torch.randn(48, generator=gen))
        layer.norm.weight.copy_(torch.empty(128).uniform_(0.5, 1.5, generator=gen))
    return layer.to(device="cuda", dtype=torch.bfloat16)


@needs_fla
@torch.no_grad()
def test_fla_layer_paths_equal_reference_in_bf16_at_27b_heads():
    """The layer's chain and decode-step paths with kernels=True against the reference paths (bf16 model)."""
    from target_svc.gated_deltanet import (LinearAttnStateShape, gdn_chain_forward, gdn_commit_path,
                                           gdn_step_forward_lean)
    from target_svc.gdn_tree_wy import gdn_commit_path_wy, gdn_tree_forward_wy

    layer = _gdn_layer_27b_heads(seed=11)
    dims = LinearAttnStateShape.from_module(layer)
    gen = torch.Generator(device="cuda").manual_seed(12)
    conv0 = torch.randn(dims.conv_shape(3), generator=gen, device="cuda").bfloat16()
    rec0 = torch.randn(dims.rec_shape(3), generator=gen, device="cuda") * 0.1
    # Prefill: three right-padded chains (300, 37 and 0 tokens) from non-zero states.
    x = torch.randn(3, 300, 1024, generator=gen, device="cuda").bfloat16()
    lengths = torch.tensor([300, 37, 0], device="cuda")
    want = gdn_chain_forward(layer, x, lengths, conv0, rec0)
    got = gdn_chain_forward(layer, x, lengths, conv0, rec0, kernels=True)
    # bf16 outputs: one bf16 rounding (3.9e-3) on top of the kernel's own error.
    assert _rel_err(got[0], want[0]) <= 2e-2
    assert torch.equal(got[1], want[1])  # the conv state does not go through the kernels
    assert _rel_err(got[2], want[2]) <= CHUNK_TOL
    # A row of length 0 keeps its state: its steps are identities (k = 0, g = 0, beta = 0) in the kernels too.
    torch.testing.assert_close(got[2][2], rec0[2], rtol=1e-6, atol=0)
    # Decode step: against today's CUDA decode step (the one-pass tree form with one node), output and commit.
    x1 = torch.randn(3, 1, 1024, generator=gen, device="cuda").bfloat16()
    valid = torch.ones(3, 1, dtype=torch.bool, device="cuda")
    parents = torch.full((3, 1), -1, device="cuda")
    path, path_len = torch.zeros(3, 1, dtype=torch.long, device="cuda"), torch.tensor([1, 1, 0], device="cuda")
    want_out, want_trace = gdn_tree_forward_wy(layer, x1, parents, valid, conv0, rec0)
    want_conv, want_rec = gdn_commit_path_wy(want_trace, path, path_len, conv0, rec0)
    got_out, trace = gdn_step_forward_lean(layer, x1, valid, conv0, rec0, kernels=True)
    got_conv, got_rec = gdn_commit_path(trace, path, path_len, conv0, rec0, kernels=True)
    assert _rel_err(got_out, want_out) <= 2e-2
    assert torch.equal(got_conv, want_conv)
    assert _rel_err(got_rec, want_rec) <= RECURRENT_TOL
    torch.testing.assert_close(got_rec[2], rec0[2], rtol=1e-6, atol=0)  # path_len 0: the committed state stays


@needs_fla
def test_cuda_hybrid_runner_greedy_with_fla_kernels_equals_kernels_off(monkeypatch):
    """float32 greedy decode (prefill, root-only steps and small trees, CUDA graphs on): kernels on == off."""
    import random
    import tempfile

    from target_svc.gdn_kernels import ENV_VAR
    from tests.fixtures import make_tiny_qwen3_5

    # fla's chunked kernel runs fp32 products as TF32 unless told otherwise: IEEE for this comparison (read when
    # Triton compiles a kernel; no other test builds the chunked kernels at these tiny shapes). Its triangular
    # solve asks for TF32 explicitly and stays so: errors of ~1e-5 here. Checked on the CPU: these prompts keep
    # their greedy tokens under Gaussian noise of 3e-4 x max on every prefill output and state (8 of 8 seeds).
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    model_dir = make_tiny_qwen3_5(tempfile.mkdtemp(prefix="gdn_fla_"), seed=23, multimodal_wrapper=True)
    # 19 tokens: prefill through the recurrent kernel; 150 tokens: through the chunked kernel.
    prompts = prompts_for(model_dir, [19, 150], seed=14)

    def decode(kernels: bool) -> tuple[list[list[int]], TargetRunner]:
        if kernels:
            monkeypatch.delenv(ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(ENV_VAR, "off")
        runner = TargetRunner(TargetConfig(model_dir=str(model_dir), device="cuda", dtype=torch.float32, max_batch=2,
                                           max_seq_len=256, max_tree_nodes=17, prefill_verify_chunks=0))
        assert runner.model.gdn_kernels_on is kernels
        tokens = [[runner.prefill([PrefillItem(f"s{i}", p, SamplingParams())])[0].next_token]
                  for i, p in enumerate(prompts)]
        rng = random.Random(15)
        for step in range(24):
            items = []
            for i, seq in enumerate(tokens):
                if step % 3 == 2:  # a 3-node chain of guesses (one-pass tree path), else a decode step
                    items.append(VerifyItem(f"s{i}", torch.tensor([seq[-1], rng.randrange(4, 300), rng.randrange(4, 300)]),
                                            torch.tensor([-1, 0, 1])))
                else:
                    items.append(VerifyItem(f"s{i}", torch.tensor([seq[-1]]), torch.tensor([-1])))
            for seq, result in zip(tokens, runner.verify(items)):
                seq += result.accepted_tokens + [result.next_token]
        return tokens, runner

    with_kernels, runner = decode(True)
    assert runner.graphs is not None and runner.graphs.forwards.graphs  # the fla decode step ran captured
    without, _ = decode(False)
    assert with_kernels == without
# ---- the fused tree WY core (target_svc/gdn_tree_kernel.py; Triton) ------------------------------------------------
def _tree_kernel_usable() -> bool:
    from target_svc import gdn_tree_kernel

    return gdn_tree_kernel.available("cuda")


needs_tree_kernel = pytest.mark.skipif(not _tree_kernel_usable(), reason="needs the triton package and sm_80+")
# As a fraction of the reference's largest magnitude: both do float32 arithmetic (IEEE dots, no TF32), in other
# orders and with the kernel's approximate exp; the interpreter showed <= 1e-6, a wrong mask or block is O(1e-3+).
TREE_KERNEL_TOL = 1e-4


def _tree_core_inputs_27b(trees: list[list[int]], seed: int):
    """(qh, kh, vh, g, beta, anc, s0) at the 27B's GDN heads as gdn_tree_forward_wy hands them to the core:
    padded trees, key heads repeated to the 48 value heads, heads-first views, padded nodes with k = g = beta = 0."""
    from ddtree_serve.decoding.tree_mask import ancestor_mask_batch

    bsz, t = len(trees), max(len(p) for p in trees)
    parents = torch.full((bsz, t), -1, dtype=torch.long)
    for b, p in enumerate(trees):
        parents[b, : len(p)] = torch.tensor(p)
    sizes = torch.tensor([len(p) for p in trees])
    anc = ancestor_mask_batch(parents.cuda(), sizes.cuda())
    q, k, v, g, beta, state = _gdn_inputs_27b(bsz, t, random_state=True, seed=seed)
    vf = (torch.arange(t)[None, :] < sizes[:, None]).float().cuda()
    q, k = q.repeat_interleave(3, dim=2), k.repeat_interleave(3, dim=2) * vf[:, :, None, None]
    g, beta = g * vf[..., None], beta * vf[..., None]
    return (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2), anc,
            state)


def _tree_parents(n: int, max_depth: int, seed: int) -> list[int]:
    from bench.common import random_parents

    return random_parents(n, max_depth, torch.Generator().manual_seed(seed))


TREE_CASES = {
    "one node": lambda: [[-1]],
    "16-node chain": lambda: [list(range(-1, 15))],
    "65 nodes, depth 16, and a padded 40": lambda: [_tree_parents(65, 16, 1), _tree_parents(40, 16, 2)],
    "8 trees of 65": lambda: [_tree_parents(65, 16, 10 + b) for b in range(8)],
    "256 nodes, depth 16": lambda: [_tree_parents(256, 16, 3)],
    "a 256-node chain": lambda: [list(range(-1, 255))],
}


@needs_tree_kernel
@pytest.mark.parametrize("case", list(TREE_CASES))
def test_tree_wy_kernel_equals_the_reference_core_at_27b_heads(case):
    from target_svc.gdn_tree_kernel import tree_wy_core
    from target_svc.gdn_tree_wy import _wy_core_reference

    args = _tree_core_inputs_27b(TREE_CASES[case](), seed=len(case))
    want = _wy_core_reference(*args)
    got = tree_wy_core(*args)
    for name, x, ref in zip(("core", "u", "cum"), got, want):
        assert x.shape == ref.shape and x.dtype == torch.float32, name
        assert _rel_err(x, ref) <= TREE_KERNEL_TOL, f"{case}: {name} {_rel_err(x, ref):.2e}"


@needs_tree_kernel
@pytest.mark.parametrize("indexed", [False, True])
@pytest.mark.parametrize("nodes", [16, 17, 32, 48, 63, 64, 65, 80])
def test_tree_wy_kernel_equals_the_reference_core_on_and_off_the_block_boundary(nodes, indexed):
    """Tree sizes on and off the 16-node blocks (nodes 1 .. T-1 fill them exactly at T = 16k + 1), two trees of T
    and T - 3 nodes, from per-tree states or from a pool read in place (s0_index, as the serving path does); the
    first tree's root gate -100, whose e^100 overflows float32 (rows past the last block once scaled by it: NaN)."""
    from target_svc.gdn_tree_kernel import tree_wy_core
    from target_svc.gdn_tree_wy import _wy_core_reference

    qh, kh, vh, g, beta, anc, s0 = _tree_core_inputs_27b(
        [_tree_parents(nodes, 16, nodes), _tree_parents(nodes - 3, 16, nodes + 1)], seed=nodes)
    g = g.clone()
    g[0, :, 0] = -100.0
    want = _wy_core_reference(qh, kh, vh, g, beta, anc, s0)
    if indexed:  # the same states, rows 3 and 1 of a pool of 5
        pool = torch.randn(5, *s0.shape[1:], device="cuda")
        index = torch.tensor([3, 1], device="cuda")
        pool[index] = s0
        got = tree_wy_core(qh, kh, vh, g, beta, anc, pool, s0_index=index)
    else:
        got = tree_wy_core(qh, kh, vh, g, beta, anc, s0)
    for name, x, ref in zip(("core", "u", "cum"), got, want):
        assert torch.isfinite(x).all(), f"{nodes} nodes: {name} not finite"
        assert _rel_err(x, ref) <= TREE_KERNEL_TOL, f"{nodes} nodes: {name} {_rel_err(x, ref):.2e}"


@needs_tree_kernel
@pytest.mark.parametrize("tiles", [(16, 32, 8, "rows", 1), (32, 32, 8, "blocks", 1), (32, 64, 4, "blocks", 1),
                                   (16, 32, 8, "blocks", 3), (32, 32, 4, "blocks", 3), (16, 32, 4, "blocks", 2),
                                   (16, 32, 8, "blocks", 2), (16, 32, 4, "blocks16", 2)])
def test_tree_wy_kernel_equals_the_reference_core_under_the_swept_tilings(tiles):
    """Tilings the sweep may pick besides the default: the row-by-row inversion, 32-node diagonal blocks, the
    three-launch form (its 255-node chain takes it too: up to THREE_PHASE_MAX_NODES), the two-launch form (65
    nodes; the chain goes to one launch), with its inverse's diagonal 16-blocks batched (blocks16)."""
    from target_svc.gdn_tree_kernel import TileConfig, tree_wy_core
    from target_svc.gdn_tree_wy import _wy_core_reference

    block_t, block_c, warps, invert, phases = tiles
    config = TileConfig(block_t=block_t, block_c=block_c, block_v=64, num_warps=warps, num_stages=1, invert=invert,
                        phases=phases)
    for trees in ([_tree_parents(65, 16, 1), _tree_parents(40, 16, 2)], [list(range(-1, 255))]):
        args = _tree_core_inputs_27b(trees, seed=3)
        want = _wy_core_reference(*args)
        got = tree_wy_core(*args, config=config)
        for name, x, ref in zip(("core", "u", "cum"), got, want):
            assert _rel_err(x, ref) <= TREE_KERNEL_TOL, f"{config}: {name} {_rel_err(x, ref):.2e}"


@needs_tree_kernel
@pytest.mark.parametrize("precision, tol", [("tf32x3", TREE_KERNEL_TOL), ("bf16x6", TREE_KERNEL_TOL),
                                            ("bf16x3", 1e-3), ("tf32", 1e-2)])
def test_tree_wy_kernel_on_tensor_cores_stays_within_its_precisions_error(precision, tol):
    """The dots on the tensor cores (TileConfig.precision, one launch and three): three TF32 or six bf16 parts a
    product keep float32's tolerance; three bf16 parts (~2^-16 a product) and one TF32 (2^-11) are looser."""
    from target_svc.gdn_tree_kernel import TileConfig, tree_wy_core
    from target_svc.gdn_tree_wy import _wy_core_reference

    args = _tree_core_inputs_27b([_tree_parents(65, 16, 1), _tree_parents(40, 16, 2)], seed=5)
    want = _wy_core_reference(*args)
    for phases, invert in ((1, "blocks"), (2, "blocks"), (3, "blocks"), (2, "blocks16")):
        config = TileConfig(block_t=16, block_c=32, block_v=64, num_warps=8, num_stages=1, phases=phases,
                            precision=precision, invert=invert)
        for name, x, ref in zip(("core", "u", "cum"), tree_wy_core(*args, config=config), want):
            assert _rel_err(x, ref) <= tol, f"{config}: {name} {_rel_err(x, ref):.2e}"


@needs_tree_kernel
def test_tree_wy_precision_named_in_the_environment_is_the_one_the_serving_call_runs(monkeypatch):
    """DDTREE_TREE_WY_PRECISION=bf16x3: tree_wy_core without a config gives the bits of choose_config's tiles at
    bf16x3, and not those at IEEE."""
    import dataclasses

    from target_svc import gdn_tree_kernel
    from target_svc.gdn_tree_kernel import choose_config, tree_wy_core

    args = _tree_core_inputs_27b([_tree_parents(65, 16, 1)], seed=9)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    monkeypatch.delenv(gdn_tree_kernel.PHASES_ENV, raising=False)
    tiles = choose_config(48, 128, sms, phases=gdn_tree_kernel.default_phases(65, "bf16x3"))
    monkeypatch.setenv(gdn_tree_kernel.PRECISION_ENV, "bf16x3")
    got = tree_wy_core(*args)
    want = tree_wy_core(*args, config=dataclasses.replace(tiles, precision="bf16x3"))
    ieee = tree_wy_core(*args, config=dataclasses.replace(tiles, precision="ieee"))
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert not torch.equal(got[0], ieee[0])


@needs_tree_kernel
def test_tree_wy_launch_form_named_in_the_environment_is_the_one_the_serving_call_runs(monkeypatch):
    """Unset, a bf16x3 65-node tree runs the two launches; DDTREE_TREE_WY_PHASES=1 makes tree_wy_core without a
    config give the bits of choose_config's one-launch tiles instead."""
    import dataclasses

    from target_svc import gdn_tree_kernel
    from target_svc.gdn_tree_kernel import choose_config, tree_wy_core

    args = _tree_core_inputs_27b([_tree_parents(65, 16, 1)], seed=9)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    monkeypatch.delenv(gdn_tree_kernel.PHASES_ENV, raising=False)
    for phases in (2, 1):
        got = tree_wy_core(*args, precision="bf16x3")
        want = tree_wy_core(*args, config=dataclasses.replace(choose_config(48, 128, sms, phases=phases),
                                                              precision="bf16x3"))
        assert all(torch.equal(x, y) for x, y in zip(got, want)), phases
        monkeypatch.setenv(gdn_tree_kernel.PHASES_ENV, "1")


@needs_tree_kernel
@pytest.mark.parametrize("phases", [1, 2, 3])
@pytest.mark.parametrize("nodes", [16, 65])
def test_tree_wy_kernel_replays_inside_a_captured_graph(nodes, phases):
    """No host sync, no autotuning: a replay on new inputs equals an eager call bit for bit (the G that the
    programs of one head all write is the same bits)."""
    from ddtree_serve.plumbing.cuda_graphs import CapturedFunction
    from target_svc.gdn_tree_kernel import TileConfig, tree_wy_core

    config = TileConfig(block_v=64, num_stages=1, phases=phases)

    def core(*args):
        return tree_wy_core(*args, config=config)

    trees = [_tree_parents(nodes, 16, 4), _tree_parents(nodes - 5, 16, 5)]
    captured = CapturedFunction.capture(core, _tree_core_inputs_27b(trees, seed=6), pool=None)
    for seed in (7, 8):
        fresh = _tree_core_inputs_27b([_tree_parents(nodes, 16, seed), _tree_parents(nodes - 5, 16, seed + 1)],
                                      seed=seed)
        replay = [x.clone() for x in captured(*fresh)]
        eager = core(*fresh)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(replay, eager))


@needs_tree_kernel
@torch.no_grad()
def test_hybrid_verify_and_commit_with_the_tree_kernel_equal_the_pytorch_core_at_every_tree_size(checkpoints):
    """The serving path (compiled glue, the kernel reading the slots' states in place, the compiled commit) against
    the PyTorch core, float32, at tree sizes on and off the 16-node block boundary: a 64-node tree through the
    services once disagreed with `ar` where 65 nodes did not. Stated tolerance: 1e-4 of the largest logit and
    state (float32 in other orders), the same greedy tokens."""
    from bench.tree_kernel_check import VARIANTS, check
    from target_svc.loader import load_target
    from target_svc.model import TargetModel

    target_dir, _ = checkpoints("qwen3_5")
    sizes = (16, 17, 48, 63, 64, 65)
    model = TargetModel(load_target(str(target_dir), "cuda", torch.float32), len(VARIANTS) + 1, 24 + max(sizes) + 8,
                        max(sizes))
    gen = torch.Generator().manual_seed(0)
    rows = [check(model, nodes, 24, gen) for nodes in sizes]
    for row in rows:
        assert row["reference finite"], row["nodes"]
        for name, _, _ in VARIANTS[1:]:
            got = row[name]
            assert got["finite"] and got["greedy"] == 1.0, (row["nodes"], name, got)
            assert max(got["logits"], got["rec"], got["conv"]) <= 1e-4, (row["nodes"], name, got)
    # The kernel ran: its float32 sums, in another order than the reference's, differ somewhere in the last bits.
    assert any(row["kernel"]["rec"] > 0 for row in rows)


@pytest.mark.parametrize("n_kv, head_dim, nodes", [(8, 128, 1), (8, 128, 65), (4, 256, 17)])
def test_cuda_kv_write_kernel_writes_what_index_put_writes_and_replays_in_a_graph(n_kv, head_dim, nodes):
    """KVCache.write_kv through the Triton kernel (target_svc/kv_cache_kernels.py): the very bytes of index_put_,
    values sliced out of a fused projection as the verify hands them over; eagerly and replayed in a graph."""
    from ddtree_serve.plumbing.cuda_graphs import CapturedFunction
    from target_svc.kv_cache import kv_write_kernel_available, write_kv_rows

    if not kv_write_kernel_available("cuda"):
        pytest.skip("needs Triton")
    shape = (5, 300, n_kv, head_dim)
    k_cache, v_cache = (torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2))

    def inputs(seed: int):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        qkv = torch.randn(3, nodes, 3 * n_kv * head_dim, generator=gen, device="cuda").bfloat16()
        k = qkv[..., : n_kv * head_dim].reshape(3, nodes, n_kv, head_dim).contiguous()
        v = qkv[..., n_kv * head_dim: 2 * n_kv * head_dim].view(3, nodes, n_kv, head_dim)
        slots = torch.tensor([3, 0, 4], device="cuda")
        rows = torch.tensor([100, 7, 0], device="cuda")[:, None] + torch.arange(nodes, device="cuda")
        return slots, rows, k, v

    def write(slots, rows, k, v):
        write_kv_rows(k_cache, v_cache, slots, rows, k, v)
        return k_cache

    captured = CapturedFunction.capture(write, inputs(1), pool=None)
    for seed in (2, 3):
        slots, rows, k, v = inputs(seed)
        want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        index = (slots[:, None].expand_as(rows), rows)
        want_k.index_put_(index, k)
        want_v.index_put_(index, v)
        for run in (lambda: write(slots, rows, k, v), lambda: captured(slots, rows, k, v)):
            k_cache.zero_(), v_cache.zero_()
            run()
            torch.cuda.synchronize()
            assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("n_kv, head_dim, width", [(8, 128, 17), (4, 256, 65), (8, 128, 2)])
def test_cuda_move_rows_kernel_moves_what_the_gather_and_scatter_move_and_replays_in_a_graph(n_kv, head_dim, width):
    """KVCache.move_rows through the Triton kernel (target_svc/kv_cache_kernels.py): the very bytes of the
    gather-then-scatter, with paths whose rows move past each other, padded pairs, and a padding row in the
    scratch slot; eagerly and replayed in a graph on new paths."""
    from ddtree_serve.decoding.acceptance import compaction_indices_batch
    from ddtree_serve.plumbing.cuda_graphs import CapturedFunction
    from target_svc.kv_cache import kv_write_kernel_available, move_rows_in_place

    if not kv_write_kernel_available("cuda"):
        pytest.skip("needs Triton")
    shape = (6, 5, 400, n_kv, head_dim)
    k0 = torch.randn(shape, device="cuda").bfloat16()
    v0 = torch.randn(shape, device="cuda").bfloat16()
    k, v = k0.clone(), v0.clone()

    def inputs(seed: int):
        gen = torch.Generator().manual_seed(seed)
        paths = torch.full((3, width), -1, dtype=torch.long)
        n_acc = torch.tensor([width, max(1, width // 3), 1])
        for b in range(2):   # increasing node indices from the root: a path of a tree whose parents come first
            steps = torch.randint(1, 4, (int(n_acc[b]) - 1,), generator=gen)
            paths[b, : int(n_acc[b])] = torch.cat([torch.zeros(1, dtype=torch.long), steps.cumsum(0)])
        paths[2, 0] = 0   # a padding row: its root only
        src, dst = compaction_indices_batch(paths, n_acc, torch.tensor([37, 0, 5]))
        return torch.tensor([3, 0, 4], device="cuda"), src.cuda(), dst.cuda()

    def move(slots, src, dst):
        move_rows_in_place(k, v, slots, src, dst)
        return k

    captured = CapturedFunction.capture(move, inputs(1), pool=None)
    for seed in (2, 3):
        slots, src, dst = inputs(seed)
        want_k, want_v = k0.clone(), v0.clone()
        b_idx = slots[:, None].expand_as(src)
        for buf in (want_k, want_v):
            buf[:, b_idx, dst] = buf[:, b_idx, src]
        for run in (lambda: move(slots, src, dst), lambda: captured(slots, src, dst)):
            k.copy_(k0), v.copy_(v0)
            run()
            torch.cuda.synchronize()
            assert torch.equal(k, want_k) and torch.equal(v, want_v)


@pytest.mark.parametrize("nodes", [2, 17, 65, 128])
def test_cuda_tree_layout_kernel_equals_the_pytorch_structure_and_windows_and_replays_in_a_graph(nodes):
    """The one-launch tree structure (target_svc/tree_layout.py) gives the very integers of the PyTorch path, eagerly
    and replayed in a captured graph on new trees."""
    from ddtree_serve.decoding.tree_mask import tree_structure
    from ddtree_serve.plumbing.cuda_graphs import CapturedFunction
    from target_svc.gdn_tree_wy import conv_windows
    from target_svc.tree_layout import available, tree_layout

    if not available("cuda"):
        pytest.skip("needs Triton")

    def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        trees = [_tree_parents(nodes, 16, seed), _tree_parents(max(1, nodes // 2), 3, seed + 1),
                 list(range(-1, nodes - 1))]
        parents = torch.full((3, nodes), -1, dtype=torch.long)
        for b, p in enumerate(trees):
            parents[b, : len(p)] = torch.tensor(p)
        return parents.cuda(), torch.tensor([len(p) for p in trees]).cuda()

    def layout(parents, sizes):
        got = tree_layout(parents, sizes, 4)
        return got.anc, got.depth, got.conv_windows

    captured = CapturedFunction.capture(layout, batch(1), pool=None)
    for seed in (2, 3):
        parents, sizes = batch(seed)
        want = tree_structure(parents, sizes)
        valid = torch.arange(nodes, device="cuda")[None, :] < sizes[:, None]
        windows = conv_windows(parents, valid, want.depth, 4)
        for got in (layout(parents, sizes), [x.clone() for x in captured(parents, sizes)]):
            assert torch.equal(got[0], want.anc) and torch.equal(got[1], want.depth) and torch.equal(got[2], windows)


@needs_tree_kernel
@torch.no_grad()
def test_tree_forward_through_the_kernel_equals_the_reference_in_bf16_at_27b_heads():
    """The layer's one-pass tree verify with the kernel against the PyTorch core; the committed states agree."""
    from target_svc.gated_deltanet import LinearAttnStateShape
    from target_svc.gdn_tree_wy import gdn_commit_path_wy, gdn_tree_forward_wy

    layer = _gdn_layer_27b_heads(seed=21)
    dims = LinearAttnStateShape.from_module(layer)
    gen = torch.Generator(device="cuda").manual_seed(22)
    trees = [_tree_parents(65, 16, 23), _tree_parents(30, 16, 24)]
    parents = torch.full((2, 65), -1, dtype=torch.long)
    for b, p in enumerate(trees):
        parents[b, : len(p)] = torch.tensor(p)
    parents = parents.cuda()
    valid = torch.arange(65, device="cuda")[None, :] < torch.tensor([65, 30], device="cuda")[:, None]
    x = torch.randn(2, 65, 1024, generator=gen, device="cuda").bfloat16()
    conv = torch.randn(dims.conv_shape(2), generator=gen, device="cuda").bfloat16()
    rec = torch.randn(dims.rec_shape(2), generator=gen, device="cuda") * 0.1
    want_out, want = gdn_tree_forward_wy(layer, x, parents, valid, conv, rec, kernel=False)
    got_out, got = gdn_tree_forward_wy(layer, x, parents, valid, conv, rec, kernel=True)
    assert _rel_err(got_out, want_out) <= 2e-2  # bf16 outputs: one bf16 rounding on top
    assert _rel_err(got.u, want.u) <= TREE_KERNEL_TOL and _rel_err(got.cum_g, want.cum_g) <= TREE_KERNEL_TOL
    # The deepest node of each tree: the committed state from the kernel's trace equals the reference's.
    last = [max(range(len(p)), key=lambda i, p=p: _depth(p, i)) for p in trees]
    paths = [_path_to(p, i) for p, i in zip(trees, last)]
    path = torch.full((2, 17), -1, dtype=torch.long, device="cuda")
    for b, nodes in enumerate(paths):
        path[b, : len(nodes)] = torch.tensor(nodes)
    path_len = torch.tensor([len(nodes) for nodes in paths], device="cuda")
    want_rec = gdn_commit_path_wy(want, path, path_len, conv, rec)[1]
    got_rec = gdn_commit_path_wy(got, path, path_len, conv, rec)[1]
    assert _rel_err(got_rec, want_rec) <= TREE_KERNEL_TOL


def _path_to(parents: list[int], node: int) -> list[int]:
    nodes = [node]
    while parents[nodes[-1]] >= 0:
        nodes.append(parents[nodes[-1]])
    return nodes[::-1]


def _depth(parents: list[int], node: int) -> int:
    return len(_path_to(parents, node)) - 1


# ---- the Triton weight-only matmul (target_svc/int8_matmul.py) -----------------------------------------------------
def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


needs_triton = pytest.mark.skipif(not _has_triton(), reason="needs the triton package")
KERNEL_SHAPES = [(17408, 5120), (4096, 12288), (6144, 4096)]  # 27B MLP up, 8B down, 8B fused qkv


def _quantized(n: int, k: int, bits: int):
    from target_svc.quantization import quantize_weight

    gen = torch.Generator(device="cuda").manual_seed(n + k + bits)
    return quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02, bits)


def _assert_close_to_reference(got: torch.Tensor, ref: torch.Tensor, what) -> None:
    """Stated tolerance: max |got - ref| <= 2e-2 * max |ref|. Kernel and reference add the same float32 products in
    different orders, the reference rounds each q * s to bf16 before its GEMM, and both round the output to bf16
    (half an ulp is 2^-9 of a value): the H200 showed <= 4e-3 of the largest output, while a wrong tile, mask,
    scale or split is off by O(1)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape, what
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= 2e-2 * ref.float().abs().max().item(), (what, err)


def _random_trees(bsz: int, nodes: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded random trees [bsz, nodes] (parents[i] < i) with sizes from 1 to nodes (the last row full)."""
    parents = torch.full((bsz, nodes), -1, dtype=torch.long)
    for i in range(1, nodes):
        parents[:, i] = torch.randint(0, i, (bsz,), generator=gen)
    sizes = torch.randint(1, nodes + 1, (bsz,), generator=gen)
    sizes[-1] = nodes
    return parents.cuda(), sizes.cuda()


@needs_triton
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 128), (24, 4, 256), (4, 4, 64)])
@pytest.mark.parametrize("nodes", [1, 5, 17, 65, 129, 257])
def test_cuda_triton_tree_attention_equals_sdpa_over_the_gathered_masked_rows(heads, kv_heads, head_dim, nodes):
    """The kernel reads each sequence's slot in place, with contexts of different lengths (one empty), padded trees,
    key_len past every sequence (stale rows there must not be read), split over the keys or not, and in a graph;
    SDPA over the gathered rows with tree_attention_mask is the reference (stated tolerance: 2e-2 of the largest
    output; bf16 probabilities against SDPA's, seen <= 1e-2)."""
    import torch.nn.functional as F

    from ddtree_serve.decoding.tree_mask import ancestor_mask_batch, tree_attention_mask
    from ddtree_serve.plumbing.cuda_graphs import CapturedFunction
    from ddtree_serve.kernels.tree_attention import SplitConfig, TreeKeys, choose_config, tree_attention

    gen = torch.Generator().manual_seed(nodes + head_dim)
    bsz, capacity, dtype = 4, 1400, torch.bfloat16   # past key_len at 257 nodes
    k_cache = torch.randn(bsz + 2, capacity, kv_heads, head_dim, generator=gen).to("cuda", dtype)
    v_cache = torch.randn(bsz + 2, capacity, kv_heads, head_dim, generator=gen).to("cuda", dtype)
    # Columns of one packed tensor, as the verify batch hands them over (strided, not contiguous).
    packed = torch.tensor([[3, 700], [0, 0], [5, 33], [1, 1000]], device="cuda")
    slots, ctx = packed[:, 0], packed[:, 1]
    parents, sizes = _random_trees(bsz, nodes, gen)
    q = torch.randn(bsz, nodes, heads, head_dim, generator=gen).to("cuda", dtype)
    key_len = 1100 + nodes   # past every ctx + nodes
    scale = head_dim ** -0.5

    mask = tree_attention_mask(ctx, parents, sizes, key_len)   # [B, T, key_len]
    keys, values = k_cache[slots, :key_len], v_cache[slots, :key_len]
    rep = heads // kv_heads
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.repeat_interleave(rep, dim=2).transpose(1, 2),
        values.repeat_interleave(rep, dim=2).transpose(1, 2), attn_mask=mask[:, None], scale=scale).transpose(1, 2)
    tree_keys = TreeKeys(ctx, ancestor_mask_batch(parents, sizes))
    chosen = choose_config(bsz, kv_heads, rep * nodes, key_len, head_dim)
    unsplit = SplitConfig(chosen.block_m, chosen.block_n, 1, -(-key_len // chosen.block_n) * chosen.block_n)
    for cfg in (None, unsplit, dataclasses.replace(chosen, context_loop=False),
                dataclasses.replace(unsplit, context_loop=False), dataclasses.replace(chosen, balanced=True),
                dataclasses.replace(chosen, fused_merge=True)):
        got = tree_attention(q, k_cache, v_cache, slots, tree_keys, key_len, scale, cfg)
        _assert_close_to_reference(got, ref, (cfg, "eager"))
    captured = CapturedFunction.capture(lambda x: tree_attention(x, k_cache, v_cache, slots, tree_keys, key_len, scale),
                                        [q], torch.cuda.graph_pool_handle())
    assert torch.equal(captured(q), tree_attention(q, k_cache, v_cache, slots, tree_keys, key_len, scale))
    # The fused merge in a graph, its counts shared by the replays (each launch leaves them zero): the same output.
    fused = dataclasses.replace(chosen, fused_merge=True)
    shared = TreeKeys(ctx, tree_keys.ancestors, torch.zeros(bsz * kv_heads * -(-(rep * nodes) // 16),
                                                            dtype=torch.int32, device="cuda"))
    captured = CapturedFunction.capture(lambda x: tree_attention(x, k_cache, v_cache, slots, shared, key_len, scale,
                                                                 fused), [q], torch.cuda.graph_pool_handle())
    for _ in range(3):
        _assert_close_to_reference(captured(q), ref, (fused, "graph"))
    assert not shared.merge_counts.any()


@needs_triton
def test_cuda_drafter_attending_in_place_equals_the_gathered_rows_eager_and_captured(checkpoints):
    """bf16: drafts attending over their slots in place (forced on: the tiny heads are not a size the runner picks
    it for) against the gathered rows, eagerly and through the block graphs, three sequences of 1 to 100 context
    rows; log-probs within 2 % of the largest (stated tolerance: bf16 probabilities against SDPA's), top-1 ids equal
    at >= 95 % of the positions."""
    target, drafter = checkpoints("qwen3")
    items = [DraftItem("a", 5, 9), DraftItem("b", 7, 100), DraftItem("c", 3, 1)]
    runs = {}
    for in_place in (False, True):
        for eager in (True, False):
            runner = DrafterRunner(DrafterConfig(drafter_dir=str(drafter), target_model_dir=str(target),
                                                 device="cuda", dtype=torch.bfloat16, max_batch=4, max_seq_len=256,
                                                 enforce_eager=eager, lazy_graphs=True))
            runner.slot_attention = in_place
            gen = torch.Generator().manual_seed(0)
            for it in items:
                runner.add_context(it.seq_id, 0, torch.randn(it.context_len, runner.feature_dim,
                                                             generator=gen).to("cuda", torch.bfloat16))
            runs[in_place, eager] = runner.draft(items, 8)
    want_lp, want_ids = runs[False, True]
    for key, (lp, ids) in runs.items():
        assert (lp - want_lp).abs().max().item() <= 0.02 * want_lp.abs().max().item(), key
        assert (ids[..., 0] == want_ids[..., 0]).float().mean().item() >= 0.95, key


@needs_triton
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n, k", KERNEL_SHAPES)
def test_cuda_triton_weight_only_matmul_equals_the_dequantized_reference(n, k, bits):
    """The tiles chosen for each row count (decode: batch; verify: batch x tree nodes), with and without bias."""
    import torch.nn.functional as F

    from target_svc import int8_matmul

    q = _quantized(n, k, bits)
    w = q.dequantize(torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for m in (1, 3, 16, 65, 130, 520):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for b in (None, bias):
            got = int8_matmul.matmul(x, q.qweight, q.scales, b, bits)
            _assert_close_to_reference(got, F.linear(x, w, b), (m, b is not None))


@needs_triton
@pytest.mark.parametrize("bits", [8, 4])
def test_cuda_triton_weight_only_matmul_every_kernel_path(bits):
    """Split K, the swapped dot, tiles wider and narrower than M, ragged N and K, a 3-D input, fp16."""
    import torch.nn.functional as F

    from target_svc import int8_matmul
    from target_svc.int8_matmul import TileConfig

    configs = [TileConfig(16, 64, 128, 4), TileConfig(16, 32, 128, 1, True), TileConfig(64, 128, 64, 2, False, 8, 3),
               TileConfig(128, 64, 64, 1, True, 4, 3), TileConfig(32, 64, 128, 1, False, 4, 3)]
    n, k = (4100, 1000) if bits == 8 else (4100, 1024)  # N not a multiple of any tile; int8 K not of BLOCK_K
    q = _quantized(n, k, bits)
    for dtype in (torch.bfloat16, torch.float16):
        w = q.dequantize(dtype)
        for m in (1, 20, 65):
            x = torch.randn(2, m, k, device="cuda", dtype=dtype)
            ref = F.linear(x, w)
            for cfg in configs:
                got = int8_matmul.matmul(x, q.qweight, q.scales.to(dtype), None, bits, cfg)
                _assert_close_to_reference(got, ref, (dtype, m, cfg))


@needs_triton
@pytest.mark.parametrize("bits", [8, 4])
def test_cuda_triton_weight_only_matmul_replays_inside_a_captured_graph(bits):
    """Captured as the engine captures (warm-up runs on a side stream, then recorded; split-K workspace allocated
    during the capture), the replay equals an eager call bit for bit: no host syncs, no atomics."""
    from ddtree_serve.plumbing.cuda_graphs import CapturedFunction
    from target_svc import int8_matmul

    q = _quantized(4096, 12288, bits)
    pool = torch.cuda.graph_pool_handle()
    for m in (1, 16, 65, 520):
        captured = CapturedFunction.capture(lambda x: int8_matmul.matmul(x, q.qweight, q.scales, None, bits),
                                            [torch.randn(m, 12288, device="cuda", dtype=torch.bfloat16)], pool)
        for _ in range(3):
            x = torch.randn(m, 12288, device="cuda", dtype=torch.bfloat16)
            want = int8_matmul.matmul(x, q.qweight, q.scales, None, bits)
            assert torch.equal(captured(x), want), m


@needs_triton
@pytest.mark.parametrize("bits", [8, 4])
def test_cuda_triton_fused_split_k_reduction_equals_the_reduction_kernel_bit_for_bit(bits):
    """The default split tilings of the 8B's split projections (qkv, o_proj, down) at 1 to 65 rows: the last split
    adding the others' sums gives the reduction kernel's bits, eagerly and replayed from a graph, call after call
    (its counters back at 0 each time)."""
    from ddtree_serve.plumbing.cuda_graphs import CapturedFunction
    from target_svc import int8_matmul

    counters = torch.zeros(int8_matmul.SPLIT_COUNTERS, dtype=torch.int32, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    for n, k in ((6144, 4096), (4096, 4096), (4096, 12288)):
        q = _quantized(n, k, bits)
        for m in (1, 4, 17, 64, 65):
            cfg = int8_matmul.choose_config(m, n, k, bits, q.group_size, torch.cuda.get_device_properties(0)
                                            .multi_processor_count)
            assert cfg.split_k > 1 or m > 16, (n, k, m, cfg)   # the decode shapes split (else nothing is tested)
            fused = CapturedFunction.capture(
                lambda x: int8_matmul.matmul(x, q.qweight, q.scales, None, bits, cfg, counters),
                [torch.randn(m, k, device="cuda", dtype=torch.bfloat16)], pool)
            for _ in range(3):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                want = int8_matmul.matmul(x, q.qweight, q.scales, None, bits, cfg)
                assert torch.equal(int8_matmul.matmul(x, q.qweight, q.scales, None, bits, cfg, counters), want)
                assert torch.equal(fused(x), want), (n, k, m, cfg)
            torch.cuda.synchronize()
            assert not counters.any()


@needs_triton
@pytest.mark.parametrize("bits", [8, 4])
def test_cuda_pdl_launches_give_the_same_bits_right_after_the_kernel_that_writes_their_input(bits):
    """Programmatic dependent launch (DDTREE_INT8_PDL): each launch may start while the kernel before it finishes,
    so its input is written by a kernel immediately before it (x = a * 3 + 1, eagerly and in a captured graph, as
    a norm precedes a projection) and the result must still equal the non-PDL launch bit for bit: default and
    split tilings (with the reduction kernel, itself PDL-launched after the matmul), the GEMV path, 1 to 65 rows.
    A launch that read x before its wait would read the previous call's values."""
    from ddtree_serve.plumbing.cuda_graphs import CapturedFunction
    from target_svc import int8_matmul
    from target_svc.int8_matmul import GemvConfig

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9 (Hopper) or more")
    pool = torch.cuda.graph_pool_handle()
    for n, k in ((6144, 4096), (4096, 12288), (24576, 4096)):
        q = _quantized(n, k, bits)
        for m in (1, 4, 17, 64, 65):
            configs = [None] + ([GemvConfig(64, 1024, 2, 8)] if bits == 8 and m <= 4 else [])
            for cfg in configs:
                def run(a, pdl, cfg=cfg):
                    return int8_matmul.matmul(a * 3 + 1, q.qweight, q.scales, None, bits, cfg, pdl=pdl)
                captured = CapturedFunction.capture(lambda a, run=run: run(a, True),
                                                    [torch.randn(m, k, device="cuda", dtype=torch.bfloat16)], pool)
                for _ in range(3):
                    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    want = run(a, False)
                    assert torch.equal(run(a, True), want), (n, k, m, cfg)
                    assert torch.equal(captured(a), want), (n, k, m, cfg)


@needs_triton
@pytest.mark.parametrize("n, k", [(4096, 4096), (24576, 4096), (4096, 12288), (4100, 1000)])
def test_cuda_triton_int8_gemv_equals_the_reference_and_a_graph_replays_it_bit_for_bit(n, k, monkeypatch):
    """The few-row GEMV (default tiles: split K at 4096 rows, none at 24576; ragged N and K), 1 to 4 rows, with
    and without bias: within the reference's tolerance, and an eager call, a second one and a captured replay all
    give the same bits (split-K partials reduced in a fixed order, no atomics)."""
    import torch.nn.functional as F

    from ddtree_serve.plumbing.cuda_graphs import CapturedFunction
    from target_svc import int8_matmul
    from target_svc.int8_matmul import GemvConfig

    q = _quantized(n, k, 8)
    w = q.dequantize(torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    pool = torch.cuda.graph_pool_handle()
    configs = [None, GemvConfig(16, 256, 1), GemvConfig(64, 1024, 2, 8)]
    monkeypatch.setenv(int8_matmul.GEMV_ENV, "on")  # off by default until timed
    for m in range(1, 5):
        assert isinstance(int8_matmul.kernel_config(m, n, k), GemvConfig)
        for b in (None, bias):
            for cfg in configs:
                fn = lambda x, b=b, cfg=cfg: int8_matmul.matmul(x, q.qweight, q.scales, b, 8, cfg)  # noqa: E731
                captured = CapturedFunction.capture(fn, [torch.randn(m, k, device="cuda", dtype=torch.bfloat16)],
                                                    pool)
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                want = fn(x)
                _assert_close_to_reference(want, F.linear(x, w, b), (m, b is not None, cfg))
                assert torch.equal(fn(x), want) and torch.equal(captured(x), want), (m, b is not None, cfg)


@needs_triton
@pytest.mark.parametrize("n, k", [(6144, 4096), (24576, 4096), (4096, 12288), (40, 96)])
def test_cuda_w8a8_kernels_equal_the_reference_bit_for_bit_and_a_graph_replays_them(n, k):
    """Compiled, in bf16, at the 8B's projection shapes and 1 to 130 rows (split and unsplit launches): the row
    quantizer's and the product's outputs equal the PyTorch reference's exactly (tolerance 0: the integer sums are
    exact and the epilogue the same float32 operations), each row equals that row run alone, and a captured graph
    replays the same bits."""
    from target_svc import w8a8_matmul
    from target_svc.quantization import quantize_rows, quantize_weight, w8a8_reference

    torch.manual_seed(0)
    q = quantize_weight(torch.randn(n, k, device="cuda") * 0.02, 8, torch.bfloat16, act_bits=8)
    for m in (1, 4, 17, 64, 65, 130):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        xq, sx = w8a8_matmul.quantize_rows(x)
        want_q, want_s = quantize_rows(x)
        assert torch.equal(xq, want_q) and torch.equal(sx, want_s), m
        y = w8a8_matmul.matmul(x, q.qweight, q.scales)
        assert torch.equal(y, w8a8_reference(x, q).to(torch.bfloat16)), (m, w8a8_matmul.choose_config(m, n, k))
        assert torch.equal(w8a8_matmul.matmul(x[-1:], q.qweight, q.scales), y[-1:]), m
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = w8a8_matmul.matmul(static, q.qweight, q.scales)
        graph.replay()
        assert torch.equal(out, y), m


@needs_triton
@pytest.mark.parametrize("quantize, fused_reduce", [("int8", "off"), ("int4", "off"), ("int8-head", "on"),
                                                    ("w8a8", "off")])
def test_cuda_quantized_target_runs_the_triton_kernels_and_greedy_is_the_same_graphed_and_eager(checkpoints,
                                                                                                quantize, fused_reduce,
                                                                                                monkeypatch):
    """int8-head with the fused split-K reduction: the head a QuantizedLinear too, every weight with counters."""
    from target_svc.int8_matmul import FUSED_REDUCE_ENV

    monkeypatch.setenv(FUSED_REDUCE_ENV, fused_reduce)
    target_dir, _ = checkpoints("qwen3")
    prompt = prompts_for(target_dir, [13], seed=3)[0]
    outputs = []
    for eager in (False, True):
        runner = TargetRunner(TargetConfig(model_dir=str(target_dir), device="cuda", dtype=torch.bfloat16,
                                           max_batch=2, max_seq_len=128, max_tree_nodes=16, quantize=quantize,
                                           enforce_eager=eager, kv_cache_memory_bytes=2**26))
        assert runner.model.int8_backend == "triton"
        head_counters = getattr(runner.target.lm_head, "split_counters", None)  # a plain Linear has none
        assert (head_counters is not None) == (quantize == "int8-head")
        generated = [runner.prefill([PrefillItem("s", prompt, SamplingParams())])[0].next_token]
        while len(generated) < 24:
            generated.append(runner.verify([VerifyItem("s", torch.tensor([generated[-1]]), torch.tensor([-1]))])[0]
                             .next_token)
        outputs.append(generated)
    assert outputs[0] == outputs[1]


def test_cuda_gpu_memory_cap_bounds_the_allocator_at_its_utilization_and_the_plan_takes_it_as_the_card(checkpoints):
    from target_svc.memory_plan import GIB, MemoryPlanError

    target_dir, _ = checkpoints("qwen3")
    cap = 2 * GIB
    try:
        runner = TargetRunner(TargetConfig(model_dir=str(target_dir), device="cuda", dtype=torch.bfloat16,
                                           max_batch=4, max_seq_len=256, max_tree_nodes=16, enforce_eager=True,
                                           gpu_memory_cap_bytes=cap))
        plan = runner.memory
        assert "--gpu-memory-cap 2.00 GiB" in plan.source and plan.max_batch == 4
        # The budget is 0.9 x the cap minus what this process held after the weights loaded (<= the cap).
        assert 0 < plan.budget_bytes <= int(0.9 * cap)
        # The allocator may hold 0.9 x the cap: the rest is the CUDA context's and the graphs' (outside torch).
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(0.9 * cap), dtype=torch.uint8, device="cuda")   # on top of the weights and cache
        with pytest.raises(MemoryPlanError, match="larger than the card"):
            TargetRunner(TargetConfig(model_dir=str(target_dir), device="cuda",
                                      gpu_memory_cap_bytes=torch.cuda.mem_get_info()[1] + GIB))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)   # the cap is process-wide: the other tests run uncapped


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_host_copies_equal_cpu_copies_after_queued_work():
    """The pinned, event-waited copies see everything queued before them (a long matmul chain), like .cpu()."""
    from ddtree_serve.plumbing.host_copy import to_host

    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):
        x = torch.tanh(x @ x.T / 2048)
    ids = x.argmax(dim=-1).to(torch.int32)
    view = x[:, ::2]  # not contiguous
    got = to_host(x, ids, view, torch.arange(3))
    assert all(t.device.type == "cpu" for t in got)
    assert torch.equal(got[0], x.cpu()) and torch.equal(got[1], ids.cpu()) and torch.equal(got[2], view.cpu())
    assert got[0].is_pinned() and torch.equal(got[3], torch.arange(3))




@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_warmup_passes_measure_the_device_memory_they_leave_and_end_lean(checkpoints):
    """Each pass reports the memory its process grew outside torch's allocator (nvidia-smi), and the passes stop at
    the first one that found its kernels cached."""
    import asyncio

    from target_svc.kernel_warmup import WarmupSpec, run_passes

    target_dir, _ = checkpoints("qwen3_5")
    passes = asyncio.run(run_passes(WarmupSpec(str(target_dir), device="cuda", dtype="bfloat16", batch=2, chunk=64,
                                               tree_nodes=17), passes=3))
    assert passes and not any(p.error for p in passes), passes
    if passes[0].outside_growth_bytes is None:
        pytest.skip("nvidia-smi does not list this process (e.g. another PID namespace)")
    assert passes[-1].lean, passes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_bucket_whose_capture_runs_out_of_memory_runs_eagerly_with_the_same_tokens(checkpoints, monkeypatch):
    """Every verify commit capture raises OutOfMemoryError (after its forward graph replayed): each step runs again
    eagerly and its bucket stays eager; the tokens equal an eager runner's."""
    from ddtree_serve.plumbing.cuda_graphs import GraphCache

    real_get = GraphCache.get

    def get(self, key, fn, example_inputs):
        if self.name == "target verify commit" and key not in self.graphs:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (test)")
        return real_get(self, key, fn, example_inputs)

    monkeypatch.setattr(GraphCache, "get", get)
    target, drafter = checkpoints("qwen3")
    prompt = prompts_for(target, [30], seed=8)[0]
    runners = []
    got, accepted_g = speculative_greedy(target, drafter, prompt, 40, torch.float32, runners=runners)
    want, accepted_e = speculative_greedy(target, drafter, prompt, 40, torch.float32, enforce_eager=True,
                                          prefill_verify_chunks=PREFILL_VERIFY_CHUNKS)
    assert got == want and accepted_g == accepted_e
    graphs = runners[0].graphs
    assert graphs.eager_shapes and not graphs.commits.graphs
    assert not (set(graphs.forwards.graphs) & graphs.eager_shapes)   # a given-up bucket's forward graph is let go
