"""Tree verification on the device: one forward over a padded batch of trees, the acceptance walk, the commit.

A verify step is two device functions over one packed integer tensor (`VerifyBatch.packed`: ids, parents, tree
sizes, context lengths and slots of every row), so that a step needs one host->device copy and one
device->host copy:

- `verify_forward`: the target forward over the trees -> logits (model dtype), the greedy choice per node, features;
- `verify_walk`: the acceptance walk against the target's choices -> the packed result (accepted count, bonus
  token, path) and the accepted nodes' feature rows;
- `commit_path`: the commit of the accepted paths (K/V compaction, linear-attention states). The results are
  copied out (and the features pushed) before it: nothing they hold depends on it, and on the hybrid 27B layout
  it is ~350 small kernels (~1 ms) that the step's critical path no longer waits for.

Sampled sequences replace their rows of the greedy choices between the forward and the walk. On CUDA the three
functions are captured as CUDA graphs per shape bucket (`VerifyGraphs`; Gated DeltaNet layers through the sync-free
tree pass of target_svc/gdn_tree_wy.py); the eager path runs the very same functions, so the two agree by
construction (tests/test_gpu.py checks it on the device).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ddtree_serve.decoding.acceptance import AcceptBatch, accept_batch
from ddtree_serve.plumbing.compiled import compile_all
from ddtree_serve.plumbing.cuda_graphs import (GraphCache, SharedOutput, key_buckets, pick_bucket, power_of_two_buckets,
                                               tree_node_buckets)
from target_svc.model import TargetModel


@dataclass(frozen=True)
class VerifyShape:
    """Padded batch shape of one step: rows, nodes per row, cache rows attended (key length)."""

    batch: int
    nodes: int
    key_len: int


@dataclass
class VerifyBatch:
    """Padded trees on the host, packed as [B, 2T + 3]: ids | parents | size | ctx_len | slot."""

    packed: Tensor
    shape: VerifyShape
    num_real: int  # rows past this are padding (size-1 trees in the scratch slot)

    @classmethod
    def pack(cls, trees: Sequence[tuple[Tensor | Sequence[int], Tensor | Sequence[int]]], ctx_lens: list[int],
             slots: list[int], shape: VerifyShape, scratch_slot: int) -> "VerifyBatch":
        """trees[b] = (tokens[T_b], parents[T_b]), host tensors or lists; rows and nodes padded up to `shape`."""
        b, t = shape.batch, shape.nodes
        # In numpy: the per-step host work before the forward, where torch's per-op overhead on rows of a few dozen
        # integers cost ~3x as much (bench.tree_build measures the gateway's side of the same trade).
        packed = np.zeros((b, 2 * t + 3), dtype=np.int64)
        packed[:, t : 2 * t] = -1
        packed[:, 2 * t] = 1  # padding rows are one-node trees (a walk needs a root)
        packed[:, 2 * t + 2] = scratch_slot
        for row, (tokens, parents) in enumerate(trees):
            n = len(tokens)
            packed[row, :n] = tokens
            packed[row, t : t + n] = parents
            packed[row, 2 * t : 2 * t + 3] = (n, ctx_lens[row], slots[row])
        # Pageable on purpose: pinning per step costs more than the copy of a few hundred integers.
        return cls(torch.from_numpy(packed), shape, len(trees))


# A commit's state update and K/V compaction walk the accepted paths' columns: a bucket of many nodes also gets a
# commit this narrow, which takes every batch whose trees are at most this deep (a DFlash block: 16 drafts and their
# root), so that a wide tree's commit costs what a chain's does (the H100's 65-node verify spent 1.5x a 17-node
# chain's time on the GDN commit's state GEMM over all 65 columns).
SHALLOW_COMMIT_WIDTH = 17


def commit_widths(nodes: int) -> tuple[int, ...]:
    """The path widths a bucket of `nodes` nodes captures its commit at, narrowest first (the last is nodes)."""
    return (SHALLOW_COMMIT_WIDTH, nodes) if nodes > SHALLOW_COMMIT_WIDTH else (nodes,)


def unpack(packed: Tensor, nodes: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(ids, parents, sizes, ctx_lens, slots) views of a packed batch."""
    t = nodes
    return packed[:, :t], packed[:, t : 2 * t], packed[:, 2 * t], packed[:, 2 * t + 1], packed[:, 2 * t + 2]


