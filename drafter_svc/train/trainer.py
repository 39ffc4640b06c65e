"""DFlash drafter training (the published recipe): random anchors, masked blocks, decayed CE, frozen target.

One step, per sequence of a batch:
  * the frozen target runs once over the whole sequence; context features = its hidden states at
    target_layer_ids (HF hidden_states[i + 1]), concatenated;
  * up to `num_anchors` anchors a are drawn among the positions that may start a block (response tokens);
  * each block is [token a, MASK x (bs-1)] at positions a..a+bs-1; it attends to context features of
    positions < a (strictly before its anchor: at decode time the anchor is the bonus token, whose features
    do not exist yet) and bidirectionally to its own block, never to other blocks;
  * slot k (1..bs-1) predicts token a+k at its own position (no shift), through the target's frozen LM head,
    with weight exp(-(k-1)/gamma).
The drafter is saved in the z-lab format (config.json + model.safetensors); training state beside it.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from drafter_svc.dflash_model import DFlashDraftModel, load_target_embeddings
from drafter_svc.train.batching import Batch, BatchSampler, collate
from drafter_svc.train.blocks import default_gamma, sample_anchors, valid_label_index
from drafter_svc.train.loss import DFlashTrainModule
from drafter_svc.train.new_drafter import DrafterShape, count_parameters, init_drafter, new_drafter_config
from drafter_svc.train.samples import Sample
from drafter_svc.train.target_features import load_frozen_target, target_features

log = logging.getLogger(__name__)

STATE_NAME = "trainer_state.pt"


@dataclass
class TrainConfig:
    """Everything a run needs besides the data."""

    target_dir: str
    out_dir: str
    shape: DrafterShape = field(default_factory=DrafterShape)
    init_from: str | None = None  # start from an existing drafter directory instead of a fresh one
    device: str = "cpu"
    amp: bool = False  # bf16 autocast (GPU); float32 otherwise
    target_dtype: str = "float32"
    save_dtype: str = "bfloat16"
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    gamma: float | None = None  # None: default_gamma(block_size)
    num_anchors: int = 512
    max_tokens: int = 8192  # padded sequence tokens per batch (per rank)
    max_batch: int | None = None
    max_len: int = 3072
    max_steps: int = 1000
    time_budget_s: float | None = None  # ends the run (and shapes the LR schedule) by wall-clock time
    stop_after_s: float | None = None  # ends this invocation (checkpointed) without changing the schedule
    ckpt_dir: str | None = None
    ckpt_every: int = 500
    ckpt_every_s: float | None = None
    resume: bool = True
    log_every: int = 10
    seed: int = 0
    ce_chunk: int = 0
    grad_checkpointing: bool = False
    fsdp: bool = False
    progress: bool = True
    compile: bool = False


@dataclass
class TrainResult:
    """What a run did."""

    steps: int
    epochs: float
    elapsed_s: float
    first_loss: float
    last_loss: float
    last_acc: float
    loss_history: list[tuple[int, float, float]]  # (step, loss, acc) at each log point
    label_tokens: int
    context_tokens: int
    params: int
    out_dir: str
    per_slot_acc: list[float]


def dist_info() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment (0, 1, 0 when not distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))
    return 0, 1, 0


def init_distributed(device: str) -> tuple[int, int, str]:
    """Initialises torch.distributed under torchrun; returns (rank, world, this rank's device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, device
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") and torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device.startswith("cuda"):
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    return dist.get_rank(), dist.get_world_size(), device


def lr_factor(progress: float, warmup_frac: float, min_ratio: float) -> float:
    """Linear warm-up then cosine decay to min_ratio, over progress in [0, 1]."""
    progress = min(max(progress, 0.0), 1.0)
    if warmup_frac > 0 and progress < warmup_frac:
        return max(progress / warmup_frac, 1e-3)
    t = (progress - warmup_frac) / max(1e-9, 1.0 - warmup_frac)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def _atomic_dir_write(final: Path, write: Callable[[Path], None]) -> None:
    """Writes a directory through a temporary sibling and a rename, so a crash never leaves half a checkpoint."""
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write(tmp)
    old = final.with_name(final.name + ".old")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)


