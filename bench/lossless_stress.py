"""Randomised-schedule losslessness check of the runners in one process (no gRPC), on any device.

Sequences join at random steps (as the gateway's continuous batching admits them), mix ddtree/dflash/ar, and
drafts come from a real (random) drafter; every sequence must equal transformers' greedy generate().
    python -m bench.lossless_stress --kind qwen3 --device cuda [--math-sdpa]
"""
from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
from pathlib import Path

import torch

from ddtree_serve.decoding.config import SamplingParams
from ddtree_serve.decoding.ddtree import build_chain, build_ddtree_batch
from drafter_svc.runner import DraftItem, DrafterConfig, DrafterRunner
from target_svc.runner import PrefillItem, TargetConfig, TargetRunner, VerifyItem

MODES = ["ddtree", "ddtree", "ddtree", "ddtree", "dflash", "dflash", "ar", "ar", "ddtree", "ddtree"]
BUDGETS = [64, 4, 16, 64, 0, 0, 0, 0, 64, 8]
LENGTHS = [5, 17, 9, 30, 3, 12, 7, 21, 11, 2]


def run(kind: str, device: str, new_tokens: int, seed: int) -> list[int | None]:
    """First mismatch index per sequence (None = equal to transformers' greedy)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.conftest import TARGET_MAKERS, prompts_for, reference_greedy
    from tests.fixtures.tiny_drafter import make_tiny_drafter

    root = Path(tempfile.mkdtemp())
    target = Path(TARGET_MAKERS[kind](root / "t"))
    drafter = make_tiny_drafter(root / "d", target, seed=7)
    prompts = prompts_for(target, LENGTHS, seed=11)
    refs = [reference_greedy(target, p, new_tokens) for p in prompts]
    tr = TargetRunner(TargetConfig(model_dir=str(target), device=device, max_batch=8, max_seq_len=512,
                                   max_tree_nodes=129))
    dr = DrafterRunner(DrafterConfig(drafter_dir=str(drafter), target_model_dir=str(target), device=device,
                                     max_batch=8, max_seq_len=512))
    tr.set_feature_layers(dr.target_layer_ids)
    rng = random.Random(seed)
    waiting, running, ctx, gen, done = list(range(len(prompts))), {}, {}, {}, {}
    while waiting or running:
        new = [waiting.pop(0) for _ in range(rng.randint(0, min(len(waiting), 8 - len(running))))]
        if new:
            outs = tr.prefill([PrefillItem(f"s{i}", prompts[i], SamplingParams(), MODES[i] != "ar") for i in new])
            for i, o in zip(new, outs):
                s = f"s{i}"
                running[s], gen[s], ctx[s] = i, [o.next_token], o.context_len
                if MODES[i] != "ar":
                    dr.add_context(s, 0, o.features)
        if not running:
            continue
        ids = list(running)
        spec = [s for s in ids if MODES[running[s]] != "ar" and new_tokens - len(gen[s]) - 1 > 0]
        trees = {}
        if spec:
            lp, tk = dr.draft([DraftItem(s, gen[s][-1], ctx[s]) for s in spec], top_k=64, max_depth=15)
            for j, s in enumerate(spec):
                i, depth = running[s], min(15, new_tokens - len(gen[s]) - 1)
                if MODES[i] == "ddtree":
                    trees[s] = build_ddtree_batch(lp[j:j + 1], tk[j:j + 1], [gen[s][-1]], [BUDGETS[i]], [depth]).tree(0)
                else:
                    trees[s] = build_chain(lp[j:j + 1], tk[j:j + 1], [gen[s][-1]], [depth]).tree(0)
        items = [VerifyItem(s, trees[s].tokens.cpu(), trees[s].parents.cpu()) if s in trees else
                 VerifyItem(s, torch.tensor([gen[s][-1]]), torch.tensor([-1])) for s in ids]
        for o in tr.verify(items):
            s = o.seq_id
            if MODES[running[s]] != "ar":
                dr.add_context(s, ctx[s], o.features)
            gen[s] += o.accepted_tokens + [o.next_token]
            ctx[s] = o.context_len
            if len(gen[s]) >= new_tokens:
                done[s] = gen[s][:new_tokens]
                tr.release(s)
                dr.release(s)
                del running[s]
    return [next((j for j, (a, b) in enumerate(zip(done[f"s{i}"], refs[i])) if a != b), None)
            for i in range(len(prompts))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--kind", default="qwen3", choices=["qwen3", "llama", "qwen3_5"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--math-sdpa", action="store_true", help="force PyTorch's reference attention kernel")
    args = p.parse_args()
    ctx = contextlib.nullcontext()
    if args.math_sdpa:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ctx = sdpa_kernel(SDPBackend.MATH)
    with ctx:
        for seed in range(args.seeds):
            mismatches = run(args.kind, args.device, args.new_tokens, seed)
            ok = all(m is None for m in mismatches)
            print(f"{args.kind} {args.device} math_sdpa={args.math_sdpa} seed={seed}: "
                  f"{'OK' if ok else 'MISMATCH'} {mismatches}", flush=True)


if __name__ == "__main__":
    main()
