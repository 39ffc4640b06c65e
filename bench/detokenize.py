"""The gateway's per-step detokenization: the windowed IncrementalDetokenizer against decoding the whole output.

Every engine step the gateway turns each sequence's newly accepted tokens into a text delta, on the step's
critical path. Decoding the whole output each step (what gateway/detokenizer.py did before) costs time in the
output's length; the windowed decode does not. This streams the SmolLM2 tokenizer's encoding of held-out prompts
(repeated to the longest length) through both, `--per-step` tokens a step as a DDTree verify accepts them, and
reports the mean microseconds per step over the steps that end between each pair of lengths; both must give the
same text. The two take turns every step (ratios within one run).

    python -m bench.detokenize [--lengths 128 512 2048] [--per-step 8]

Writes <out-dir>/detokenize-<hardware>.{md,json}.
"""
from __future__ import annotations

import argparse
import time

from bench import common
from gateway.detokenizer import IncrementalDetokenizer


class WholeDecode(IncrementalDetokenizer):
    """The baseline: every update decodes all ids so far."""

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.detokenize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048], help="output lengths (tokens)")
    p.add_argument("--per-step", type=int, default=8, help="tokens accepted per step")
    p.add_argument("--rounds", type=int, default=5, help="streams per detokenizer")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(common.resolve_model(None), local_files_only=True)
    prompts, source = common.load_prompts(None, None)
    text = "\n".join(p["text"] for p in prompts)
    ids = tokenizer.encode(text, add_special_tokens=False)
    longest = max(args.lengths)
    ids = (ids * (longest // max(1, len(ids)) + 1))[:longest]
    edges = [0, *sorted(args.lengths)]
    kinds = {"whole decode (before)": WholeDecode, "windowed (now)": IncrementalDetokenizer}
    spent = {k: [0.0] * (len(edges) - 1) for k in kinds}
    steps = [0] * (len(edges) - 1)
    for _ in range(args.rounds):
        detoks = {k: cls(tokenizer) for k, cls in kinds.items()}
        texts = {k: [] for k in kinds}
        for start in range(0, longest, args.per_step):
            chunk = ids[start:start + args.per_step]
            end = start + len(chunk)
            bucket = next(i for i in range(len(edges) - 1) if end <= edges[i + 1])
            steps[bucket] += 1
            for k, d in detoks.items():   # turns every step
                t0 = time.perf_counter()
                for tok in chunk:
                    d.stop_hit(tok)
                texts[k].append(d.take_text(final=end >= longest))
                spent[k][bucket] += time.perf_counter() - t0
        whole, windowed = ("".join(t) for t in texts.values())
        if whole != windowed:
            raise SystemExit("the two detokenizers disagree")
    per_step = {k: [s / max(1, n) * 1e6 for s, n in zip(v, steps)] for k, v in spent.items()}
    hw = common.hardware("cpu", "-", None)
    rows = []
    for i in range(len(edges) - 1):
        before, now = (per_step[k][i] for k in kinds)
        rows.append([f"{edges[i] + 1}-{edges[i + 1]}", f"{before:.1f}", f"{now:.1f}", f"{before / now:.2f}"])
    data = {"bench": "detokenize", "command": common.command_line("bench.detokenize"), "date": common.now_utc(),
            "hardware": hw, "tokenizer": "SmolLM2-135M-Instruct", "prompts": source, "per_step": args.per_step,
            "rounds": args.rounds, "lengths": args.lengths, "us_per_step": per_step}
    md = "\n".join([
        f"# Per-step detokenization on the gateway ({common.hardware_tag(hw)})", "",
        f"Command: `{data['command']}`  ", f"Date: {data['date']}  ",
        f"CPU: {hw['cpu_model']} ({hw['usable_cpus']} usable)", "",
        f"SmolLM2 tokenizer, {args.per_step} tokens a step, {args.rounds} streams each; microseconds per step "
        "(one sequence) over the steps whose output ends in the length range; the texts are identical.", "",
        common.md_table(["output tokens", "whole decode us", "windowed us", "x"], rows), ""])
    print(md)
    common.write_outputs(args.out_dir, f"detokenize-{common.hardware_tag(hw)}", data, md)


if __name__ == "__main__":
    main()
