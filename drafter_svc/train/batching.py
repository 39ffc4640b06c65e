"""Batches of token samples: padding (collate) and the resumable, rank-sharded BatchSampler."""
from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from drafter_svc.train.samples import Sample


@dataclass
class Batch:
    """Right-padded token batch: positions >= lengths[b] are padding; anchors at loss_start[b]..lengths[b]-2."""

    input_ids: torch.Tensor  # LongTensor[B, L]
    lengths: torch.Tensor  # LongTensor[B]
    loss_start: torch.Tensor  # LongTensor[B]

    def to(self, device: torch.device | str) -> "Batch":
        """The batch on device."""
        return Batch(self.input_ids.to(device), self.lengths.to(device), self.loss_start.to(device))


def collate(samples: Sequence[Sample], pad_id: int = 0, max_len: int | None = None) -> Batch:
    """Right-pads samples into a Batch (each cut to max_len)."""
    seqs = [s.input_ids[:max_len] if max_len else s.input_ids for s in samples]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    starts = torch.tensor([min(s.loss_start, len(q)) for s, q in zip(samples, seqs)], dtype=torch.long)
    return Batch(ids, lengths, starts)


class BatchSampler:
    """Endless epochs of length-bucketed, shuffled batches of at most max_tokens padded tokens; sharded by rank."""

    def __init__(
        self,
        samples: Sequence[Sample],
        max_tokens: int,
        max_len: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        max_batch: int | None = None,
    ) -> None:
        # Usable samples need at least one anchor with one label inside max_len.
        self.samples = [s for s in samples if min(len(s.input_ids), max_len) - s.loss_start >= 2]
        if not self.samples:
            raise ValueError("no usable training samples (each needs >= 2 tokens after loss_start)")
        self.max_tokens, self.max_len, self.seed = max_tokens, max_len, seed
        self.rank, self.world_size, self.max_batch = rank, world_size, max_batch

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches (sample indices) for an epoch; every rank gets the same count."""
        rng = random.Random(self.seed * 1_000_003 + epoch)
        idx = list(range(len(self.samples)))
        rng.shuffle(idx)
        # Sort within chunks of 64 batches' worth: similar lengths per batch, still random across the epoch.
        chunk = 4096
        batches: list[list[int]] = []
        for c in range(0, len(idx), chunk):
            part = sorted(idx[c : c + chunk], key=lambda i: len(self.samples[i].input_ids))
            cur: list[int] = []
            for i in part:
                n = min(len(self.samples[i].input_ids), self.max_len)
                width = max([n] + [min(len(self.samples[j].input_ids), self.max_len) for j in cur[-1:]])
                full = (len(cur) + 1) * width > self.max_tokens or (self.max_batch and len(cur) >= self.max_batch)
                if cur and full:
                    batches.append(cur)
                    cur = []
                cur.append(i)
            if cur:
                batches.append(cur)
        rng.shuffle(batches)
        per_rank = len(batches) // self.world_size if self.world_size > 1 else len(batches)
        if per_rank == 0:
            per_rank = 1
            batches = (batches * self.world_size)[: self.world_size]
        return batches[self.rank * per_rank : (self.rank + 1) * per_rank] if self.world_size > 1 else batches

    def iterate(self, start_epoch: int = 0, skip: int = 0) -> Iterator[tuple[int, int, list[Sample]]]:
        """Yields (epoch, index in epoch, samples) forever, starting at (start_epoch, skip) to resume."""
        epoch = start_epoch
        while True:
            batches = self.epoch_batches(epoch)
            for j in range(skip, len(batches)):
                yield epoch, j, [self.samples[i] for i in batches[j]]
            skip = 0
            epoch += 1

    def tokens_per_epoch(self) -> int:
        """Anchor-eligible tokens in one epoch over all ranks."""
        return sum(min(len(s.input_ids), self.max_len) - s.loss_start for s in self.samples)
