"""HTTP load: the official openai client, streaming chat completions at a fixed concurrency; TTFT and tokens/s.

    python -m bench.http_load --concurrency 8 --num-prompts 16 --max-tokens 64 --modes ddtree,ar

Starts the three services (SmolLM2-135M-Instruct and its bundled drafter unless --model/--drafter) with the
gateway's HTTP front, or measures a running server with --url. Writes bench/results/http-<hardware>.{json,md}.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from bench.common import (RESULTS_DIR, command_line, hardware, hardware_tag, load_prompts, md_table, now_utc,
                          resolve_drafter, resolve_model, write_outputs)


async def one_request(client, model: str, text: str, max_tokens: int, mode: str) -> dict:
    """One streamed chat completion: TTFT (first content chunk), end-to-end time, tokens, tau."""
    t0 = time.perf_counter()
    ttft, parts, usage, ddtree = None, [], None, {}
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"mode": mode})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            ddtree = (chunk.model_extra or {}).get("ddtree", {})
        if chunk.usage is not None:
            usage = chunk.usage
    return {"ttft_s": ttft or 0.0, "e2e_s": time.perf_counter() - t0, "tokens": usage.completion_tokens,
            "text": "".join(parts), "tau": ddtree.get("mean_acceptance_length", 1.0)}


async def run_mode(base_url: str, api_key: str, prompts: list[str], max_tokens: int, mode: str,
                   concurrency: int) -> tuple[list[dict], float]:
    """All prompts through a semaphore of `concurrency` in-flight requests; returns results and wall seconds."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=900)
    model = (await client.models.list()).data[0].id
    gate = asyncio.Semaphore(concurrency)

    async def guarded(text):
        async with gate:
            return await one_request(client, model, text, max_tokens, mode)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(guarded(t) for t in prompts))
    wall = time.perf_counter() - t0
    await client.close()
    return list(results), wall


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def main() -> None:
    """Runs the load for each mode and writes the results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="base URL of a running server (e.g. http://127.0.0.1:8000/v1); default: start one")
    ap.add_argument("--api-key", default="none", help="Bearer key of --url")
    ap.add_argument("--model", help="target checkpoint (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--drafter", help="drafter directory (default: the bundled SmolLM2 drafter)")
    ap.add_argument("--device", default="cpu", help="device of the started services")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per started model service")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument("--num-prompts", type=int, default=16, help="held-out prompts sent per mode")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request")
    ap.add_argument("--modes", default="ddtree,ar", help="comma-separated decode modes to measure, in order")
    ap.add_argument("--out-dir", default=str(RESULTS_DIR), help="where the .json and .md go")
    args = ap.parse_args()

    prompts, source = load_prompts(None, args.num_prompts)
    texts = [p["text"] for p in prompts]
    hw = hardware(args.device, "float32", args.threads)
    stack = None
    base_url = args.url
    if base_url is None:
        from launch.local_stack import LocalStack

        stack = LocalStack(model=resolve_model(args.model), drafter=resolve_drafter(args.drafter), budget=0,
                           device=args.device, threads=args.threads, http=True,
                           # the modes run the same prompts in turn: none may start from another's cached rows
                           extra={"gateway": ["--no-enable-prefix-caching"]})
        stack.start(timeout_s=960)
        base_url = stack.http_url
    rows, data = [], {"command": command_line("bench.http_load"), "date": now_utc(), "hardware": hw,
                      "prompts": source, "concurrency": args.concurrency, "max_tokens": args.max_tokens, "modes": {}}
    texts_by_mode = {}
    try:
        asyncio.run(run_mode(base_url, args.api_key, texts[:1], 8, "ar", 1))  # warm-up, not counted
        for mode in args.modes.split(","):
            results, wall = asyncio.run(run_mode(base_url, args.api_key, texts, args.max_tokens, mode,
                                                 args.concurrency))
            tokens = sum(r["tokens"] for r in results)
            ttfts = [r["ttft_s"] for r in results]
            texts_by_mode[mode] = [r["text"] for r in results]
            row = {"mode": mode, "requests": len(results), "tokens": tokens, "wall_s": round(wall, 3),
                   "tokens_per_s": round(tokens / wall, 2), "ttft_mean_s": round(statistics.mean(ttfts), 3),
                   "ttft_p50_s": round(percentile(ttfts, 50), 3), "ttft_p90_s": round(percentile(ttfts, 90), 3),
                   "e2e_mean_s": round(statistics.mean(r["e2e_s"] for r in results), 3),
                   "tau_mean": round(statistics.mean(r["tau"] for r in results), 3)}
            data["modes"][mode] = row
            rows.append(list(row.values()))
            print(row, flush=True)
    finally:
        if stack is not None:
            stack.stop()
            stack.cleanup()
    base = "ar" if "ar" in texts_by_mode else None
    same = {m: (texts_by_mode[m] == texts_by_mode[base]) if base else None for m in texts_by_mode}
    data["outputs_equal_ar"] = same
    md = [f"# HTTP load: openai client, streaming chat completions ({hardware_tag(hw)})", "",
          f"- Command: `{data['command']}`", f"- Date: {data['date']}",
          f"- Hardware: {hw['cpu_model']} ({hw['usable_cpus']} usable of {hw['logical_cpus']} logical CPUs); device "
          f"`{hw['device']}`, float32; torch threads per service {args.threads}; load average at start "
          f"{hw.get('load_average_at_start')}",
          f"- Software: torch {hw['torch']}, transformers {hw['transformers']}, grpcio {hw['grpcio']}, Python "
          f"{hw['python']}",
          f"- Server: {'started by the script: ' + (args.model or 'SmolLM2-135M-Instruct') if stack else base_url}"
          f"; default DDTree budget (by device: {'16 on CPU' if args.device == 'cpu' else '64 on GPU'})",
          f"- Work: {len(texts)} prompts from {source}, chat template, greedy, max_tokens {args.max_tokens}, EOS "
          f"honoured, {args.concurrency} requests in flight; `openai` AsyncOpenAI, stream=True with include_usage; "
          "one warm-up request excluded", "",
          "tokens/s = completion tokens of all requests / wall time of the whole set. TTFT = time to the first "
          "content chunk, as the client sees it (includes queueing behind the other requests).", "",
          md_table(["mode", "requests", "tokens", "wall s", "tokens/s", "TTFT mean s", "TTFT p50 s", "TTFT p90 s",
                    "e2e mean s", "tau"], rows), "",
          f"Outputs equal to ar's (greedy, lossless): {same}"]
    write_outputs(args.out_dir, f"http-{hardware_tag(hw)}", data, "\n".join(md))


if __name__ == "__main__":
    main()
