"""Preallocated per-slot target cache: K/V of full-attention layers and Gated DeltaNet states of linear ones."""
from __future__ import annotations

import importlib
import importlib.util
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ddtree_serve.prefix_match import reclaim_parked_slot
from ddtree_serve.switches import switched_off
from target_svc.gated_deltanet import LinearAttnState, LinearAttnStateShape, allocate_linear_attn_state

KV_WRITE_ENV_VAR = "DDTREE_KV_WRITE_KERNEL"
_KV_WRITE_BLOCK = 1024   # values per load/store of the write kernel (n_kv * head_dim is 1024 on Qwen3-8B)


def kv_write_kernel_available(device: torch.device | str) -> bool:
    """Whether write_kv and move_rows go through the Triton kernels on device: CUDA, Triton installed,
    DDTREE_KV_WRITE_KERNEL not off."""
    if switched_off(KV_WRITE_ENV_VAR):
        return False
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class CacheSpec:
    """Sizes of the cache; capacity rows per slot = max_seq_len + max_tree_nodes (a verify block fits past ctx).

    The tensors hold one slot more than max_batch: the scratch slot, never handed out, where the padding rows of
    a bucketed (graph-captured) batch write their K/V and states.
    """

    max_batch: int
    max_seq_len: int
    max_tree_nodes: int
    num_full_layers: int
    num_kv_heads: int
    head_dim: int
    linear_shapes: tuple[LinearAttnStateShape, ...]
    device: torch.device
    dtype: torch.dtype
    # Gated DeltaNet state snapshots (prefix caching on a hybrid target): copies of a slot's linear-attention states
    # at a position inside its context, so that a prompt sharing those leading tokens starts there
    state_snapshots: int = 0

    @property
    def capacity(self) -> int:
        """Rows per slot: committed context plus one verify block written past it."""
        return self.max_seq_len + self.max_tree_nodes

    @property
    def scratch_slot(self) -> int:
        """The slot that padding rows use; no sequence ever holds it."""
        return self.max_batch


