"""The drafter's top-K over its logits, timed on the GPU: torch.topk (what DrafterRunner.draft runs) against a
two-stage top-K over vocabulary chunks (top-K per chunk, then over the chunks' winners).

Shape of the 8B drafter's tree draft: 15 positions x 151936 logits (bf16), K = 64. Each variant --calls calls in
one CUDA graph, median of --replays replays (bench/gdn_kernels.time_per_call); the chunked variant is checked to
give the same values and ids that hold them.

    python -m bench.drafter_topk [--out-dir DIR]
"""
from __future__ import annotations

import sys

import torch

from bench.gdn_kernels import finish_sweep, sweep_parser, sweep_row

POSITIONS, VOCAB, TOP_K = 15, 151936, 64


def chunked_topk(x: torch.Tensor, k: int, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of x's last dim in two stages: per chunk of the vocabulary, then over the chunks' winners."""
    pad = (-x.shape[-1]) % chunks
    parts = torch.nn.functional.pad(x, (0, pad), value=float("-inf")).unflatten(-1, (chunks, -1))
    values, ids = torch.topk(parts, k, dim=-1, sorted=False)
    ids = ids + torch.arange(chunks, device=x.device)[:, None] * parts.shape[-1]
    best, where = torch.topk(values.flatten(-2), k, dim=-1, sorted=True)
    return best, torch.gather(ids.flatten(-2), -1, where)


def main(argv: list[str] | None = None) -> int:
    args = sweep_parser("bench.drafter_topk", __doc__, "drafter-topk").parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    x = torch.randn(1, POSITIONS, VOCAB, device="cuda", dtype=torch.bfloat16)
    want, _ = torch.topk(x, TOP_K, dim=-1, sorted=True)

    def error(got) -> float:
        values, ids = got
        return float((values != want).any() or (torch.gather(x, -1, ids) != want).any())

    case = f"{POSITIONS} x {VOCAB}, k {TOP_K}"
    rows = [sweep_row(case, "torch.topk", lambda: torch.topk(x, TOP_K, dim=-1, sorted=True), error, args.calls,
                      args.replays, unit=1000.0, digits=1)]
    for chunks in (64, 128, 256, 512):
        rows.append(sweep_row(case, f"two-stage, {chunks} chunks", lambda c=chunks: chunked_topk(x, TOP_K, c), error,
                              args.calls, args.replays, unit=1000.0, digits=1))
    finish_sweep("bench.drafter_topk", "drafter-topk", ["case", "variant", "us per call", "mismatch", "mode"], rows,
                 "bfloat16", args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
