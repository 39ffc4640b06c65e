"""What a structured output costs the target per step and sequence: the grammar's walk over the draft tree
(xgrammar's traverse_draft_tree: every node's allowed tokens, on the host) and masking the tree's logits with it
(where the logits are). A request without a grammar pays neither.

Trees are laid along a valid answer of a JSON schema (the spine: its next tokens) with random siblings, as a
DDTree of the given sizes carries them; the grammar has accepted a random prefix of the answer first. The
tokenizer is SmolLM2's (49k tokens); the compile time of the schema comes first.

    python -m bench.guide_cost [--nodes 17 65] [--device cpu|cuda] [--steps 200]

Writes <out-dir>/guide-cost-<hardware>.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from bench import common
from ddtree_serve.decoding.guides import GuideSpec, SequenceGuide, apply_guide_mask

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "born": {"type": "integer"}, "fields": {"type": "array", "items": {"type": "string"}},
    "alive": {"type": "boolean"}}, "required": ["name", "born", "fields", "alive"]}
ANSWER = '{"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing", "poetry"], "alive": false}'


def tree_along(spine: list[int], nodes: int, vocab: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """A tree of `nodes` nodes: the spine as a chain from the root, the rest random tokens under random nodes."""
    tokens, parents = [spine[0]], [-1]
    for token in spine[1:nodes]:
        tokens.append(token)
        parents.append(len(tokens) - 2)
    while len(tokens) < nodes:
        parents.append(rng.randrange(len(tokens)))
        tokens.append(rng.randrange(vocab))
    return tokens, parents


def time_steps(guide: SequenceGuide, answer: list[int], nodes: int, vocab: int, steps: int, device: str,
               rng: random.Random) -> dict:
    """Mean microseconds per step of the tree walk and of masking the tree's logits, over `steps` trees."""
    walk = mask = 0.0
    logits = torch.randn(nodes, vocab, device=device)
    for _ in range(steps):
        cut = rng.randrange(1, len(answer) - 2)
        guide.matcher.reset()
        guide.accept(answer[:cut])
        tokens, parents = tree_along(answer[cut - 1:], nodes, vocab, rng)
        t0 = time.perf_counter()
        bitmask = guide.tree_mask(tokens, parents)
        t1 = time.perf_counter()
        masked = apply_guide_mask(logits, bitmask)
        if device == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        walk += t1 - t0
        mask += t2 - t1
        del masked
    return {"walk_us": walk / steps * 1e6, "mask_us": mask / steps * 1e6}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.guide_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 17, 65], help="tree sizes (nodes, root included)")
    p.add_argument("--steps", type=int, default=200, help="trees per size")
    p.add_argument("--device", default="cpu", help="where the logits are masked")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(common.resolve_model(None), local_files_only=True)
    vocab = len(tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    t0 = time.perf_counter()
    grammar = GuideSpec("json", json.dumps(SCHEMA)).grammar()
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(grammar)
    compile_s = time.perf_counter() - t0
    answer = tokenizer.encode(ANSWER, add_special_tokens=False)
    guide = SequenceGuide(compiled, vocab)
    rng = random.Random(0)
    time_steps(guide, answer, max(args.nodes), vocab, 5, args.device, rng)   # warm-up
    per_size = {n: time_steps(guide, answer, n, vocab, args.steps, args.device, rng) for n in args.nodes}
    hw = common.hardware(args.device, "float32", None)
    rows = [[str(n), f"{r['walk_us']:.0f}", f"{r['walk_us'] / n:.1f}", f"{r['mask_us']:.0f}",
             f"{r['walk_us'] + r['mask_us']:.0f}"] for n, r in per_size.items()]
    data = {"bench": "guide_cost", "command": common.command_line("bench.guide_cost"), "date": common.now_utc(),
            "hardware": hw, "tokenizer": "SmolLM2-135M-Instruct", "vocab": vocab, "schema": SCHEMA,
            "compile_seconds": compile_s, "steps": args.steps, "device": args.device,
            "per_tree_size": {str(n): r for n, r in per_size.items()}}
    md = "\n".join([
        f"# A structured output's cost per target step ({common.hardware_tag(hw)})", "",
        f"Command: `{data['command']}`  ", f"Date: {data['date']}  ",
        f"CPU: {hw['cpu_model']} ({hw['usable_cpus']} usable); logits masked on `{args.device}`", "",
        f"SmolLM2 tokenizer ({vocab} tokens), a JSON schema of four fields (compiled once in {compile_s * 1e3:.0f} "
        f"ms); {args.steps} trees per size laid along a valid answer with random siblings, after a random prefix of "
        "it. Microseconds per step and sequence: the grammar's walk over the tree (host), masking the tree's logits "
        "with it (unpacking the bitmask where the logits are). A request without a grammar pays neither.", "",
        common.md_table(["tree nodes", "walk us", "walk us / node", "mask us", "total us"], rows), ""])
    print(md)
    common.write_outputs(args.out_dir, f"guide-cost-{common.hardware_tag(hw)}", data, md)


if __name__ == "__main__":
    main()