def verify_forward(model: TargetModel, packed: Tensor, nodes: int, key_len: int, feature_layers: tuple[int, ...],
                   out: tuple[Tensor, Tensor | None] | None = None) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """Forward over the packed trees -> (logits [B, T, V] in the model dtype, greedy choices [B, T], features
    [B, T, F] | None, the trees' ancestor mask [B, T, T] for the walk); out = (logits, features) buffers to write
    them into."""
    ids, parents, sizes, ctx_lens, slots = unpack(packed, nodes)
    valid = torch.arange(nodes, device=packed.device)[None, :] < sizes[:, None]
    structure = model.tree_structure(parents, sizes)
    logits_out, features_out = out or (None, None)
    logits, features = model.forward_block(ids, parents, valid, ctx_lens, slots, key_len=key_len,
                                           feature_layers=feature_layers, logits_out=logits_out,
                                           features_out=features_out, structure=structure)
    return logits, logits.argmax(dim=-1), features, structure.anc


def verify_walk(packed: Tensor, nodes: int, choices: Tensor, features: Tensor | None, path_width: int,
                rows_out: Tensor | None = None, anc: Tensor | None = None,
                accept: Callable[..., AcceptBatch] = accept_batch) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """The acceptance walk of the pending block -> (packed result [B, 2 + W]: accepted count | bonus | path, the
    accepted nodes' feature rows [B, W, F] (into rows_out when given), path [B, W], accepted count [B]): all that a
    step returns, before anything is committed. anc: the ancestor mask verify_forward returned (else rebuilt);
    accept: accept_batch, or it compiled."""
    # path_width >= the deepest tree's depth + 1: accepted paths are at most that long, and the linear-attention
    # replay walks that many columns.
    ids, parents, sizes, _, _ = unpack(packed, nodes)
    walk = accept(ids, parents, choices, sizes, anc)
    path, n_acc = walk.accepted_nodes[:, :path_width], walk.num_accepted
    rows = None
    if features is not None:
        index = path.clamp(min=0)[:, :, None].expand(-1, -1, features.shape[-1])
        rows = features.gather(1, index) if rows_out is None else torch.gather(features, 1, index, out=rows_out)
    return torch.cat([n_acc[:, None], walk.next_tokens[:, None], path], dim=1), rows, path, n_acc


def commit_path(model: TargetModel, packed: Tensor, nodes: int, path: Tensor, n_acc: Tensor,
                traces: list | None = None) -> None:
    """The commit of the walked paths: K/V compaction and linear-attention states (nothing a step returns reads
    it, so it may run after the results have been copied out)."""
    _, _, _, ctx_lens, slots = unpack(packed, nodes)
    model.commit_block(path, n_acc, slots, ctx_lens, traces)


