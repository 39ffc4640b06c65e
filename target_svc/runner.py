"""TargetRunner: prefill / verify / release over the slot cache (pure torch, no gRPC)."""
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from ddtree_serve.decoding.config import SamplingParams
from ddtree_serve.decoding.guides import SequenceGuide, apply_guide_mask, grammar_kept_nodes
from ddtree_serve.decoding.logits_processing import TokenHistory, adjust_logits
from ddtree_serve.decoding.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprobs
from ddtree_serve.decoding.sampling import choose_tokens, make_generator
from ddtree_serve.plumbing.cuda_graphs import (HYBRID_PREFILL_FORWARD_FIXED_ROWS, PREFILL_FORWARD_FIXED_ROWS,
                                              pick_bucket, prefill_chunk)
from ddtree_serve.plumbing.host_copy import PendingHostCopy, start_host_copy, to_host
from ddtree_serve.prefix_match import reusable_rows
from ddtree_serve.transport.base import EarlyRows
from target_svc.loader import LoadedTarget, load_target
from target_svc.memory_plan import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    MemoryPlan,
    cap_gpu_memory,
    capped_cache_budget,
    dtype_bytes,
    geometry_of,
    gpu_cache_budget,
    human_bytes,
    plan_cache,
    workspace_estimate,
)
from target_svc.model import TargetModel
from target_svc.quantization import tensor_bytes
from target_svc.verify import VerifyBatch, VerifyGraphs, VerifyShape, commit_path, verify_forward, verify_walk

log = logging.getLogger(__name__)

# Measured on the H200 at the Qwen3-8B shape: an eager forward costs ~30 ms of host work whatever its length, a
# captured 65-node verify forward 7.7 ms; up to four graphed chunks (260 prompt tokens at 65 nodes) beat one eager
# pass, beyond that the eager pass's single weight read wins.
PREFILL_VERIFY_CHUNKS = 4
PREFILL_CHAIN_NODES = 65   # chain length: the verify size those figures are for (a budget-64 tree's bucket)
# Prompt log-probs need every prompt position's logits: a forward then holds at most this many rows of them (over
# its batch), so that a long prompt's scoring stays ~150 MB at a 150k vocabulary in bf16.
PROMPT_SCORING_ROWS = 512


@dataclass(frozen=True)
class TargetConfig:
    """Where the target lives and how much it may hold."""

    model_dir: str
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    max_batch: int = 8
    max_seq_len: int = 2048
    max_tree_nodes: int = 257
    graph_node_sizes: tuple[int, ...] = ()   # verify sizes captured besides 1, 4^k + 1 and max_tree_nodes
    prefill_chunk: int = 512   # prompt positions per forward (0: whole prompts at once); bounds prefill memory
    # Prompts of at most this many chains of min(max_tree_nodes, 65) tokens are prefilled as fully accepted chains
    # through the verify functions, i.e. through the captured verify graphs (None: PREFILL_VERIFY_CHUNKS when there are graphs,
    # else 0 = never; any other value applies as given, eagerly where there are no graphs).
    prefill_verify_chunks: int | None = None
    enforce_eager: bool = False  # True: never capture CUDA graphs (they are used on CUDA where the model allows)
    lazy_graphs: bool = False    # True: capture on first use; else the server warms up all buckets on attach
    quantize: str = "none"       # "int8": weight-only int8 of the decoder layers' projections (quantization.py)
    # The cache is sized from memory (memory_plan.py): max_batch becomes min(max_batch, what fits).
    gpu_memory_utilization: float | None = None  # fraction of the card this target may use (CUDA; None: 0.9)
    kv_cache_memory_bytes: int | None = None     # the cache's bytes, given directly (any device; enforced)
    # CUDA only: the allocator may hold at most this many bytes, and the plan takes it as the card's size (a
    # smaller card emulated on a larger one, or a share of a card other processes also use).
    gpu_memory_cap_bytes: int | None = None
    num_layers: int | None = None   # tools only: the checkpoint's first num_layers decoder layers (kernel_warmup.py)
    # Hybrid targets: Gated DeltaNet state snapshots kept for prefix caching (a prompt sharing a running or parked
    # sequence's leading tokens up to a snapshot starts there; PrefillItem.snapshot_at takes them); 0: none
    state_snapshots: int = 0


@dataclass(frozen=True)
class PrefillItem:
    """A prompt to admit, or one chunk of it: prompt_ids sit at positions start.. of the sequence."""

    seq_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    want_features: bool = False
    start: int = 0        # > 0: continues a sequence whose first `start` prompt tokens are prefilled
    more: bool = False    # more chunks follow: no first token is sampled yet
    logprobs: int = -1    # >= 0: report each emitted token's log-prob and this many alternatives (first chunk's)
    prompt_logprobs: int = -1   # >= 0: each prompt token's log-prob after the tokens before it, with alternatives
    guide: Any = None     # a compiled grammar (xgrammar's) every generated token must keep to (first chunk's)
    guide_start_after: tuple[int, ...] = ()   # the grammar holds from the token after these (GuideSpec.start_after)
    # Prefix caching (first chunk): reuse up to reuse_max leading prompt rows of the sequence reuse_from (parked:
    # its slot is adopted; reuse_copy: its rows are copied, and it may be running)
    reuse_from: str = ""
    reuse_max: int = 0
    # copy the rows into a slot of its own (reuse_from keeps its slot; a hybrid target copies them up to one of
    # reuse_from's state snapshots, whose states it starts from)
    reuse_copy: bool = False
    # A resumed (preempted) sequence: its tokens from this position on are outputs generated before the preemption
    # (0: none); every chunk carries it
    outputs_from: int = 0
    # Hybrid targets with state snapshots: when this chunk ends at this position, its Gated DeltaNet states there
    # are kept, so that prompts sharing these leading tokens start from them (0: none)
    snapshot_at: int = 0


