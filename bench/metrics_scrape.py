"""What a Prometheus scrape costs each service: lines exported and the time to render them.

A scrape renders the registry in the serving process (a thread of it, holding the GIL the event loop needs), so
its time is time the service's steps wait. This starts the three services (tiny random checkpoints unless
`--model`/`--drafter`: the series, not the model, are what is measured), streams requests in every mode (and a
batch of them, so that the step histograms hold every label value a real run gives them), then times `--scrapes`
scrapes of each service's /metrics and counts its lines per metric family.

    python -m bench.metrics_scrape [--scrapes 20] [--requests 3]

Writes <out-dir>/metrics-scrape-<hardware>.{md,json}.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from bench import common
from bench.rpc_hop import tiny_checkpoints

SUFFIXES = ("_bucket", "_count", "_sum", "_created", "_total")


def family_of(line: str) -> str:
    """The metric family of one sample line of the text format."""
    name = line.split("{", 1)[0].split(" ", 1)[0]
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def time_scrapes(port: int, n: int) -> tuple[list[float], bytes]:
    """Wall seconds of n scrapes of one /metrics endpoint, and the last body."""
    url = f"http://127.0.0.1:{port}/metrics"
    body, times = b"", []
    for _ in range(n):
        t0 = time.perf_counter()
        body = urllib.request.urlopen(url, timeout=30).read()
        times.append(time.perf_counter() - t0)
    return times, body


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.metrics_scrape", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target checkpoint dir (default: a tiny random Qwen3)")
    p.add_argument("--drafter", help="drafter dir (default: a tiny random drafter for it)")
    p.add_argument("--scrapes", type=int, default=20)
    p.add_argument("--requests", type=int, default=3, help="requests per mode before the scrapes")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    hw = common.hardware("cpu", "float32", 1)
    with tempfile.TemporaryDirectory(prefix="ddtree-scrape-") as tmp:
        model, drafter = (args.model, args.drafter) if args.model else tiny_checkpoints(Path(tmp))
        stack = common.start_stack(model, drafter, "cpu", "float32", 1, step_sockets=True)
        try:
            prompts = [p["text"][:200] for p in common.load_prompts(None, args.requests)[0]]
            for mode in ("ar", "dflash", "ddtree"):
                common.run_requests(stack.gateway, [common.chat_request(t, args.max_tokens, mode) for t in prompts])
            batch = [common.chat_request(t, args.max_tokens, m) for t in prompts for m in ("ar", "ddtree")]
            common.run_requests(stack.gateway, batch, concurrency=len(batch))   # mixed-mode steps too
            rows, data = [], {}
            for service, port in stack.metrics_ports.items():
                times, body = time_scrapes(port, args.scrapes)
                lines = [ln for ln in body.decode().splitlines() if ln and not ln.startswith("#")]
                families = Counter(family_of(ln) for ln in lines)
                data[service] = {"lines": len(lines), "bytes": len(body), "median_ms": statistics.median(times) * 1e3,
                                 "max_ms": max(times) * 1e3, "top_families": families.most_common(5)}
                top = ", ".join(f"{f} {n}" for f, n in families.most_common(3))
                rows.append([service, len(lines), len(body), f"{data[service]['median_ms']:.1f}",
                             f"{data[service]['max_ms']:.1f}", top])
        finally:
            stack.stop()
    out = {"bench": "metrics_scrape", "command": common.command_line("bench.metrics_scrape"),
           "date": common.now_utc(), "hardware": hw, "scrapes": args.scrapes, "services": data}
    md = "\n".join([
        f"# What a /metrics scrape costs each service ({common.hardware_tag(hw)})", "",
        f"- Command: `{out['command']}`", f"- Date: {out['date']}",
        f"- Hardware: {hw['cpu_model']} ({hw['usable_cpus']} usable CPUs)",
        f"- Work: {args.requests} requests per mode (ar, dflash, ddtree) one at a time, then {2 * args.requests} at "
        f"once (ar and ddtree mixed), then {args.scrapes} scrapes per service, one after another, from this "
        "process; the scrape renders in the service's own process", "",
        common.md_table(["service", "sample lines", "bytes", "median ms", "max ms", "most lines"], rows), ""])
    print(md)
    common.write_outputs(args.out_dir, f"metrics-scrape-{common.hardware_tag(hw)}", out, md)


if __name__ == "__main__":
    main()