@dataclass
class KVCache:
    """K/V `[n_full_layers, max_batch + 1, capacity, n_kv, head_dim]` plus per-linear-layer states; slots by seq id."""

    spec: CacheSpec
    k: Tensor
    v: Tensor
    linear: list[LinearAttnState]
    ctx_len: list[int]  # committed tokens per slot (host-side: known without a device sync)
    slot_of: dict[str, int] = field(default_factory=dict)
    free_slots: list[int] = field(default_factory=list)
    # Prefix caching: released sequences whose slots keep their rows and states until a new sequence adopts them or
    # a slot is needed (oldest parked first), by seq id -> (slot, the token ids their ctx_len rows hold)
    parked: OrderedDict[str, tuple[int, list[int]]] = field(default_factory=OrderedDict)
    # write_kv and move_rows through target_svc/kv_cache_kernels.py (one launch each: two index_puts, and a gather
    # and a scatter of K and of V)
    write_kernel: bool = False
    # State snapshots: the pool (one LinearAttnState of spec.state_snapshots entries per linear layer) and which
    # entry holds (slot, position), oldest first; a slot's snapshots last while its rows do (dropped when the slot
    # is released or starts a new sequence, kept when a sequence adopts it)
    snapshot_pool: list[LinearAttnState] = field(default_factory=list)
    snapshots: OrderedDict[tuple[int, int], int] = field(default_factory=OrderedDict)

    @classmethod
    def allocate(cls, spec: CacheSpec) -> "KVCache":
        """Zeroed cache with every slot free."""
        slots = spec.max_batch + 1  # + the scratch slot
        shape = (spec.num_full_layers, slots, spec.capacity, spec.num_kv_heads, spec.head_dim)
        return cls(
            spec=spec,
            k=torch.zeros(shape, device=spec.device, dtype=spec.dtype),
            v=torch.zeros(shape, device=spec.device, dtype=spec.dtype),
            linear=[allocate_linear_attn_state(s, slots, spec.device, spec.dtype) for s in spec.linear_shapes],
            ctx_len=[0] * spec.max_batch,
            # Popped from the end: slot 0 is handed out first.
            free_slots=list(range(spec.max_batch - 1, -1, -1)),
            write_kernel=kv_write_kernel_available(spec.device),
            snapshot_pool=[allocate_linear_attn_state(s, spec.state_snapshots, spec.device, spec.dtype)
                           for s in spec.linear_shapes] if spec.state_snapshots else [],
        )

    def add_sequence(self, seq_id: str, spare: str = "") -> int:
        """Takes a free slot for seq_id (else the oldest parked one's but spare's) and resets its state;
        RuntimeError('capacity ...') when none is left."""
        if seq_id in self.slot_of:
            raise ValueError(f"sequence {seq_id!r} is already in the target cache")
        reclaim_parked_slot(self.free_slots, self.parked, spare)
        if not self.free_slots:
            raise RuntimeError(f"capacity: all {self.spec.max_batch} sequence slots are in use")
        slot = self.free_slots.pop()
        self.slot_of[seq_id] = slot
        self.ctx_len[slot] = 0
        self._drop_snapshots(slot)
        # Linear-attention layers start from zero state; K/V rows need no reset (ctx_len bounds what is read).
        for state in self.linear:
            state.conv[slot].zero_()
            state.rec[slot].zero_()
        return slot

    def release(self, seq_id: str) -> None:
        """Frees the slot of seq_id; KeyError if unknown."""
        slot = self.slot(seq_id)
        del self.slot_of[seq_id]
        self.ctx_len[slot] = 0
        self.free_slots.append(slot)
        self._drop_snapshots(slot)

    def park(self, seq_id: str, tokens: list[int]) -> None:
        """Releases seq_id but keeps its slot's rows and states for a later adopt(); tokens: the ids of its ctx_len
        committed rows. KeyError if unknown."""
        slot = self.slot(seq_id)
        if len(tokens) != self.ctx_len[slot]:
            raise ValueError(f"sequence {seq_id!r} holds {self.ctx_len[slot]} rows, not {len(tokens)}")
        del self.slot_of[seq_id]
        self.parked[seq_id] = (slot, tokens)

    def adopt(self, seq_id: str, parked_id: str) -> tuple[int, list[int]]:
        """Gives parked_id's slot, rows and states (ctx_len unchanged) to the new sequence seq_id -> (slot, the token
        ids of its rows); KeyError when parked_id is not parked."""
        if seq_id in self.slot_of:
            raise ValueError(f"sequence {seq_id!r} is already in the target cache")
        slot, tokens = self.parked.pop(parked_id)
        self.slot_of[seq_id] = slot
        return slot, tokens

    def copy_rows(self, src_slot: int, dst_slot: int, rows: int) -> None:
        """Copies rows [0, rows) of every full-attention layer's K and V from one slot to another (prefix caching
        from a sequence that keeps its own slot; linear-attention states are not copied)."""
        if self.spec.num_full_layers and rows > 0:
            for buf in (self.k, self.v):
                buf[:, dst_slot, :rows] = buf[:, src_slot, :rows]

    def take_snapshot(self, slot: int, position: int) -> bool:
        """Copies the slot's linear-attention states, which stand at `position` (its ctx_len), into the snapshot
        pool (the oldest snapshot makes room); False when the pool is empty."""
        if not self.snapshot_pool or self.ctx_len[slot] != position:
            return False
        key = (slot, position)
        if key in self.snapshots:
            entry = self.snapshots.pop(key)
        elif len(self.snapshots) < self.spec.state_snapshots:
            taken = set(self.snapshots.values())
            entry = next(i for i in range(self.spec.state_snapshots) if i not in taken)
        else:
            entry = self.snapshots.pop(next(iter(self.snapshots)))
        for pool, state in zip(self.snapshot_pool, self.linear):
            pool.conv[entry].copy_(state.conv[slot])
            pool.rec[entry].copy_(state.rec[slot])
        self.snapshots[key] = entry
        return True

    def snapshot_positions(self, slot: int) -> list[int]:
        """Positions of the slot's snapshots."""
        return [p for s, p in self.snapshots if s == slot]

    def restore_snapshot(self, src_slot: int, position: int, dst_slot: int) -> None:
        """Sets dst_slot's linear-attention states to src_slot's snapshot at position (KeyError if none)."""
        entry = self.snapshots[(src_slot, position)]
        self.snapshots.move_to_end((src_slot, position))
        for pool, state in zip(self.snapshot_pool, self.linear):
            state.conv[dst_slot].copy_(pool.conv[entry])
            state.rec[dst_slot].copy_(pool.rec[entry])

    def _drop_snapshots(self, slot: int) -> None:
        for key in [k for k in self.snapshots if k[0] == slot]:
            del self.snapshots[key]

    @property
    def slots_available(self) -> int:
        """Slots a new sequence can take: the free ones and the parked ones."""
        return len(self.free_slots) + len(self.parked)

    def slot(self, seq_id: str) -> int:
        """Slot of seq_id; KeyError if unknown."""
        try:
            return self.slot_of[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence id {seq_id!r}") from None

    @property
    def num_sequences(self) -> int:
        """Sequences holding a slot."""
        return len(self.slot_of)

    def used_tokens(self) -> int:
        """Committed tokens over all live slots."""
        # list() snapshots the slots in one C call under the GIL: Info reads this on the event loop while the model
        # thread may be adding or releasing a sequence (iterating the dict itself could then raise).
        return sum(self.ctx_len[s] for s in list(self.slot_of.values()))

    def write_kv(self, layer: int, slots: Tensor, rows: Tensor, k: Tensor, v: Tensor) -> None:
        """Writes k/v [B, T, n_kv, head_dim] of full-attention layer `layer` to rows[B, T] of slots[B]."""
        if self.write_kernel and k.numel():
            write_kv_rows(self.k[layer], self.v[layer], slots, rows, k, v)
            return
        index = (slots[:, None].expand_as(rows), rows)
        self.k[layer].index_put_(index, k)
        self.v[layer].index_put_(index, v)

    def read_kv(self, layer: int, slots: Tensor, key_len: int) -> tuple[Tensor, Tensor]:
        """Rows [0, key_len) of slots[B] for one layer: ([B, key_len, n_kv, hd], same)."""
        return self.k[layer][slots, :key_len], self.v[layer][slots, :key_len]

    def move_rows(self, slots: Tensor, src_rows: Tensor, dst_rows: Tensor) -> None:
        """Copies rows src_rows[B, D] to dst_rows[B, D] of slots[B] in every full-attention layer at once.

        Used for compaction of accepted tree rows: gathered before written, so overlapping rows are safe.
        """
        if self.spec.num_full_layers == 0:
            return
        if self.write_kernel and src_rows.numel():
            move_rows_in_place(self.k, self.v, slots, src_rows, dst_rows)
            return
        b_idx = slots[:, None].expand_as(src_rows)
        for buf in (self.k, self.v):
            rows = buf[:, b_idx, src_rows]  # [L, B, D, n_kv, hd]
            buf[:, b_idx, dst_rows] = rows


def move_rows_in_place(k: Tensor, v: Tensor, slots: Tensor, src_rows: Tensor, dst_rows: Tensor) -> None:
    """KVCache.move_rows through the Triton kernel: rows src_rows[b, :] of slot slots[b] -> dst_rows[b, :] in every
    layer of k, v [L, slots, capacity, n_kv, hd] (contiguous); one launch, no sync."""
    layers, _, _, n_kv, hd = k.shape
    bsz, width = src_rows.shape
    if not (k.is_contiguous() and v.is_contiguous()) or v.shape != k.shape:
        raise ValueError("the slot cache must be contiguous, K and V of one shape")
    c = n_kv * hd
    block_d = max(2, 1 << (width - 1).bit_length())
    block_c = min(1 << (c - 1).bit_length(), max(64, 8192 // block_d))   # <= 8192 values a tile and buffer
    kernels = importlib.import_module("target_svc.kv_cache_kernels")  # Triton: only once a launch is certain
    kernels.move_rows_kernel[(layers, bsz, -(-c // block_c))](
        k, v, slots, src_rows, dst_rows,
        width, k.stride(0), k.stride(1), k.stride(2), slots.stride(0), src_rows.stride(0), src_rows.stride(1),
        dst_rows.stride(0), dst_rows.stride(1),
        C=c, BLOCK_D=block_d, BLOCK_C=block_c, num_warps=4 if block_d * block_c <= 4096 else 8,
    )


def write_kv_rows(k_cache: Tensor, v_cache: Tensor, slots: Tensor, rows: Tensor, k: Tensor, v: Tensor) -> None:
    """KVCache.write_kv of one layer through the Triton kernel: k_cache, v_cache [slots, capacity, n_kv, hd]
    contiguous; k, v [B, T, n_kv, hd] (copied where a node's n_kv x hd values are not dense); no sync."""
    bsz, t, n_kv, hd = k.shape
    d = n_kv * hd
    k, v = (x if x.stride(-1) == 1 and x.stride(-2) == hd else x.contiguous() for x in (k, v))
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the slot cache must be contiguous")
    kernels = importlib.import_module("target_svc.kv_cache_kernels")  # Triton: only once a launch is certain
    kernels.write_kv_kernel[(bsz * t,)](
        k, v, k_cache, v_cache, slots, rows,
        t, k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        slots.stride(0), rows.stride(0), rows.stride(1),
        D=d, BLOCK=min(_KV_WRITE_BLOCK, 1 << (d - 1).bit_length()),
    )
