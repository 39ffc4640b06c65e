"""The tree WY kernel inside the hybrid model against the PyTorch core, tree size by tree size (a GPU check).

The kernel's own tests compare its core with the reference core on made-up inputs; this runs the whole path a
verify takes in the target service: the compiled glue's inputs, the kernel reading the slots' states in place,
the compiled commit of the accepted path. For each node count T, three slots prefill the same context, verify the
same DDTree-shaped tree of T nodes and commit the same path, each one way:

    reference               the PyTorch core (DDTREE_GDN_KERNELS=off), the compiled commit
    kernel                  the fused kernel, the compiled commit (the serving path on a GPU)
    kernel, plain commit    the fused kernel, commit_states uncompiled
    kernel, plain glue      the fused kernel, every glue function and the commit uncompiled

It found (H100, 2026-12-06) 64-node trees of a random 27B layout NaN: rows past the tree's last 16-node block
were scaled by e^{-g_0}, infinite for a fast-decaying root gate (target_svc/gdn_tree_wy_kernels.py, _block_terms).

Reported per T, against the reference: the logits' max |diff| / max |logit|, greedy agreement, and the committed
recurrent and conv states' max |diff| / max |state|, and whether everything is finite. A serving path that is
right differs by float32 rounding carried through bf16 layers (~1e-3 of the logits, greedy agreement 1.0).

    python -m bench.tree_kernel_check --model /tmp/w27/target --layers 4 --nodes 16,17,48,63,64,65 --out-dir DIR
"""
from __future__ import annotations

import argparse
import dataclasses
import os

import torch

from bench import common
from bench.step_cost import random_tree
from target_svc import gdn_kernels
from target_svc.gdn_tree_wy import commit_states
from target_svc.hybrid_layers import HybridKernels
from target_svc.loader import load_target
from target_svc.model import TargetModel

