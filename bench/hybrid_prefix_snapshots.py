"""What Gated DeltaNet state snapshots give chats that share a system prompt on a hybrid target: the same chats
(one long system prompt, a different user question each, sent one after another) through a fresh stack with the
target's --gdn-state-snapshots 0 and N. Without snapshots a hybrid target can reuse a parked context only whole, so
every chat runs the system prompt again; with them the chats after the first copy its rows and start from the
snapshot taken at its end. Greedy, so both settings must give the same tokens (checked); what changes is the prompt
tokens each chat runs and its time to first token.

    python -m bench.hybrid_prefix_snapshots [--shape tiny-hybrid] [--layers 8] [--system-tokens 768] [--chats 6]

The pair is a random-weight checkpoint of bench/shapes.py's layout (3 Gated DeltaNet : 1 attention layers) and a
random DFlash drafter for it, built into --work-dir. Writes <out-dir>/hybrid-prefix-snapshots-<hardware>.{md,json}.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from bench import common, shapes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tiny-hybrid", choices=["tiny-hybrid", "qwen3.6-27b"])
    p.add_argument("--layers", type=int, default=8, help="decoder layers (the 3:1 pattern kept)")
    p.add_argument("--system-tokens", type=int, default=768)
    p.add_argument("--user-tokens", type=int, default=24)
    p.add_argument("--chats", type=int, default=6)
    p.add_argument("--snapshots", type=int, default=4, help="--gdn-state-snapshots of the second setting")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--work-dir", default="", help="where the checkpoints are built (default: a temporary folder)")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    return p.parse_args(argv)


def words(ids: list[int]) -> str:
    """Text that the shapes' word tokenizer turns back into exactly these ids."""
    return " ".join(f"t{i}" for i in ids)


def chats(vocab: int, system_tokens: int, user_tokens: int, n: int) -> list[list[tuple[str, str]]]:
    """n chats of one system prompt and a different user question each (random ordinary token ids, fixed seed;
    none whose word contains a special token's, 't0' or 't1', which the gateway refuses in chat messages)."""
    ordinary = torch.tensor([i for i in range(2, vocab) if str(i)[0] not in "01"])
    g = torch.Generator().manual_seed(0)

    def text(k: int) -> str:
        return words(ordinary[torch.randint(0, len(ordinary), (k,), generator=g)].tolist())

    system = text(system_tokens)
    return [[("system", system), ("user", text(user_tokens))] for _ in range(n)]


def request(messages: list[tuple[str, str]], max_tokens: int):
    """A greedy autoregressive chat request (the prefill is what is measured; no drafter needed for it)."""
    from ddtree_serve.proto import gateway_pb2

    return gateway_pb2.GenerateRequest(
        chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role=r, content=c) for r, c in messages]),
        max_tokens=max_tokens, ignore_eos=True, mode=gateway_pb2.DECODE_MODE_AR)


def run_setting(args, target: str, drafter: str, conversations: list, snapshots: int) -> list[dict]:
    """The chats one after another through a fresh stack with prefix caching on and --gdn-state-snapshots N."""
    stack = common.start_stack(target, drafter, args.device, args.dtype, None, max_batch=4, max_seq_len=2048,
                               gateway_args=["--enable-prefix-caching"],
                               target_args=["--gdn-state-snapshots", str(snapshots)])
    try:
        with common.GatewayClient(stack.gateway) as client:
            client.run([request([("user", "t5 t6 t7")], 2)])   # warm-up, not counted
            out = []
            for messages in conversations:
                (r,), _ = client.run([request(messages, args.max_tokens)])
                out.append({"prompt_tokens": r.stats["prompt_tokens"], "cached": r.stats["cached_prompt_tokens"],
                            "ttft_s": r.stats["ttft_seconds"], "token_ids": r.token_ids})
    finally:
        stack.stop()
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="hybrid-snapshots-"))
    dtype = getattr(torch, args.dtype)
    target = shapes.build_target(args.shape, work / "target", layers=args.layers, device=args.device, dtype=dtype)
    drafter = shapes.build_drafter(target, work / "drafter", num_layers=1, device=args.device, dtype=dtype)
    vocab = shapes.target_config(args.shape, args.layers).vocab_size
    conversations = chats(vocab, args.system_tokens, args.user_tokens, args.chats)
    runs = {n: run_setting(args, str(target), str(drafter), conversations, n) for n in (0, args.snapshots)}
    same = [c["token_ids"] for c in runs[0]] == [c["token_ids"] for c in runs[args.snapshots]]

    def later(n: int) -> dict:   # the chats after the first: the system prompt could come from the cache
        rows = runs[n][1:]
        return {"mean_prompt_tokens": round(statistics.fmean(r["prompt_tokens"] for r in rows), 1),
                "mean_cached_tokens": round(statistics.fmean(r["cached"] for r in rows), 1),
                "mean_ttft_ms": round(1e3 * statistics.fmean(r["ttft_s"] for r in rows), 2)}

    table = {n: later(n) for n in runs}
    hw = common.hardware(args.device, args.dtype, None)
    data = {"bench": "hybrid_prefix_snapshots", "command": common.command_line("bench.hybrid_prefix_snapshots"),
            "date": common.now_utc(), "hardware": hw, "shape": args.shape, "layers": args.layers,
            "target": common.describe_checkpoint(str(target)), "system_tokens": args.system_tokens,
            "user_tokens": args.user_tokens, "chats": args.chats, "max_tokens": args.max_tokens,
            "same_tokens_in_both_settings": same, "summary": {str(n): s for n, s in table.items()},
            "runs": {str(n): [{k: v for k, v in r.items() if k != "token_ids"} for r in rs] for n, rs in runs.items()}}
    rows = [[str(n), f"{s['mean_prompt_tokens']:.1f}", f"{s['mean_cached_tokens']:.1f}", f"{s['mean_ttft_ms']:.1f}"]
            for n, s in table.items()]
    rows.append([f"{args.snapshots} / 0", "", "",
                 f"{table[args.snapshots]['mean_ttft_ms'] / table[0]['mean_ttft_ms']:.3f}"])
    md = "\n".join([
        f"# Gated DeltaNet state snapshots on chats sharing a system prompt ({common.hardware_tag(hw)})", "",
        f"Command: `{data['command']}`  ", f"Date: {data['date']}  ",
        f"CPU: {hw['cpu_model']} ({hw['usable_cpus']} usable), device `{args.device}`, {args.dtype}", "",
        f"Random-weight `{args.shape}` target cut to {args.layers} layers (3 Gated DeltaNet : 1 attention), its random "
        f"drafter; {args.chats} chats sent one after another, each a {args.system_tokens}-token system prompt (the "
        f"same) and a different {args.user_tokens}-token question, greedy `ar`, {args.max_tokens} tokens; a fresh "
        "stack per setting, prefix caching on in both. Means over the chats after the first (the first runs the "
        "system prompt in both settings); TTFT is the gateway's (arrival to first token). Same tokens in both "
        f"settings: {'yes' if same else 'NO'}.", "",
        common.md_table(["--gdn-state-snapshots", "prompt tokens", "cached tokens", "TTFT ms"], rows), ""])
    print(md)
    common.write_outputs(args.out_dir, f"hybrid-prefix-snapshots-{common.hardware_tag(hw)}", data, md)


if __name__ == "__main__":
    main()
