"""Where a service's host time goes: a summary of py-spy's folded stacks (`py-spy record -f raw --threads`).

    python -m bench.pyspy_summary r/pyspy-gateway.txt r/pyspy-target.txt [--top 30] [--thread NAME]

Per file: samples per thread, then the functions with the most samples on top of the stack (self) and anywhere in
it (inclusive; a recursive function counted once per sample). Samples are CPU samples (py-spy without --idle), so
the shares say where a process spends its CPU, not where a step waits.
"""
from __future__ import annotations

import argparse
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

_LINE = re.compile(r"^(.*) (\d+)$")
_THREAD = re.compile(r'^thread \((\w+)\)(?:: "?([^"]*)"?)?$')   # 'thread (TID): name', quoted or not


@dataclass
class Profile:
    """Sample counts of one folded-stacks file."""

    total: int = 0
    threads: Counter = field(default_factory=Counter)
    self_samples: Counter = field(default_factory=Counter)
    inclusive: Counter = field(default_factory=Counter)


def function_of(frame: str) -> str:
    """'fn (path/file.py:123)' -> 'fn (path/file.py)': lines of one function counted together."""
    return re.sub(r":\d+\)$", ")", frame)


def read_folded(path: str | Path, thread: str | None = None) -> Profile:
    """Counts of one py-spy raw file; `thread`: only stacks of threads whose name contains it."""
    out = Profile()
    for line in Path(path).read_text().splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        frames, n = m.group(1).split(";"), int(m.group(2))
        if frames and frames[0].startswith("process "):
            frames = frames[1:]
        name = "?"
        if frames and (t := _THREAD.match(frames[0])):
            name = t.group(2) or t.group(1)
            frames = frames[1:]
        if thread is not None and thread not in name:
            continue
        out.total += n
        out.threads[name] += n
        if frames:
            out.self_samples[frames[-1]] += n
        for fn in {function_of(f) for f in frames}:
            out.inclusive[fn] += n
    return out


def render(path: str, p: Profile, top: int) -> str:
    """A text report of one file."""
    lines = [f"== {path}: {p.total} samples"]
    if not p.total:
        return "\n".join(lines)
    pct = lambda n: f"{100 * n / p.total:5.1f}%"   # noqa: E731
    lines.append("-- threads")
    lines += [f"{pct(n)} {n:7d}  {name}" for name, n in p.threads.most_common(top)]
    lines.append("-- self (top of stack)")
    lines += [f"{pct(n)} {n:7d}  {f}" for f, n in p.self_samples.most_common(top)]
    lines.append("-- inclusive (anywhere in the stack)")
    lines += [f"{pct(n)} {n:7d}  {f}" for f, n in p.inclusive.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--thread", help="only threads whose name contains this")
    args = ap.parse_args(argv)
    for f in args.files:
        print(render(f, read_folded(f, args.thread), args.top))


if __name__ == "__main__":
    main()
