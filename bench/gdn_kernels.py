"""Gated DeltaNet on the GPU: the PyTorch reference against fla-core's kernels at the Qwen3.6-27B GDN shape.

16 key heads and 48 value heads of 128, fp32 recurrence (as the target runs it), per batch size:

- decode, recurrence: one token from a random state, `stepwise_delta_rule` (the reference update) against
  `gdn_kernels.recurrent_delta_rule` (fla's fused_recurrent_gated_delta_rule);
- decode, layer + commit: a whole bf16 Gated DeltaNet layer (hidden 5120) for one token plus the commit of its
  state, today's CUDA decode step (the one-pass WY tree with one node, `gdn_tree_wy.py`) against the fla step
  (`gdn_step_forward_lean` + `gdn_commit_path`, kernels=True);
- prefill, recurrence: a --prefill-tokens chain from a random state, `chunked_delta_rule` (the reference chain)
  against `gdn_kernels.chunk_delta_rule` (fla's chunk_gated_delta_rule).

Each timing: --calls back-to-back calls captured in one CUDA graph, the graph replayed --replays times, each
replay timed with CUDA events; the median per call is reported. A case that cannot be captured is timed eagerly
(events around the same calls) and marked so; a case that fails is reported with its error and the run goes on.
The agreement column is max |fla - reference| / max |reference| over the outputs and the final state.

    python -m bench.gdn_kernels --out-dir /tmp/gdn            # on the GPU machine, fla-core installed

Writes <out-dir>/gdn-kernels-<hardware>.{md,json} (default out-dir: bench/results).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench import common

# The 27B's Gated DeltaNet: 16 key heads and 48 value heads of 128, hidden 5120, conv kernel 4.
KEY_HEADS, VALUE_HEADS, HEAD_DIM, HIDDEN, CONV_KERNEL = 16, 48, 128, 5120, 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gdn_kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--calls", type=int, default=20, help="back-to-back calls captured in one graph")
    p.add_argument("--replays", type=int, default=20, help="timed replays (median reported)")
    p.add_argument("--no-layer", action="store_true", help="skip the whole-layer decode case")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    return p.parse_args(argv)


# ---- timing --------------------------------------------------------------------------------------------------------
def _warm(fn: Callable[[], object], n: int = 3) -> None:
    """Runs fn on a side stream (compilation, autotuning), as a capture needs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(n):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def _events_ms(run: Callable[[], None], replays: int, calls: int) -> float:
    """Median over `replays` of the CUDA-event time of run(), divided by the calls run() makes."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def time_per_call(fn: Callable[[], object], calls: int, replays: int) -> tuple[float, str]:
    """(median ms per call, "graph" or "eager: why"): calls captured back to back, else timed eagerly."""
    _warm(fn)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        return _events_ms(graph.replay, replays, calls), "graph"
    except Exception as exc:  # not capturable: eager timing of the same calls
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
        torch.cuda.synchronize()

        def eager() -> None:
            for _ in range(calls):
                fn()

        return _events_ms(eager, replays, calls), f"eager ({why})"


def agreement(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> float:
    """max |got - want| / max |want| over matching tensors."""
    err = 0.0
    for a, b in zip(got, want):
        scale = b.float().abs().max().clamp(min=1e-12)
        err = max(err, ((a.float() - b.float()).abs().max() / scale).item())
    return err


# ---- inputs --------------------------------------------------------------------------------------------------------
def sweep_parser(module: str, description: str | None, out_stem: str) -> argparse.ArgumentParser:
    """The arguments every kernel sweep takes: --calls, --replays, --sweep, --out-dir (add the sweep's own)."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20, help="back-to-back calls captured in one graph")
    p.add_argument("--replays", type=int, default=20, help="timed replays (median reported)")
    p.add_argument("--sweep", action="store_true", help="time every tiling of the sweep grid too")
    p.add_argument("--out-dir", default=None, help=f"write {out_stem}-<hardware>.{{md,json}} there")
    return p


def sweep_row(case: str, label: str, call: Callable[[], object], error: Callable[[object], float], calls: int,
              replays: int, unit: float = 1.0, digits: int = 4) -> list[str]:
    """One row of a kernel sweep, [case, label, time per call (ms x unit), agreement, mode], printed as it comes;
    a configuration that does not compile or fit is reported in the row and the sweep goes on."""
    try:
        err = error(call())
        ms, mode = time_per_call(call, calls, replays)
        row = [case, label, f"{ms * unit:.{digits}f}", f"{err:.1e}", mode]
    except Exception as exc:  # noqa: BLE001 - reported, the sweep goes on
        row = [case, label, "", "", f"{type(exc).__name__}: {str(exc)[:80]}"]
        torch.cuda.synchronize()
    print(" | ".join(row), flush=True)
    return row


def finish_sweep(module: str, stem: str, headers: list[str], rows: list[list[str]], dtype: str,
                 out_dir: str | None) -> None:
    """Prints a sweep's markdown table and, with out_dir, writes <stem>-<hardware>.{md,json} with command and date."""
    md = common.md_table(headers, rows)
    print(md, flush=True)
    if out_dir:
        meta = {"command": common.command_line(module), "when": common.now_utc(),
                "hardware": common.hardware("cuda", dtype, None), "torch": torch.__version__}
        common.write_outputs(out_dir, f"{stem}-{common.hardware_tag(meta['hardware'])}", {"meta": meta, "rows": rows},
                             md)


def delta_inputs(batch: int, tokens: int, seed: int, device: str) -> tuple[torch.Tensor, ...]:
    """q, k, v, g, beta, state as the reference hands them to the recurrence (fp32, from bf16 conv outputs)."""
    from target_svc.gated_deltanet import _l2norm

    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    q = _l2norm(randn(batch, tokens, KEY_HEADS, HEAD_DIM).bfloat16().float()) * HEAD_DIM**-0.5
    k = _l2norm(randn(batch, tokens, KEY_HEADS, HEAD_DIM).bfloat16().float())
    v = randn(batch, tokens, VALUE_HEADS, HEAD_DIM).bfloat16().float()
    g = -torch.linspace(-4.0, 1.0, VALUE_HEADS, device=device).exp() * F.softplus(randn(batch, tokens, VALUE_HEADS))
    beta = torch.sigmoid(randn(batch, tokens, VALUE_HEADS)).float()
    state = randn(batch, VALUE_HEADS, HEAD_DIM, HEAD_DIM) * 0.1
    return q, k, v, g, beta, state


def gdn_layer(device: str) -> torch.nn.Module:
    """A bf16 Gated DeltaNet layer of the 27B (random weights: only the time is measured with it)."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["linear_attention"],
                               linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS,
                               linear_key_head_dim=HEAD_DIM, linear_value_head_dim=HEAD_DIM,
                               linear_conv_kernel_dim=CONV_KERNEL, hidden_act="silu", rms_norm_eps=1e-6)
    with torch.device(device):
        layer = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    return layer.to(torch.bfloat16).eval()


# ---- cases ---------------------------------------------------------------------------------------------------------
def case_decode_recurrence(batch: int, device: str) -> tuple[Callable, Callable]:
    from target_svc.gated_deltanet import stepwise_delta_rule
    from target_svc.gdn_kernels import recurrent_delta_rule

    args = delta_inputs(batch, 1, seed=batch, device=device)
    return (lambda: stepwise_delta_rule(*args)), (lambda: recurrent_delta_rule(*args))


def case_prefill_recurrence(batch: int, tokens: int, device: str) -> tuple[Callable, Callable]:
    from target_svc.gated_deltanet import chunked_delta_rule
    from target_svc.gdn_kernels import chunk_delta_rule

    args = delta_inputs(batch, tokens, seed=1000 + batch, device=device)
    return (lambda: chunked_delta_rule(*args)), (lambda: chunk_delta_rule(*args))


def case_decode_layer(batch: int, layer: torch.nn.Module, device: str) -> tuple[Callable, Callable]:
    from target_svc.gated_deltanet import LinearAttnStateShape, gdn_commit_path, gdn_step_forward_lean
    from target_svc.gdn_tree_wy import gdn_commit_path_wy, gdn_tree_forward_wy

    dims = LinearAttnStateShape.from_module(layer)
    gen = torch.Generator(device=device).manual_seed(2000 + batch)
    x = torch.randn(batch, 1, HIDDEN, generator=gen, device=device).bfloat16()
    conv = torch.randn(dims.conv_shape(batch), generator=gen, device=device).bfloat16()
    rec = torch.randn(dims.rec_shape(batch), generator=gen, device=device) * 0.1
    valid = torch.ones(batch, 1, dtype=torch.bool, device=device)
    parents = torch.full((batch, 1), -1, dtype=torch.long, device=device)
    path = torch.zeros(batch, 1, dtype=torch.long, device=device)
    path_len = torch.ones(batch, dtype=torch.long, device=device)

    def reference():
        out, trace = gdn_tree_forward_wy(layer, x, parents, valid, conv, rec)
        return (out, *gdn_commit_path_wy(trace, path, path_len, conv, rec))

    def fla():
        out, trace = gdn_step_forward_lean(layer, x, valid, conv, rec, kernels=True)
        return (out, *gdn_commit_path(trace, path, path_len, conv, rec, kernels=True))

    return reference, fla


def measure(name: str, batch: int, make: Callable[[], tuple[Callable, Callable]], args: argparse.Namespace) -> dict:
    """Times one case (reference and fla) and checks their agreement; errors are recorded, not raised."""
    row: dict = {"case": name, "batch": batch}
    t0 = time.perf_counter()
    try:
        reference, fla = make()
        want, got = reference(), fla()
        torch.cuda.synchronize()
        row["agreement"] = agreement(tuple(got), tuple(want))
        for label, fn in (("reference", reference), ("fla", fla)):
            try:
                row[f"{label}_ms"], row[f"{label}_mode"] = time_per_call(fn, args.calls, args.replays)
            except Exception as exc:
                row[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:300]
                torch.cuda.synchronize()
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        traceback.print_exc()
    row["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"  {name} batch {batch}: {row}", flush=True)
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    table = []
    for r in rows:
        ref, fla = r.get("reference_ms"), r.get("fla_ms")
        speedup = ref / fla if ref and fla else None
        modes = {r.get("reference_mode"), r.get("fla_mode")} - {None}
        note = r.get("error") or r.get("reference_error") or r.get("fla_error") or ", ".join(sorted(modes))
        table.append([r["case"], r["batch"], ref, fla, None if speedup is None else round(speedup, 2),
                      None if "agreement" not in r else f"{r['agreement']:.1e}", note])
    head = (f"# Gated DeltaNet: PyTorch reference vs fla-core at the Qwen3.6-27B GDN shape\n\n"
            f"{meta['command']}  \n{meta['when']}; {meta['hardware'].get('gpu', '?')}, torch {meta['torch']}, "
            f"triton {meta['triton']}, fla-core {meta['fla']}\n\n"
            f"Heads: {KEY_HEADS} key x {HEAD_DIM}, {VALUE_HEADS} value x {HEAD_DIM}; fp32 recurrence. "
            f"ms per call: median over {meta['replays']} replays of {meta['calls']} back-to-back calls captured in "
            f"one CUDA graph (\"graph\"), else eager. Agreement: max |fla - reference| / max |reference|.\n\n")
    return head + common.md_table(["case", "batch", "reference ms", "fla ms", "speedup", "agreement", "note"], table)


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return "?"


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from target_svc import gdn_kernels

    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    if not gdn_kernels.available("cuda"):
        print(f"fla-core is not importable here (or {gdn_kernels.ENV_VAR} is off): pip install fla-core",
              file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    meta = {"command": common.command_line("bench.gdn_kernels"), "when": common.now_utc(),
            "hardware": common.hardware("cuda", "float32", None), "torch": torch.__version__,
            "triton": _version("triton"), "fla": _version("fla-core"), "calls": args.calls,
            "replays": args.replays, "prefill_tokens": args.prefill_tokens,
            "shape": {"key_heads": KEY_HEADS, "value_heads": VALUE_HEADS, "head_dim": HEAD_DIM, "hidden": HIDDEN}}
    print(f"GDN kernels bench on {meta['hardware'].get('gpu')}: batches {batches}", flush=True)
    rows = []
    layer = None
    if not args.no_layer:
        try:
            layer = gdn_layer("cuda")
        except Exception as exc:
            print(f"  no layer case: {type(exc).__name__}: {exc}", flush=True)
    for b in batches:
        rows.append(measure("decode 1 token: recurrence", b, lambda b=b: case_decode_recurrence(b, "cuda"), args))
        if layer is not None:
            rows.append(measure("decode 1 token: layer + commit", b,
                                lambda b=b: case_decode_layer(b, layer, "cuda"), args))
        rows.append(measure(f"prefill {args.prefill_tokens}: recurrence", b,
                            lambda b=b: case_prefill_recurrence(b, args.prefill_tokens, "cuda"), args))
        torch.cuda.empty_cache()
    md = markdown(rows, meta)
    print(md, flush=True)
    tag = common.hardware_tag(meta["hardware"])
    common.write_outputs(args.out_dir, f"gdn-kernels-{tag}", {"meta": meta, "rows": rows}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
