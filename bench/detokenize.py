"""The gateway's per-step detokenization: the windowed IncrementalDetokenizer against decoding the whole output.

Every engine step the gateway turns each sequence's newly accepted tokens into a text delta, on the step's
critical path. Decoding the whole output each step (what gateway/detokenizer.py did before) costs time in the
output's length; the windowed decode does not. This streams the SmolLM2 tokenizer's encoding of held-out prompts
(repeated to the longest length) through both, `--per-step` tokens a step as a DDTree verify accepts them, and
reports the mean microseconds per step over the steps that end between each pair of lengths; both must give the
same text. The two take turns every step (ratios within one run).

With stop strings (a request's `stop`; here ones the text never contains, the common case) every token of a step
used to be decoded on its own, to see whether it completed one; a second table times that against one decode a
step (`IncrementalDetokenizer.extend`, which goes token by token only once a stop string has appeared).

    python -m bench.detokenize [--lengths 128 512 2048] [--per-step 8] [--stop "</answer>" "User:"]

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


def _token_by_token(d: IncrementalDetokenizer, chunk: list[int]) -> None:
    for tok in chunk:
        d.stop_hit(tok)


def _one_decode(d: IncrementalDetokenizer, chunk: list[int]) -> None:
    d.extend(chunk)


def time_steps(tokenizer, ids: list[int], edges: list[int], per_step: int, rounds: int, kinds: dict) -> dict:
    """Mean microseconds per step of each kind (detokenizer class, stop strings, how a step adds its tokens) over
    the steps ending in each length range; the kinds take turns every step and must stream the same text."""
    spent = {k: [0.0] * (len(edges) - 1) for k in kinds}
    steps = [0] * (len(edges) - 1)
    longest = edges[-1]
    for _ in range(rounds):
        detoks = {k: cls(tokenizer, stop) for k, (cls, stop, _) in kinds.items()}
        texts = {k: [] for k in kinds}
        for start in range(0, longest, per_step):
            chunk = ids[start:start + per_step]
            end = start + len(chunk)
            bucket = next(i for i in range(len(edges) - 1) if end <= edges[i + 1])
            steps[bucket] += 1
            for k, d in detoks.items():   # turns every step
                t0 = time.perf_counter()
                kinds[k][2](d, chunk)
                texts[k].append(d.take_text(final=end >= longest))
                spent[k][bucket] += time.perf_counter() - t0
        if len({"".join(t) for t in texts.values()}) != 1:
            raise SystemExit(f"the detokenizers disagree: {list(kinds)}")
    return {k: [s / max(1, n) * 1e6 for s, n in zip(v, steps)] for k, v in spent.items()}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.detokenize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048], help="output lengths (tokens)")
    p.add_argument("--per-step", type=int, default=8, help="tokens accepted per step")
    p.add_argument("--rounds", type=int, default=5, help="streams per detokenizer")
    p.add_argument("--stop", nargs="*", default=["</answer>", "\n\nUser:"], help="stop strings (second table)")
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
    windowed = {"whole decode (before)": (WholeDecode, [], _token_by_token),
                "windowed (now)": (IncrementalDetokenizer, [], _token_by_token)}
    stopping = {"a decode a token (before)": (IncrementalDetokenizer, args.stop, _token_by_token),
                "a decode a step (now)": (IncrementalDetokenizer, args.stop, _one_decode)}
    per_step = {**time_steps(tokenizer, ids, edges, args.per_step, args.rounds, windowed),
                **time_steps(tokenizer, ids, edges, args.per_step, args.rounds, stopping)}
    hw = common.hardware("cpu", "-", None)
    tables = []
    for kinds in (windowed, stopping):
        (before_name, now_name) = kinds
        rows = [[f"{edges[i] + 1}-{edges[i + 1]}", f"{per_step[before_name][i]:.1f}", f"{per_step[now_name][i]:.1f}",
                 f"{per_step[before_name][i] / per_step[now_name][i]:.2f}"] for i in range(len(edges) - 1)]
        tables.append(common.md_table(["output tokens", f"{before_name} us", f"{now_name} us", "x"], rows))
    data = {"bench": "detokenize", "command": common.command_line("bench.detokenize"), "date": common.now_utc(),
            "hardware": hw, "tokenizer": "SmolLM2-135M-Instruct", "prompts": source, "per_step": args.per_step,
            "rounds": args.rounds, "lengths": args.lengths, "stop": args.stop, "us_per_step": per_step}
    md = "\n".join([
        f"# Per-step detokenization on the gateway ({common.hardware_tag(hw)})", "",
        f"Command: `{data['command']}`  ", f"Date: {data['date']}  ",
        f"CPU: {hw['cpu_model']} ({hw['usable_cpus']} usable)", "",
        f"SmolLM2 tokenizer, {args.per_step} tokens a step, {args.rounds} streams each; microseconds per step "
        "(one sequence) over the steps whose output ends in the length range; in each table the texts are "
        "identical and the two take turns every step.", "",
        "## Without stop strings: the windowed decode against decoding the whole output", "", tables[0], "",
        f"## With stop strings {args.stop} (never in the text): a decode a token against one a step", "", tables[1],
        ""])
    print(md)
    common.write_outputs(args.out_dir, f"detokenize-{common.hardware_tag(hw)}", data, md)


if __name__ == "__main__":
    main()
