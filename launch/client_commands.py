"""`ddtree-serve generate` and the client helpers `up` shares: request building, one streamed call, printing."""
from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path


def build_request(prompt: str | None, prompt_ids: str | None, max_tokens: int, temperature: float, seed: int | None,
                  mode: str | None, budget: int, chat: bool, stop: list[str] | None = None, ignore_eos: bool = False,
                  top_p: float = 1.0, top_k: int = 0, **adjust):
    """Builds a public GenerateRequest from CLI-style arguments (prompt_ids: comma-separated; adjust: the logit
    adjustments, min_p and the penalties, by name)."""
    from ddtree_serve.client import build_request as build

    ids = [int(x) for x in prompt_ids.split(",") if x.strip()] if prompt_ids else None
    return build(prompt, prompt_ids=ids, chat=chat, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                 top_k=top_k, seed=seed, mode=mode, budget=budget, stop=stop, ignore_eos=ignore_eos, **adjust)


ADJUST_FLAGS = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")


def adjust_args(args) -> dict:
    """The parsed --min-p, penalty, --min-tokens and structured-output flags as build_request's keyword
    arguments."""
    out = {name: getattr(args, name) for name in ADJUST_FLAGS}
    if getattr(args, "json_schema", None):
        out["structured_output"] = ("json", _text_or_file(args.json_schema))
    elif getattr(args, "structural_tag", None):
        out["structured_output"] = ("structural_tag", _text_or_file(args.structural_tag))
    elif getattr(args, "json_object", False):
        out["structured_output"] = ("json_object", "")
    elif getattr(args, "regex", None):
        out["structured_output"] = ("regex", args.regex)
    elif getattr(args, "choice", None):
        out["structured_output"] = ("choice", json.dumps(args.choice))
    return out


def _text_or_file(value: str) -> str:
    """The flag's text, or the file's after an @."""
    return Path(value[1:]).read_text() if value.startswith("@") else value


async def generate_once(address: str, request, timeout_s: float = 600.0, on_text=None) -> dict:
    """Streams one generation from a gateway (on_text(str) per chunk); returns ids, text and stats as a dict."""
    from ddtree_serve.client import AsyncClient, Chunk, _collect

    chunks: list[Chunk] = []
    async with AsyncClient(address, timeout_s) as client:
        async for chunk in client.stream(request=request):
            chunks.append(chunk)
            if on_text is not None and chunk.text:
                on_text(chunk.text)
    return _collect(chunks).as_dict()


def print_text(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def print_stats(result: dict, baseline: dict | None = None) -> None:
    """The stats line under a streamed answer; with an ar baseline, its speed and the ratio too."""
    s = result["stats"]
    mode = s["mode"] + (f" (asked {s['requested_mode']}; the drafter failed)" if s.get("drafter_fallback") else "")
    budget = f" budget {s['budget']}," if s["mode"] == "ddtree" else ""
    print(f"\n--- {s['generated_tokens']} tokens in {s['e2e_seconds']:.2f} s ({s['tokens_per_second']} tok/s), "
          f"mode {mode},{budget} {s['steps']} verify steps, tau (mean acceptance length) "
          f"{s['mean_acceptance_length']:.2f}, TTFT {s['ttft_seconds'] * 1000:.0f} ms, finish: {result['finish_reason']}")
    if baseline is not None:
        b = baseline["stats"]
        ratio = s["tokens_per_second"] / b["tokens_per_second"] if b["tokens_per_second"] else 0.0
        same = "same text" if baseline["token_ids"] == result["token_ids"] else "text differs (sampling)"
        print(f"--- ar baseline: {b['generated_tokens']} tokens at {b['tokens_per_second']} tok/s; {s['mode']} is "
              f"{ratio:.2f}x ar at tau {s['mean_acceptance_length']:.2f} ({same})")


def print_result(result: dict, as_json: bool) -> None:
    """Prints a generation for people (text, then stats) or as one JSON object."""
    if as_json:
        print(json.dumps(result))
        return
    print(result["text"])
    print_stats(result)


def up_state_file() -> Path:
    """Where a running `up` leaves its addresses so that `generate` finds it without --gateway."""
    from ddtree_serve.default_model import default_cache_dir

    return default_cache_dir() / "up.json"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def find_gateway() -> tuple[str, str]:
    """(address, where it came from): $DDTREE_GATEWAY, else a running `up`, else 127.0.0.1:50050."""
    if os.environ.get("DDTREE_GATEWAY"):
        return os.environ["DDTREE_GATEWAY"], "$DDTREE_GATEWAY"
    try:
        state = json.loads(up_state_file().read_text())
        if pid_alive(int(state["pid"])):
            return state["gateway"], f"the running `ddtree-serve up` (pid {state['pid']})"
    except (OSError, ValueError, KeyError):
        pass
    return "127.0.0.1:50050", "the default address"


def cmd_generate(args) -> None:
    import grpc

    if args.prompt is None and not args.prompt_ids:
        args.parser.error("give a PROMPT or --prompt-ids")
    if args.prompt is not None and not args.prompt.strip() and not args.prompt_ids:
        args.parser.error("the prompt is empty")
    address, source = (args.gateway, "--gateway") if args.gateway else find_gateway()
    req = build_request(args.prompt, args.prompt_ids, args.max_tokens, args.temperature, args.seed, args.mode,
                        args.budget, not args.raw, args.stop, args.ignore_eos, args.top_p, args.top_k,
                        priority=args.priority, **adjust_args(args))
    try:
        result = asyncio.run(generate_once(address, req, on_text=None if args.json else print_text))
    except grpc.aio.AioRpcError as exc:
        hint = ""
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            hint = (f" (no gateway at {address}, from {source}: start one with `ddtree-serve up`, or pass "
                    f"--gateway HOST:PORT)")
        print(f"\nerror: {exc.code().name}: {exc.details()}{hint}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    if args.json:
        print(json.dumps(result))
    else:
        print_stats(result)
