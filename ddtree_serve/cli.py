"""`ddtree-serve`: run a service, all three locally, a client request, or drafter training."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path

from ddtree_serve.config import TRANSPORTS

log = logging.getLogger("ddtree_serve")


def _setup_logging(service: str, level: str) -> None:
    try:
        from ddtree_serve.request_context import configure_logging

        configure_logging(service, level)
    except ImportError:
        logging.basicConfig(level=level, format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")


def _set_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def _add_common(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=default_port)
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus endpoint port (off when omitted)")
    p.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--log-level", default=os.environ.get("DDTREE_LOG_LEVEL", "INFO"))
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-batch", type=int, default=8, help="sequences held at once (cache slots)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="context limit per sequence (prompt + output)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs (by default decode/verify/draft steps replay captured graphs on "
                        "CUDA)")


def cmd_target(args) -> None:
    from target_svc.server import TargetServerConfig, serve

    _setup_logging("target", args.log_level)
    _set_threads(args.threads)
    cfg = TargetServerConfig(model_dir=args.model, device=args.device, dtype=args.dtype, max_batch=args.max_batch,
                             max_seq_len=args.max_seq_len, max_tree_nodes=args.max_tree_nodes,
                             prefill_chunk=args.prefill_chunk, enforce_eager=args.enforce_eager)
    asyncio.run(serve(cfg, args.host, args.port, args.metrics_port, args.ready_file))


def cmd_drafter(args) -> None:
    from drafter_svc.server import DrafterServerConfig, serve

    _setup_logging("drafter", args.log_level)
    _set_threads(args.threads)
    cfg = DrafterServerConfig(drafter_dir=args.drafter, target_model_dir=args.target_model, device=args.device,
                              dtype=args.dtype, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                              enforce_eager=args.enforce_eager)
    asyncio.run(serve(cfg, args.host, args.port, args.metrics_port, args.ready_file))


def _read_pairs(args):
    from gateway.backends import PairAddress

    pairs = []
    if args.pairs:
        import yaml

        for entry in yaml.safe_load(Path(args.pairs).read_text()):
            pairs.append(PairAddress(target=entry["target"], drafter=entry["drafter"],
                                     drafter_for_target=entry.get("drafter_for_target", "")))
    if args.target or args.drafter:
        if not (args.target and args.drafter):
            raise SystemExit("--target and --drafter go together")
        pairs.insert(0, PairAddress(target=args.target, drafter=args.drafter,
                                    drafter_for_target=args.drafter_for_target or ""))
    if not pairs:
        raise SystemExit("give --target HOST:PORT --drafter HOST:PORT, or --pairs FILE")
    return pairs


def cmd_gateway(args) -> None:
    from gateway.engine import EngineConfig
    from gateway.server import GatewayConfig, serve

    _setup_logging("gateway", args.log_level)
    cfg = GatewayConfig(pairs=_read_pairs(args), mode=args.mode, budget=args.budget, tokenizer_dir=args.tokenizer,
                        transport=args.transport, engine=EngineConfig(max_prefill_tokens=args.max_prefill_tokens))
    asyncio.run(serve(cfg, args.host, args.port, args.metrics_port, args.ready_file))


# ---- client ---------------------------------------------------------------------------------------------------
def build_request(prompt: str | None, prompt_ids: str | None, max_tokens: int, temperature: float, seed: int | None,
                  mode: str | None, budget: int, chat: bool, stop: list[str] | None = None, ignore_eos: bool = False):
    """Builds a public GenerateRequest from CLI-style arguments."""
    from ddtree_serve.proto import common_pb2, gateway_pb2

    modes = {None: gateway_pb2.DECODE_MODE_DEFAULT, "ddtree": gateway_pb2.DECODE_MODE_DDTREE,
             "dflash": gateway_pb2.DECODE_MODE_DFLASH, "ar": gateway_pb2.DECODE_MODE_AR}
    req = gateway_pb2.GenerateRequest(
        max_tokens=max_tokens, mode=modes[mode], budget=budget, stop=stop or [], ignore_eos=ignore_eos,
        sampling=common_pb2.SamplingParams(temperature=temperature, seed=seed or 0, has_seed=seed is not None))
    if prompt_ids:
        req.token_ids.ids.extend(int(x) for x in prompt_ids.split(",") if x.strip())
    elif chat:
        req.chat.messages.add(role="user", content=prompt)
    else:
        req.text = prompt
    return req


async def generate_once(address: str, request, timeout_s: float = 600.0) -> dict:
    """Streams one generation from a gateway; returns ids, text and stats as a dict."""
    import grpc

    from ddtree_serve.proto import gateway_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        ids, text, final = [], [], None
        async for msg in stub.GenerateStream(request, timeout=timeout_s):
            ids.extend(msg.token_ids)
            text.append(msg.text)
            final = msg
    s = final.stats
    stats = {"prompt_tokens": s.prompt_tokens, "generated_tokens": s.generated_tokens, "steps": s.steps,
             "accepted_tokens": s.accepted_tokens, "mean_acceptance_length": round(s.mean_acceptance_length, 4),
             "draft_tokens": s.draft_tokens, "ttft_seconds": round(s.ttft_seconds, 4),
             "e2e_seconds": round(s.e2e_seconds, 4), "mode": s.mode, "budget": s.budget,
             "tokens_per_second": round(s.generated_tokens / s.e2e_seconds, 2) if s.e2e_seconds else 0.0}
    return {"request_id": final.request_id, "token_ids": ids, "text": "".join(text),
            "finish_reason": final.finish_reason, "stats": stats}


def print_result(result: dict, as_json: bool) -> None:
    """Prints a generation for people (text, then stats) or as one JSON object."""
    if as_json:
        print(json.dumps(result))
        return
    print(result["text"])
    s = result["stats"]
    print(f"\n--- {s['generated_tokens']} tokens in {s['e2e_seconds']:.2f} s ({s['tokens_per_second']} tok/s), "
          f"mode {s['mode']}, {s['steps']} verify steps, mean acceptance length {s['mean_acceptance_length']:.2f}, "
          f"TTFT {s['ttft_seconds'] * 1000:.0f} ms, finish: {result['finish_reason']}")


def cmd_generate(args) -> None:
    import grpc

    if not args.prompt and not args.prompt_ids:
        raise SystemExit("give a PROMPT or --prompt-ids")
    req = build_request(args.prompt, args.prompt_ids, args.max_tokens, args.temperature, args.seed, args.mode,
                        args.budget, args.chat, args.stop, args.ignore_eos)
    try:
        result = asyncio.run(generate_once(args.gateway, req))
    except grpc.aio.AioRpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        raise SystemExit(1) from None
    print_result(result, args.json)


# ---- all three locally --------------------------------------------------------------------------------------
def cmd_up(args) -> None:
    from ddtree_serve.local_stack import LocalStack

    model, drafter = args.model, args.drafter
    if model is None or drafter is None:
        from ddtree_serve.default_model import default_drafter_dir, ensure_default_model

        if model is None:
            print("preparing the default model (SmolLM2-135M-Instruct, converted once from the packaged GGUF)...")
            model = str(ensure_default_model())
        if drafter is None:
            drafter = str(default_drafter_dir())
    small_cpu = args.device == "cpu" and (os.cpu_count() or 1) <= 2
    stack = LocalStack(model=model, drafter=drafter, mode=args.mode, budget=args.budget, transport=args.transport,
                       device=args.device, dtype=args.dtype, metrics=args.metrics, threads=1 if small_cpu else None,
                       log_dir=args.log_dir or "",
                       ports={k: v for k, v in (("gateway", args.port), ("target", args.target_port),
                                                ("drafter", args.drafter_port)) if v})
    print(f"target  {stack.address('target')}\ndrafter {stack.address('drafter')}\ngateway {stack.gateway}")
    if stack.metrics_ports:
        print("metrics " + ", ".join(f"{k} http://127.0.0.1:{v}/metrics" for k, v in stack.metrics_ports.items()))
    print(f"logs    {stack.log_dir}")
    try:
        stack.start()
        print("ready")
        if args.prompt:
            req = build_request(args.prompt, None, args.max_tokens, args.temperature, args.seed, None, 0,
                                chat=not args.no_chat)
            print(f"\n> {args.prompt}\n")
            print_result(asyncio.run(generate_once(stack.gateway, req)), args.json)
            return
        print("Ctrl-C stops all three")
        while all(stack.alive().values()):
            time.sleep(0.5)
        print("a service exited; stopping", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()


def build_parser() -> argparse.ArgumentParser:
    """The full command-line interface."""
    parser = argparse.ArgumentParser(prog="ddtree-serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("target", help="run the target service")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    _add_common(p, 50051)
    _add_model_args(p)
    p.add_argument("--max-tree-nodes", type=int, default=257, help="largest verify block (root + budget)")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prompt positions per prefill forward (0: whole prompts at once); bounds prefill memory")
    p.set_defaults(func=cmd_target)

    p = sub.add_parser("drafter", help="run the drafter service")
    p.add_argument("--drafter", required=True, help="DFlash drafter directory (z-lab format)")
    p.add_argument("--target-model", required=True, help="target checkpoint (for its embedding and LM head)")
    _add_common(p, 50052)
    _add_model_args(p)
    p.set_defaults(func=cmd_drafter)

    p = sub.add_parser("gateway", help="run the public gateway")
    p.add_argument("--target", help="HOST:PORT of a target service")
    p.add_argument("--drafter", help="HOST:PORT of its drafter service")
    p.add_argument("--drafter-for-target", help="the drafter's address as the target reaches it (default: --drafter)")
    p.add_argument("--pairs", help="YAML list of {target, drafter} pairs to spread sequences over")
    p.add_argument("--mode", default="ddtree", choices=["ddtree", "dflash", "ar"])
    p.add_argument("--budget", type=int, default=64, help="DDTree node budget (root excluded)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: fetched from the target)")
    p.add_argument("--max-prefill-tokens", type=int, default=2048,
                   help="prompt tokens prefilled per step (0: no limit); longer prompts are prefilled in chunks over "
                        "several steps while the running batch keeps decoding")
    p.add_argument("--transport", default="inline", choices=TRANSPORTS,
                   help="how targets send context features to drafters: inline (in the RPC, anywhere), shm (shared "
                        "memory, same host), cuda-ipc (GPU memory, same GPU or peer-accessible GPUs)")
    _add_common(p, 50050)
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser("up", help="run all three locally; answer --prompt and exit, or serve until Ctrl-C")
    p.add_argument("--model", help="target checkpoint (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", help="drafter directory (default: the bundled SmolLM2 drafter)")
    p.add_argument("--port", type=int, default=0, help="gateway port (default: a free one)")
    p.add_argument("--target-port", type=int, default=0)
    p.add_argument("--drafter-port", type=int, default=0)
    p.add_argument("--mode", default="ddtree", choices=["ddtree", "dflash", "ar"])
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--transport", default="inline", choices=TRANSPORTS, help="context-feature transport")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--metrics", action="store_true", help="expose Prometheus endpoints on free ports")
    p.add_argument("--log-dir")
    p.add_argument("--prompt", help="answer this prompt (as a chat message), print stats, stop")
    p.add_argument("--no-chat", action="store_true", help="send --prompt as raw text, without the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("generate", help="send one request to a gateway and print the result")
    p.add_argument("--gateway", default="127.0.0.1:50050")
    p.add_argument("prompt", nargs="?")
    p.add_argument("--prompt-ids", help="comma-separated token ids instead of text")
    p.add_argument("--chat", action="store_true", help="render the prompt with the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--mode", choices=["ddtree", "dflash", "ar"])
    p.add_argument("--budget", type=int, default=0)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object (token_ids, text, stats)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("train-drafter", help="train a DFlash drafter for a target checkpoint")
    try:
        from drafter_svc.train.cli import add_arguments, run

        add_arguments(p)
        p.set_defaults(func=run)
    except ImportError as exc:  # keeps the serving commands usable if training deps are missing
        p.set_defaults(func=lambda a, e=exc: sys.exit(f"train-drafter unavailable: {e}"))
    return parser


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