# (name, DDTREE_GDN_KERNELS, what runs uncompiled: nothing, the commit, or the glue and the commit)
VARIANTS = (("reference", "off", ""), ("kernel", "", ""), ("kernel, plain commit", "", "commit"),
            ("kernel, plain glue", "", "glue"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.tree_kernel_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a hybrid (Qwen3.5 / Qwen3.6) checkpoint directory")
    p.add_argument("--layers", type=int, default=4, help="load only the first N layers (default 4: 3 GDN + 1)")
    p.add_argument("--nodes", default="16,17,32,33,48,63,64,65,80", help="tree sizes, comma-separated")
    p.add_argument("--context", type=int, default=40, help="prefilled tokens before the tree")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--out-dir", default=None)
    return p.parse_args(argv)


def root_path(parents: list[int], node: int) -> list[int]:
    """node and its ancestors, root first."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (nan where either is not finite)."""
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return float("nan")
    return ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()


def run_variant(model: TargetModel, slot: int, prompt: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                path: list[int], env: str, uncompiled: str) -> dict:
    """Prefill slot, verify the tree and commit path one way: {logits, conv states, recurrent states} in float32."""
    dev = model.device
    ctx = prompt.shape[0]
    for state in model.cache.linear:
        state.conv[slot].zero_()
        state.rec[slot].zero_()
    slots = torch.tensor([slot], device=dev)
    chain = (torch.arange(ctx, device=dev) - 1)[None]
    model.forward_block(prompt[None].to(dev), chain, torch.ones(1, ctx, dtype=torch.bool, device=dev),
                        torch.zeros(1, dtype=torch.long, device=dev), slots, chain=True)
    switches = {gdn_kernels.ENV_VAR: env}
    saved_env, saved_kernels = {k: os.environ.get(k) for k in switches}, model.hybrid_kernels
    os.environ.update(switches)
    glues = [w.gdn.glue for w in model.hybrid or [] if w.gdn is not None]
    saved_glue = [glue.kernels for glue in glues]
    if uncompiled == "commit" and saved_kernels is not None:
        model.hybrid_kernels = dataclasses.replace(saved_kernels, commit_states=commit_states)
    elif uncompiled == "glue" and saved_kernels is not None:
        model.hybrid_kernels = HybridKernels.make(compiled=False)
        for glue in glues:
            glue.kernels = model.hybrid_kernels
    try:
        t = tokens.shape[0]
        ctx_lens = torch.full((1,), ctx, dtype=torch.long, device=dev)
        logits, _ = model.forward_block(tokens[None].to(dev), parents[None].to(dev),
                                        torch.ones(1, t, dtype=torch.bool, device=dev), ctx_lens, slots,
                                        key_len=ctx + t)
        model.commit_block(torch.tensor([path], device=dev), torch.tensor([len(path)], device=dev), slots, ctx_lens)
    finally:
        model.hybrid_kernels = saved_kernels
        for glue, kernels in zip(glues, saved_glue):
            glue.kernels = kernels
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return {"logits": logits[0].float(),
            "conv": torch.stack([s.conv[slot].float() for s in model.cache.linear]),
            "rec": torch.stack([s.rec[slot].float() for s in model.cache.linear])}


def check(model: TargetModel, nodes: int, context: int, gen: torch.Generator) -> dict:
    """One tree size: every variant against the reference."""
    vocab = model.target.vocab_size
    prompt = torch.randint(2, vocab, (context,), generator=gen)
    tokens, parents = random_tree(nodes, int(prompt[-1]), vocab, gen)
    deepest = max(range(nodes), key=lambda i: len(root_path(parents.tolist(), i)))
    path = root_path(parents.tolist(), deepest)
    out = {name: run_variant(model, slot, prompt, tokens, parents, path, env, uncompiled)
           for slot, (name, env, uncompiled) in enumerate(VARIANTS)}
    ref = out["reference"]
    row = {"nodes": nodes, "path": len(path)}
    for name, _, _ in VARIANTS[1:]:
        got = out[name]
        row[name] = {
            "logits": relative(got["logits"], ref["logits"]),
            "greedy": (got["logits"].argmax(-1) == ref["logits"].argmax(-1)).float().mean().item(),
            "rec": relative(got["rec"], ref["rec"]),
            "conv": relative(got["conv"], ref["conv"]),
            "finite": all(torch.isfinite(x).all().item() for x in got.values()),
        }
    row["reference finite"] = all(torch.isfinite(x).all().item() for x in ref.values())
    return row


def main(argv=None) -> None:
    """Runs the check per tree size; prints and writes a table."""
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    nodes = [int(n) for n in args.nodes.split(",")]
    target = load_target(args.model, device, dtype, num_layers=args.layers)
    model = TargetModel(target, len(VARIANTS) + 1, args.context + max(nodes) + 8, max(nodes))
    gen = torch.Generator().manual_seed(0)
    rows = [check(model, n, args.context, gen) for n in nodes]
    table = common.md_table(
        ["nodes", "path", "variant", "logits rel", "greedy", "rec rel", "conv rel", "finite"],
        [[r["nodes"], r["path"], name, f"{v['logits']:.1e}", f"{v['greedy']:.3f}", f"{v['rec']:.1e}",
          f"{v['conv']:.1e}", v["finite"] and r["reference finite"]]
         for r in rows for name, v in r.items() if isinstance(v, dict)])
    print(table, flush=True)
    if args.out_dir:
        hw = common.hardware(args.device, args.dtype, None)
        data = {"command": common.command_line("bench.tree_kernel_check"), "date": common.now_utc(),
                "hardware": hw, "model": args.model, "layers": args.layers, "rows": rows}
        common.write_outputs(args.out_dir, f"tree-kernel-check-{common.hardware_tag(hw)}", data,
                             f"# The tree WY kernel in the model against the PyTorch core\n\n{table}\n")


if __name__ == "__main__":
    main()
