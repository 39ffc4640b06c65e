"""DrafterRunner: per-sequence cache of context K/V and one batched DFlash block forward per step (no gRPC).

Each running sequence owns a slot of preallocated tensors holding, per drafter layer, the context keys (after
k_norm and RoPE at their own positions) and values; a context row is projected exactly once, when it arrives
(`add_context`). `draft` builds the block [bonus, MASK x (block_size - 1)] at positions context_len .. context_len +
block_size - 1 for every sequence, runs one forward over the whole batch (keys padded to the longest context and
masked), and returns the top-K tokens per position from a float32 log-softmax at temperature 1. Slot i of the block
predicts the token at its own position (no shift), so position j of the result is slot j + 1. Block K/V are
never kept: on CUDA (`slot_attention`) a draft writes them into the rows just past each sequence's context, which
every slot has block_size spare of, and attends over its slot in place; elsewhere the context rows are gathered.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ddtree_serve.kernels import tree_attention
from ddtree_serve.kernels.tree_attention import TreeKeys
from ddtree_serve.plumbing.cuda_graphs import GraphCache, SharedOutput, key_buckets, pick_bucket, power_of_two_buckets
from ddtree_serve.plumbing.host_copy import to_host
from ddtree_serve.prefix_match import reclaim_parked_slot
from drafter_svc.dflash_model import ContextKV, DFlashDraftModel, SlotContext, load_target_embeddings

log = logging.getLogger(__name__)


@dataclass
class DrafterConfig:
    """Where the drafter and its target live, and how much cache to preallocate."""

    drafter_dir: str
    target_model_dir: str
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    max_batch: int = 8
    max_seq_len: int = 2048
    enforce_eager: bool = False  # True: never capture CUDA graphs (used on CUDA otherwise)
    lazy_graphs: bool = False    # True: capture each graph on first use (else all buckets at construction)


# Context rows of one push captured as a graph, at the least (a prompt of up to this many tokens; longer ones run
# eagerly, their projection's host work a smaller share of their prefill).
PROMPT_PUSH_ROWS = 256


class DraftGraphs:
    """Captured drafter steps: the block forward per (batch, context bucket), and the storing of a push's context
    rows per row bucket. Top-k runs after the graph, so the drafts' K is not part of any key."""

    def __init__(self, max_batch: int, max_seq_len: int, depth: int, vocab_size: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.batch_buckets = power_of_two_buckets(max_batch)
        self.key_buckets = key_buckets(max_seq_len)
        # A step pushes each sequence's accepted rows (at most a block): up to max_batch * 16 rows together. A prompt
        # push (its prefill's rows) up to PROMPT_PUSH_ROWS is graphed too: the first draft of every request waits
        # for it, and its eager projection is ~30 launches of host work.
        self.row_buckets = power_of_two_buckets(max(16 * max_batch, min(PROMPT_PUSH_ROWS, max_seq_len)))
        self.cache = GraphCache("drafter block forward")
        # Every block forward writes its [batch, depth, vocab] logits here (one buffer, not one per bucket:
        # ~0.7 GiB over the buckets at a 248k vocabulary), beside its own [batch, depth] float32 normalizers.
        self.logits_out = SharedOutput(self.batch_buckets[-1] * depth * vocab_size, dtype, device)

    def rows_bucket(self, rows: int) -> int | None:
        """Bucket of a push's context rows (a step's accepted rows); None past it (prompt pushes run eagerly)."""
        try:
            return pick_bucket(self.row_buckets, rows)
        except ValueError:
            return None

    def shape_for(self, batch: int, key_len: int) -> tuple[int, int] | None:
        """(batch bucket, context bucket), or None when larger than every bucket."""
        try:
            return pick_bucket(self.batch_buckets, batch), pick_bucket(self.key_buckets, key_len)
        except ValueError:
            return None


@dataclass
class DeferredRows:
    """A sequence's rows from an early push: the target sent them while its verify still ran, so only its device
    knows how many were accepted. rows holds an upper bound R of them at positions start..; header (int64) is
    (n, next token): the first n rows are the context, the next token the next draft's bonus."""

    seq_id: str
    start: int
    rows: torch.Tensor     # [R, F]
    header: torch.Tensor   # int64 [2]


@dataclass
class DeferredDraft:
    """What add_deferred_and_draft made of one sequence: its context length and bonus token (read back from the
    header), its draft (None when the bonus token was not one), or the error that rejected it."""

    seq_id: str
    context_len: int = 0
    bonus_token: int = -1
    logprobs: torch.Tensor | None = None   # [depth, K] on the host
    token_ids: torch.Tensor | None = None
    error: Exception | None = None


@dataclass
class DraftItem:
    """One sequence of a draft batch: its bonus token sits at position context_len."""

    seq_id: str
    bonus_token: int
    context_len: int


class DrafterRunner:
    """Context cache + batched block drafting for a DFlash drafter sharing the target's embedding and head."""

    def __init__(self, cfg: DrafterConfig) -> None:
        if cfg.max_batch < 1 or cfg.max_seq_len < 1:
            raise ValueError("max_batch and max_seq_len must be >= 1")
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.dtype = cfg.dtype
        self.model = DFlashDraftModel.from_pretrained(cfg.drafter_dir, self.device, self.dtype)
        mc = self.model.config
        if mc.mask_token_id is None:
            raise ValueError(f"drafter {cfg.drafter_dir} has no dflash_config.mask_token_id")
        self.embed_weight, self.lm_head_weight = load_target_embeddings(cfg.target_model_dir, self.device, self.dtype)
        if self.embed_weight.shape[1] != mc.hidden_size:
            raise ValueError(
                f"target hidden size {self.embed_weight.shape[1]} != drafter hidden size {mc.hidden_size}"
            )
        if not 0 <= mc.mask_token_id < self.embed_weight.shape[0]:
            raise ValueError(f"mask_token_id {mc.mask_token_id} is outside the target vocabulary")
        self.vocab_size = int(self.lm_head_weight.shape[0])
        # One slot more than max_batch: the scratch slot, where padding rows of a bucketed batch read nothing.
        # block_size rows past max_seq_len: where a draft at the longest context writes its block (slot_attention).
        shape = (cfg.max_batch + 1, mc.num_key_value_heads, cfg.max_seq_len + mc.block_size, mc.head_dim)
        # One K and one V tensor per layer, slot-major so that a batch of consecutive slots is a view.
        self.k_cache = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(mc.num_hidden_layers)]
        self.v_cache = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(mc.num_hidden_layers)]
        self._slot: dict[str, int] = {}
        self._len: dict[str, int] = {}
        self._free = list(range(cfg.max_batch))
        # Prefix caching: released sequences' slots kept with their rows for adopt(), oldest first: seq -> (slot, rows)
        self._parked: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._adopted: set[str] = set()   # adopted sequences whose first push may start at or below the rows held
        self._lock = threading.Lock()
        self.slot_attention = self._choose_slot_attention()
        # Every block row sees the whole block (tree attention's ancestors, for all batch buckets at once).
        self._block_sees_block = torch.ones(cfg.max_batch + 1, mc.block_size, mc.block_size, dtype=torch.bool,
                                            device=self.device)
        if self.device.type == "cuda":   # as the target's glue and GEMMs: compiled and fused on CUDA, plain elsewhere
            self.model.compile_glue()
            self.model.fuse_projections()
        self.graphs: DraftGraphs | None = None
        if not cfg.enforce_eager and self.device.type == "cuda":
            self.graphs = DraftGraphs(cfg.max_batch, cfg.max_seq_len, self.block_size - 1, self.vocab_size,
                                      self.device, self.dtype)
            if not cfg.lazy_graphs:
                self.warmup()

    def _choose_slot_attention(self) -> bool:
        """Whether drafts attend in place over the slot cache (ddtree_serve/kernels/tree_attention.py): where the
        kernel runs and every layer is full and bidirectional, unless DDTREE_TREE_ATTENTION is off."""
        mc = self.model.config
        plain = all(mc.layer_window(i) is None and not mc.layer_is_causal(i) for i in range(mc.num_hidden_layers))
        ok = plain and not tree_attention.switched_off() and tree_attention.available(self.device, mc.head_dim,
                                                                                        self.dtype)
        log.info("drafter attention: %s",
                 "Triton tree attention over the slot cache" if ok else "SDPA over gathered rows")
        return ok

    # ------------------------------------------------------------------------------------------------------------
    # Properties
    # ------------------------------------------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.model.config.block_size

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.model.config.target_layer_ids)

    @property
    def mask_token_id(self) -> int:
        return int(self.model.config.mask_token_id)  # type: ignore[arg-type]

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def feature_dim(self) -> int:
        return self.model.config.feature_dim

    def context_len(self, seq_id: str) -> int:
        """Context rows held for a sequence (0 when unknown)."""
        return self._len.get(seq_id, 0)

    def cache_usage(self) -> tuple[int, int, int, int]:
        """(running sequences, max_batch, used tokens, capacity tokens)."""
        # Without the runner's lock: Info and the metrics read this on the event loop, which must never wait for
        # a draft or a store in progress on the model thread (a wait there holds up every push and Draft behind
        # it). list() snapshots the dicts in one C call under the GIL; a count a step stale is fine here.
        lens = list(self._len.values())
        return len(self._slot), self.cfg.max_batch, sum(lens), self.cfg.max_batch * self.cfg.max_seq_len

    # ------------------------------------------------------------------------------------------------------------
    # Context
    # ------------------------------------------------------------------------------------------------------------

    def synchronize(self, *devices: torch.device) -> None:
        """Waits until the work queued on this runner's device (and on `devices`) is done (no-op on CPU)."""
        for device in {torch.device(self.device), *map(torch.device, devices)}:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    def add_context(self, seq_id: str, start: int, features: torch.Tensor) -> None:
        """Appends feature rows [n, F] for positions start .. start + n - 1; start must equal the rows held."""
        error = self.add_contexts([(seq_id, start, features)])[seq_id]
        if error is not None:
            raise error

    @torch.inference_mode()
    def add_contexts(self, entries: list[tuple[str, int, torch.Tensor]]) -> dict[str, Exception | None]:
        """add_context for several sequences in one projection; a bad entry fails alone (its error is returned)."""
        errors: dict[str, Exception | None] = {}
        accepted: list[tuple[int, int, torch.Tensor]] = []  # (slot, start, rows)
        with self._lock:
            for seq_id, start, features in entries:
                try:
                    slot = self._claim(seq_id, start, features)
                except (ValueError, RuntimeError) as exc:
                    errors[seq_id] = exc
                    continue
                errors[seq_id] = None
                if slot is not None:
                    accepted.append((slot, start, features))
            if accepted:
                self._project_into_cache(accepted)
        return errors

    def _claim(self, seq_id: str, start: int, features: torch.Tensor) -> int | None:
        """Checks an entry and reserves its rows (and a slot for a new sequence); None when it has no rows."""
        if features.dim() != 2 or features.shape[1] != self.feature_dim:
            raise ValueError(f"features must be [n, {self.feature_dim}], got {tuple(features.shape)}")
        n = int(features.shape[0])
        held = self._rows_before(seq_id, start)
        if n == 0:
            return None
        if (held or 0) + n > self.cfg.max_seq_len:
            raise RuntimeError(
                f"capacity exceeded: sequence {seq_id!r} would hold {(held or 0) + n} context rows "
                f"(max_seq_len {self.cfg.max_seq_len})"
            )
        if held is None:
            self._slot[seq_id] = self._take_slot()
        self._adopted.discard(seq_id)
        self._len[seq_id] = start + n
        return self._slot[seq_id]

    def _rows_before(self, seq_id: str, start: int) -> int | None:
        """The rows a push at `start` follows (None: a new sequence); ValueError unless start is the rows held, or
        at most them on an adopted sequence's first push (which then drops the adopted rows from start on)."""
        held = self._len.get(seq_id)
        if seq_id in self._adopted and 0 <= start <= held:
            self._len[seq_id] = held = start
        if start != (held or 0):
            raise ValueError(f"sequence {seq_id!r}: context rows start at {start}, expected {held or 0}")
        return held

    def _take_slot(self, spare: str = "") -> int:
        """A free slot (lowest first: a running batch's slots stay together), else the oldest parked one's but
        spare's."""
        reclaim_parked_slot(self._free, self._parked, spare)
        if not self._free:
            raise RuntimeError(f"capacity exceeded: all {self.cfg.max_batch} drafter slots are in use")
        self._free.sort()
        return self._free.pop(0)

    def _project_into_cache(self, accepted: list[tuple[int, int, torch.Tensor]]) -> None:
        """One K/V projection over all accepted rows, scattered to their (slot, position) cache rows."""
        dev = self.device
        n = sum(int(f.shape[0]) for _, _, f in accepted)
        rows = self.graphs.rows_bucket(n) if self.graphs is not None else None
        width = rows or n
        # Positions and slots as one host tensor built from lists (this runs on every step's critical path, where
        # torch's per-op cost on tiny tensors added up); padding rows go to position 0 of the scratch slot, which
        # nothing reads.
        pos: list[int] = []
        slots: list[int] = []
        for slot, start, f in accepted:
            pos.extend(range(start, start + int(f.shape[0])))
            slots.extend([slot] * int(f.shape[0]))
        pos.extend([0] * (width - n))
        slots.extend([self.cfg.max_batch] * (width - n))
        index = torch.tensor([pos, slots], dtype=torch.long)
        if rows is None:
            x = torch.cat([f.to(device=dev, dtype=self.dtype) for _, _, f in accepted])
            index = index.to(dev)
            self._store_rows(x, index[0], index[1])
            return
        # Graphed: each sequence's rows go straight into the graph's input rows (no concatenated copy); the padding
        # rows keep whatever they hold, since they land in the scratch slot.
        store = self._store_graph(rows)
        x_in = store.static_inputs[0]
        offset = 0
        for _, _, f in accepted:
            x_in[offset:offset + f.shape[0]].copy_(f, non_blocking=True)
            offset += int(f.shape[0])
        store(x_in, index[0], index[1])

    @torch.inference_mode()
    def add_deferred_and_draft(self, entries: list[DeferredRows], top_k: int, ready=None
                               ) -> tuple[list[DeferredDraft], float]:
        """Stores an early push's rows and drafts each of its sequences, with no host wait in between: the rows past
        each header's n go to the scratch slot, and the drafts start at context start + n from the header's bonus
        token, all on the device. `ready` (a CUDA event) is waited for on the device before the rows are read.
        Returns the sequences' results (in entries' order) and the draft's own seconds (CUDA: between device events
        after `ready`, so not the wait for the target's verify)."""
        if not entries:
            return [], 0.0
        dev = self.device
        out = [DeferredDraft(e.seq_id) for e in entries]
        with self._lock:
            held: list[tuple[int, DeferredRows, int, int]] = []   # (index, entry, slot, rows kept)
            for i, e in enumerate(entries):
                try:
                    width = self._claim_deferred(e)
                except (ValueError, RuntimeError) as exc:
                    out[i].error = exc
                    continue
                held.append((i, e, self._slot[e.seq_id], width))
            if not held:
                return out, 0.0
            depth, k = self.block_size - 1, min(top_k, self.vocab_size)
            lmax = max(e.start + w for _, e, _, w in held)
            shape = self.graphs.shape_for(len(held), lmax) if self.graphs is not None else None
            # Every host -> device copy before the wait: a copy from pageable memory may wait for the stream, and
            # the stream is about to wait for the target's verify.
            store_index, bucket = self._deferred_store_index(held)
            starts, slots, widths = torch.tensor([[e.start, slot, w] for _, e, slot, w in held],
                                                 dtype=torch.long).T.to(dev, non_blocking=True)
            pad = self._pack([], shape[0])[len(held):].to(dev, non_blocking=True) if shape is not None else None
            timer = _DeviceTimer(dev)
            if ready is not None:
                torch.cuda.current_stream(dev).wait_event(ready)
            timer.start()
            headers = torch.stack([e.header.to(dev, torch.long) for _, e, _, _ in held])   # [B, 2]
            self._store_deferred(held, headers, store_index, bucket)
            # The drafts: (bonus, context length, slot) per sequence, from the headers on the device.
            bonus = headers[:, 1].clamp(0, self.embed_weight.shape[0] - 1)   # checked on the host below
            # A header past its rows (refused on the host below) must not send the draft past the slot's rows.
            packed = torch.stack([bonus, starts + torch.minimum(headers[:, 0].clamp(min=0), widths), slots], dim=1)
            if shape is None:
                logits, lse = self._draft_logits(packed, lmax, depth)
            else:
                logits, lse = self._block_graph(*shape)(torch.cat([packed, pad]))
            values, ids = top_logprobs(logits, lse, len(held), depth, k)
            timer.stop()
            values, ids, headers = to_host(values, ids, headers)
            for b, (i, e, _, width) in enumerate(held):
                n, token = int(headers[b, 0]), int(headers[b, 1])
                if not 0 <= n <= width:
                    # Rows were stored for positions the sequence does not hold: it cannot draft any more.
                    self._len[e.seq_id] = e.start
                    out[i].error = ValueError(f"sequence {e.seq_id!r}: an early push says {n} rows of at most "
                                              f"{width}")
                    continue
                self._len[e.seq_id] = e.start + n
                out[i].context_len, out[i].bonus_token = e.start + n, token
                if 0 <= token < self.embed_weight.shape[0]:
                    out[i].logprobs, out[i].token_ids = values[b].float(), ids[b].to(torch.int32)
            return out, timer.seconds()

    def _deferred_store_index(self, held: list[tuple[int, DeferredRows, int, int]]
                              ) -> tuple[torch.Tensor, int | None]:
        """On the device: (position, slot, sequence, row within it) of every row of an early push, a graph
        bucket's padding rows last (row index past every n: never kept); and that bucket (None: eager)."""
        n_rows = sum(w for *_, w in held)
        bucket = self.graphs.rows_bucket(n_rows) if self.graphs is not None else None
        index = [[e.start + r, slot, b, r] for b, (_, e, slot, w) in enumerate(held) for r in range(w)]
        index += [[0, self.cfg.max_batch, 0, n_rows]] * ((bucket or n_rows) - n_rows)
        return torch.tensor(index, dtype=torch.long).T.to(self.device, non_blocking=True), bucket

    def _store_deferred(self, held: list[tuple[int, DeferredRows, int, int]], headers: torch.Tensor,
                        index: torch.Tensor, bucket: int | None) -> None:
        """The context K/V of each held sequence's first n rows (n from its header, on the device); its other rows,
        and a graph bucket's padding, go to the scratch slot, which nothing reads."""
        pos, slot, seq, row = index
        slots = torch.where(row < headers[seq, 0], slot, torch.full_like(slot, self.cfg.max_batch))
        if bucket is None:
            self._store_rows(torch.cat([e.rows[:w].to(device=self.device, dtype=self.dtype) for _, e, _, w in held]),
                             pos, slots)
            return
        store = self._store_graph(bucket)
        x_in = store.static_inputs[0]
        offset = 0
        for _, e, _, w in held:
            x_in[offset:offset + w].copy_(e.rows[:w], non_blocking=True)
            offset += w
        store(x_in, pos, slots)

    def _claim_deferred(self, e: DeferredRows) -> int:
        """Checks an early push's entry and reserves its slot; returns how many of its rows can be kept (its upper
        bound, cut to the context limit)."""
        if e.rows.dim() != 2 or e.rows.shape[1] != self.feature_dim:
            raise ValueError(f"features must be [n, {self.feature_dim}], got {tuple(e.rows.shape)}")
        if tuple(e.header.shape) != (2,):
            raise ValueError(f"an early push's header must hold 2 values, not {tuple(e.header.shape)}")
        held = self._rows_before(e.seq_id, e.start)
        width = min(int(e.rows.shape[0]), self.cfg.max_seq_len - e.start)
        if width <= 0:
            raise RuntimeError(f"capacity exceeded: sequence {e.seq_id!r} holds {e.start} context rows "
                               f"(max_seq_len {self.cfg.max_seq_len})")
        if held is None:
            self._slot[e.seq_id] = self._take_slot()
            self._len[e.seq_id] = 0
        self._adopted.discard(e.seq_id)
        return width

    def _store_rows(self, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor) -> None:
        """Context K/V of feature rows x [N, F] at positions pos [N] into cache slots [N] (no host sync)."""
        ctx = self.model.project_context(x.unsqueeze(0), pos.unsqueeze(0))
        for i in range(len(self.k_cache)):
            # [1, n_kv, N, D] -> [N, n_kv, D], the layout of cache[slots, :, positions]
            self.k_cache[i][slots, :, pos] = ctx.keys[i][0].transpose(0, 1)
            self.v_cache[i][slots, :, pos] = ctx.values[i][0].transpose(0, 1)

    def release(self, seq_id: str, park: bool = False) -> bool:
        """Frees a sequence's slot, or parks it (park: its rows kept for adopt()); False when it was not held
        (releases are idempotent)."""
        with self._lock:
            slot = self._slot.pop(seq_id, None)
            rows = self._len.pop(seq_id, 0)
            self._adopted.discard(seq_id)
            if slot is None:
                return False
            if park and rows:
                self._parked[seq_id] = (slot, rows)
            else:
                self._free.append(slot)
            return True

    def parked_rows(self, seq_id: str) -> int:
        """The context rows a parked sequence holds (0: not parked)."""
        with self._lock:
            parked = self._parked.get(seq_id)
            return parked[1] if parked is not None else 0

    def parked_ids(self) -> list[str]:
        """The parked sequences, oldest first (a snapshot)."""
        return list(self._parked)

    def adopt(self, seq_id: str, source_id: str, rows: int, copy: bool = False) -> int:
        """Gives the new sequence seq_id up to `rows` of another's context rows -> the rows it holds (0, and nothing
        taken, when there is no such source or seq_id exists): the parked source's slot itself, or (copy) a slot of
        its own with the rows copied from the source, running or parked (a parked source's slot is adopted all the
        same when no other slot is free)."""
        with self._lock:
            parked = self._parked.get(source_id)
            source = parked if parked is not None else (
                (self._slot[source_id], self._len.get(source_id, 0)) if copy and source_id in self._slot else None)
            if seq_id in self._slot or source is None or rows <= 0 or source[1] <= 0:
                return 0
            n = min(rows, source[1])
            if copy and (parked is None or self._free):
                try:
                    slot = self._take_slot(spare=source_id)
                except RuntimeError:   # every slot runs a sequence: this one starts without rows (and a slot)
                    return 0
                for cache in (*self.k_cache, *self.v_cache):
                    cache[slot, :, :n] = cache[source[0], :, :n]
            else:
                slot = self._parked.pop(source_id)[0]
            self._slot[seq_id] = slot
            self._len[seq_id] = n
            self._adopted.add(seq_id)
            return n

    # ------------------------------------------------------------------------------------------------------------
    # Draft
    # ------------------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def draft(self, items: list[DraftItem], top_k: int, max_depth: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One block forward for all items -> (top-K log-probs [B, L, K] descending, token ids [B, L, K])."""
        bs = self.block_size
        if not items:
            raise ValueError("draft needs at least one sequence")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        if not 0 <= max_depth <= bs - 1:
            raise ValueError(f"max_depth must be in [0, {bs - 1}] (0 = all), got {max_depth}")
        depth = max_depth or bs - 1
        k = min(top_k, self.vocab_size)
        with self._lock:
            seen: set[str] = set()
            for it in items:
                if it.seq_id in seen:
                    raise ValueError(f"sequence {it.seq_id!r} appears twice in one draft batch")
                seen.add(it.seq_id)
                if it.seq_id not in self._slot:
                    raise KeyError(f"unknown sequence {it.seq_id!r}")
                if it.context_len != self._len[it.seq_id]:
                    raise ValueError(
                        f"sequence {it.seq_id!r}: draft at context_len {it.context_len}, "
                        f"but {self._len[it.seq_id]} context rows are held"
                    )
                if not 0 <= it.bonus_token < self.embed_weight.shape[0]:
                    raise ValueError(f"bonus token {it.bonus_token} is outside the vocabulary")
            rows = [(it.bonus_token, it.context_len, self._slot[it.seq_id]) for it in items]
            lmax = max(it.context_len for it in items)
            shape = self.graphs.shape_for(len(items), lmax) if self.graphs is not None else None
            if shape is None:
                packed = self._pack(rows, len(items)).to(self.device, non_blocking=True)
                logits, lse = self._draft_logits(packed, lmax, depth)
            else:
                # One graph per (batch, context bucket): every depth is computed and the wanted ones sliced, so the
                # shrinking depths at the end of a request need no new captures.
                batch, keys = shape
                packed = self._pack(rows, batch).to(self.device, non_blocking=True)
                logits, lse = self._block_graph(batch, keys)(packed)
            n = len(items)
            # Top-k outside the graph (one kernel): K varies with the budget, and the result is a fresh tensor that
            # the next replay does not overwrite.
            return top_logprobs(logits, lse, n, depth, k)

    def _block_graph(self, batch: int, keys: int):
        """The captured block forward of a (batch, context) bucket (captured on first use)."""
        depth = self.block_size - 1
        fresh = (batch, keys) not in self.graphs.cache.graphs
        out = self.graphs.logits_out.view(batch, depth, self.vocab_size) if fresh else None
        return self.graphs.cache.get((batch, keys), lambda p: self._draft_logits(p, keys, depth, out=out),
                                     lambda: [self._pack([], batch).to(self.device)])

    def _store_graph(self, rows: int):
        """The captured context store of a row bucket (captured on first use)."""
        dev = self.device
        return self.graphs.cache.get(("context", rows), self._store_rows, lambda: [
            torch.zeros(rows, self.feature_dim, device=dev, dtype=self.dtype),
            torch.zeros(rows, dtype=torch.long, device=dev),
            torch.full((rows,), self.cfg.max_batch, dtype=torch.long, device=dev)])

    @torch.inference_mode()
    def warmup(self) -> float:
        """Captures every (batch, context) bucket's block forward and every row bucket's context store now, so that
        no capture stalls a live step; returns the seconds spent (0 without graphs)."""
        if self.graphs is None:
            return 0.0
        with self._lock:
            for batch in self.graphs.batch_buckets:
                for keys in self.graphs.key_buckets:
                    self._block_graph(batch, keys)
            for rows in self.graphs.row_buckets:
                self._store_graph(rows)
        return self.graphs.cache.capture_seconds

    def _pack(self, rows: list[tuple[int, int, int]], batch: int) -> torch.Tensor:
        """[batch, 3] (bonus token, context length, slot); padding rows draft from the empty scratch slot."""
        packed = torch.zeros(batch, 3, dtype=torch.long)
        packed[:, 0] = self.mask_token_id
        packed[:, 2] = self.cfg.max_batch  # the scratch slot
        if rows:
            packed[: len(rows)] = torch.tensor(rows, dtype=torch.long)
        return packed

    def _draft_logits(self, packed: torch.Tensor, key_len: int, depth: int, out: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The device part of a draft: block forward over the packed rows -> (logits [B, depth, V] of the positions
        the trees can use, written into out when given; their float32 log-normalizers [B, depth]), no host sync."""
        bs = self.block_size
        dev = self.device
        bonus, ctx_len, slots = packed[:, 0], packed[:, 1], packed[:, 2]
        b = packed.shape[0]
        ids = torch.full((b, bs), self.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = bonus
        noise = self.model.embed(ids, self.embed_weight)
        positions = ctx_len[:, None] + torch.arange(bs, device=dev)
        if self.slot_attention:
            mc = self.model.config
            counts = tree_attention.merge_counts(b, mc.num_key_value_heads, mc.num_attention_heads
                                                 // mc.num_key_value_heads * bs, dev)
            past = SlotContext(self.k_cache, self.v_cache, slots, positions,
                               TreeKeys(ctx_len, self._block_sees_block[:b], counts), key_len + bs)
            h = self.model(noise, None, positions, past=past)
        else:
            h = self._gathered_forward(noise, positions, ctx_len, slots, key_len)
        # Only the positions the trees can use go through the head and the normalizer.
        logits = self.model.compute_logits(h[:, 1 : 1 + depth], self.lm_head_weight)
        lse = self.model.log_normalizer(logits)
        return (logits if out is None else out.copy_(logits)), lse

    def _gathered_forward(self, noise: torch.Tensor, positions: torch.Tensor, ctx_len: torch.Tensor,
                          slots: torch.Tensor, key_len: int) -> torch.Tensor:
        """The block forward over each sequence's context rows [0, key_len) gathered out of the cache, masked."""
        bs, dev = self.block_size, self.device
        b = noise.shape[0]
        keys = [kc[slots, :, :key_len] for kc in self.k_cache]
        values = [vc[slots, :, :key_len] for vc in self.v_cache]
        key_pos = torch.arange(key_len, device=dev).expand(b, key_len)
        valid = key_pos < ctx_len[:, None]  # padding rows of shorter contexts
        mask = torch.cat([valid, torch.ones(b, bs, dtype=torch.bool, device=dev)], dim=1)
        mask = mask[:, None, None, :].expand(b, 1, bs, key_len + bs)
        return self.model(noise, None, positions, attention_mask=mask, past=ContextKV(keys, values, key_pos))


def top_logprobs(logits: torch.Tensor, lse: torch.Tensor, n: int, depth: int, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k float32 log-probs [n, depth, k] (descending) and their token ids of the first n rows' first depth
    positions: the top-k of the logits (the same order: log-softmax is monotone) less each row's normalizer."""
    values, ids = torch.topk(logits[:n, :depth], k, dim=-1, sorted=True)
    return values.float() - lse[:n, :depth, None], ids


class _DeviceTimer:
    """Seconds between start() and stop() of the work queued on a device's stream (CUDA events), or of the host's
    wall clock elsewhere; read after the work is done."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._t0 = self._t1 = 0.0
        if self.cuda:
            self._stream = torch.cuda.current_stream(device)
            self._start, self._stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self._start.record(self._stream)
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self._stop.record(self._stream)
        self._t1 = time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            self._stop.synchronize()
            return self._start.elapsed_time(self._stop) / 1e3
        return self._t1 - self._t0