def _full_state_dict(module: nn.Module, fsdp: bool) -> dict[str, torch.Tensor]:
    """The drafter's full (unsharded) state dict on CPU."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _load_or_init_drafter(cfg: TrainConfig, latest: Path) -> tuple[DFlashDraftModel, dict[str, Any] | None]:
    """The drafter to train, on CPU in float32: the latest checkpoint (with its state) when resuming, else
    cfg.init_from, else a fresh one for the target."""
    if cfg.resume and (latest / STATE_NAME).is_file():
        drafter = DFlashDraftModel.from_pretrained(latest, device="cpu", dtype=torch.float32)
        resume_state = torch.load(str(latest / STATE_NAME), map_location="cpu", weights_only=False)
        log.info("resuming from %s at step %d", latest, resume_state["step"])
        return drafter, resume_state
    if cfg.init_from:
        return DFlashDraftModel.from_pretrained(cfg.init_from, device="cpu", dtype=torch.float32), None
    return init_drafter(new_drafter_config(cfg.target_dir, cfg.shape), cfg.seed), None


def _distribute(module: nn.Module, drafter: DFlashDraftModel, cfg: TrainConfig, world: int,
                device: torch.device) -> nn.Module:
    """The step function over ranks: FSDP or DDP when world > 1, compiled when asked."""
    wrapped: nn.Module = module
    if world > 1 and cfg.fsdp:
        from torch.distributed.fsdp import fully_shard

        # One FSDP unit for the whole drafter: its forward calls into layers outside their own forward
        # (context K/V projection), which per-layer units would leave sharded.
        fully_shard(drafter)
    elif world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # Buffers (frozen embedding/head) are identical everywhere: no per-step broadcast.
        wrapped = DDP(module, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)
    return torch.compile(wrapped) if cfg.compile else wrapped


def _make_optimizer(drafter: DFlashDraftModel, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norms and other vectors are not decayed)."""
    decay, no_decay = [], []
    for p in drafter.parameters():
        (no_decay if p.ndim < 2 else decay).append(p)
    opt_kwargs: dict[str, Any] = dict(lr=cfg.lr, betas=cfg.betas)
    if device.type == "cuda" and not cfg.fsdp:
        opt_kwargs["fused"] = True
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], **opt_kwargs
    )


