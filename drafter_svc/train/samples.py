"""Token samples: chat-templated prompts + the target's greedy continuation, or plain-text windows."""
from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass
class Sample:
    """Token ids of one training sequence; positions >= loss_start may be anchors (and are labels)."""

    input_ids: list[int]
    loss_start: int


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """The user message under the tokenizer's chat template, ready for the assistant's answer."""
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(enc["input_ids"])


def chat_prompt_ids_batch(tokenizer, texts: Sequence[str], chunk: int = 4096) -> list[list[int]]:
    """chat_prompt_ids for many messages: templates rendered as text, then one batched (parallel) tokenisation."""
    out: list[list[int]] = []
    for i in range(0, len(texts), chunk):
        rendered = [
            tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
            for t in texts[i : i + chunk]
        ]
        # The rendered template already holds every special token: add none.
        out += [list(x) for x in tokenizer(rendered, add_special_tokens=False)["input_ids"]]
    return out


def save_samples(path: str | os.PathLike, samples: Sequence[Sample], meta: dict | None = None) -> None:
    """Stores samples compactly (one flat int32 tensor + offsets) with torch.save."""
    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.int64)
    flat = torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.int32)
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    starts = torch.tensor([s.loss_start for s in samples], dtype=torch.int64)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"tokens": flat, "offsets": offsets, "loss_start": starts, "meta": meta or {}}, str(path))


def load_samples(path: str | os.PathLike) -> list[Sample]:
    """Reads samples written by save_samples."""
    d = torch.load(str(path), map_location="cpu", weights_only=True)
    flat, off, starts = d["tokens"].tolist(), d["offsets"].tolist(), d["loss_start"].tolist()
    return [Sample(flat[off[i] : off[i + 1]], int(starts[i])) for i in range(len(starts))]


def corpus_samples(tokenizer, texts: Sequence[str], seq_len: int, eos_id: int | None = None) -> list[Sample]:
    """Plain text packed into windows of seq_len tokens (documents separated by EOS); anchors from position 1."""
    eos = tokenizer.eos_token_id if eos_id is None else eos_id
    stream: list[int] = []
    for t in texts:
        stream += tokenizer(t, add_special_tokens=False)["input_ids"]
        if eos is not None:
            stream.append(int(eos))
    return [Sample(stream[i : i + seq_len], 1) for i in range(0, len(stream) - 16, seq_len)]


@torch.no_grad()
def generate_greedy(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    batch_size: int = 64,
    max_batch_tokens: int | None = None,
    time_budget_s: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[list[int] | None]:
    """Greedy continuations (transformers' own generate, left padding), EOS kept, pads dropped.

    Prompts are batched by length; batches run in a shuffled order until time_budget_s is spent, and prompts
    left over get None.
    """
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = max([len(prompts[j]) for j in cur] + [len(prompts[i])])
        too_many = max_batch_tokens is not None and (len(cur) + 1) * (longest + max_new_tokens) > max_batch_tokens
        if cur and (len(cur) >= batch_size or too_many):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    random.Random(len(prompts)).shuffle(batches)  # mixed lengths across time, so a cut keeps a fair sample
    gen_cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=list(eos_token_ids),
        pad_token_id=pad_token_id,
    )
    eos = set(int(e) for e in eos_token_ids)
    out: list[list[int] | None] = [None] * len(prompts)
    t0 = time.perf_counter()
    done = 0
    for batch in batches:
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            break
        width = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):
            p = prompts[i]
            ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p) :] = 1
        gen = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen_cfg
        )
        new = gen[:, width:].tolist()
        for r, i in enumerate(batch):
            toks = new[r]
            cut = next((k + 1 for k, t in enumerate(toks) if t in eos), len(toks))
            out[i] = toks[:cut]
        done += len(batch)
        if progress is not None:
            progress(done, len(prompts))
    return out


def distill_samples(prompt_ids: Sequence[Sequence[int]], responses: Sequence[list[int] | None]) -> list[Sample]:
    """prompt + response samples (anchors in the response); prompts without a response are skipped."""
    return [
        Sample(list(p) + list(r), len(p)) for p, r in zip(prompt_ids, responses) if r is not None and len(r) >= 2
    ]
