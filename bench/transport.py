"""Context-feature transports compared in one run: time until pushed rows are stored in a real drafter service.

A sender in this process pushes rows of the drafter's feature width (target hidden size x feature layers) to the
drafter service of a running stack, once per transport and row count (1 verify step of a small batch up to a long
prompt's prefill), and waits for the drafter's answer, which comes after the rows are projected into its cache.
The drafter's work is the same for every transport, so the differences are the transport's.
    python -m bench.transport [--transports inline,shm] [--rows 8,64,512,2048] [--repeats 20]
    python -m bench.transport --device cuda --dtype bfloat16 --transports inline,cuda-ipc
    python -m bench.transport --device cuda:0 --drafter-device cuda:1 --dtype bfloat16 --transports inline,nccl
With --drafter-device on another GPU the default transports are inline,nccl; this process plays the target
(rank 0 of the NCCL pair, rows on --device).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from bench import common


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.transport", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target checkpoint dir (default: SmolLM2-135M-Instruct from the packaged GGUF)")
    p.add_argument("--drafter", help="drafter dir (default: the bundled SmolLM2 drafter)")
    p.add_argument("--transports", default=None, help="comma list (default: inline,shm on CPU; inline,cuda-ipc on one GPU; "
                                                        "inline,nccl with --drafter-device on another GPU)")
    p.add_argument("--rows", default="8,64,512,2048", help="rows per push (comma list)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cpu", help="where the rows are made (the target's side)")
    p.add_argument("--drafter-device", default=None, help="the drafter service's device (nccl: another GPU)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per model service")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    return p.parse_args(argv)


async def _time_pushes(kind: str, drafter_address: str, features: torch.Tensor, repeats: int) -> list[float]:
    """Seconds from submit to the drafter's answer, per push (after one warm-up push)."""
    from ddtree_serve.proto import drafter_pb2, drafter_pb2_grpc
    from ddtree_serve.plumbing.rpc import CHANNEL_OPTIONS
    from ddtree_serve.transport import FeatureRows, make_sender

    sender = make_sender(kind, drafter_address)
    if kind == "nccl":
        await sender.establish(features.device)   # the communicator forms once, outside the timed pushes
    times = []
    async with grpc_channel(drafter_address, CHANNEL_OPTIONS) as channel:
        drafter = drafter_pb2_grpc.DrafterServiceStub(channel)
        for i in range(repeats + 1):
            seq_id = f"bench-{kind}-{features.shape[0]}-{i}"
            if features.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            sender.submit([FeatureRows(seq_id, 0, features)])
            await sender.flush()
            dt = time.perf_counter() - t0
            await drafter.Release(drafter_pb2.DrafterReleaseRequest(seq_ids=[seq_id]), timeout=30)
            if i:
                times.append(dt)
    if sender.stats.failures:
        raise RuntimeError(f"{kind}: {sender.stats.failures} pushes failed: {sender.stats.last_error}")
    await sender.close()
    return times


def grpc_channel(address: str, options):
    import grpc

    return grpc.aio.insecure_channel(address, options=options)


def main(argv=None) -> None:
    """Times every transport at every row count against one drafter; writes bench/results/transport-<hw>.*"""
    args = parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    two_gpus = on_gpu and args.drafter_device not in (None, args.device)
    default = "inline,nccl" if two_gpus else "inline,cuda-ipc" if on_gpu else "inline,shm"
    transports = (args.transports or default).split(",")
    row_counts = [int(x) for x in args.rows.split(",")]
    model, drafter = common.resolve_model(args.model), common.resolve_drafter(args.drafter)
    hw = common.hardware(args.device, args.dtype, args.threads)
    date = common.now_utc()
    stack = common.start_stack(model, drafter, args.device, args.dtype, args.threads,
                               max_seq_len=max(2048, max(row_counts)), drafter_device=args.drafter_device)
    try:
        info = _drafter_info(stack.address("drafter"))
        feature_dim = len(info.target_layer_ids) * info.hidden_size
        dtype = getattr(torch, args.dtype)
        rows = []
        for n in row_counts:
            features = torch.randn(n, feature_dim, dtype=dtype, device=args.device)
            for kind in transports:
                times = asyncio.run(_time_pushes(kind, stack.address("drafter"), features, args.repeats))
                nbytes = features.numel() * features.element_size()
                med = statistics.median(times)
                rows.append({"transport": kind, "rows": n, "bytes": nbytes, "median_ms": med * 1e3,
                             "p90_ms": sorted(times)[int(0.9 * (len(times) - 1))] * 1e3, "mb_s": nbytes / med / 1e6})
                print(f"{kind:9s} {n:5d} rows {nbytes / 1e6:8.3f} MB  median {med * 1e3:8.2f} ms", flush=True)
    finally:
        stack.stop()
    base = {r["rows"]: r["median_ms"] for r in rows if r["transport"] == transports[0]}
    for r in rows:
        r[f"x_{transports[0]}"] = base[r["rows"]] / r["median_ms"]

    command = common.command_line("bench.transport")
    md = [f"# Context-feature transports ({common.hardware_tag(hw)})", "",
          f"- Command: `{command}`", f"- Date: {date}",
          f"- Hardware: {hw['cpu_model']} ({hw['usable_cpus']} usable CPUs)"
          + (f", {hw['gpu']}" if hw.get("gpu") else "") + f"; device `{args.device}`"
          + (f", drafter on `{args.drafter_device}`" if args.drafter_device else "") + f", dtype {args.dtype}, "
          f"torch threads per service {args.threads}",
          f"- Software: torch {hw['torch']}, grpcio {hw['grpcio']}, Python {hw['python']}",
          f"- Drafter: `{drafter}` ({len(info.target_layer_ids)} feature layers x hidden {info.hidden_size} = "
          f"{feature_dim} features per row)",
          f"- Work: per row count, {args.repeats} pushes (+1 warm-up) of fresh random rows to one drafter service "
          "over loopback; time = submit until the drafter has stored the rows (its projection into the context "
          "cache included, the same for every transport)", "",
          common.md_table(["transport", "rows", "MB", "median ms", "p90 ms", "MB/s", f"x {transports[0]}"],
                          [[r["transport"], r["rows"], r["bytes"] / 1e6, r["median_ms"], r["p90_ms"], r["mb_s"],
                            r[f"x_{transports[0]}"]] for r in rows])]
    data = {"command": command, "date": date, "hardware": hw, "model": model, "drafter": drafter,
            "feature_dim": feature_dim, "repeats": args.repeats, "rows": rows}
    common.write_outputs(args.out_dir, f"transport-{common.hardware_tag(hw)}", data, "\n".join(md))


def _drafter_info(address: str):
    from ddtree_serve.proto import drafter_pb2, drafter_pb2_grpc

    async def call():
        async with grpc_channel(address, []) as channel:
            return await drafter_pb2_grpc.DrafterServiceStub(channel).Info(drafter_pb2.DrafterInfoRequest(),
                                                                           timeout=30)

    return asyncio.run(call())


if __name__ == "__main__":
    main()