def _any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when it is true on any (all ranks must take the same branch)."""
    t = torch.tensor([1.0 if flag else 0.0], device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def train(
    cfg: TrainConfig,
    samples: Sequence[Sample],
    on_log: Callable[[dict[str, Any]], None] | None = None,
    target: nn.Module | None = None,
) -> TrainResult:
    """Trains (or resumes) a drafter on token samples; saves checkpoints and the final drafter (rank 0).

    `target` may be passed already loaded (frozen, on cfg.device); otherwise it is loaded from cfg.target_dir.
    """
    rank, world, local = dist_info()
    device = torch.device(cfg.device)
    is_main = rank == 0
    torch.manual_seed(cfg.seed + 17 * rank)
    random.seed(cfg.seed + 17 * rank)

    # --- model -------------------------------------------------------------------------------------------
    latest = (Path(cfg.ckpt_dir) if cfg.ckpt_dir else Path(cfg.out_dir) / "checkpoints") / "latest"
    drafter, resume_state = _load_or_init_drafter(cfg, latest)
    drafter.train()
    drafter.gradient_checkpointing = cfg.grad_checkpointing
    dcfg = drafter.config
    if dcfg.mask_token_id is None:
        raise ValueError("drafter config has no mask_token_id")
    gamma = cfg.gamma if cfg.gamma is not None else default_gamma(dcfg.block_size)
    drafter.to(device)
    embed, head = load_target_embeddings(cfg.target_dir, device=device, dtype=torch.float32)
    module = DFlashTrainModule(drafter, embed, head, gamma, ce_chunk=cfg.ce_chunk)
    if target is None:
        target = load_frozen_target(cfg.target_dir, device, _dtype(cfg.target_dtype))
    n_params = count_parameters(drafter)

    step_fn = _distribute(module, drafter, cfg, world, device)
    optimizer = _make_optimizer(drafter, cfg, device)

    # --- data --------------------------------------------------------------------------------------------
    sampler = BatchSampler(samples, cfg.max_tokens, cfg.max_len, seed=cfg.seed, rank=rank, world_size=world,
                           max_batch=cfg.max_batch)
    step, elapsed_before, epoch0, skip = 0, 0.0, 0, 0
    history: list[tuple[int, float, float]] = []
    label_tokens = context_tokens = anchors_drawn = 0
    if resume_state is not None:
        if resume_state.get("optimizer") is not None and not (cfg.fsdp and world > 1):
            optimizer.load_state_dict(resume_state["optimizer"])
        else:
            log.warning("resuming without optimiser state (FSDP checkpoint or FSDP run)")
        step = int(resume_state["step"])
        elapsed_before = float(resume_state["elapsed_s"])
        epoch0, skip = int(resume_state["epoch"]), int(resume_state["batch_in_epoch"])
        history = [tuple(h) for h in resume_state.get("history", [])]  # type: ignore[misc]
        label_tokens = int(resume_state.get("label_tokens", 0))
        context_tokens = int(resume_state.get("context_tokens", 0))
        anchors_drawn = int(resume_state.get("anchors_drawn", 0))
        torch.set_rng_state(resume_state["torch_rng"])
        random.setstate(resume_state["py_rng"])
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed * 7919 + rank + 1000 * step)
    batches = sampler.iterate(epoch0, skip)

    amp_ctx = (
        (lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16))
        if cfg.amp
        else contextlib.nullcontext
    )
    bar = None
    if is_main and cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.max_steps, initial=step, desc="train-drafter", dynamic_ncols=True)

    def save_checkpoint(epoch: int, in_epoch: int, elapsed: float) -> None:
        state = _full_state_dict(drafter, cfg.fsdp)
        if not is_main:
            return

        def write(d: Path) -> None:
            copy = DFlashDraftModel(dcfg)
            copy.load_state_dict({k: v.float() for k, v in state.items()})
            copy.save_pretrained(d)
            torch.save(
                {
                    "step": step, "epoch": epoch, "batch_in_epoch": in_epoch, "elapsed_s": elapsed,
                    # FSDP optimiser state is sharded per rank: not kept (a resume restarts the moments)
                    "optimizer": None if cfg.fsdp and world > 1 else optimizer.state_dict(),
                    "torch_rng": torch.get_rng_state(),
                    "py_rng": random.getstate(), "history": history, "label_tokens": label_tokens,
                    "context_tokens": context_tokens, "anchors_drawn": anchors_drawn,
                    "config": asdict(cfg),
                },
                str(d / STATE_NAME),
            )

        _atomic_dir_write(latest, write)

    start_step = step
    t_start = time.perf_counter()
    last_ckpt_t = t_start
    # Running figures stay on the device and are read only at log points: a read is a host sync, and without
    # one per step the host prepares the next batch while the device still works on this one.
    ema_loss = ema_acc = None
    first_loss = math.nan
    win_labels = torch.zeros((), device=device)
    win_ctx = 0
    label_sum = torch.zeros((), device=device)
    win_t = time.perf_counter()
    slot_hits = torch.zeros(dcfg.block_size, device=device)
    slot_counts = torch.zeros(dcfg.block_size, device=device)
    epoch = epoch0
    in_epoch = skip
    pin = device.type == "cuda"

    def put(t: torch.Tensor) -> torch.Tensor:
        """Host tensor -> device; pinned and asynchronous on CUDA, so the copy overlaps the running step."""
        return (t.pin_memory() if pin else t).to(device, non_blocking=pin)

    while True:
        now = time.perf_counter()
        elapsed = elapsed_before + (now - t_start)
        progress = step / max(1, cfg.max_steps)
        if cfg.time_budget_s:
            progress = max(progress, elapsed / cfg.time_budget_s)
        stop = step >= cfg.max_steps or progress >= 1.0
        if cfg.stop_after_s is not None and now - t_start >= cfg.stop_after_s:
            stop = True
        if world > 1:  # every rank must stop at the same step (time differs slightly between ranks)
            stop = _any_rank(stop, device)
        if stop:
            break
        for g in optimizer.param_groups:
            g["lr"] = cfg.lr * lr_factor(progress, cfg.warmup_frac, cfg.min_lr_ratio)

        epoch, in_epoch, batch_samples = next(batches)
        host: Batch = collate(batch_samples, pad_id=0, max_len=cfg.max_len)
        # Anchors and the labelled-slot index are drawn on the host, where their sizes are known for free.
        anchors, keep = sample_anchors(host.lengths, host.loss_start, cfg.num_anchors, gen)
        valid_index = valid_label_index(host.lengths, anchors, keep, dcfg.block_size)
        n_ctx = int(host.lengths.sum()) * world
        anchors_drawn += int(keep.sum()) * world
        batch = Batch(put(host.input_ids), put(host.lengths), put(host.loss_start))
        anchors, keep, valid_index = put(anchors), put(keep), put(valid_index)
        with amp_ctx():
            feats = target_features(target, batch.input_ids, dcfg.target_layer_ids)
            stats = step_fn(batch.input_ids, batch.lengths, feats, anchors, keep, valid_index)
        optimizer.zero_grad(set_to_none=True)
        stats.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        optimizer.step()
        step += 1
        in_epoch += 1

        loss_t = stats.loss.detach().float()
        acc_t = stats.correct / stats.n_labels.clamp(min=1)
        if math.isnan(first_loss):
            first_loss = float(loss_t)
        ema_loss = loss_t if ema_loss is None else 0.95 * ema_loss + 0.05 * loss_t
        ema_acc = acc_t if ema_acc is None else 0.95 * ema_acc + 0.05 * acc_t
        n_lab = stats.n_labels.detach() * world
        label_sum += n_lab
        context_tokens += n_ctx
        win_labels += n_lab
        win_ctx += n_ctx
        slot_hits += stats.correct_per_slot.detach().float()
        slot_counts += stats.n_per_slot.detach().float()
        if step % cfg.log_every == 0 or step == start_step + 1 or step == cfg.max_steps:
            now = time.perf_counter()
            rate = win_ctx / max(1e-9, now - win_t)
            lrate = float(win_labels) / max(1e-9, now - win_t)
            win_labels.zero_()
            win_ctx = 0
            win_t = now
            loss_v, acc_v = float(ema_loss), float(ema_acc)
            history.append((step, loss_v, acc_v))
            if bar is not None:
                bar.set_postfix(loss=f"{loss_v:.3f}", acc=f"{acc_v:.3f}", tok_s=f"{rate:,.0f}",
                                lbl_s=f"{lrate:,.0f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}")
            if on_log is not None and is_main:
                on_log({"step": step, "loss": loss_v, "acc": acc_v, "raw_loss": float(loss_t), "tokens_per_s": rate,
                        "labels_per_s": lrate, "lr": optimizer.param_groups[0]["lr"], "epoch": epoch,
                        "grad_norm": float(grad_norm), "elapsed_s": elapsed})
        if bar is not None:
            bar.update(1)
        now = time.perf_counter()
        due = (cfg.ckpt_every and step % cfg.ckpt_every == 0) or (
            cfg.ckpt_every_s is not None and now - last_ckpt_t >= cfg.ckpt_every_s)
        if world > 1 and cfg.ckpt_every_s is not None:
            due = _any_rank(due, device)
        if due:
            label_tokens += int(label_sum)
            label_sum.zero_()
            save_checkpoint(epoch, in_epoch, elapsed_before + (now - t_start))
            last_ckpt_t = now

    if bar is not None:
        bar.close()
    label_tokens += int(label_sum)
    elapsed = elapsed_before + (time.perf_counter() - t_start)
    if step > 0:
        save_checkpoint(epoch, in_epoch, elapsed)
    state = _full_state_dict(drafter, cfg.fsdp)
    if is_main:
        final = DFlashDraftModel(dcfg)
        final.load_state_dict({k: v.float() for k, v in state.items()})
        final.to(_dtype(cfg.save_dtype)).save_pretrained(cfg.out_dir)
    per_slot = (slot_hits / slot_counts.clamp(min=1)).cpu().tolist()
    # anchor positions per epoch: every position from loss_start to length - 2
    epochs = anchors_drawn / max(1, sampler.tokens_per_epoch() - len(sampler.samples))
    last = history[-1] if history else (step, math.nan, math.nan)
    return TrainResult(step, epochs, elapsed, first_loss, float(last[1]), float(last[2]), history, label_tokens,
                       context_tokens, n_params, str(cfg.out_dir), per_slot)
