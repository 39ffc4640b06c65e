"""Weight-only int8 / int4 Triton matmul against bf16 F.linear, at the projection shapes of Qwen3-8B and Qwen3.6-27B.

Each case is timed inside a CUDA graph, as the engine runs it: one graph of --calls back-to-back calls, replayed
--replays times, CUDA-event timed; the median replay / calls is reported. The calls cycle through enough copies
of the weight to total >= 256 MiB per format, so no call finds its weight in the 50 MB L2 left by the previous
one (in a model step every projection reads a different weight). Each case also reports how far the kernel's
output is from the dequantized reference F.linear(x, q * s) (max |diff| / max |ref|).

    python -m bench.int8_kernel                       # Qwen3-8B shapes + the 27B MLP, M in 1, 8, 65, 520
    python -m bench.int8_kernel --ms 1,16,65,130,520 --bits 8
    python -m bench.int8_kernel --gemv-sweep          # int8 GEMV (M <= 4): every tiling of the grid, M in 1, 4
    python -m bench.int8_kernel --gemv-sweep --weights bf16   # the same kernel on bf16 weights against cuBLAS

--gemv-sweep prints one line per (shape, M, tiling): ms per call (timed as above), the error against the
reference, and the dot kernel's (int8) or cuBLAS's F.linear (bf16) and the default GEMV tiles' times for
comparison; then the best tiling of each (shape, M). --dot-sweep does the same for the dot kernel's tilings.
With --write-tiles FILE either sweep merges each (shape, M)'s winner into a per-GPU tile table
(target_svc/int8_tiles.py) where it saves at least --min-gain of the untuned tiles' time:

    python -m bench.int8_kernel --dot-sweep --ms 64 --write-tiles target_svc/int8_tiles/nvidia-h200.json

Writes bench/results/int8-kernel-<hardware>.{md,json} (or --out-dir). Needs CUDA and Triton.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/int8_kernel.py` too

from bench import common  # noqa: E402
from target_svc import int8_matmul, int8_tiles, w8a8_matmul  # noqa: E402
from target_svc.quantization import QuantizedWeight, quantize_weight, w8a8_reference  # noqa: E402

# (name, N = out_features, K = in_features)
SHAPES = [
    ("8b q_proj / o_proj", 4096, 4096),
    ("8b k_proj / v_proj", 1024, 4096),
    ("8b fused qkv", 6144, 4096),
    ("8b fused gate_up", 24576, 4096),
    ("8b down_proj", 4096, 12288),
    ("27b gate / up", 17408, 5120),
]
# The GEMV sweep also times the LM head (one decode step reads it once per token).
SWEEP_SHAPES = SHAPES + [("8b lm_head", 151936, 4096)]
L2_DEFEAT_BYTES = 256 * 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.int8_kernel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default=None,
                   help="rows of x (decode: batch; verify: batch x tree nodes); default 1,8,65,520 (sweep: 1,4)")
    p.add_argument("--bits", default="8,4", help="weight formats to time (8, 4 or both)")
    p.add_argument("--calls", type=int, default=20, help="back-to-back calls captured in one graph")
    p.add_argument("--replays", type=int, default=5, help="timed replays (median reported)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--gemv-sweep", action="store_true", help="time the int8 GEMV under every tiling of the grid")
    p.add_argument("--block-n", default="16,32,64", help="GEMV sweep: output columns per program")
    p.add_argument("--block-k", default="256,512,1024", help="GEMV sweep: K step")
    p.add_argument("--splits", default="1,2,4,8", help="GEMV sweep: K splits (those past the K steps skipped)")
    p.add_argument("--warps", default="4,8", help="GEMV sweep: warps per program")
    p.add_argument("--stages", default="2", help="GEMV sweep: num_stages (e.g. 1,2,3)")
    p.add_argument("--weights", default="int8", help="GEMV sweep: weight formats (int8, bf16 or both)")
    p.add_argument("--dot-sweep", action="store_true",
                   help="time the int8 dot kernel under every tiling of its grid (M default 17,65: verify blocks)")
    p.add_argument("--dot-block-m", default="16,32,64,128", help="dot sweep: output rows per program")
    p.add_argument("--dot-block-n", default="32,64,128", help="dot sweep: output columns per program")
    p.add_argument("--dot-block-k", default="64,128", help="dot sweep: K step")
    p.add_argument("--dot-splits", default="1,2,4", help="dot sweep: K splits")
    p.add_argument("--dot-warps", default="4", help="dot sweep: warps per program")
    p.add_argument("--dot-stages", default="3", help="dot sweep: num_stages")
    p.add_argument("--dot-swap", default="0", help="dot sweep: 0 x W^T, 1 the swapped W x^T (the weight as the left "
                   "operand, which Hopper's wgmma can take from registers), or both")
    p.add_argument("--dot-shapes", default="",
                   help="dot sweep: only the shapes whose name holds one of these comma-separated words")
    p.add_argument("--write-tiles", default="", metavar="FILE",
                   help="sweeps: merge each (shape, M)'s winner into this int8 tile table (target_svc/int8_tiles.py; "
                   "e.g. target_svc/int8_tiles/nvidia-h200.json) where it beats the untuned tiles by --min-gain")
    p.add_argument("--min-gain", type=float, default=0.03,
                   help="--write-tiles: the least fraction of the untuned tiles' time a winner must save")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    return p.parse_args(argv)


def graph_ms(fns: list[Callable[[], object]], calls: int, replays: int) -> float:
    """Median ms per call of a captured graph of `calls` calls, cycling through fns (warm-up runs first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles the kernels before the capture, as CapturedFunction does
        for fn in fns[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def copies_for(nbytes: int) -> int:
    """Weight copies whose calls together read >= L2_DEFEAT_BYTES (at least 2)."""
    return max(2, -(-L2_DEFEAT_BYTES // nbytes))


def measure_shape(n: int, k: int, ms: list[int], bits_list: list[int], args, device: torch.device) -> list[dict]:
    """Rows {M, bf16_ms, int8_ms, int8_err, ...} for one weight shape."""
    gen = torch.Generator(device=device).manual_seed(0)
    dense = [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
             for _ in range(copies_for(n * k * 2))]
    quant: dict[int, list[QuantizedWeight]] = {}
    for bits in bits_list:
        one = n * k * bits // 8
        quant[bits] = [quantize_weight(dense[i % len(dense)], bits) for i in range(copies_for(one))]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
        row: dict = {"N": n, "K": k, "M": m}
        row["bf16_ms"] = graph_ms([lambda w=w: F.linear(x, w) for w in dense], args.calls, args.replays)
        for bits in bits_list:
            ws = quant[bits]
            key = f"int{bits}"
            try:
                cfg = int8_matmul.kernel_config(m, n, k, bits, ws[0].group_size, torch.cuda.get_device_properties(
                    device).multi_processor_count)
                row[f"{key}_config"] = {"kernel": type(cfg).__name__, **cfg.__dict__}
                ref = F.linear(x.float(), ws[0].dequantize(torch.bfloat16).float())
                got = int8_matmul.matmul(x, ws[0].qweight, ws[0].scales, bits=bits).float()
                row[f"{key}_err"] = ((got - ref).abs().max() / ref.abs().max()).item()
                row[f"{key}_ms"] = graph_ms([lambda w=w: int8_matmul.matmul(x, w.qweight, w.scales, bits=bits)
                                             for w in ws], args.calls, args.replays)
                row[f"{key}_ratio"] = row[f"{key}_ms"] / row["bf16_ms"]
                # The alternative for many rows (a long prompt's prefill chunk): widen the weight to bf16, then
                # the dense GEMM; it pays a weight read and a bf16 write, which many rows can amortise.
                row[f"{key}_dequant_ms"] = graph_ms([lambda w=w: F.linear(x, w.dequantize(torch.bfloat16))
                                                     for w in ws], args.calls, args.replays)
            except Exception as exc:  # noqa: BLE001 - one failing case must not lose the others
                row[f"{key}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        if 8 in quant:   # w8a8 on the same int8 weights: the row quantizer and the int8 x int8 product together
            ws = quant[8]
            try:
                row["w8a8_config"] = w8a8_matmul.choose_config(
                    m, n, k, torch.cuda.get_device_properties(device).multi_processor_count).__dict__
                got = w8a8_matmul.matmul(x, ws[0].qweight, ws[0].scales)
                row["w8a8_exact"] = bool(torch.equal(got, w8a8_reference(x, ws[0]).to(torch.bfloat16)))
                row["w8a8_ms"] = graph_ms([lambda w=w: w8a8_matmul.matmul(x, w.qweight, w.scales) for w in ws],
                                          args.calls, args.replays)
                row["w8a8_ratio"] = row["w8a8_ms"] / row["bf16_ms"]
            except Exception as exc:  # noqa: BLE001 - one failing case must not lose the others
                row["w8a8_error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print(row, flush=True)
    return rows


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def _below(ms: list[int], m: int) -> int:
    """The largest of ms under m (0 where none)."""
    return max((v for v in ms if v < m), default=0)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


def _time_tilings(cases, call, ws, ref, args, prefix: str, describe) -> tuple[list[tuple], dict[str, float]]:
    """Each (label, config) of cases timed as call(w, config) over the weight copies ws: one line per case (prefix,
    the tiling, ms per call, describe(ms), the error against ref; FAILED where it does not compile or fit) ->
    ((ms, tiling, error, config) of the unlabelled cases (the grid's), {label: ms} of the labelled ones)."""
    results, labelled = [], {}
    for label, cfg in cases:
        tiling = (f"{label} " if label else "") + ("" if cfg is None else str(tuple(cfg.__dict__.values())))
        try:
            err = _rel_err(call(ws[0], cfg), ref)
            t = graph_ms([lambda w=w: call(w, cfg) for w in ws], args.calls, args.replays)
            if label:
                labelled[label] = t
            else:
                results.append((t, tiling, err, cfg))
            line = f"{t:.4f} | {describe(t)} | {err:.1e}"
        except Exception as exc:  # noqa: BLE001 - a tiling that does not compile or fit: the sweep goes on
            line = f"FAILED | | {type(exc).__name__}: {str(exc)[:80]}"
            torch.cuda.synchronize()
        print(f"{prefix} | {tiling} | {line}", flush=True)
    return results, labelled


def tuned_entry(kernel: str, m: int, below: int, n: int, k: int, results: list[tuple], default_ms: float | None,
                min_gain: float) -> int8_tiles.TunedTile | None:
    """The grid's winner for m rows as a tile-table entry, or None where it is not at least min_gain faster than the
    tiles the kernels launch without a table (default_ms). Its rows run up to m from the first row of m's bucket
    (the dot kernel's; the GEMV's: row 1), but not down to `below`, the next smaller M the sweep timed."""
    if not results or default_ms is None:
        return None
    t, _, _, cfg = min(results, key=lambda r: r[0])
    if t > default_ms * (1.0 - min_gain):
        return None
    lo = int8_matmul.row_bucket(m)[0] if kernel == "dot" else 1
    return int8_tiles.TunedTile(max(lo, below + 1), m, n, k, kernel, tuple(cfg.__dict__.values()), t, default_ms)


def write_tiles(path: str, entries: list[int8_tiles.TunedTile], device: torch.device) -> None:
    """Merge entries into the tile table at path (made if absent; a faster entry for the same rows wins)."""
    out = Path(path)
    old = int8_tiles.load_table(out) if out.is_file() else ()
    merged = int8_tiles.merge(old, entries)
    data = {"device": torch.cuda.get_device_properties(device).name, "date": common.now_utc(),
            "command": common.command_line("bench.int8_kernel"),
            "tiles": [int8_tiles.to_entry(t) for t in merged]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    int8_tiles.load_table(out)   # what was written reads back (no overlapping rows)
    print(f"\n{len(entries)} tuned entries written to {out} ({len(merged)} in all)", flush=True)


def gemv_sweep(args, device: torch.device) -> None:
    """One line per (weights, shape, M, GEMV tiling): ms per call and error; then the best tiling of each."""
    from target_svc.int8_matmul import GemvConfig

    ms = _ints(args.ms or "1,4")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    grid = list(itertools.product(_ints(args.block_n), _ints(args.block_k), _ints(args.splits), _ints(args.warps),
                                  _ints(args.stages)))
    print("weights | shape | N | K | M | tiling (BLOCK_N, BLOCK_K, split, warps, stages) | ms/call | GB/s | err",
          flush=True)
    best, tuned = [], []
    for fmt in args.weights.split(","):
        for name, n, k in SWEEP_SHAPES:
            gen = torch.Generator(device=device).manual_seed(0)
            nbytes = n * k * (1 if fmt == "int8" else 2)
            dense = [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
                     for _ in range(copies_for(nbytes))]
            ws = [quantize_weight(w, 8) for w in dense] if fmt == "int8" else dense
            for m in ms:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
                if fmt == "int8":
                    ref = F.linear(x.float(), ws[0].dequantize(torch.bfloat16).float())
                    call = lambda w, cfg: int8_matmul.matmul(x, w.qweight, w.scales, None, 8, cfg)  # noqa: E731
                    baseline = ("dot kernel", int8_matmul.choose_config(m, n, k, 8, 0, num_sms))
                else:
                    ref = F.linear(x.float(), ws[0].float())
                    call = lambda w, cfg: (F.linear(x, w) if cfg is None  # noqa: E731
                                           else int8_matmul.dense_gemv(x, w, None, cfg))
                    baseline = ("cuBLAS F.linear", None)
                cases = [baseline, ("default GEMV", int8_matmul.choose_gemv_config(m, n, k, num_sms))]
                cases += [("", GemvConfig(*t)) for t in grid
                          if t[2] <= -(-k // t[1]) and m <= int8_matmul.GEMV_MAX_ROWS]
                results, labelled = _time_tilings(cases, call, ws, ref, args, f"{fmt} | {name} | {n} | {k} | {m}",
                                                  lambda t, nbytes=nbytes: f"{nbytes / t / 1e6:.0f}")
                if results:
                    best.append((fmt, name, n, k, m, *min(results, key=lambda r: r[0])[:3]))
                if fmt == "int8":
                    tile = tuned_entry("gemv", m, _below(ms, m), n, k, results, labelled.get("dot kernel"),
                                       args.min_gain)
                    tuned += [tile] if tile else []
            del ws, dense
            torch.cuda.empty_cache()
    print("\nbest GEMV tiling per weights, shape and M:")
    for fmt, name, n, k, m, t, tiling, err in best:
        print(f"{fmt} | {name} | {n} | {k} | {m} | {tiling} | {t:.4f} | {err:.1e}")
    if args.write_tiles:
        write_tiles(args.write_tiles, tuned, device)


def dot_sweep(args, device: torch.device) -> None:
    """One line per (shape, M, dot-kernel tiling) of int8 weights: ms per call against cuBLAS's bf16 and the default
    tiling, and the error; then the best tiling of each (shape, M). The default tiling pads M to its bucket's tile
    (65 rows: one 128-row tile, half of its MMA work on padding): which tiling a verify block wants."""
    from target_svc.int8_matmul import TileConfig

    ms = _ints(args.ms or "17,65")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    grid = list(itertools.product(_ints(args.dot_block_m), _ints(args.dot_block_n), _ints(args.dot_block_k),
                                  _ints(args.dot_splits), _ints(args.dot_swap), _ints(args.dot_warps),
                                  _ints(args.dot_stages)))
    words = [w for w in args.dot_shapes.split(",") if w]
    shapes = [s for s in SHAPES if not words or any(w in s[0] for w in words)]
    if not shapes:
        raise SystemExit(f"--dot-shapes {args.dot_shapes!r} names none of: {', '.join(s[0] for s in SHAPES)}")
    print("shape | N | K | M | tiling (BLOCK_M, BLOCK_N, BLOCK_K, split, swap AB, warps, stages) | ms/call | x bf16 "
          "| err",
          flush=True)
    best, tuned = [], []
    for name, n, k in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        dense = [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
                 for _ in range(copies_for(n * k * 2))]
        ws = [quantize_weight(dense[i % len(dense)], 8) for i in range(copies_for(n * k))]
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
            ref = F.linear(x.float(), ws[0].dequantize(torch.bfloat16).float())
            bf16 = graph_ms([lambda w=w: F.linear(x, w) for w in dense], args.calls, args.replays)
            default = int8_matmul.kernel_config(m, n, k, 8, 0, num_sms)   # the rule (GEMV where switched on)
            cases = [("default", default)] + [
                ("", TileConfig(bm, bn, bk, split, bool(swap), warps, stages))
                for bm, bn, bk, split, swap, warps, stages in grid
                if (bm == 16 or bm < 2 * m) and split * 2 * bk <= k]
            results, labelled = _time_tilings(
                cases, lambda w, cfg: int8_matmul.matmul(x, w.qweight, w.scales, None, 8, cfg), ws, ref, args,
                f"{name} | {n} | {k} | {m}", lambda t, bf16=bf16: f"{t / bf16:.2f}")
            if results:
                t, tiling, err, _ = min(results, key=lambda r: r[0])
                best.append((name, n, k, m, tiling, t, t / bf16, err))
                tile = tuned_entry("dot", m, _below(ms, m), n, k, results, labelled.get("default"), args.min_gain)
                tuned += [tile] if tile else []
        del ws, dense
        torch.cuda.empty_cache()
    print("\nbest dot tiling per shape and M (x bf16: against cuBLAS F.linear on the bf16 weight):")
    for name, n, k, m, tiling, t, ratio, err in best:
        print(f"{name} | {n} | {k} | {m} | {tiling} | {t:.4f} | {ratio:.2f} | {err:.1e}")
    if args.write_tiles:
        write_tiles(args.write_tiles, tuned, device)


def _fmt(v: float | None, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if not int8_matmul.available(device):
        raise SystemExit(f"the Triton kernels cannot run on {device} (CUDA device of capability >= 8.0 and "
                         "the triton package needed)")
    if args.gemv_sweep or args.dot_sweep:
        with torch.inference_mode():
            (gemv_sweep if args.gemv_sweep else dot_sweep)(args, device)
        return
    ms = _ints(args.ms or "1,8,65,520")
    bits_list = [int(v) for v in args.bits.split(",")]
    rows = []
    with torch.inference_mode():
        for name, n, k in SHAPES:
            for row in measure_shape(n, k, ms, bits_list, args, device):
                rows.append({"shape": name, **row})
                torch.cuda.empty_cache()
    hw = common.hardware(args.device, "bfloat16", None)
    data = {"command": common.command_line("bench.int8_kernel"), "date": common.now_utc(), "hardware": hw,
            "calls_per_graph": args.calls, "replays": args.replays, "rows": rows}
    headers = ["shape", "N", "K", "M", "bf16 ms"]
    for bits in bits_list:
        headers += [f"int{bits} ms", f"int{bits}/bf16", f"int{bits} err", f"int{bits} dequant + bf16 ms"]
    if 8 in bits_list:
        headers += ["w8a8 ms", "w8a8/bf16", "w8a8 == reference"]
    table = []
    for r in rows:
        line = [r["shape"], r["N"], r["K"], r["M"], _fmt(r["bf16_ms"], ".4f")]
        for bits in bits_list:
            key = f"int{bits}"
            line += [_fmt(r.get(f"{key}_ms"), ".4f"), _fmt(r.get(f"{key}_ratio"), ".2f"),
                     _fmt(r.get(f"{key}_err"), ".1e") if f"{key}_error" not in r else "FAILED",
                     _fmt(r.get(f"{key}_dequant_ms"), ".4f")]
        if 8 in bits_list:
            line += [_fmt(r.get("w8a8_ms"), ".4f"), _fmt(r.get("w8a8_ratio"), ".2f"),
                     "FAILED" if "w8a8_error" in r else ("yes" if r.get("w8a8_exact") else "NO")]
        table.append(line)
    failures = [f"- {r['shape']} M={r['M']} int{b}: {r[f'int{b}_error']}" for r in rows for b in bits_list
                if f"int{b}_error" in r] + [f"- {r['shape']} M={r['M']} w8a8: {r['w8a8_error']}" for r in rows
                                             if "w8a8_error" in r]
    md = [f"# Weight-only matmul kernels: {hw.get('gpu', hw['cpu_model'])}", "",
          f"Command: `{data['command']}`  ", f"Date: {data['date']}  ",
          f"Each time: ms per call, median of {args.replays} replays of a CUDA graph of {args.calls} calls over "
          "weight copies that total >= 256 MiB (no L2 reuse between calls). err: max |kernel - F.linear(x, q * s)| "
          "/ max |F.linear(x, q * s)|, bf16 output. dequant + bf16: the weight widened to bf16, then F.linear (what "
          "many rows could take instead of the kernel). w8a8: the same int8 weights with each input row quantized "
          "to int8 (the row-quantizing launch included), compared bit for bit with its PyTorch reference.", "",
          common.md_table(headers, table)]
    if failures:
        md += ["", "Failures:", *failures]
    common.write_outputs(args.out_dir, f"int8-kernel-{common.hardware_tag(hw)}", data, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
