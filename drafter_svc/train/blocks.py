"""Training blocks: anchor sampling, the block attention mask, positions, inputs/labels and slot weights."""
from __future__ import annotations


import torch



def sample_anchors(
    lengths: torch.Tensor,
    loss_start: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct anchors per row, sorted: positions in [loss_start, length - 2] (each has >= 1 label).

    Returns (anchors LongTensor[B, N], keep BoolTensor[B, N]); rows with fewer valid positions than N are
    padded with anchor 0 and keep False.
    """
    device = lengths.device
    width = int(lengths.max().item())
    pos = torch.arange(width, device=device)[None, :]
    valid = (pos >= loss_start[:, None]) & (pos <= lengths[:, None] - 2)
    counts = valid.sum(1)
    n = min(num_anchors, int(counts.max().item()))
    if n <= 0:
        raise ValueError("batch has no anchor position (sequences too short after loss_start)")
    # Uniform random order of the valid positions (invalid ones sort last), first n kept.
    noise = torch.rand(valid.shape, generator=generator, device="cpu" if generator is None else generator.device)
    noise = noise.to(device).masked_fill(~valid, 2.0)
    picked = noise.topk(n, dim=1, largest=False).indices
    keep = torch.arange(n, device=device)[None, :] < counts.clamp(max=n)[:, None]
    anchors = torch.where(keep, picked, torch.zeros_like(picked))
    # Sorted anchors keep blocks in sequence order (nicer to debug; attention does not care).
    anchors, order = torch.sort(torch.where(keep, anchors, torch.full_like(anchors, width + 1)), dim=1)
    keep = keep.gather(1, order)
    return torch.where(keep, anchors, torch.zeros_like(anchors)), keep


def block_attention_mask(anchors: torch.Tensor, keep: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """Bool mask [B, 1, N*bs, ctx_len + N*bs]: block b sees context < anchor_b and its own block only.

    Dropped blocks (keep False) see only themselves, so no attention row is empty (an all-False row would
    make SDPA return NaN, which would poison the gradients even under a zero loss weight).
    """
    b, n = anchors.shape
    device = anchors.device
    q_block = torch.arange(n * block_size, device=device) // block_size  # [Q]
    kv = torch.arange(ctx_len + n * block_size, device=device)  # [K]
    anchor_q = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    keep_q = keep.repeat_interleave(block_size, dim=1)
    ctx_ok = (kv[None, None, :] < ctx_len) & (kv[None, None, :] < anchor_q[:, :, None]) & keep_q[:, :, None]
    kv_block = (kv - ctx_len).div(block_size, rounding_mode="floor")
    own = (kv[None, :] >= ctx_len) & (kv_block[None, :] == q_block[:, None])  # [Q, K]
    return (ctx_ok | own[None]).unsqueeze(1)


def block_position_ids(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """Position ids [B, ctx_len + N*bs]: context 0..ctx_len-1, then anchor + k for each block slot."""
    b, n = anchors.shape
    device = anchors.device
    ctx = torch.arange(ctx_len, device=device)[None, :].expand(b, -1)
    blocks = (anchors[:, :, None] + torch.arange(block_size, device=device)[None, None, :]).reshape(b, -1)
    return torch.cat([ctx, blocks], dim=1)


def block_inputs_and_labels(
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noise ids [B, N*bs], labels [B, N, bs], label_valid [B, N, bs]) for the anchored blocks.

    Slot 0 holds the anchor token (no label); slot k >= 1 holds MASK and is labelled with token anchor + k
    when that position exists in the sequence.
    """
    b, n = anchors.shape
    device = input_ids.device
    k = torch.arange(block_size, device=device)
    idx = anchors[:, :, None] + k[None, None, :]  # [B, N, bs]
    inside = idx < lengths[:, None, None]
    labels = input_ids.gather(1, idx.clamp(max=input_ids.shape[1] - 1).reshape(b, -1)).reshape(b, n, block_size)
    valid = inside & keep[:, :, None] & (k >= 1)[None, None, :]
    noise = torch.full((b, n, block_size), mask_token_id, dtype=torch.long, device=device)
    noise[:, :, 0] = torch.where(keep, labels[:, :, 0], torch.full_like(labels[:, :, 0], mask_token_id))
    return noise.reshape(b, -1), labels, valid


def valid_label_index(
    lengths: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Flat indices into [B * N * bs] of the labelled slots (the `valid` of block_inputs_and_labels)."""
    k = torch.arange(block_size, device=anchors.device)
    inside = anchors[:, :, None] + k[None, None, :] < lengths[:, None, None]
    valid = inside & keep[:, :, None] & (k >= 1)[None, None, :]
    return valid.reshape(-1).nonzero().squeeze(1)


def slot_weights(block_size: int, gamma: float | None, device: torch.device | str) -> torch.Tensor:
    """Loss weight per slot: 0 for slot 0, exp(-(k-1)/gamma) for k >= 1 (1 when gamma is None or <= 0)."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.ones(block_size, device=device) if not gamma or gamma <= 0 else torch.exp(-(k - 1).clamp(min=0) / gamma)
    w[0] = 0.0
    return w


def default_gamma(block_size: int) -> float:
    """The recipe's decay: 7 for block 16 (scaled for other block sizes)."""
    return 7.0 * (block_size - 1) / 15.0
