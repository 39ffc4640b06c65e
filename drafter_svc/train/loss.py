"""The training forward: DFlashTrainModule computes the decayed block cross-entropy of one batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from drafter_svc.dflash_model import DFlashDraftModel
from drafter_svc.train.blocks import block_attention_mask, block_inputs_and_labels, block_position_ids, slot_weights


@dataclass
class StepStats:
    """Sums over one step's valid label slots (sums so that ranks and steps add up)."""

    loss: torch.Tensor  # weighted mean CE (the optimised value)
    weight_sum: torch.Tensor
    correct: torch.Tensor  # top-1 hits over valid slots
    n_labels: torch.Tensor  # valid label slots
    correct_per_slot: torch.Tensor  # [bs]
    n_per_slot: torch.Tensor  # [bs]


class DFlashTrainModule(nn.Module):
    """Drafter + frozen target embedding/head (buffers, so DDP and the optimiser leave them alone)."""

    def __init__(
        self,
        drafter: DFlashDraftModel,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        gamma: float | None,
        ce_chunk: int = 0,
    ) -> None:
        super().__init__()
        self.drafter = drafter
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        tied = lm_head_weight.data_ptr() == embed_weight.data_ptr()
        self.register_buffer("lm_head_weight", embed_weight.detach() if tied else lm_head_weight.detach(), persistent=False)
        self.gamma = gamma
        self.ce_chunk = ce_chunk

    def forward(
        self,
        input_ids: torch.Tensor,
        lengths: torch.Tensor,
        features: torch.Tensor,
        anchors: torch.Tensor,
        keep: torch.Tensor,
        valid_index: torch.Tensor | None = None,
    ) -> StepStats:
        """Weighted CE over all anchored blocks of a batch.

        valid_index (flat indices of the labelled slots, see `valid_label_index`) may come precomputed from the
        host, so that the step never waits on the device to learn how many labels it has.
        """
        cfg = self.drafter.config
        bs = cfg.block_size
        b, s = input_ids.shape
        noise_ids, labels, valid = block_inputs_and_labels(input_ids, lengths, anchors, keep, bs, cfg.mask_token_id)
        noise = self.drafter.embed(noise_ids, self.embed_weight)
        pos = block_position_ids(anchors, s, bs)
        mask = block_attention_mask(anchors, keep, s, bs)
        hidden = self.drafter(noise, features.to(noise.dtype), pos, attention_mask=mask)  # [B, N*bs, H]
        w_slot = slot_weights(bs, self.gamma, hidden.device)
        if valid_index is None:
            valid_index = valid.reshape(-1).nonzero().squeeze(1)
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, valid_index)
        tgt = labels.reshape(-1).index_select(0, valid_index)
        slot = valid_index % bs
        w = w_slot[slot]
        ce, hit = self._ce(rows, tgt)
        wsum = w.sum()
        loss = (ce * w).sum() / wsum.clamp(min=1e-6)
        with torch.no_grad():
            hits = hit.float()
            correct_per_slot = torch.zeros(bs, device=hidden.device).index_add_(0, slot, hits)
            n_per_slot = torch.zeros(bs, device=hidden.device).index_add_(0, slot, torch.ones_like(hits))
        return StepStats(loss, wsum.detach(), hits.sum(), n_per_slot.sum(), correct_per_slot, n_per_slot)

    def _ce(self, rows: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row CE (float32 softmax) and top-1 hits; optionally in recomputed chunks to bound memory."""

        def piece(r: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.drafter.compute_logits(r, self.lm_head_weight.to(r.dtype)).float()
            return F.cross_entropy(logits, t, reduction="none"), logits.argmax(-1) == t

        if not self.ce_chunk or rows.shape[0] <= self.ce_chunk:
            return piece(rows, tgt)
        ces, hits = [], []
        for i in range(0, rows.shape[0], self.ce_chunk):
            r, t = rows[i : i + self.ce_chunk], tgt[i : i + self.ce_chunk]
            if torch.is_grad_enabled():
                # Logits of a chunk are rebuilt in backward instead of kept: [rows, vocab] floats dominate memory.
                c, h = checkpoint(piece, r, t, use_reentrant=False)
            else:
                c, h = piece(r, t)
            ces.append(c)
            hits.append(h)
        return torch.cat(ces), torch.cat(hits)