@dataclass
class PrefillOutput:
    """The first token (pending, not yet in the cache; -1 while chunks remain) and the chunk's features."""

    seq_id: str
    next_token: int
    context_len: int
    features: Tensor | None  # [chunk length, F], rows context_len - chunk length ..
    logprobs: list[TokenLogprob] | None = None   # next_token's, when the sequence asked
    # The chunk's prompt tokens' log-probs, when asked: one per token, except the prompt's very first (no context)
    prompt_logprobs: list[TokenLogprob] | None = None
    reused: int = 0   # leading prompt rows taken from a parked sequence's cache (prefix caching), not run
    snapshot: bool = False   # its states were kept at the chunk's end (PrefillItem.snapshot_at)


@dataclass(frozen=True)
class VerifyItem:
    """One draft tree: node 0 is the pending bonus token; parents[0] = -1, 0 <= parents[i] < i."""

    seq_id: str
    tokens: Tensor | Sequence[int]  # LongTensor[T], or the ids as they came (the server's: no tensor per request)
    parents: Tensor | Sequence[int]
    keep_nodes: int = 0   # verify at most this many nodes (tree order), after a guide's refused ones went (0: all)


@dataclass
class VerifyOutput:
    """The accepted root path, the next bonus token and the accepted rows' features (path order)."""

    seq_id: str
    accepted_nodes: list[int]
    accepted_tokens: list[int]
    next_token: int
    context_len: int
    features: Tensor | None  # [len(accepted_nodes), F]
    # CUDA: recorded once the features are written, before the step's commit is queued (a push waits on this, not
    # on the commit); None: they are ready now
    features_ready: torch.cuda.Event | None = None
    logprobs: list[TokenLogprob] | None = None   # accepted_tokens' then next_token's, when the sequence asked
    verified_nodes: int = 0   # the nodes the forward verified (a guided tree's pruned size)


@dataclass
class _Walked:
    """What a verified block returns, its commit queued behind it on the device."""

    logits: Tensor
    result: Tensor                    # packed [B, 2 + W]: accepted count | bonus | path
    rows: Tensor | None               # the accepted nodes' features [B, W, F]
    graphed: bool
    result_host: PendingHostCopy | None = None   # result's host copy, queued before the commit
    rows_ready: torch.cuda.Event | None = None   # rows written (CUDA), likewise


@dataclass
class _Sequence:
    """Per-sequence state beside the cache slot."""

    slot: int
    sampling: SamplingParams
    generator: torch.Generator
    pending_token: int
    logprobs: int = -1   # PrefillItem.logprobs
    history: TokenHistory | None = None   # prompt and emitted tokens, kept where the sampling adjusts logits
    # With prompt log-probs over several chunks: the logits row of the last prompt position prefilled so far (it
    # predicts the next chunk's first token)
    prompt_tail: Tensor | None = None
    guide: SequenceGuide | None = None   # structured output: the grammar's state
    tokens: list[int] = field(default_factory=list)   # the ids of the committed cache rows (what parking keeps)

    @property
    def plain_greedy(self) -> bool:
        """The raw argmax is its choice: greedy, no logit adjustments, no grammar."""
        return self.sampling.plain_greedy and self.guide is None


def _int_list(values: Tensor | Sequence[int]) -> list[int]:
    """A verify item's ids as a flat list of ints (a tensor of any integer dtype, or a sequence of ints)."""
    if isinstance(values, Tensor):
        return values.reshape(-1).long().tolist()
    return [int(v) for v in values]


@dataclass
class _Tree:
    """A validated verify item on the host."""

    seq: _Sequence
    tokens: list[int]
    parents: list[int]
    max_depth: int
    nodes: list[int] | None = None       # the item's node index of each node kept (None: all, as sent)
    guide_mask: Tensor | None = None     # a guided sequence's grammar rows for these nodes (SequenceGuide.tree_mask)


def plan_memory(target: LoadedTarget, cfg: TargetConfig, max_seq_len: int) -> MemoryPlan:
    """The cache plan for a loaded target: --kv-cache-memory if given, else on CUDA --gpu-memory-utilization of
    the card (or of --gpu-memory-cap) minus what is in use, else (CPU) reported but not enforced. MemoryPlanError if
    one sequence won't fit."""
    weights = tensor_bytes(target.embed_tokens, target.layers, target.norm, target.lm_head)
    geometry = geometry_of(target)
    budget, workspace, source = None, 0, "unbounded"
    if cfg.kv_cache_memory_bytes is not None:
        budget, source = cfg.kv_cache_memory_bytes, "--kv-cache-memory"
    elif target.device.type == "cuda":
        utilization = cfg.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        # Blocks the load's temporaries (quantization) left in torch's cache are free to reuse, not in use.
        torch.cuda.empty_cache()
        if cfg.gpu_memory_cap_bytes is not None:
            # What this process holds, not total - free: other processes on a shared card (the drafter of a
            # one-GPU bench) are not on the card the cap stands for.
            budget = capped_cache_budget(cfg.gpu_memory_cap_bytes, torch.cuda.memory_reserved(target.device),
                                         utilization)
            source = (f"--gpu-memory-utilization {utilization} of --gpu-memory-cap "
                      f"{human_bytes(cfg.gpu_memory_cap_bytes)}")
        else:
            free, total = torch.cuda.mem_get_info(target.device)
            budget = gpu_cache_budget(total, free, utilization)
            source = f"--gpu-memory-utilization {utilization}"
        tc = target.text_config
        widest = max(getattr(tc, "intermediate_size", 4 * target.hidden_size), 2 * target.num_heads * target.head_dim)
        workspace = workspace_estimate(target.vocab_size, target.hidden_size, widest, dtype_bytes(target.dtype),
                                       cfg.max_batch, cfg.max_tree_nodes, cfg.prefill_chunk, geometry.linear_shapes)
    return plan_cache(budget, geometry, max_seq_len, cfg.max_tree_nodes, cfg.max_batch, weight_bytes=weights,
                      workspace_bytes=workspace, source=source,
                      snapshot_bytes=cfg.state_snapshots * geometry.state_bytes_per_sequence)


