"""`ddtree-serve train-drafter`: data (corpus or target distillation) -> DFlash training -> offline acceptance eval.

Wiring: the CLI owner calls `add_arguments(subparser)` and then `run(args)`. Runs on CPU, one GPU, or several
GPUs under torchrun (DDP; `--fsdp` for FSDP2 sharding); rank 0 writes the files.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("ddtree_serve.train_drafter")


def _int_list(text: str) -> list[int]:
    return [int(t) for t in text.replace(",", " ").split()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the train-drafter options to a parser."""
    g = p.add_argument_group("target and output")
    g.add_argument("--target", default="default",
                   help="target HF checkpoint directory ('default': SmolLM2-135M-Instruct converted from its GGUF)")
    g.add_argument("--out", required=True, help="output drafter directory (z-lab format: config.json + model.safetensors)")
    g.add_argument("--work-dir", default=None,
                   help="prompts, generated samples, checkpoints, logs and metrics (default: OUT.work)")

    g = p.add_argument_group("data")
    g.add_argument("--data", choices=("distill", "corpus"), default="distill",
                   help="distill: the target's greedy answers to prompts built from the corpora; corpus: the raw text")
    g.add_argument("--corpus", nargs="*", default=[], metavar="PATH",
                   help="extra corpus files/directories (*.py, *.rst.txt, *.json with 'text', *.txt, fortune files)")
    g.add_argument("--no-system-corpora", action="store_true",
                   help="do not look for the Python stdlib source/docs, fortunes and cached corpora")
    g.add_argument("--prompts", default=None, help="training prompts JSON (instead of building them from the corpora)")
    g.add_argument("--heldout-prompts", default=None, help="held-out prompts JSON for the evaluation")
    g.add_argument("--exclude-prompts", nargs="*", default=[], metavar="JSON",
                   help="drop training prompts sharing a run of 180+ characters with any prompt in these files "
                        "(e.g. bench/heldout_prompts.json)")
    g.add_argument("--num-prompts", type=int, default=20000, help="training prompts to build")
    g.add_argument("--num-heldout", type=int, default=64, help="held-out prompts to build (from held-out documents)")
    g.add_argument("--samples", default=None, help="ready training samples (.pt from an earlier run): skip generation")
    g.add_argument("--heldout-samples", default=None, help="ready held-out samples (.pt)")
    g.add_argument("--max-new-tokens", type=int, default=384, help="continuation length for training data")
    g.add_argument("--eval-max-new-tokens", type=int, default=256, help="continuation length for held-out data")
    g.add_argument("--max-prompt-tokens", type=int, default=768, help="longer prompts are dropped")
    g.add_argument("--gen-batch-size", type=int, default=128, help="prompts per generate() call")
    g.add_argument("--gen-max-batch-tokens", type=int, default=None, help="cap on batch x (prompt + new) tokens")
    g.add_argument("--gen-time-budget", type=float, default=None,
                   help="seconds of generation for training data; prompts left over are not used")
    g.add_argument("--gen-engine", choices=("auto", "fast", "hf"), default="auto",
                   help="fast: our static-cache greedy loop (dense Llama/Qwen-style targets); hf: transformers' "
                        "generate; auto: fast where supported")
    g.add_argument("--build-prompts-only", action="store_true",
                   help="build the training and held-out prompts into the work dir, then stop")
    g.add_argument("--heldout-out", default=None,
                   help="also write the held-out prompts in the bench format (e.g. bench/heldout_prompts.json)")
    g.add_argument("--seq-len", type=int, default=512, help="window length in corpus mode")
    g.add_argument("--corpus-max-chars", type=int, default=20_000_000, help="corpus mode: text to read at most")

    g = p.add_argument_group("drafter")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: the target's)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--mask-token-id", type=int, default=None, help="default: <|MASK|> or an unused special token")
    g.add_argument("--target-layer-ids", type=_int_list, default=None,
                   help="feature layers, e.g. '1,14,27' (default: build_target_layer_ids(n_target, num_layers))")
    g.add_argument("--init-from", default=None, help="start from this drafter directory")

    g = p.add_argument_group("optimisation (DFlash recipe defaults)")
    g.add_argument("--steps", type=int, default=2000, help="maximum optimiser steps")
    g.add_argument("--time-budget", type=float, default=None,
                   help="training seconds; the LR schedule follows max(step/steps, time/budget)")
    g.add_argument("--stop-after", type=float, default=None,
                   help="end this invocation after S seconds of training, checkpointed; a rerun resumes on the "
                        "same schedule (for time-limited machines or job slots)")
    g.add_argument("--deadline", type=float, default=None,
                   help="unix time by which this invocation's training must end (like --stop-after, counted "
                        "from now, after data generation)")
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--min-lr-ratio", type=float, default=0.1)
    g.add_argument("--warmup-frac", type=float, default=0.04)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--gamma", type=float, default=None, help="slot loss decay (default 7 for block 16)")
    g.add_argument("--num-anchors", type=int, default=512, help="anchors per sequence")
    g.add_argument("--max-tokens", type=int, default=8192, help="padded sequence tokens per batch (per rank)")
    g.add_argument("--max-batch", type=int, default=None, help="sequences per batch at most")
    g.add_argument("--max-len", type=int, default=3072, help="sequences are cut to this length")
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("runtime")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (torchrun: one GPU per rank)")
    g.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="compute dtype: bf16 autocast + bf16 target on GPU (auto), float32 on CPU")
    g.add_argument("--save-dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    g.add_argument("--ckpt-every", type=int, default=500, help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--ckpt-every-s", type=float, default=None, help="also checkpoint every S seconds")
    g.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint in the work dir")
    g.add_argument("--grad-checkpointing", action="store_true")
    g.add_argument("--ce-chunk", type=int, default=0, help="LM-head/CE rows per recomputed chunk (0: one piece)")
    g.add_argument("--fsdp", action="store_true", help="shard the drafter with FSDP2 under torchrun")
    g.add_argument("--compile", action="store_true", help="torch.compile the training step")
    g.add_argument("--no-progress", action="store_true")

    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-budgets", type=_int_list, default=[64], help="DDTree budgets to evaluate, e.g. '16,64'")
    g.add_argument("--no-eval", action="store_true")
    g.add_argument("--eval-only", action="store_true", help="evaluate --out (or --init-from) without training")
    g.add_argument("--eval-chunk", type=int, default=256, help="roots per drafter forward in the evaluation")


