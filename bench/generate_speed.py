"""Distillation throughput: our static-cache greedy generator vs transformers' generate(), in one run.

Both answer the same chat-templated held-out prompts greedily (EOS honoured) in batches of the same size; the
rows whose outputs are identical are counted, and tokens/s is response tokens / wall time (warm-up excluded).
    python -m bench.generate_speed [--model DIR] [--device cpu|cuda] [--dtype float32|bfloat16]
                                   [--num-prompts N] [--batch B] [--max-new-tokens T]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench import common


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.generate_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target checkpoint dir (default: SmolLM2-135M-Instruct from the packaged GGUF)")
    p.add_argument("--prompts", help="prompt file (default: bench/heldout_prompts.json)")
    p.add_argument("--num-prompts", type=int, default=None, help="default: 16 on CPU, all (64) on an accelerator")
    p.add_argument("--batch", type=int, default=None, help="prompts per batch (default: 8 on CPU, 64 otherwise)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    return p.parse_args(argv)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None) -> None:
    """Runs both generators on the same prompts and writes bench/results/generate-<hardware>.{md,json}."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafter_svc.train.cli import _eos_ids
    from drafter_svc.train.samples import chat_prompt_ids_batch, generate_greedy
    from drafter_svc.train.fast_generate import generate_greedy_fast, supports_fast_greedy

    args = parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.num_prompts if args.num_prompts is not None else (0 if on_gpu else 16)
    batch = args.batch or (64 if on_gpu else 8)
    model_dir = common.resolve_model(args.model)
    prompts, source = common.load_prompts(args.prompts, n or None)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = chat_prompt_ids_batch(tok, [p["text"] for p in prompts])
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    if not supports_fast_greedy(model):
        raise SystemExit(f"model_type {model.config.model_type!r} has no fast path: nothing to compare")
    eos = _eos_ids(Path(model_dir), tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    hw = common.hardware(args.device, args.dtype, args.threads or torch.get_num_threads())
    date = common.now_utc()

    runs = {
        "transformers generate": lambda p: generate_greedy(model, p, args.max_new_tokens, eos, pad, batch_size=batch),
        "fast_generate (static cache)": lambda p: generate_greedy_fast(model, p, args.max_new_tokens, eos, pad,
                                                                       max_batch=batch),
    }
    outputs, rows = {}, []
    for name, fn in runs.items():
        fn(ids[:2])  # warm-up
        _sync(args.device)
        t0 = time.perf_counter()
        outs = fn(ids)
        _sync(args.device)
        dt = time.perf_counter() - t0
        outputs[name] = outs
        new = sum(len(o) for o in outs)
        rows.append({"system": name, "prompts": len(ids), "batch": batch, "response_tokens": new,
                     "wall_s": dt, "tok_s": new / dt})
        print(f"{name:30s} {new} tokens in {dt:.2f} s = {new / dt:.1f} tok/s", flush=True)
    ref = outputs["transformers generate"]
    for r in rows:
        r["x_generate"] = r["tok_s"] / rows[0]["tok_s"]
        r["rows_identical"] = f"{sum(a == b for a, b in zip(outputs[r['system']], ref))}/{len(ref)}"

    command = common.command_line("bench.generate_speed")
    md = [f"# Distillation generator speed ({common.hardware_tag(hw)})", "",
          f"- Command: `{command}`", f"- Date: {date}",
          f"- Hardware: {hw['cpu_model']} ({hw['usable_cpus']} usable CPUs)"
          + (f", {hw['gpu']}" if hw.get("gpu") else "") + f"; device `{args.device}`, dtype {args.dtype}, "
          f"torch threads {hw['torch_threads_per_service']}",
          f"- Software: torch {hw['torch']}, transformers {hw['transformers']}, Python {hw['python']}",
          f"- Model: `{model_dir}` ({model.config.model_type})",
          f"- Work: {len(ids)} prompts from {source}, chat template, greedy, max {args.max_new_tokens} new tokens, "
          f"EOS honoured, batches of {batch} (length-sorted for both), warm-up excluded", "",
          "tok/s = response tokens / wall time. Rows identical = outputs equal to transformers' token for token "
          "(in bfloat16 a different kernel order may flip a near-tie).", "",
          common.md_table(["system", "prompts", "batch", "response tokens", "wall s", "tok/s", "x generate",
                           "rows identical"],
                          [[r["system"], r["prompts"], r["batch"], r["response_tokens"], r["wall_s"], r["tok_s"],
                            r["x_generate"], r["rows_identical"]] for r in rows])]
    data = {"command": command, "date": date, "hardware": hw, "model": model_dir, "rows": rows,
            "max_new_tokens": args.max_new_tokens, "prompt_source": source}
    common.write_outputs(args.out_dir, f"generate-{common.hardware_tag(hw)}", data, "\n".join(md))


if __name__ == "__main__":
    main()