class TargetRunner:
    """Holds the target model and its cache; every call is a batch over sequences keyed by seq id."""

    def __init__(self, cfg: TargetConfig):
        if cfg.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0: whole prompts), got {cfg.prefill_chunk}")
        self.cfg = cfg
        if cfg.gpu_memory_cap_bytes is not None:
            # Before the weights load: loading is part of what must fit under the cap.
            cap_gpu_memory(torch.device(cfg.device), cfg.gpu_memory_cap_bytes,
                           cfg.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION)
        self.target = load_target(cfg.model_dir, cfg.device, cfg.dtype, cfg.quantize, cfg.num_layers)
        # Positions past the model's trained range are not served.
        self.max_seq_len = min(cfg.max_seq_len, self.target.max_position_embeddings)
        # Planned after the weights are on the device (what is left is measured) and before the cache exists.
        self.memory = plan_memory(self.target, cfg, self.max_seq_len)
        log.info("%s", self.memory.summary())
        self.model = TargetModel(self.target, self.memory.max_batch, self.max_seq_len, cfg.max_tree_nodes,
                                 state_snapshots=cfg.state_snapshots)
        self.graphs: VerifyGraphs | None = None
        if not cfg.enforce_eager and VerifyGraphs.supports(self.model):
            self.graphs = VerifyGraphs(self.model, self.max_batch, cfg.max_tree_nodes, self.model.cache.spec.capacity,
                                       cfg.graph_node_sizes)
        self.device = self.target.device
        self.feature_layers: tuple[int, ...] = ()
        self.seqs: dict[str, _Sequence] = {}

    # -- model facts (served by Info) ---------------------------------------------------------------------------

    @property
    def model_type(self) -> str:
        return self.target.model_type

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def num_layers(self) -> int:
        return self.target.num_layers

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.target.eos_token_ids)

    @property
    def max_batch(self) -> int:
        """Sequences held at once: the requested --max-batch, or fewer when memory holds fewer."""
        return self.memory.max_batch

    # -- API -----------------------------------------------------------------------------------------------------

    def set_feature_layers(self, layer_ids: list[int]) -> None:
        """Layers whose outputs form the context features (HF hidden_states[i + 1]), concatenated in this order."""
        ids = tuple(int(i) for i in layer_ids)
        bad = [i for i in ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"feature layers {bad} out of range for a {self.num_layers}-layer target")
        self.feature_layers = ids

    def warmup_shapes(self) -> list[VerifyShape]:
        """The verify buckets a warm-up captures (none when the runner is eager)."""
        return [] if self.graphs is None else self.graphs.shapes()

    @torch.inference_mode()
    def warmup(self, shapes: list[VerifyShape] | None = None) -> float:
        """Captures the verify graphs of the given buckets (default: every batch, tree-size and key-length bucket)
        for the current feature layers; returns the seconds spent capturing so far (0 eager)."""
        if self.graphs is None:
            return 0.0
        return self.graphs.warmup(self.feature_layers, shapes)

    def memory_summary(self) -> str:
        """The device allocator's allocated, reserved and peak bytes, for the logs ('' on the CPU)."""
        dev = self.device
        if dev.type != "cuda":
            return ""
        return (f"GPU memory allocated {human_bytes(torch.cuda.memory_allocated(dev))}, reserved "
                f"{human_bytes(torch.cuda.memory_reserved(dev))}, peak allocated "
                f"{human_bytes(torch.cuda.max_memory_allocated(dev))}")

    @torch.inference_mode()
    def prefill(self, items: list[PrefillItem]) -> list[PrefillOutput]:
        """Admits prompts or continues chunked ones (any lengths, batched) and samples each finished one's first
        token. If the forward fails, the batch's sequences are released."""
        if not items:
            return []
        self._check_prefill_batch(items)
        try:
            runs, reused = [], []   # runs: the items as run (a reused prefix cut off)
            for it in items:
                held = 0
                if it.start == 0:
                    slot, tokens = self._take_slot(it)
                    held = len(tokens)
                    history = TokenHistory.empty(self.vocab_size, self.device) if it.sampling.adjusts_logits else None
                    guide = (SequenceGuide(it.guide, self.vocab_size, it.guide_start_after)
                             if it.guide is not None else None)
                    self.seqs[it.seq_id] = _Sequence(slot, it.sampling, make_generator(it.sampling.seed, self.device),
                                                     pending_token=-1, logprobs=it.logprobs, history=history,
                                                     guide=guide, tokens=tokens)
                seq = self.seqs[it.seq_id]
                self._note_prompt_chunk(seq, it)
                run = replace(it, prompt_ids=it.prompt_ids[held:], start=held) if held else it
                seq.tokens.extend(run.prompt_ids)
                runs.append(run)
                reused.append(held)
            outputs = self._prefill(runs)
            for out, n, run in zip(outputs, reused, runs):
                out.reused = n
                if run.snapshot_at and run.snapshot_at == run.start + len(run.prompt_ids):
                    out.snapshot = self.model.cache.take_snapshot(self.seqs[run.seq_id].slot, run.snapshot_at)
            return outputs
        except BaseException:
            # A half-run forward leaves caches and linear-attention states of these sequences unusable.
            for it in items:
                if self.seqs.pop(it.seq_id, None) is not None:
                    self.model.cache.release(it.seq_id)
            raise

    @torch.inference_mode()
    def verify(self, items: list[VerifyItem], early: Callable[[list[EarlyRows]], set[str]] | None = None
               ) -> list[VerifyOutput]:
        """Verifies one tree per sequence in one forward, commits the accepted paths, returns the bonus tokens.
        early: handed each sequence's rows as soon as the verify is queued, before its results reach the host (an
        early feature push); it returns the sequences it pushed, whose outputs then carry no features."""
        if not items:
            return []
        trees = self._check_trees(items)
        sizes = [len(tr.tokens) for tr in trees]
        ctx_host = [self.model.cache.ctx_len[tr.seq.slot] for tr in trees]
        key_len = max(c + n for c, n in zip(ctx_host, sizes))
        shape = self.graphs.shape_for(len(trees), max(sizes), key_len) if self.graphs is not None else None
        graphed = shape is not None
        if shape is None:
            shape = VerifyShape(len(trees), max(sizes), key_len)
        batch = VerifyBatch.pack([(tr.tokens, tr.parents) for tr in trees], ctx_host, [tr.seq.slot for tr in trees],
                                 shape, self.model.cache.spec.scratch_slot)
        packed_dev = batch.packed.to(self.device, non_blocking=True)  # the one host->device copy of the step
        seqs = [tr.seq for tr in trees]
        plain = all(seq.plain_greedy for seq in seqs)

        def choose(logits: Tensor, choices: Tensor) -> Tensor:
            return choices if plain else self._sample_rows(logits, choices, seqs, sizes, trees)

        # Eagerly, accepted paths are at most the deepest tree's depth + 1: narrowing keeps the GDN replay short.
        walked = self._forward_commit(batch, packed_dev, graphed, choose, self.feature_layers,
                                      max(tr.max_depth for tr in trees) + 1, copy_result=True)
        rows = walked.rows
        pushed: set[str] = set()
        if early is not None and rows is not None:
            # At most the deepest path's rows: the accepted ones come first, their count rides in the header.
            pushed = early([EarlyRows(it.seq_id, ctx_host[b], rows[b, : min(rows.shape[1], tr.max_depth + 1)],
                                      walked.result[b, :2], walked.rows_ready)
                            for b, (it, tr) in enumerate(zip(items, trees))])
        (packed_host,) = walked.result_host.wait()  # the one device->host copy of the step, waited for without the GIL
        packed = packed_host.tolist()

        outputs, paths = [], []   # paths: the accepted nodes as verified (a pruned tree's own indices)
        for b, (it, tr) in enumerate(zip(items, trees)):
            n, next_token, nodes = packed[b][0], packed[b][1], packed[b][2 : 2 + packed[b][0]]
            ctx = ctx_host[b] + n
            self.model.cache.ctx_len[tr.seq.slot] = ctx
            tr.seq.pending_token = next_token
            accepted = [tr.tokens[i] for i in nodes[1:]]
            tr.seq.tokens.append(tr.tokens[0])
            tr.seq.tokens.extend(accepted)
            paths.append(nodes)
            if tr.nodes is not None:   # indices as the item sent them
                nodes = [tr.nodes[i] for i in nodes]
            if tr.seq.history is not None:
                tr.seq.history.add_output(accepted + [next_token])
            if tr.seq.guide is not None:
                tr.seq.guide.accept(accepted + [next_token])
            outputs.append(VerifyOutput(
                seq_id=it.seq_id, accepted_nodes=nodes, accepted_tokens=accepted,
                next_token=next_token, context_len=ctx,
                features=None if rows is None or it.seq_id in pushed else rows[b, :n],
                features_ready=walked.rows_ready, verified_nodes=len(tr.tokens),
            ))
        self._attach_logprobs(walked.logits, trees, outputs, paths)
        return outputs

    @staticmethod
    def _attach_logprobs(logits: Tensor, trees: list, outputs: list[VerifyOutput], paths: list[list[int]]) -> None:
        """The log-probs of the sequences that asked, all in one computation and one host copy: each accepted
        node's logits row (paths: their rows in the verified trees) chose the next accepted token, the last one's
        the next bonus token."""
        asking = [b for b, tr in enumerate(trees) if tr.seq.logprobs >= 0]
        if not asking:
            return
        rows = torch.cat([logits[b, paths[b]] for b in asking])
        chosen = torch.tensor([t for b in asking for t in outputs[b].accepted_tokens + [outputs[b].next_token]])
        top = max(trees[b].seq.logprobs for b in asking)
        got = iter(token_logprobs(rows, chosen, top))
        for b in asking:
            keep = trees[b].seq.logprobs
            outputs[b].logprobs = [TokenLogprob(lp.logprob, lp.top[:keep], lp.rank)
                                   for lp in itertools.islice(got, len(outputs[b].accepted_nodes))]

    def release(self, seq_id: str, park: bool = False) -> None:
        """Frees the sequence's slot; park: keeps its rows for a later prompt that starts with its tokens (prefix
        caching: a later PrefillItem.reuse_from names it). KeyError if unknown."""
        seq = self.seqs[seq_id]
        cache = self.model.cache
        if park and len(seq.tokens) == cache.ctx_len[seq.slot]:
            cache.park(seq_id, seq.tokens)
        else:
            cache.release(seq_id)
        del self.seqs[seq_id]

    @property
    def prefix_reuse(self) -> str:
        """What a parked sequence's rows give a new prompt: "prefix" (any common prefix), or "context" (all of them
        or nothing: Gated DeltaNet layers keep their recurrent state at the end of the context only)."""
        return "context" if self.model.linear_index else "prefix"

    @staticmethod
    def _note_prompt_chunk(seq: _Sequence, it: PrefillItem) -> None:
        """Records a chunk's tokens in the sequence's history and grammar: prompt tokens as seen, and a resumed
        sequence's earlier outputs (positions from it.outputs_from on) as emitted, so that its penalties, min_tokens,
        bad words and grammar state go on from where its preemption left them."""
        cut = max(0, it.outputs_from - it.start) if it.outputs_from > 0 else len(it.prompt_ids)
        prompt, outputs = it.prompt_ids[:cut], it.prompt_ids[cut:]
        if seq.history is not None:
            seq.history.add_prompt(prompt)
            seq.history.add_output(outputs)
        if seq.guide is not None and outputs:
            try:
                seq.guide.accept(outputs)
            except RuntimeError as exc:   # not outputs this grammar produced: the caller's error, not the target's
                raise ValueError(f"sequence {it.seq_id!r}: resumed outputs outside its guide ({exc})") from None

    def _take_slot(self, it: PrefillItem) -> tuple[int, list[int]]:
        """A new sequence's slot and the leading prompt tokens its rows already hold (prefix caching): the slot of
        the parked sequence the item names, or a fresh one with the named sequence's rows copied in (reuse_copy;
        running or parked, dense targets), where those rows start its prompt; else a fresh slot and none."""
        cache = self.model.cache
        if not it.reuse_from or it.prompt_logprobs >= 0:   # prompt log-probs need every prompt position run
            return cache.add_sequence(it.seq_id), []
        whole = self.prefix_reuse == "context"
        parked = cache.parked.get(it.reuse_from)
        if it.reuse_copy and whole:
            return self._take_slot_at_snapshot(it)
        if it.reuse_copy and (parked is None or cache.free_slots):
            source = self.seqs.get(it.reuse_from)
            slot_tokens = parked if source is None else (source.slot, source.tokens)
            if slot_tokens is not None:
                n = reusable_rows(slot_tokens[1], it.prompt_ids, it.reuse_max, whole=False)
                if n > 0:
                    slot = cache.add_sequence(it.seq_id, spare=it.reuse_from)
                    cache.copy_rows(slot_tokens[0], slot, n)
                    cache.ctx_len[slot] = n
                    return slot, slot_tokens[1][:n]
        elif parked is not None:   # adopted (a copy from a parked slot with no other slot free adopts it too)
            n = reusable_rows(parked[1], it.prompt_ids, it.reuse_max, whole)
            if n > 0:
                slot, tokens = cache.adopt(it.seq_id, it.reuse_from)
                cache.ctx_len[slot] = n
                return slot, tokens[:n]
        return cache.add_sequence(it.seq_id), []

    def _take_slot_at_snapshot(self, it: PrefillItem) -> tuple[int, list[int]]:
        """A hybrid target's copy: a fresh slot with the rows of reuse_from (running or parked) up to its latest
        state snapshot that the prompt reaches (within reuse_max), and that snapshot's states; a fresh slot and none
        when there is no such snapshot."""
        cache = self.model.cache
        source = self.seqs.get(it.reuse_from)
        slot_tokens = cache.parked.get(it.reuse_from) if source is None else (source.slot, source.tokens)
        if slot_tokens is None:
            return cache.add_sequence(it.seq_id), []
        src, tokens = slot_tokens
        n = reusable_rows(tokens, it.prompt_ids, it.reuse_max, whole=False)
        at = max((p for p in cache.snapshot_positions(src) if p <= n), default=0)
        if at == 0:
            return cache.add_sequence(it.seq_id), []
        if not cache.free_slots and all(pid == it.reuse_from for pid in cache.parked):
            slot, _ = cache.adopt(it.seq_id, it.reuse_from)   # the parked source's slot is the only one left
        else:
            slot = cache.add_sequence(it.seq_id, spare=it.reuse_from)
            cache.copy_rows(src, slot, at)
        cache.restore_snapshot(src, at, slot)
        cache.ctx_len[slot] = at
        return slot, tokens[:at]

    def cache_usage(self) -> tuple[int, int, int, int]:
        """(running sequences, max sequences, committed tokens, token capacity)."""
        cache = self.model.cache
        return cache.num_sequences, self.max_batch, cache.used_tokens(), self.max_batch * self.max_seq_len

    # -- internals -----------------------------------------------------------------------------------------------

    def _prefill(self, items: list[PrefillItem]) -> list[PrefillOutput]:
        lens = [len(it.prompt_ids) for it in items]
        seqs = [self.seqs[it.seq_id] for it in items]
        chunks_allowed = self.cfg.prefill_verify_chunks
        if chunks_allowed is None:
            chunks_allowed = PREFILL_VERIFY_CHUNKS if self.graphs is not None else 0
        # per item, its chunk's prompt log-probs (None where not asked), filled by the forwards as they go
        prompt_lps: list[list[TokenLogprob] | None] = [[] if it.prompt_logprobs >= 0 else None for it in items]
        if max(lens) <= chunks_allowed * self._prefill_chain_nodes:
            last_logits, feature_parts = self._prefill_as_chains(items, lens, seqs, prompt_lps)
        else:
            last_logits, feature_parts = self._prefill_forwards(items, lens, seqs, prompt_lps)
        finishing = [b for b in range(len(items)) if not items[b].more]
        first = {}
        if finishing:
            chosen = self._choose(torch.stack([last_logits[b] for b in finishing]), [seqs[b] for b in finishing],
                                  [1] * len(finishing))[:, 0].tolist()
            first = dict(zip(finishing, chosen))
        outputs = []
        for b, (it, seq) in enumerate(zip(items, seqs)):
            context_len = it.start + lens[b]
            self.model.cache.ctx_len[seq.slot] = context_len
            seq.pending_token = first.get(b, -1)
            if b in first and seq.history is not None:
                seq.history.add_output([first[b]])
            if b in first and seq.guide is not None:
                seq.guide.accept([first[b]])
            parts = feature_parts[b]
            feats = (parts[0] if len(parts) == 1 else torch.cat(parts)) if parts else None
            lps = None
            if b in first and seq.logprobs >= 0:
                row = last_logits[b].reshape(-1, last_logits[b].shape[-1])[-1:]
                lps = token_logprobs(row, torch.tensor([first[b]]), seq.logprobs)
            if not it.more:
                seq.prompt_tail = None
            outputs.append(PrefillOutput(it.seq_id, seq.pending_token, context_len, feats, lps, prompt_lps[b]))
        return outputs

    @staticmethod
    def _score_prompt(item: PrefillItem, seq: _Sequence, rows: Tensor, c0: int, out: list[TokenLogprob]) -> None:
        """Appends to out the log-probs of the item's prompt tokens at chunk positions c0.. (as many as rows), from
        the logits rows of those positions [n, V] and, for the first of them, the row before (seq.prompt_tail;
        none for the prompt's very first token)."""
        ids = item.prompt_ids[c0 : c0 + rows.shape[0]]
        predictors, targets = rows[:-1], ids[1:]
        if seq.prompt_tail is not None:
            predictors, targets = torch.cat([seq.prompt_tail[None].to(rows.dtype), predictors]), ids
        seq.prompt_tail = rows[-1].clone()   # a graph's rows are overwritten by the next replay
        if targets:
            out += token_logprobs(predictors, torch.tensor(targets), item.prompt_logprobs)

    @property
    def _prefill_chain_nodes(self) -> int:
        return min(self.cfg.max_tree_nodes, PREFILL_CHAIN_NODES)

    def _prefill_chunk(self, rest: int, batch: int) -> int:
        """Prompt positions in the next prefill chain of `batch` prompts: with graphs, the node bucket that takes
        the rest of the longest prompt at the least estimated cost (cuda_graphs.prefill_chunk, with the fixed cost
        measured for this kind of target); otherwise _prefill_chain_nodes."""
        if self.graphs is None:
            return self._prefill_chain_nodes
        fixed = HYBRID_PREFILL_FORWARD_FIXED_ROWS if self.model.linear_index else PREFILL_FORWARD_FIXED_ROWS
        return prefill_chunk(rest, self.graphs.node_buckets, pick_bucket(self.graphs.batch_buckets, batch), fixed)

    def _prefill_forwards(self, items: list[PrefillItem], lens: list[int], seqs: list[_Sequence],
                          prompt_lps: list[list[TokenLogprob] | None]):
        """Prompts through forward_block in chunks of prefill_chunk positions -> (last logits, feature parts); the
        prompt log-probs that items ask for go to prompt_lps."""
        tmax = max(lens)
        chunk = self.cfg.prefill_chunk or tmax
        dev = self.device
        feature_layers = self.feature_layers if any(it.want_features for it in items) else ()
        last_logits: list[Tensor | None] = [None] * len(items)
        feature_parts: list[list[Tensor]] = [[] for _ in items]
        every_row = any(lps is not None for lps in prompt_lps)   # prompt log-probs need every position's logits
        if every_row:
            chunk = min(chunk, max(1, PROMPT_SCORING_ROWS // len(items)))
        # Chunk by chunk: each forward attends to the positions already cached and commits the linear-attention
        # states, so the result is that of one forward over the whole prompts; only memory is bounded.
        for c0 in range(0, tmax, chunk):
            active = [b for b in range(len(items)) if lens[b] > c0]
            sizes = [min(chunk, lens[b] - c0) for b in active]
            ctx = [items[b].start + c0 for b in active]
            width = max(sizes)
            ids = torch.zeros(len(active), width, dtype=torch.long)
            for row, b in enumerate(active):
                ids[row, : sizes[row]] = torch.tensor(items[b].prompt_ids[c0 : c0 + sizes[row]], dtype=torch.long)
            size_t = torch.tensor(sizes)
            valid = torch.arange(width)[None, :] < size_t[:, None]
            parents = (torch.arange(width) - 1).expand(len(active), width).contiguous()
            logits, features = self.model.forward_block(
                ids.to(dev, non_blocking=True), parents.to(dev, non_blocking=True), valid.to(dev, non_blocking=True),
                torch.tensor(ctx).to(dev, non_blocking=True),
                torch.tensor([seqs[b].slot for b in active]).to(dev, non_blocking=True),
                key_len=max(c + n for c, n in zip(ctx, sizes)), feature_layers=feature_layers, chain=True,
                logits_at=None if every_row else (size_t - 1).to(dev, non_blocking=True),
            )
            for row, b in enumerate(active):
                if prompt_lps[b] is not None:
                    self._score_prompt(items[b], seqs[b], logits[row, : sizes[row]], c0, prompt_lps[b])
                if c0 + sizes[row] == lens[b] and not items[b].more:
                    last_logits[b] = logits[row, sizes[row] - 1 : sizes[row]] if every_row else logits[row]
                if features is not None and items[b].want_features:
                    feature_parts[b].append(features[row, : sizes[row]])
        return last_logits, feature_parts

    def _prefill_as_chains(self, items: list[PrefillItem], lens: list[int], seqs: list[_Sequence],
                           prompt_lps: list[list[TokenLogprob] | None]):
        """Prompts as chains (each chunk's length from _prefill_chunk) through the verify functions (their captured
        graphs where a bucket fits), every node accepted -> (last logits, feature parts); the prompt log-probs that
        items ask for go to prompt_lps."""
        want_features = any(it.want_features for it in items)
        last_logits: list[Tensor | None] = [None] * len(items)
        feature_parts: list[list[Tensor]] = [[] for _ in items]
        accepted, expected = [], []
        c0 = 0
        while c0 < max(lens):
            active = [b for b in range(len(items)) if lens[b] > c0]
            chunk = self._prefill_chunk(max(lens) - c0, len(active))
            sizes = [min(chunk, lens[b] - c0) for b in active]
            ctx = [items[b].start + c0 for b in active]
            chains = [(torch.tensor(items[b].prompt_ids[c0 : c0 + n], dtype=torch.long), torch.arange(n) - 1)
                      for b, n in zip(active, sizes)]
            key_len = max(c + n for c, n in zip(ctx, sizes))
            shape = self.graphs.shape_for(len(active), max(sizes), key_len) if self.graphs is not None else None
            graphed = shape is not None
            shape = shape or VerifyShape(len(active), max(sizes), key_len)
            batch = VerifyBatch.pack(chains, ctx, [seqs[b].slot for b in active], shape,
                                     self.model.cache.spec.scratch_slot)
            packed_dev = batch.packed.to(self.device, non_blocking=True)
            # "The target chose each next prompt token": the acceptance walk then takes the whole chain, and the
            # commit stores its K/V and linear-attention states exactly as for an accepted draft.
            choices = torch.roll(batch.packed[:, : shape.nodes], -1, dims=1).to(self.device, non_blocking=True)
            # The graphs bake the drafter's feature layers in: they always ask for them (a change would recapture all).
            walked = self._forward_commit(batch, packed_dev, graphed, lambda _logits, _choices: choices,
                                          self.feature_layers if want_features else (), shape.nodes)
            logits, result, rows, graphed = walked.logits, walked.result, walked.rows, walked.graphed
            accepted.append(result[: len(active), 0].clone())   # a graph's output: the next replay overwrites it
            expected += sizes
            last = torch.tensor(sizes, device=self.device) - 1
            # [rows, 1, V] as forward_block's logits_at gives them; indexing copies, so they outlive the next replay
            ends = logits[torch.arange(len(active), device=self.device), last][:, None]
            for row, b in enumerate(active):
                if prompt_lps[b] is not None:
                    self._score_prompt(items[b], seqs[b], logits[row, : sizes[row]], c0, prompt_lps[b])
                if c0 + sizes[row] == lens[b] and not items[b].more:
                    last_logits[b] = ends[row]
                if rows is not None and items[b].want_features:
                    feature_parts[b].append(rows[row, : sizes[row]])
            c0 += chunk
        (got,) = to_host(torch.cat(accepted))
        if got.tolist() != expected:   # cannot happen for chains; a cache that silently missed rows must not serve
            raise RuntimeError(f"prefill chains were not fully committed: {got.tolist()} of {expected} tokens")
        return last_logits, feature_parts

    def _forward_commit(self, batch: VerifyBatch, packed_dev: Tensor, graphed: bool,
                        choose: Callable[[Tensor, Tensor], Tensor], eager_feature_layers: tuple[int, ...],
                        path_width: int, copy_result: bool = False) -> _Walked:
        """Forward, choices, walk, then the commit of a packed block: through its bucket's graphs where graphed,
        else eagerly. The commit is queued last, behind the result's host copy (copy_result) and the rows, so that
        neither waits for it. A bucket whose capture runs out of memory is given up and the block runs again
        eagerly: nothing is committed before its commit runs (the forward only wrote the block's K/V past the
        context). path_width: no accepted path is longer (the deepest tree's depth + 1): the eager walk's width,
        and what picks the captured commit's."""
        s = batch.shape
        if graphed:
            try:
                logits, choices, features, anc = self.graphs.forward(batch, packed_dev, self.feature_layers)
                result, rows, path, n_acc = self.graphs.walk(batch, packed_dev, choose(logits, choices), features,
                                                             anc)
                # The graphs' rows buffer is overwritten by the next step; the pushes may read them later.
                walked = self._walked(logits, result, None if rows is None else rows.clone(), True, copy_result)
                self.graphs.commit(batch, packed_dev, path, n_acc, path_width)
                return walked
            except torch.OutOfMemoryError as exc:
                log.warning("verify bucket %s could not be captured (%s): its steps run eagerly; %s", s,
                            str(exc).splitlines()[0][:200] if str(exc) else "out of memory", self.memory_summary())
                self.graphs.give_up(s)
        logits, choices, features, anc = verify_forward(self.model, packed_dev, s.nodes, s.key_len,
                                                        eager_feature_layers)
        result, rows, path, n_acc = verify_walk(packed_dev, s.nodes, choose(logits, choices), features, path_width,
                                                anc=anc)
        walked = self._walked(logits, result, rows, False, copy_result)
        commit_path(self.model, packed_dev, s.nodes, path, n_acc)
        return walked

    @staticmethod
    def _walked(logits: Tensor, result: Tensor, rows: Tensor | None, graphed: bool, copy_result: bool) -> _Walked:
        """The block's results, with their host copy and the rows' ready event queued now (before the commit)."""
        walked = _Walked(logits, result, rows, graphed)
        if copy_result:
            walked.result_host = start_host_copy(result)
        if rows is not None and rows.is_cuda:
            if walked.result_host is not None and walked.result_host.done:
                walked.rows_ready = walked.result_host.done[0]   # recorded after the rows too: the same point
            else:
                walked.rows_ready = torch.cuda.Event()
                walked.rows_ready.record()
        return walked

    def _choose(self, logits: Tensor, seqs: list[_Sequence], sizes: list[int]) -> Tensor:
        """LongTensor[B, Tmax]: the target's choice per node; greedy rows in one argmax, sampled rows per sequence."""
        return self._sample_rows(logits, logits.argmax(dim=-1), seqs, sizes)

    @staticmethod
    def _sample_rows(logits: Tensor, greedy: Tensor, seqs: list[_Sequence], sizes: list[int],
                     trees: list[_Tree] | None = None) -> Tensor:
        """The raw greedy choices with the rows of each sequence that samples or adjusts its logits replaced: logits
        adjusted per node under the node's own context (trees: the verified trees; None: one row per sequence, its
        context the history alone) and masked with the tokens its grammar allows there, then the argmax or a sample
        from the sequence's generator."""
        choices = greedy.clone()
        for b, seq in enumerate(seqs):
            params = seq.sampling
            if seq.plain_greedy:
                continue
            rows = logits[b, : sizes[b]]
            if seq.guide is not None:
                guide = seq.guide
                mask = guide.row_mask() if trees is None else trees[b].guide_mask
                rows = apply_guide_mask(rows, mask)
            if params.adjusts_logits:
                tokens = parents = None
                if trees is not None:
                    tokens = torch.tensor(trees[b].tokens, dtype=torch.long)
                    parents = torch.tensor(trees[b].parents, dtype=torch.long)
                rows = adjust_logits(rows, params, seq.history, tokens, parents)
            choices[b, : sizes[b]] = choose_tokens(rows, params, seq.generator)
        return choices

    def _check_prefill_batch(self, items: list[PrefillItem]) -> None:
        """All prompts valid and a slot for each new one, or nothing happens."""
        ids = [it.seq_id for it in items]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate seq_id in one prefill batch")
        for it in items:
            if it.start < 0:
                raise ValueError(f"sequence {it.seq_id!r}: prefill start must be >= 0, got {it.start}")
            if it.start == 0 and it.seq_id in self.seqs:
                raise ValueError(f"sequence {it.seq_id!r} already exists")
            if it.start > 0:
                seq = self.seqs.get(it.seq_id)
                if seq is None:
                    raise KeyError(f"sequence {it.seq_id!r} has no prefilled chunk to continue")
                held = self.model.cache.ctx_len[seq.slot]
                if seq.pending_token != -1 or held != it.start:
                    state = "its prompt is complete" if seq.pending_token != -1 else f"it holds {held} positions"
                    raise ValueError(f"sequence {it.seq_id!r}: a chunk at position {it.start}, but {state}")
            it.sampling.validate()
            it.sampling.check_vocab(self.vocab_size)
            if it.outputs_from < 0:
                raise ValueError(f"sequence {it.seq_id!r}: outputs_from must be >= 0, got {it.outputs_from}")
            if not -1 <= it.prompt_logprobs <= MAX_TOP_LOGPROBS:
                raise ValueError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {it.prompt_logprobs}")
            n = it.start + len(it.prompt_ids)
            if len(it.prompt_ids) == 0:
                raise ValueError(f"sequence {it.seq_id!r}: empty prompt")
            if n > self.max_seq_len - 1:
                raise ValueError(
                    f"sequence {it.seq_id!r}: prompt too long ({n} tokens; the limit is {self.max_seq_len - 1})"
                )
            lo, hi = min(it.prompt_ids), max(it.prompt_ids)
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"sequence {it.seq_id!r}: token ids must lie in [0, {self.vocab_size}), got {bad}")
        new = sum(it.start == 0 for it in items)
        free = self.model.cache.slots_available
        if new > free:
            raise RuntimeError(f"capacity: {new} new sequences but {free} of {self.max_batch} slots free")

    def _check_trees(self, items: list[VerifyItem]) -> list[_Tree]:
        """Validates every tree on the host before anything runs: plain Python over lists, since a tree is at most a
        few hundred nodes and per-op tensor overhead would dominate (~4x slower for a 65-node tree)."""
        ids = [it.seq_id for it in items]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate seq_id in one verify batch")
        trees = []
        for it in items:
            if it.seq_id not in self.seqs:
                raise KeyError(f"unknown sequence id {it.seq_id!r}")
            seq = self.seqs[it.seq_id]
            if seq.pending_token == -1:
                raise ValueError(f"sequence {it.seq_id!r}: its prompt is still being prefilled")
            tok, par = _int_list(it.tokens), _int_list(it.parents)
            t = len(tok)
            where = f"sequence {it.seq_id!r}"
            if t == 0 or len(par) != t:
                raise ValueError(f"{where}: a tree needs >= 1 node and one parent per token")
            if t > self.cfg.max_tree_nodes:
                raise ValueError(f"{where}: tree too big ({t} nodes; the limit is {self.cfg.max_tree_nodes})")
            if min(tok) < 0 or max(tok) >= self.vocab_size:
                raise ValueError(f"{where}: token ids must lie in [0, {self.vocab_size})")
            if par[0] != -1 or any(not 0 <= p < i for i, p in enumerate(par[1:], start=1)):
                raise ValueError(f"{where}: malformed tree (need parents[0] = -1 and 0 <= parents[i] < i)")
            if tok[0] != seq.pending_token:
                raise ValueError(f"{where}: root token {tok[0]} is not the pending bonus token {seq.pending_token}")
            if len(set(zip(par, tok))) != t:
                raise ValueError(f"{where}: siblings must carry distinct tokens")
            depth = [0] * t
            for i in range(1, t):   # parents precede their children
                depth[i] = depth[par[i]] + 1
            max_depth = max(depth)
            ctx = self.model.cache.ctx_len[seq.slot]
            if ctx + max_depth + 1 > self.max_seq_len:
                raise ValueError(
                    f"{where}: tree too big for the remaining capacity (context {ctx} + depth {max_depth + 1} > "
                    f"{self.max_seq_len})"
                )
            trees.append(self._pruned(_Tree(seq, tok, par, max_depth), it.keep_nodes))
        return trees

    @staticmethod
    def _pruned(tree: _Tree, keep: int) -> _Tree:
        """The tree as verified: a guided sequence's without the nodes its grammar refuses (and their subtrees), each
        node with its grammar row; then at most `keep` nodes in tree order (0: all)."""
        guide, n = tree.seq.guide, len(tree.tokens)
        if guide is None and not 0 < keep < n:   # the common case: the tree as sent
            return tree
        mask = None if guide is None else guide.tree_mask(tree.tokens, tree.parents)
        kept = list(range(min(n, keep or n))) if mask is None else grammar_kept_nodes(mask, tree.tokens, tree.parents,
                                                                                        keep)
        if len(kept) == n:
            tree.guide_mask = mask
            return tree
        new_index = {old: new for new, old in enumerate(kept)}
        tokens = [tree.tokens[i] for i in kept]
        parents = [-1] + [new_index[tree.parents[i]] for i in kept[1:]]
        depth = [0] * len(kept)
        for i in range(1, len(kept)):
            depth[i] = depth[parents[i]] + 1
        return _Tree(tree.seq, tokens, parents, max(depth), nodes=kept,
                     guide_mask=None if mask is None else mask[kept])