def _resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _barrier(world: int) -> None:
    if world > 1:
        torch.distributed.barrier()


def _load_tokenizer(target_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target_dir))


def _eos_ids(target_dir: Path, tokenizer) -> list[int]:
    """EOS ids from generation_config.json (else config/tokenizer)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        f = target_dir / name
        if f.is_file():
            v = json.loads(f.read_text()).get("eos_token_id")
            if v is not None:
                ids += v if isinstance(v, list) else [v]
                break
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return sorted(set(int(i) for i in ids))


def _prompt_token_lists(tokenizer, prompts, max_prompt_tokens: int):
    """(kept prompts, their chat-templated ids) without prompts over max_prompt_tokens."""
    from drafter_svc.train.samples import chat_prompt_ids_batch

    kept, ids = [], []
    for p, t in zip(prompts, chat_prompt_ids_batch(tokenizer, [p.text for p in prompts])):
        if len(t) <= max_prompt_tokens:
            kept.append(p)
            ids.append(t)
    return kept, ids


def _generate_shard(args, target_dir: Path, device: str, dtype: torch.dtype, prompts, max_new: int,
                    time_budget: float | None, rank: int, world: int, model=None, desc: str = "generate"):
    """This rank's share of greedy continuations -> samples (prompt ids + response)."""
    from drafter_svc.train.samples import distill_samples, generate_greedy
    from drafter_svc.train.fast_generate import generate_greedy_fast, supports_fast_greedy
    from drafter_svc.train.target_features import load_frozen_target

    tok = _load_tokenizer(target_dir)
    kept, ids = _prompt_token_lists(tok, prompts[rank::world], args.max_prompt_tokens)
    if model is None:
        model = load_frozen_target(target_dir, device, dtype)
    eos = _eos_ids(target_dir, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ids), desc=desc, dynamic_ncols=True)

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.n = done
            bar.refresh()

    t0 = time.perf_counter()
    fast = args.gen_engine == "fast" or (args.gen_engine == "auto" and supports_fast_greedy(model))
    if args.gen_engine == "fast" and not supports_fast_greedy(model):
        raise ValueError(f"--gen-engine fast does not support model_type {model.config.model_type!r}")
    if fast:
        outs = generate_greedy_fast(model, ids, max_new, eos, pad, max_batch=args.gen_batch_size,
                                    max_batch_tokens=args.gen_max_batch_tokens or 2_000_000,
                                    time_budget_s=time_budget, progress=progress)
    else:
        outs = generate_greedy(model, ids, max_new, eos, pad, batch_size=args.gen_batch_size,
                               max_batch_tokens=args.gen_max_batch_tokens, time_budget_s=time_budget,
                               progress=progress)
    if bar is not None:
        bar.close()
    dt = time.perf_counter() - t0
    samples = distill_samples(ids, outs)
    used = [p for p, o in zip(kept, outs) if o is not None and len(o) >= 2]
    n_new = sum(len(o) for o in outs if o is not None)
    log.info("rank %d: %d continuations, %d new tokens in %.1fs (%.0f tok/s, %s)", rank, len(samples), n_new, dt,
             n_new / max(dt, 1e-9), "fast" if fast else "hf")
    return samples, used, {"seconds": dt, "new_tokens": n_new, "sequences": len(samples),
                           "engine": "fast" if fast else "hf"}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the pipeline described by args; returns (and writes) the metrics of the run."""
    from ddtree_serve.default_model import ensure_default_model
    from drafter_svc.dflash_model import DFlashDraftModel, load_target_embeddings
    from drafter_svc.train import corpora as C, prompts as P, samples as S
    from drafter_svc.train.evaluate import evaluate_acceptance, format_result
    from drafter_svc.train.new_drafter import DrafterShape
    from drafter_svc.train.target_features import load_frozen_target
    from drafter_svc.train.trainer import TrainConfig, init_distributed, train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rank, world, device = init_distributed(_resolve_device(args.device))
    is_main = rank == 0
    on_gpu = device.startswith("cuda")
    amp = args.dtype == "bfloat16" or (args.dtype == "auto" and on_gpu)
    target_dtype = torch.bfloat16 if amp else torch.float32

    target_dir = Path(ensure_default_model() if args.target in (None, "", "default") else args.target)
    out_dir = Path(args.out)
    work = Path(args.work_dir) if args.work_dir else out_dir.with_name(out_dir.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, Any] = {"target": str(target_dir), "device": device, "world_size": world,
                               "amp_bf16": amp, "args": {k: v for k, v in vars(args).items() if k != "func"}}
    t_all = time.perf_counter()

    # --- prompts -------------------------------------------------------------------------------------------
    train_prompts = heldout_prompts = None
    need_train_data = not args.eval_only and args.samples is None
    need_heldout = not args.no_eval and args.heldout_samples is None
    if args.data == "distill" and (need_train_data or need_heldout):
        if args.prompts:
            train_prompts = P.load_prompts(args.prompts)
        if args.heldout_prompts:
            heldout_prompts = P.load_prompts(args.heldout_prompts)
        if (train_prompts is None and need_train_data) or (heldout_prompts is None and need_heldout):
            corpora = C.discover_corpora(args.corpus, use_system=not args.no_system_corpora)
            built_train, built_held = P.build_prompts(corpora, args.num_prompts, args.num_heldout, seed=args.seed)
            train_prompts = train_prompts or built_train
            heldout_prompts = heldout_prompts or built_held
            if args.max_prompt_tokens:
                # Drop over-long prompts now, so every held-out prompt written out is one the eval uses.
                tok = _load_tokenizer(target_dir)
                train_prompts = _prompt_token_lists(tok, train_prompts, args.max_prompt_tokens)[0]
                heldout_prompts = _prompt_token_lists(tok, heldout_prompts, args.max_prompt_tokens)[0]
            if is_main:
                P.save_prompts(work / "prompts_train.json.gz", train_prompts, {"corpora": corpora.counts()})
                P.save_prompts(work / "prompts_heldout.json", heldout_prompts, {"corpora": corpora.counts()})
        if is_main and args.heldout_out and heldout_prompts:
            P.write_heldout_bench_file(args.heldout_out, heldout_prompts, args.eval_max_new_tokens, str(target_dir))
    if train_prompts is not None and args.exclude_prompts:
        excluded = [p for f in args.exclude_prompts for p in P.load_prompts(f)]
        before = len(train_prompts)
        train_prompts = P.drop_overlapping(train_prompts, excluded)
        log.info("dropped %d training prompts overlapping %d excluded prompts", before - len(train_prompts),
                 len(excluded))
        if is_main and args.build_prompts_only:
            P.save_prompts(work / "prompts_train.json.gz", train_prompts, {"excluded": list(args.exclude_prompts)})
    if args.build_prompts_only:
        return {"train_prompts": len(train_prompts or []), "heldout_prompts": len(heldout_prompts or [])}

    # --- training samples ----------------------------------------------------------------------------------
    samples: list[S.Sample] = []
    target_model = None
    if args.samples:
        samples = S.load_samples(args.samples)
    elif not args.eval_only:
        if args.data == "corpus":
            corpora = C.discover_corpora(args.corpus, use_system=not args.no_system_corpora)
            texts, total = [], 0
            for kind in C.KINDS:
                for f in getattr(corpora, kind):
                    try:
                        t = f.read_text(encoding="utf-8", errors="replace")
                    except OSError:
                        continue
                    texts.append(t)
                    total += len(t)
                    if total >= args.corpus_max_chars:
                        break
            samples = S.corpus_samples(_load_tokenizer(target_dir), texts, args.seq_len)
            metrics["data"] = {"mode": "corpus", "chars": total, "sequences": len(samples)}
        else:
            target_model = load_frozen_target(target_dir, device, target_dtype)
            shard, used, gstats = _generate_shard(args, target_dir, device, target_dtype, train_prompts,
                                                  args.max_new_tokens, args.gen_time_budget, rank, world,
                                                  model=target_model, desc="distill")
            S.save_samples(work / f"samples.rank{rank}.pt", shard, {"rank": rank})
            _barrier(world)
            samples = [s for r in range(world) for s in S.load_samples(work / f"samples.rank{r}.pt")]
            metrics["data"] = {"mode": "distill", "prompts_available": len(train_prompts),
                               "generation_rank0": gstats, "sequences": len(samples),
                               "tokens": sum(len(s.input_ids) for s in samples),
                               "response_tokens": sum(len(s.input_ids) - s.loss_start for s in samples)}
            if is_main:
                S.save_samples(work / "samples.pt", samples, {"prompts": len(train_prompts)})

    # --- held-out samples ----------------------------------------------------------------------------------
    heldout: list[S.Sample] = []
    if not args.no_eval:
        if args.heldout_samples:
            heldout = S.load_samples(args.heldout_samples)
        elif is_main:
            if args.data == "distill":
                if target_model is None:
                    target_model = load_frozen_target(target_dir, device, target_dtype)
                heldout, used_h, hstats = _generate_shard(args, target_dir, device, target_dtype, heldout_prompts,
                                                          args.eval_max_new_tokens, None, 0, 1, model=target_model,
                                                          desc="held-out")
                P.save_prompts(work / "prompts_heldout_used.json", used_h,
                               {"max_new_tokens": args.eval_max_new_tokens})
            else:
                heldout = samples[-max(1, args.num_heldout):]
                samples = samples[: -len(heldout)] if len(samples) > len(heldout) else samples
            S.save_samples(work / "heldout_samples.pt", heldout)

    # --- training ------------------------------------------------------------------------------------------
    if not args.eval_only:
        cfg = TrainConfig(
            target_dir=str(target_dir), out_dir=str(out_dir),
            shape=DrafterShape(args.num_layers, args.intermediate_size, args.block_size, args.mask_token_id,
                               args.target_layer_ids),
            init_from=args.init_from, device=device, amp=amp,
            target_dtype="bfloat16" if amp else "float32", save_dtype=args.save_dtype,
            lr=args.lr, min_lr_ratio=args.min_lr_ratio, warmup_frac=args.warmup_frac,
            weight_decay=args.weight_decay, grad_clip=args.grad_clip, gamma=args.gamma,
            num_anchors=args.num_anchors, max_tokens=args.max_tokens, max_batch=args.max_batch,
            max_len=args.max_len, max_steps=args.steps, time_budget_s=args.time_budget, stop_after_s=args.stop_after,
            ckpt_dir=str(work / "checkpoints"), ckpt_every=args.ckpt_every, ckpt_every_s=args.ckpt_every_s,
            resume=not args.no_resume, seed=args.seed, ce_chunk=args.ce_chunk,
            grad_checkpointing=args.grad_checkpointing, fsdp=args.fsdp, progress=is_main and not args.no_progress,
            compile=args.compile,
        )
        log_path = work / "train_log.jsonl"

        def on_log(rec: dict[str, Any]) -> None:
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

        if target_model is None:
            target_model = load_frozen_target(target_dir, device, target_dtype)
        if args.deadline is not None:
            left = max(0.0, args.deadline - time.time())
            cfg.stop_after_s = left if cfg.stop_after_s is None else min(cfg.stop_after_s, left)
        res = train(cfg, samples, on_log=on_log, target=target_model)
        metrics["train"] = {k: v for k, v in res.__dict__.items() if k != "loss_history"}
        metrics["train"]["loss_history"] = res.loss_history[:: max(1, len(res.loss_history) // 50)]
        if on_gpu:
            metrics["train"]["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if is_main:
            print(f"trained {res.steps} steps ({res.epochs:.2f} epochs of anchors) in {res.elapsed_s:.0f}s: "
                  f"loss {res.first_loss:.3f} -> {res.last_loss:.3f}, acc {res.last_acc:.3f}, "
                  f"{res.context_tokens / max(res.elapsed_s, 1e-9):,.0f} context tok/s, "
                  f"{res.label_tokens / max(res.elapsed_s, 1e-9):,.0f} label tok/s", flush=True)
            # written now too, so an interrupted evaluation still leaves the training figures
            (work / "metrics.json").write_text(json.dumps(metrics, indent=1, default=str))
        _barrier(world)

    # --- evaluation ----------------------------------------------------------------------------------------
    if not args.no_eval and is_main and heldout:
        src = out_dir if (out_dir / "config.json").is_file() else Path(args.init_from or out_dir)
        drafter = DFlashDraftModel.from_pretrained(src, device=device, dtype=torch.float32)
        embed, head = load_target_embeddings(target_dir, device=device, dtype=torch.float32)
        if target_model is None:
            target_model = load_frozen_target(target_dir, device, target_dtype)
        t0 = time.perf_counter()
        ev = evaluate_acceptance(drafter, target_model, embed, head, heldout, budgets=args.eval_budgets, amp=amp,
                                 chunk=args.eval_chunk)
        metrics["eval"] = ev.summary()
        metrics["eval"]["seconds"] = time.perf_counter() - t0
        print(format_result(ev), flush=True)
    metrics["total_seconds"] = time.perf_counter() - t_all
    if is_main:
        (work / "metrics.json").write_text(json.dumps(metrics, indent=1, default=str))
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return metrics


def main(argv: list[str] | None = None) -> None:
    """Stand-alone entry: `python -m drafter_svc.train.cli --out DIR ...` (same as `ddtree-serve train-drafter`)."""
    parser = argparse.ArgumentParser(prog="train-drafter", description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