def verify_commit(model: TargetModel, packed: Tensor, nodes: int, choices: Tensor, features: Tensor | None,
                  path_width: int, traces: list | None = None,
                  rows_out: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Walk + commit of the pending block -> (packed [B, 2 + W]: accepted count | bonus | path, rows [B, W, F]);
    rows_out = a [B, W, F] buffer to write the rows into."""
    result, rows, path, n_acc = verify_walk(packed, nodes, choices, features, path_width, rows_out)
    commit_path(model, packed, nodes, path, n_acc, traces)
    return result, rows


class VerifyGraphs:
    """verify_forward / verify_commit captured per (batch, nodes, key length) bucket, writing shared buffers.

    A bucket's graph keeps what is alive when its capture ends: with ~100 buckets, per-bucket logits and
    Gated DeltaNet traces would take more memory than a 27B int8 target's cache (measured: the flagship's
    warm-up ran past a 45 GiB cap). So every forward writes its logits and features into two buffers of the
    largest shape, every commit its accepted rows into a third (per-bucket rows would be ~0.3 GiB at the 27B's
    80 buckets), and a bucket's traces are let go once its commit is captured: the commit graph has their
    addresses baked in, and later captures may reuse that memory as scratch, which is safe because a step
    replays its forward and then its commit with no other replay in between.
    """

    def __init__(self, model: TargetModel, max_batch: int, max_nodes: int, capacity: int,
                 extra_nodes: tuple[int, ...] = ()) -> None:
        self.model = model
        self.batch_buckets = power_of_two_buckets(max_batch)
        self.node_buckets = tree_node_buckets(max_nodes, extra_nodes)
        self.key_buckets = key_buckets(capacity)
        self.forwards = GraphCache("target verify forward")
        self.walks = GraphCache("target verify walk")
        self.commits = GraphCache("target verify commit")
        # The walk's ~35 small kernels (matches, twins, the ancestor test, the path's scatter) in a few: it is on the
        # step's path, between the forward and the result's copy to the host.
        (self.accept,) = compile_all((accept_batch,), compiled=model.device.type == "cuda")
        self._feature_layers: tuple[int, ...] | None = None
        self._traces: dict[VerifyShape, list] = {}   # from a bucket's forward capture until its commit capture
        self.eager_shapes: set[VerifyShape] = set()   # buckets whose capture ran out of memory: they run eagerly
        self._rows = self.batch_buckets[-1] * self.node_buckets[-1]
        self._logits_out = SharedOutput(self._rows * model.target.vocab_size, model.dtype, model.device)
        self._features_out: SharedOutput | None = None   # sized when the feature layers are known
        self._rows_out: SharedOutput | None = None       # the walks' accepted feature rows, likewise

    @staticmethod
    def supports(model: TargetModel) -> bool:
        """Graphs need CUDA, and Gated DeltaNet layers (if any) on the sync-free tree path."""
        return model.device.type == "cuda" and (not model.linear_index or model.tree_gdn == "wy")

    def shape_for(self, batch: int, nodes: int, key_len: int) -> VerifyShape | None:
        """The bucket covering a step, or None when it is larger than every bucket or its capture failed (the step
        then runs eagerly)."""
        try:
            shape = VerifyShape(pick_bucket(self.batch_buckets, batch), pick_bucket(self.node_buckets, nodes),
                                pick_bucket(self.key_buckets, key_len))
        except ValueError:
            return None
        return None if shape in self.eager_shapes else shape

    def give_up(self, s: VerifyShape) -> None:
        """Bucket s runs eagerly from now on (its capture failed): what its capture left is let go."""
        self.eager_shapes.add(s)
        self.forwards.graphs.pop(s, None)
        for cache in (self.commits, self.walks):
            for key in [k for k in cache.graphs if k[0] == s]:
                del cache.graphs[key]
        self._traces.pop(s, None)
        self.model.pending_traces = None
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def _reset_if_layers_changed(self, feature_layers: tuple[int, ...]) -> None:
        # Feature layers are baked into a captured forward; a new drafter with other layers needs new graphs.
        if feature_layers != self._feature_layers:
            self.forwards.graphs.clear()
            self.walks.graphs.clear()
            self.commits.graphs.clear()
            self._traces.clear()
            self._features_out = self._rows_out = None
            self._feature_layers = feature_layers

    def _outputs(self, s: VerifyShape, feature_layers: tuple[int, ...]) -> tuple[Tensor, Tensor | None]:
        """Views at s's shape of the buffers every forward graph writes (allocated at the largest shape)."""
        m = self.model
        logits = self._logits_out.view(s.batch, s.nodes, m.target.vocab_size)
        if not feature_layers:
            return logits, None
        width = len(feature_layers) * m.target.hidden_size
        if self._features_out is None:
            self._features_out = SharedOutput(self._rows * width, m.dtype, m.device)
        return logits, self._features_out.view(s.batch, s.nodes, width)

    def forward(self, batch: VerifyBatch, packed_dev: Tensor, feature_layers: tuple[int, ...]):
        """Replays (capturing on first use) the forward of batch's bucket."""
        self._reset_if_layers_changed(feature_layers)
        s = batch.shape
        fresh = s not in self.forwards.graphs
        buffers = self._outputs(s, feature_layers) if fresh else None

        def run(p: Tensor):
            # The capture's warm-up runs and the capture each make traces: drop the last run's before the next
            # makes its own (at the 27B's batch-8 65-node bucket one set is ~1.6 GiB).
            self.model.pending_traces = None
            return verify_forward(self.model, p, s.nodes, s.key_len, feature_layers, buffers)

        fn = self.forwards.get(s, run, lambda: [self._example(s)])
        if fresh:   # the GDN traces every replay of this forward fills are those its capture left pending
            self._traces[s] = self.model.pending_traces
        out = fn(packed_dev)
        self.model.pending_traces = None  # the commit graph reads self._traces[s]
        return out

    def walk(self, batch: VerifyBatch, packed_dev: Tensor, choices: Tensor, features: Tensor | None, anc: Tensor
             ) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """Replays (capturing on first use) the acceptance walk of batch's bucket -> verify_walk's outputs (anc: the
        forward's ancestor mask, an input like the choices: one small copy, not the ~30 kernels that rebuild it)."""
        s = batch.shape
        has_features = features is not None
        shared, rows_out = None, None
        if has_features:
            # The forward graph wrote these features into the shared buffer: the walk graph reads them there
            # rather than from a static copy of its own (one per bucket, ~0.3 GiB over the 27B's buckets).
            _, shared = self._outputs(s, self._feature_layers)
            if features.data_ptr() != shared.data_ptr():
                shared.copy_(features)
            if self._rows_out is None:
                self._rows_out = SharedOutput(self._rows * shared.shape[-1], shared.dtype, shared.device)
            rows_out = self._rows_out.view(s.batch, s.nodes, shared.shape[-1])
        fn = self.walks.get(
            (s, has_features),
            lambda p, c, a: verify_walk(p, s.nodes, c, shared, s.nodes, rows_out, a, self.accept),
            lambda: [self._example(s), torch.zeros(s.batch, s.nodes, dtype=torch.long, device=self.model.device),
                     self._example_anc(s)],
        )
        return fn(packed_dev, choices, anc)

    def commit(self, batch: VerifyBatch, packed_dev: Tensor, path: Tensor, n_acc: Tensor,
               path_len_bound: int | None = None) -> None:
        """Replays (capturing on first use) the commit of batch's bucket along the walked paths. path_len_bound: no
        accepted path is longer (the deepest tree's depth + 1; None: the bucket's nodes), which picks the commit's
        path width (commit_widths)."""
        s = batch.shape
        if s.nodes == 1 and not self.model.linear_index:
            self._traces.pop(s, None)
            return   # a dense one-node block commits nothing: its row sits where it was written (no empty graph)
        widths = commit_widths(s.nodes)
        # Every width of the bucket is captured at once: they all read the bucket's traces, let go of after.
        fns = {w: self.commits.get(
            (s, w),
            lambda p, path_w, n: commit_path(self.model, p, s.nodes, path_w, n, self._traces[s]),
            lambda w=w: [self._example(s), torch.zeros(s.batch, w, dtype=torch.long, device=self.model.device),
                         torch.ones(s.batch, dtype=torch.long, device=self.model.device)],
        ) for w in widths}
        self._traces.pop(s, None)   # captured: the graphs hold the traces' addresses (see the class docstring)
        width = next(w for w in widths if w >= min(path_len_bound or s.nodes, s.nodes))
        fns[width](packed_dev, path[:, :width], n_acc)

    def shapes(self) -> list[VerifyShape]:
        """Every (batch, nodes, key length) bucket, largest first.

        Largest first because all graphs share one pool: the first capture sizes it for the biggest step and the
        smaller ones then fit in the blocks it freed. Smallest first grew the pool capture by capture into pieces
        no later capture could reuse (the flagship's warm-up, capped at a 48 GB card, ran out of memory at its
        first batch-8 65-node bucket with 2.67 GiB in the pool)."""
        shapes = [VerifyShape(b, t, k)
                  for b, t, k in itertools.product(self.batch_buckets, self.node_buckets, self.key_buckets)]
        return sorted(shapes, key=lambda s: (s.batch * s.nodes, s.key_len), reverse=True)

    def warmup(self, feature_layers: tuple[int, ...], shapes: list[VerifyShape] | None = None) -> float:
        """Captures the forward and commit of the given buckets (default: all) not captured yet, on one-node trees
        in the scratch slot; returns the seconds spent capturing so far."""
        self._reset_if_layers_changed(feature_layers)
        for s in self.shapes() if shapes is None else shapes:
            if s in self.forwards.graphs or s in self.eager_shapes:
                continue
            packed_dev = self._example(s)
            batch = VerifyBatch(packed_dev, s, 0)
            try:
                _, choices, features, anc = self.forward(batch, packed_dev, feature_layers)
                _, _, path, n_acc = self.walk(batch, packed_dev, choices, features, anc)
                self.commit(batch, packed_dev, path, n_acc)
            except torch.OutOfMemoryError:
                self.give_up(s)   # its steps run eagerly; the caller hears why
                raise
        return self.capture_seconds

    @property
    def capture_seconds(self) -> float:
        """Seconds spent capturing the forward, walk and commit graphs so far."""
        return self.forwards.capture_seconds + self.walks.capture_seconds + self.commits.capture_seconds

    def _example_anc(self, s: VerifyShape) -> Tensor:
        """The ancestor mask of _example's one-node trees at s's shape (each node sees itself)."""
        return torch.eye(s.nodes, dtype=torch.bool, device=self.model.device).expand(s.batch, -1, -1).contiguous()

    def _example(self, s: VerifyShape) -> Tensor:
        """A packed batch of one-node trees in the scratch slot: capturing it writes nowhere that matters."""
        scratch = self.model.cache.spec.scratch_slot
        return VerifyBatch.pack([], [], [], s, scratch).packed.to(self.model.device)
