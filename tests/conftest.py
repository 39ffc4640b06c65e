"""Shared fixtures: tiny checkpoints built once per session, and the three services started as real processes."""
from __future__ import annotations

import asyncio
import json
from functools import lru_cache
from pathlib import Path

import grpc
import pytest
import torch
import transformers

from ddtree_serve.decoding.config import SamplingParams
from launch.local_stack import LocalStack
from target_svc.quantization import BITS, quantize_weight, quantizes_head
from ddtree_serve.proto import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.fixtures import make_tiny_llama, make_tiny_qwen3, make_tiny_qwen3_5
from tests.fixtures.tiny_drafter import make_tiny_drafter

# Two cores are shared by pytest and up to three service processes: more threads only add contention.
torch.set_num_threads(1)

TARGET_MAKERS = {
    "qwen3": lambda d: make_tiny_qwen3(d, seed=1),
    "llama": lambda d: make_tiny_llama(d, seed=2),
    "qwen3_5": lambda d: make_tiny_qwen3_5(d, seed=3, multimodal_wrapper=True),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Builds (target_dir, drafter_dir) for a model kind on first use, once per session."""
    root = tmp_path_factory.mktemp("checkpoints")
    built: dict[str, tuple[Path, Path]] = {}

    def get(kind: str) -> tuple[Path, Path]:
        if kind not in built:
            target = Path(TARGET_MAKERS[kind](root / kind))
            drafter = Path(make_tiny_drafter(root / f"{kind}-drafter", target, seed=7))
            built[kind] = (target, drafter)
        return built[kind]

    return get


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted once per session from the packaged GGUF into a temporary cache."""
    from ddtree_serve.default_model import ensure_default_model

    return ensure_default_model(cache_dir=tmp_path_factory.mktemp("ddtree-cache"))


def start_stack(target: Path, drafter: Path, **kw) -> LocalStack:
    """Starts the three services (one torch thread each: CI has 2 cores)."""
    return LocalStack(model=str(target), drafter=str(drafter), threads=1, **kw).start(timeout_s=180)


@lru_cache(maxsize=4)
def reference_model(model_dir: str, quantize: str = "none"):
    """The checkpoint loaded by transformers itself, float32 on CPU (the losslessness oracle).

    quantize="int8" / "int4": the decoder layers' Linear weights are replaced by their dequantized quantized
    weights (q * s), i.e. the model that `--quantize int8` / `int4` serves; "int8-head": the LM head's too (untied
    from the embedding, which keeps its float weights).
    """
    config = transformers.AutoConfig.from_pretrained(model_dir)
    cls = getattr(transformers, config.architectures[0])
    model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare fixed lengths; the services get ignore_eos
    if quantize != "none":
        dequantize_decoder_linears_(model, BITS[quantize])
    if quantizes_head(quantize):
        head = model.get_output_embeddings()
        dequantized = quantize_weight(head.weight.detach(), BITS[quantize]).dequantize(torch.float32)
        head.weight = torch.nn.Parameter(dequantized, requires_grad=False)   # a tensor of its own: untied
    return model


def dequantize_decoder_linears_(model: torch.nn.Module, bits: int = 8) -> int:
    """Replaces every decoder-layer Linear weight (text model only) by q * s of its int8 (or int4) quantization;
    returns how many were replaced."""
    n = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.split(".layers.")[0] in ("model", "model.language_model") \
                    and ".layers." in name:
                module.weight.copy_(quantize_weight(module.weight, bits).dequantize(torch.float32))
                n += 1
    return n


# Logit bias and all three penalties, each a value a float32 holds exactly (as the wire carries it).
ADJUSTED_SAMPLING = SamplingParams(repetition_penalty=1.75, frequency_penalty=0.5, presence_penalty=0.25,
                                   logit_bias=((7, 3.0), (50, -5.0)))


class FrequencyPresencePenalty(transformers.LogitsProcessor):
    """vLLM's frequency and presence penalties as a transformers processor, one token at a time (transformers has
    none): each output token's logit loses frequency x its count, plus presence once."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        for row in range(scores.shape[0]):
            output = input_ids[row, self.prompt_len:].tolist()
            for token in set(output):   # two subtractions, as vLLM rounds them
                scores[row, token] -= self.frequency * output.count(token)
                scores[row, token] -= self.presence
        return scores


class VllmBadWords(transformers.LogitsProcessor):
    """vLLM's bad_words, one token at a time: a word's last token is -inf where the generated tokens (not the
    prompt, unlike transformers' NoBadWordsLogitsProcessor) end with the rest of it."""

    def __init__(self, prompt_len: int, bad_words):
        self.prompt_len, self.bad_words = prompt_len, [list(w) for w in bad_words]

    def __call__(self, input_ids, scores):
        for row in range(scores.shape[0]):
            output = input_ids[row, self.prompt_len:].tolist()
            for word in self.bad_words:
                prefix = word[:-1]
                if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
                    scores[row, word[-1]] = float("-inf")
        return scores


def adjusted_generate_kwargs(sampling: SamplingParams, prompt_len: int) -> dict:
    """generate() keyword arguments that apply sampling's logit bias and penalties in our order: the bias, the
    repetition penalty, then the frequency and presence penalties."""
    processors = [FrequencyPresencePenalty(prompt_len, sampling.frequency_penalty, sampling.presence_penalty)]
    if sampling.bad_words:
        processors.insert(0, VllmBadWords(prompt_len, sampling.bad_words))
    if sampling.holds_back_stops:
        processors.insert(0, transformers.MinNewTokensLengthLogitsProcessor(
            prompt_len, sampling.min_tokens, list(sampling.min_tokens_blocked)))
    return {"repetition_penalty": sampling.repetition_penalty,
            "sequence_bias": {(t,): b for t, b in sampling.logit_bias} or None,
            "logits_processor": transformers.LogitsProcessorList(processors)}


class GrammarLogits(transformers.LogitsProcessor):
    """Structured output one token at a time: each generated token is accepted by a fresh xgrammar matcher of the
    compiled grammar, and every token the grammar does not allow next is -inf, until the grammar has ended; with
    start_after, nothing is masked until the generated tokens end with it (and those are not the grammar's)."""

    def __init__(self, compiled, prompt_len: int, start_after: tuple[int, ...] = ()):
        import xgrammar as xgr

        self.xgr, self.matcher, self.prompt_len = xgr, xgr.GrammarMatcher(compiled), prompt_len
        self.start_after, self.started_at = list(start_after), None if start_after else prompt_len

    def __call__(self, input_ids, scores):
        generated = input_ids[0, self.prompt_len:].tolist()
        if self.started_at is None:
            if generated[-len(self.start_after):] != self.start_after:
                return scores
            self.started_at = input_ids.shape[1]   # the grammar's first token comes next
        elif input_ids.shape[1] > self.started_at and not self.matcher.is_terminated():
            assert self.matcher.accept_token(int(input_ids[0, -1]))
        if not self.matcher.is_terminated():
            bitmask = self.xgr.allocate_token_bitmask(1, scores.shape[-1])
            self.matcher.fill_next_token_bitmask(bitmask, 0)
            allowed = [t for t in range(scores.shape[-1]) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
            masked = torch.full_like(scores, float("-inf"))
            masked[:, allowed] = scores[:, allowed]
            scores = masked
        return scores


def compile_guide(model_dir: str | Path, kind: str, spec: str = ""):
    """The target's compiled grammar for a guide over the checkpoint at model_dir (its tokenizer, its vocabulary)."""
    from ddtree_serve.decoding.guides import GuideSpec
    from target_svc.grammar_compiler import GrammarCompiler

    config = transformers.AutoConfig.from_pretrained(model_dir).get_text_config()
    eos = transformers.GenerationConfig.from_pretrained(model_dir).eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return GrammarCompiler(model_dir, config.vocab_size, eos, threads=1).compile(GuideSpec(kind, spec))


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
              guide=None, guide_start_after: tuple[int, ...] = ()) -> list[int]:
    """model.generate() greedy, new tokens only; with sampling, its logit bias and penalties applied; with guide
    (a compiled grammar), kept to it (from the token after guide_start_after, when given)."""
    extra = adjusted_generate_kwargs(sampling, len(prompt_ids)) if sampling is not None else {}
    if guide is not None:
        processors = extra.get("logits_processor", transformers.LogitsProcessorList())
        processors.insert(0, GrammarLogits(guide, len(prompt_ids), guide_start_after))
        extra["logits_processor"] = processors
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0, pad_token_id=0, **extra)
    return out[0, len(prompt_ids):].tolist()


def reference_greedy(model_dir: str | Path, prompt_ids: list[int], max_new_tokens: int,
                     quantize: str = "none", sampling: SamplingParams | None = None) -> list[int]:
    """transformers' own greedy generate(), new tokens only (of the dequantized int8 / int4 model with quantize=;
    with sampling, its logit bias and penalties applied)."""
    return hf_greedy(reference_model(str(model_dir), quantize), prompt_ids, max_new_tokens, sampling)


def make_request(prompt_ids: list[int], max_tokens: int, mode: str | None = None, budget: int = 0,
                 temperature: float = 0.0, seed: int | None = None, ignore_eos: bool = True, **kw):
    """A public GenerateRequest over token ids."""
    modes = {None: gateway_pb2.DECODE_MODE_DEFAULT, "ddtree": gateway_pb2.DECODE_MODE_DDTREE,
             "dflash": gateway_pb2.DECODE_MODE_DFLASH, "ar": gateway_pb2.DECODE_MODE_AR}
    return gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=prompt_ids), max_tokens=max_tokens, mode=modes[mode], budget=budget,
        ignore_eos=ignore_eos, sampling=common_pb2.SamplingParams(temperature=temperature, seed=seed or 0,
                                                                  has_seed=seed is not None), **kw)


async def stream_all(address: str, requests: list, timeout_s: float = 300.0) -> list[dict]:
    """Runs the requests concurrently over GenerateStream; returns ids, text, finish reason and stats of each."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def one(req):
            ids, text, final = [], [], None
            async for msg in stub.GenerateStream(req, timeout=timeout_s):
                ids.extend(msg.token_ids)
                text.append(msg.text)
                final = msg
            return {"token_ids": ids, "text": "".join(text), "finish_reason": final.finish_reason,
                    "stats": final.stats}

        return await asyncio.gather(*(one(r) for r in requests))


def run_streams(address: str, requests: list, timeout_s: float = 300.0) -> list[dict]:
    """Synchronous wrapper of stream_all."""
    return asyncio.run(stream_all(address, requests, timeout_s))


def prompts_for(model_dir: Path, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Deterministic random prompts of the given lengths over the model's ordinary tokens."""
    vocab = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = vocab.get("vocab_size") or vocab["text_config"]["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, min(vocab, 300), (n,), generator=g).tolist() for n in lengths]
