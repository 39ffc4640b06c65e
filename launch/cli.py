"""`ddtree-serve`: run a service, all three locally, a client request, or drafter training."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from ddtree_serve.plumbing import event_loop
from ddtree_serve.transport import TRANSPORTS
from launch.client_commands import (adjust_args, build_request, cmd_generate, generate_once, print_stats, print_text,
                                    up_state_file)

log = logging.getLogger("ddtree_serve")


def _setup_logging(service: str, level: str) -> None:
    try:
        from ddtree_serve.plumbing.request_context import configure_logging

        configure_logging(service, level)
    except ImportError:
        logging.basicConfig(level=level, format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")


def _set_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def _pin_cpus(args) -> None:
    """--cpus: every thread of this service onto those CPUs (a one-line error for CPUs it may not use)."""
    if not args.cpus:
        return
    from ddtree_serve.plumbing.cpu_affinity import format_cpu_list, pin_process

    try:
        pin_process(args.cpus)
    except ValueError as exc:
        args.parser.exit(2, f"{args.parser.prog}: error: --cpus: {exc}\n")
    log.info("pinned to CPUs %s", format_cpu_list(args.cpus))


def _cpu_list(text: str) -> tuple[int, ...]:
    """argparse type: a CPU list (0-3,6)."""
    from ddtree_serve.plumbing.cpu_affinity import parse_cpu_list

    try:
        return parse_cpu_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_common(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="interface to bind, metrics included (default loopback; 0.0.0.0 in containers)")
    p.add_argument("--port", type=_int_in(0, 65535), default=default_port, help="gRPC port")
    p.add_argument("--metrics-port", type=_int_in(0, 65535), default=None,
                   help="Prometheus endpoint port (off when omitted)")
    p.add_argument("--unix-socket", metavar="PATH", default=None,
                   help="also serve gRPC on this Unix domain socket (clients: unix:PATH); co-located services reach "
                        "each other there without the TCP/IP stack (`up` does this); same credential checks")
    p.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--log-level", default=os.environ.get("DDTREE_LOG_LEVEL", "INFO"),
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper, help="log level ($DDTREE_LOG_LEVEL)")
    p.add_argument("--threads", type=_int_in(1), default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--cpus", type=_cpu_list, default=None, metavar="LIST",
                   help="run this service's threads on these CPUs only, e.g. 2-4 (default: wherever the scheduler "
                        "puts them); a thread woken on the CPU it last ran on finds its caches warm")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop (as on SIGTERM) once the process that started this service has exited, however it "
                        "went; `up` and the benches set it, so that no service outlives a launcher killed outright")
    p.add_argument("--event-loop", choices=event_loop.EVENT_LOOPS, default=event_loop.default_event_loop(),
                   help="the service's event loop: auto (uvloop when installed, else asyncio), uvloop, asyncio "
                        "($DDTREE_EVENT_LOOP)")
    g = p.add_argument_group("security")
    g.add_argument("--secret-file", help="internal shared secret (else $DDTREE_INTERNAL_SECRET); target and drafter "
                                         "refuse calls without it, the gateway and target send it")
    g.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve internal RPCs beyond loopback without a secret (not recommended)")
    g.add_argument("--tls-cert", help="PEM certificate chain of this service: TLS on its port")
    g.add_argument("--tls-key", help="PEM private key for --tls-cert")
    g.add_argument("--tls-client-ca", help="PEM CA: clients must present a certificate it signed (mTLS)")
    g.add_argument("--tls-ca", help="PEM CA to verify internal services (TLS on outgoing internal channels)")
    g.add_argument("--tls-server-name", help="name the internal services' certificates are issued to")
    g.add_argument("--reflection", action="store_true", default=None,
                   help="gRPC server reflection (default: on for the gateway only)")


def _run_service(main, args) -> None:
    """Runs a service's main coroutine on its --event-loop (uvloop asked for and missing: a one-line error)."""
    try:
        event_loop.loop_factory(args.event_loop)
    except RuntimeError as exc:
        main.close()
        args.parser.exit(2, f"{args.parser.prog}: error: {exc}\n")
    if args.exit_with_parent:
        from ddtree_serve.plumbing.parent_watch import watch_parent

        watch_parent()
    event_loop.run(main, args.event_loop)


def _security(args, public: bool = False) -> None:
    from ddtree_serve.plumbing import auth

    auth.security_from_args(args, public=public)
    auth.check_bind(args.host, public, args.allow_unauthenticated)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--step-socket", metavar="PATH", default=None,
                   help="also serve the per-step calls (Verify; Draft and the feature push) on this Unix socket, "
                        "length-prefixed protobuf frames without gRPC, for a gateway (--step-transport socket) and "
                        "target on this host; same secret, created 0600")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model dtype")
    p.add_argument("--max-batch", type=_int_in(1), default=8, help="sequences held at once (cache slots)")
    p.add_argument("--max-seq-len", type=_int_in(2), default=2048, help="context limit per sequence (prompt + output)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs (by default decode/verify/draft steps replay captured graphs on "
                        "CUDA)")
    p.add_argument("--lazy-graphs", action="store_true",
                   help="capture each CUDA graph on its first use instead of every batch/tree-size bucket up front "
                        "(faster start; the first steps of each new shape then stall for the capture)")


def target_config(args):
    """The TargetServerConfig of parsed `target` arguments."""
    from target_svc.server import TargetServerConfig

    return TargetServerConfig(model_dir=args.model, device=args.device, dtype=args.dtype, max_batch=args.max_batch,
                              max_seq_len=args.max_seq_len, max_tree_nodes=args.max_tree_nodes,
                              graph_node_sizes=args.graph_node_sizes,
                              prefill_chunk=args.prefill_chunk, enforce_eager=args.enforce_eager,
                              lazy_graphs=args.lazy_graphs, gdn_state_snapshots=args.gdn_state_snapshots,
                              allowed_drafters=tuple(args.allow_drafter or ()), lease_s=args.lease_s,
                              quantize=args.quantize, gpu_memory_utilization=args.gpu_memory_utilization,
                              kv_cache_memory_gb=args.kv_cache_memory, gpu_memory_cap_gb=args.gpu_memory_cap,
                              kernel_warmup_passes=args.kernel_warmup_passes, step_socket=args.step_socket,
                              early_push=not args.no_early_push)


def cmd_target(args) -> None:
    from target_svc.memory_plan import MemoryPlanError
    from target_svc.server import serve

    _setup_logging("target", args.log_level)
    _pin_cpus(args)
    _security(args)
    _set_threads(args.threads)
    cfg = target_config(args)
    try:
        _run_service(serve(cfg, args.host, args.port, args.metrics_port, args.ready_file,
                               reflection=args.reflection, unix_socket=args.unix_socket), args)
    except MemoryPlanError as exc:  # a configuration that cannot hold one sequence: one line, not a traceback
        args.parser.exit(1, f"{args.parser.prog}: error: {exc}\n")


def cmd_drafter(args) -> None:
    from drafter_svc.server import DrafterServerConfig, serve

    _setup_logging("drafter", args.log_level)
    _pin_cpus(args)
    _security(args)
    _set_threads(args.threads)
    cfg = DrafterServerConfig(drafter_dir=args.drafter, target_model_dir=args.target_model, device=args.device,
                              dtype=args.dtype, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                              enforce_eager=args.enforce_eager, lazy_graphs=args.lazy_graphs, lease_s=args.lease_s,
                              step_socket=args.step_socket)
    _run_service(serve(cfg, args.host, args.port, args.metrics_port, args.ready_file, reflection=args.reflection,
                           unix_socket=args.unix_socket), args)


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

    if args.priority_scheduling_preemption_threshold is not None and args.scheduling_policy != "priority":
        args.parser.error("--priority-scheduling-preemption-threshold needs --scheduling-policy priority")
    _setup_logging("gateway", args.log_level)
    _pin_cpus(args)
    _security(args, public=True)
    engine = EngineConfig(max_prefill_tokens=args.max_prefill_tokens, draft_timeout_s=args.draft_timeout_s,
                          max_verify_nodes=args.max_verify_nodes, batch_budgets=args.batch_budgets,
                          guided_overdraft=args.guided_overdraft, prefix_caching=args.enable_prefix_caching)
    if args.calibrated_acceptance:
        from gateway.calibrated_drafts import calibrator_from_args

        engine.calibrator = calibrator_from_args(args.calibrated_acceptance, args.calibration_references)
    cfg = GatewayConfig(pairs=_read_pairs(args), mode=args.mode, budget=args.budget, tokenizer_dir=args.tokenizer,
                        transport=args.transport, drain_s=args.drain_s, engine=engine,
                        step_streams=not args.unary_steps, step_sockets=args.step_transport == "socket",
                        step_spin_us=args.step_spin_us, backend_wait_s=args.backend_wait_s,
                        scheduling_policy=args.scheduling_policy,
                        preemption_threshold=args.priority_scheduling_preemption_threshold,
                        reasoning_parser="" if args.reasoning_parser == "none" else args.reasoning_parser)
    from gateway.backends import AttachRefused

    try:
        _run_service(serve(cfg, args.host, args.port, args.metrics_port, args.ready_file, http_port=args.http_port,
                               api_key=args.api_key, reflection=args.reflection, unix_socket=args.unix_socket), args)
    except AttachRefused as exc:
        # A misconfigured pair fails at start-up with one line, as a vLLM server refuses a bad config.
        log.error("%s", exc)
        raise SystemExit(2) from None


# ---- all three locally --------------------------------------------------------------------------------------
def up_service_args(args) -> dict[str, list[str]]:
    """Each service's extra flags from `up`'s: the engine limits both model services take, the target's memory
    options, then --target-args, --drafter-args and --gateway-args as given."""
    both = [*(["--max-seq-len", str(args.max_seq_len)] if args.max_seq_len else []),
            *(["--max-batch", str(args.max_batch)] if args.max_batch else [])]
    target = [*both, *(["--quantize", args.quantize] if args.quantize else []),
              *([] if args.gpu_memory_utilization is None
                else ["--gpu-memory-utilization", str(args.gpu_memory_utilization)])]
    return {"target": target + shlex.split(args.target_args), "drafter": both + shlex.split(args.drafter_args),
            "gateway": shlex.split(args.gateway_args)}


# The least each service's parser takes: `up` checks its pass-through flags against the real parsers before starting.
_REQUIRED = {"target": ["--model", "M"], "drafter": ["--drafter", "D", "--target-model", "M"],
             "gateway": ["--target", "T:1", "--drafter", "D:1"]}


def _check_up_args(args) -> None:
    """Everything `up` can check before it starts three processes; one-line errors, exit 2."""
    try:
        extra = up_service_args(args)
    except ValueError as exc:   # unbalanced quotes in a --*-args string
        args.parser.error(f"--target-args / --drafter-args / --gateway-args: {exc}")
    for name, flags in extra.items():
        build_parser().parse_args([name, *_REQUIRED[name], *flags])   # a bad flag: the service's one-line error
    for flag, path in (("--model", args.model), ("--drafter", args.drafter), ("--log-dir", None)):
        if path is not None and not Path(path).is_dir():
            args.parser.error(f"{flag} {path}: no such directory")
    if args.prompt is not None and not args.prompt.strip():
        args.parser.error("--prompt is empty")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            args.parser.error(f"--device {args.device}: no CUDA device is available (use --device cpu)")
    if args.transport == "nccl" and (args.drafter_device or args.device) == args.device:
        args.parser.error("--transport nccl needs the drafter on another GPU than the target "
                          "(e.g. --device cuda:0 --drafter-device cuda:1); on one GPU use --transport cuda-ipc")
    ports = [p for p in (args.port, args.target_port, args.drafter_port, args.http_port) if p]
    if len(set(ports)) != len(ports):
        args.parser.error("--port, --target-port, --drafter-port and --http-port must differ")


# `kill`, `timeout`, `docker stop` and a closed terminal end `up` as Ctrl-C does (its services stopped, its logs and
# state file removed); without a handler SIGTERM and SIGHUP would end the process before its cleanup ran.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def cmd_up(args) -> None:
    from launch.local_stack import LocalStack

    _check_up_args(args)
    model, drafter = args.model, args.drafter
    if model is None or drafter is None:
        from ddtree_serve.default_model import default_drafter_dir, default_model_dir, ensure_default_model, is_converted

        if model is None:
            if not is_converted(default_model_dir()):
                print(f"preparing the default model: converting SmolLM2-135M-Instruct from the packaged GGUF into "
                      f"{default_model_dir()} (once, ~540 MB)...", flush=True)
            model = str(ensure_default_model())
        if drafter is None:
            drafter = str(default_drafter_dir())
    small_cpu = args.device == "cpu" and (os.cpu_count() or 1) <= 2
    ports = {k: v for k, v in (("gateway", args.port), ("target", args.target_port), ("drafter", args.drafter_port),
                               ("http", args.http_port)) if v}
    try:
        stack = LocalStack(model=model, drafter=drafter, mode=args.mode, budget=args.budget or 0,
                           transport=args.transport, device=args.device, drafter_device=args.drafter_device or "",
                           dtype=args.dtype, metrics=args.metrics, threads=1 if small_cpu else None,
                           log_dir=args.log_dir or "", ports=ports, http=not args.no_http, api_key=args.api_key,
                           step_sockets=args.step_transport == "socket", pin_cpus=args.pin_cpus,
                           extra=up_service_args(args))
    except ValueError as exc:   # --pin-cpus on too few CPUs
        args.parser.error(str(exc))
    print(f"target  {stack.address('target')}\ndrafter {stack.address('drafter')}\ngateway {stack.gateway}")
    if stack.http:
        print(f"http    {stack.http_url}  (OpenAI-compatible)")
    if stack.metrics_ports:
        print("metrics " + ", ".join(f"{k} http://127.0.0.1:{v}/metrics" for k, v in stack.metrics_ports.items()))
    print(f"logs    {stack.log_dir}", flush=True)
    state = up_state_file()
    clean = False
    for sig in _STOP_SIGNALS[1:]:
        signal.signal(sig, _interrupt)
    try:
        stack.start()
        print("ready", flush=True)
        if args.prompt:
            req = build_request(args.prompt, None, args.max_tokens, args.temperature, args.seed, None, 0,
                                chat=not args.raw, top_p=args.top_p, top_k=args.top_k, **adjust_args(args))
            if not args.json:
                print(f"\n> {args.prompt}\n")
            result = asyncio.run(generate_once(stack.gateway, req, on_text=None if args.json else print_text))
            baseline = None
            if not args.no_baseline and result["stats"]["mode"] != "ar":
                req.mode = build_request("", None, 1, 0.0, None, "ar", 0, True).mode
                baseline = asyncio.run(generate_once(stack.gateway, req))
            if args.json:
                if baseline is not None:
                    result["ar_baseline"] = baseline["stats"]
                print(json.dumps(result))
            else:
                print_stats(result, baseline)
            clean = True
            return
        state.parent.mkdir(parents=True, exist_ok=True)
        state.write_text(json.dumps({"gateway": stack.gateway, "http": stack.http_url if stack.http else "",
                                     "pid": os.getpid()}))
        print("\nTry it (Ctrl-C here stops all three):")
        print(f"  ddtree-serve generate --gateway {stack.gateway} \"What is the capital of France?\"")
        if stack.http:
            auth = ' -H "Authorization: Bearer $DDTREE_API_KEY"' if args.api_key else ""
            print(f"  curl {stack.http_url}/chat/completions -H 'Content-Type: application/json'{auth} "
                  f"-d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}], "
                  f"\"max_tokens\": 64}}'", flush=True)
        while all(stack.alive().values()):
            time.sleep(0.5)
        print(f"a service exited; stopping (logs kept in {stack.log_dir})", file=sys.stderr)
    except KeyboardInterrupt:
        clean = True
    except Exception as exc:  # noqa: BLE001 - one message, not a traceback; the logs say the rest
        print(f"error: {exc}\n(logs kept in {stack.log_dir})", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        for sig in _STOP_SIGNALS:   # a second signal must not cut the stop short and orphan a service
            signal.signal(sig, signal.SIG_IGN)
        stack.stop()
        with contextlib.suppress(OSError, ValueError):
            if json.loads(state.read_text()).get("pid") == os.getpid():
                state.unlink()
        if clean:
            stack.cleanup()


class OneLineParser(argparse.ArgumentParser):
    """argparse with every usage error as one line (`ddtree-serve up: error: ...`) and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default next to its help, unless the help states it or there is none to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def _int_in(lo: int, hi: int | None = None, what: str = ""):
    """argparse type: an integer in [lo, hi] (hi None: unbounded above but within the wire's int32/uint64)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        top = hi if hi is not None else 2**31 - 1
        if not lo <= value <= top:
            raise argparse.ArgumentTypeError(f"{value} is out of range [{lo}, {top}]{what}")
        return value
    return parse


def _int_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated integers >= 1 (an empty string: none)."""
    parse = _int_in(1)
    return tuple(parse(part.strip()) for part in text.split(",") if part.strip())


def _batch_budgets(text: str) -> tuple[tuple[int, int], ...]:
    """argparse type: --batch-budgets (gateway.scheduler.parse_batch_budgets)."""
    from gateway.scheduler import parse_batch_budgets

    try:
        return parse_batch_budgets(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _float_in(lo: float, hi: float | None = None, lo_open: bool = False):
    """argparse type: a finite float in [lo, hi] ((lo, hi] with lo_open)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        bad = value != value or value in (float("inf"), float("-inf")) or value < lo or (lo_open and value == lo)
        if bad or (hi is not None and value > hi):
            interval = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]"
            raise argparse.ArgumentTypeError(f"{text} is out of range {interval}")
        return value
    return parse


def _token_ids(text: str) -> str:
    """argparse type: comma-separated non-negative token ids (kept as text; build_request parses them)."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts or not all(x.isdigit() for x in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids, e.g. 1,2,3")
    return ",".join(parts)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=_int_in(1), default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=_float_in(0.0), default=0.0, help="0: greedy (lossless = same as ar)")
    p.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True), default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=_int_in(0), default=0, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--seed", type=_int_in(0, 2**64 - 1), default=None, help="sampling seed (reproducible samples)")
    p.add_argument("--min-p", type=_float_in(0.0, 1.0), default=0.0,
                   help="drop tokens less likely than this times the likeliest (0: off)")
    p.add_argument("--repetition-penalty", type=_float_in(0.0, lo_open=True), default=1.0,
                   help="divide positive (multiply negative) logits of prompt and output tokens (1: off)")
    p.add_argument("--presence-penalty", type=_float_in(-2.0, 2.0), default=0.0,
                   help="subtract from the logits of tokens already output (0: off)")
    p.add_argument("--frequency-penalty", type=_float_in(-2.0, 2.0), default=0.0,
                   help="subtract this times each token's output count from its logit (0: off)")
    p.add_argument("--min-tokens", type=_int_in(0), default=0,
                   help="generate at least this many tokens before EOS or a stop token may come")
    guide = p.add_mutually_exclusive_group()
    guide.add_argument("--json-schema", metavar="SCHEMA", default=None,
                       help="structured output: the answer is JSON of this schema (JSON text, or @FILE)")
    guide.add_argument("--json-object", action="store_true", help="structured output: the answer is a JSON object")
    guide.add_argument("--regex", default=None, help="structured output: the answer matches this regex")
    guide.add_argument("--choice", action="append", default=None,
                       help="structured output: the answer is one of these strings (repeatable)")
    guide.add_argument("--structural-tag", metavar="TAG", default=None,
                       help="structured output: free text whose tagged parts keep to their schemas (xgrammar's "
                            "structural tag, or vLLM's {structures, triggers}; JSON text, or @FILE)")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object (token_ids, text, stats), not a stream")


def build_parser() -> argparse.ArgumentParser:
    """The full command-line interface."""
    parser = OneLineParser(prog="ddtree-serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    def add(name: str, help_: str, formatter=_Help) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_, formatter_class=formatter)
        p.set_defaults(parser=p)
        return p

    p = add("target", "run the target service")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    _add_common(p, 50051)
    _add_model_args(p)
    p.add_argument("--max-tree-nodes", type=_int_in(2), default=257, help="largest verify block (root + budget)")
    p.add_argument("--graph-node-sizes", type=_int_list, default=(),
                   help="verify block sizes (root + budget, comma-separated) to capture CUDA graphs for besides 1, "
                        "4^k + 1 and --max-tree-nodes, e.g. 64 for budget-63 trees or 129 for budget 128 (a block "
                        "pads to the next captured size)")
    p.add_argument("--no-early-push", action="store_true",
                   help="push a verify's features after its results reach the host (by default, over shm/cuda-ipc, "
                        "they go out as soon as the verify is queued and the drafter's store and draft queue behind "
                        "it on the device)")
    p.add_argument("--prefill-chunk", type=_int_in(0), default=512,
                   help="prompt positions per prefill forward (0: whole prompts at once); bounds prefill memory")
    p.add_argument("--gdn-state-snapshots", type=_int_in(0, 4096), default=0, metavar="N",
                   help="hybrid (Gated DeltaNet) targets: keep up to N snapshots of a sequence's recurrent states "
                        "inside its context (at a chat's system prompt), so prompts sharing that prefix start there "
                        "(prefix caching; each costs one sequence's GDN states, taken from the cache budget)")
    p.add_argument("--allow-drafter", action="append",
                   help="HOST:PORT (or unix:PATH) the target may send features to (repeatable; default: any, "
                        "secret-holders only)")
    # target_svc.quantization.SERVED_QUANTIZE_MODES, spelled out: the CLI imports no torch until a service starts
    p.add_argument("--quantize", default="none", choices=["none", "int8", "int4", "int8-head"],
                   help="int8: weight-only int8 of the decoder layers' projections (per-output-channel scales); "
                        "int4: weight-only int4 (a scale per output channel and 128 input columns); int8-head: "
                        "int8 and the LM head too (per vocabulary row); outputs are then lossless with respect to "
                        "the quantized model, not the bf16 one")
    p.add_argument("--gpu-memory-utilization", type=_float_in(0.0, 1.0, lo_open=True), default=None,
                   help="fraction of the GPU this target may use; the KV cache and GDN states get what the weights "
                        "and an activation estimate leave, and --max-batch shrinks to what fits (default 0.9 on "
                        "CUDA; ignored on CPU)")
    p.add_argument("--kv-cache-memory", type=_float_in(0.0, lo_open=True), default=None, metavar="GB",
                   help="GiB for the KV cache and GDN states, given directly (overrides --gpu-memory-utilization; "
                        "enforced on CPU too)")
    p.add_argument("--gpu-memory-cap", type=_float_in(0.0, lo_open=True), default=None, metavar="GB",
                   help="CUDA only: GiB this target's allocator may hold, from before the weights load; the memory "
                        "plan takes the cap as the card (--gpu-memory-utilization x cap - what the process holds). "
                        "Emulates a smaller card on a larger one, or shares a card; refused on CPU and above the "
                        "card's size")
    p.add_argument("--kernel-warmup-passes", type=_int_in(0), default=None,
                   help="CUDA only: before the model loads, autotune and compile its kernels in up to this many "
                        "throwaway processes (each loads the first layers, prefills and verifies one batch), until one "
                        "finds them all cached; the server then loads the tuned kernels only, without the device "
                        "memory that autotuning leaves behind (default: 3 for hybrid models, whose Gated DeltaNet "
                        "kernels autotune, 0 for dense ones; 0: autotune in the server)")
    p.add_argument("--lease-s", type=float, default=60.0,
                   help="a sequence whose gateway has not been heard from for this long is freed")
    p.set_defaults(func=cmd_target)

    p = add("drafter", "run the drafter service")
    p.add_argument("--drafter", required=True, help="DFlash drafter directory (z-lab format)")
    p.add_argument("--target-model", required=True, help="target checkpoint (for its embedding and LM head)")
    _add_common(p, 50052)
    _add_model_args(p)
    p.add_argument("--lease-s", type=float, default=60.0,
                   help="a sequence not drafted or fed for this long (its gateway gone) is freed")
    p.set_defaults(func=cmd_drafter)

    p = add("gateway", "run the public gateway (gRPC, and with --http-port the OpenAI-compatible HTTP API)")
    p.add_argument("--target", help="HOST:PORT of a target service")
    p.add_argument("--drafter", help="HOST:PORT of its drafter service")
    p.add_argument("--drafter-for-target", help="the drafter's address as the target reaches it (default: --drafter)")
    p.add_argument("--pairs", help="YAML list of {target, drafter} pairs to spread sequences over")
    p.add_argument("--mode", default="ddtree", choices=["ddtree", "dflash", "ar"], help="decoding mode of requests that name none")
    p.add_argument("--budget", type=_int_in(0), default=0,
                   help="DDTree node budget, root excluded (0: by the target's device, 16 on CPU, 64 on GPU)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: fetched from the target)")
    p.add_argument("--max-prefill-tokens", type=_int_in(0), default=2048,
                   help="prompt tokens prefilled per step (0: no limit); longer prompts are prefilled in chunks over "
                        "several steps while the running batch keeps decoding")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="finished sequences' slots stay parked with their cache rows until needed, and a new prompt "
                        "that starts with one's tokens reuses them instead of running them (vLLM's; on by default; "
                        "requests share rows only within one cache_salt)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="the order waiting requests are admitted in (vLLM's): fcfs, arrival order; priority, each "
                        "request's priority field lowest first, equal ones in arrival order (running requests are "
                        "not preempted unless --priority-scheduling-preemption-threshold is given)")
    p.add_argument("--reasoning-parser", choices=["none", "qwen3", "deepseek_r1"], default="none",
                   help="chat answers of a thinking model (vLLM's flag): the text inside <think> ... </think> goes "
                        "in the message's `reasoning` (and `reasoning_content`), the rest in `content`, streamed "
                        "alike; a structured output's grammar holds from the end of the reasoning on. none: no "
                        "split")
    p.add_argument("--priority-scheduling-preemption-threshold", type=_int_in(0), default=None, metavar="T",
                   help="with --scheduling-policy priority (SGLang's flag): a waiting request that does not fit "
                        "preempts running ones whose priority value exceeds its own by more than T, lowest priority "
                        "first; they wait again and go on from their prompt and outputs (their rows kept by prefix "
                        "caching while they last; seeded samples are never preempted). Unset: no preemption")
    p.add_argument("--guided-overdraft", type=_int_in(1), default=1,
                   help="a structured output's DDTree trees are drafted this many times their budget; the target "
                        "verifies the budget's worth of the nodes its grammar allows (1: the budget alone; more "
                        "tokens a step for a longer grammar walk on the target's host)")
    p.add_argument("--max-verify-nodes", type=_int_in(0), default=0,
                   help="verify nodes per step over the whole batch (0: no cap); past it every DDTree sequence's "
                        "budget shrinks for that step to an equal share (a power of four), so a wide batch's verify "
                        "stays memory-bound (e.g. 256: budget 64 up to batch 3, 16 at batch 8)")
    p.add_argument("--batch-budgets", type=_batch_budgets, default=None, metavar="BATCH:BUDGET,...",
                   help="from BATCH sequences in a step on, DDTree budgets of at most BUDGET (e.g. 4:16); none: no "
                        "ceiling; default: 4:16 on a GPU target (measured: budget 16 beats 64 from batch 8 up), none "
                        "on CPU")
    p.add_argument("--transport", default="inline", choices=TRANSPORTS,
                   help="how targets send context features to drafters: inline (in the RPC, anywhere), shm (shared "
                        "memory, same host), cuda-ipc (GPU memory, same GPU or peer-accessible GPUs), nccl (NCCL "
                        "send/recv between two GPUs, target and drafter on different GPUs; needs cupy: the gpu extra)")
    p.add_argument("--http-port", type=_int_in(0, 65535), default=None,
                   help="serve the OpenAI-compatible HTTP API (/v1/..., /health, /metrics) on this port")
    p.add_argument("--step-transport", default="grpc", choices=["grpc", "socket"],
                   help="how each step's Draft, Verify and feature push travel: messages on gRPC streams, or frames on "
                        "the services' --step-socket Unix sockets (same host; about half a gRPC message's cost)")
    p.add_argument("--step-spin-us", type=_int_in(0, 1_000_000), default=0,
                   help="with --step-transport socket: poll the socket up to this many microseconds for each step "
                        "answer before sleeping in the event loop (a woken process costs ~50-80 us on a VM; "
                        "bench/socket_wakeup.py). It holds the gateway's event loop: for one pair on a GPU host. "
                        "Default 0 (off): not yet shown to speed up a step (docs/ENGINE.md)")
    p.add_argument("--unary-steps", action="store_true",
                   help="send each step's Draft and Verify as unary calls instead of messages on one long-lived "
                        "stream per service (about twice the per-call cost; for comparison)")
    p.add_argument("--api-key", default=os.environ.get("DDTREE_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $DDTREE_API_KEY; none: open)")
    p.add_argument("--calibrated-acceptance", metavar="PROFILE",
                   help="BENCH-ONLY: rewrite drafts so acceptance follows this profile (bench/calibration_profile.py); "
                        "needs --calibration-references. Outputs stay the target's own, acceptance is synthetic")
    p.add_argument("--calibration-references", metavar="REFS.json",
                   help="BENCH-ONLY: prompt ids -> reference greedy continuation (from an ar run); may be written "
                        "after start, reloaded when it changes")
    p.add_argument("--api-key-file", help="require 'authorization: Bearer KEY' on public gRPC calls, KEY read from this "
                                          "file (or $DDTREE_GRPC_API_KEY); health stays open")
    p.add_argument("--drain-s", type=float, default=20.0,
                   help="on SIGTERM: seconds running requests get to finish before their streams are ended")
    p.add_argument("--draft-timeout-s", type=float, default=10.0,
                   help="a Draft slower than this turns its sequences autoregressive (stalled drafter)")
    p.add_argument("--backend-wait-s", type=_float_in(0.0, lo_open=True), default=900.0,
                   help="at start-up, how long to wait for each target and drafter to serve (a 27B target's first "
                        "start autotunes its kernels and loads ~30 GB: minutes)")
    _add_common(p, 50050)
    p.set_defaults(func=cmd_gateway)

    p = add("up", "run all three locally; answer --prompt and exit, or serve until Ctrl-C")
    p.add_argument("--model", help="target checkpoint (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", help="drafter directory (default: the bundled SmolLM2 drafter)")
    p.add_argument("--port", type=_int_in(0, 65535), default=0, help="gateway gRPC port (0: a free one)")
    p.add_argument("--http-port", type=_int_in(0, 65535), default=0,
                   help="OpenAI-compatible HTTP port (0: a free one)")
    p.add_argument("--no-http", action="store_true", help="no HTTP API, gRPC only")
    p.add_argument("--api-key", default=os.environ.get("DDTREE_API_KEY") or None,
                   help="require this Bearer key on /v1/* (default: $DDTREE_API_KEY; none: open)")
    p.add_argument("--target-port", type=_int_in(0, 65535), default=0, help="target port (0: a free one)")
    p.add_argument("--drafter-port", type=_int_in(0, 65535), default=0, help="drafter port (0: a free one)")
    p.add_argument("--mode", default="ddtree", choices=["ddtree", "dflash", "ar"], help="decoding mode of requests that name none")
    p.add_argument("--budget", type=_int_in(0), default=0,
                   help="DDTree node budget (0: by device, 16 on CPU, 64 on GPU)")
    p.add_argument("--transport", default="inline", choices=TRANSPORTS,
                   help="context-feature transport (nccl: give the drafter its own GPU with --drafter-device)")
    p.add_argument("--step-transport", default="grpc", choices=["grpc", "socket"],
                   help="each step's Draft, Verify and feature push: messages on gRPC streams, or frames on step "
                        "sockets beside the services' Unix sockets (see `gateway --step-transport`)")
    p.add_argument("--device", default="cpu", help="torch device of the target and drafter (cpu, cuda, cuda:1)")
    p.add_argument("--drafter-device", default=None, help="the drafter's device when not --device (e.g. cuda:1)")
    p.add_argument("--pin-cpus", action="store_true",
                   help="each service on CPUs of its own (gateway 2, target 3, drafter 3, from the last CPUs; each "
                        "service's --cpus): steps wake threads where their caches are warm")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model dtype")
    p.add_argument("--max-seq-len", type=_int_in(2), default=None,
                   help="context limit per sequence, prompt + output, in both model services (default: theirs, 2048)")
    p.add_argument("--max-batch", type=_int_in(1), default=None,
                   help="sequences served at once, in both model services (default: theirs, 8)")
    p.add_argument("--quantize", choices=["none", "int8", "int4", "int8-head"], default=None,
                   help="the target's weights (see `target --quantize`; default: as loaded)")
    p.add_argument("--gpu-memory-utilization", type=_float_in(0.0, 1.0, lo_open=True), default=None,
                   help="share of the target's GPU it may use (see `target --gpu-memory-utilization`)")
    for name in ("target", "drafter", "gateway"):
        p.add_argument(f"--{name}-args", default="", metavar="ARGS",
                       help=f"more flags for the {name} service, as one string (e.g. --{name}-args=\"--log-level "
                            f"DEBUG\"); see `ddtree-serve {name} -h`")
    p.add_argument("--metrics", action="store_true", help="expose Prometheus endpoints on free ports")
    p.add_argument("--log-dir", help="service logs (default: a temporary folder, removed on a clean exit)")
    p.add_argument("--prompt", help="answer this prompt (as a chat message), print stats, stop")
    p.add_argument("--no-chat", dest="raw", action="store_true", help=argparse.SUPPRESS)  # the old spelling of --raw
    p.add_argument("--no-baseline", action="store_true",
                   help="with --prompt: skip the second, autoregressive (ar) run that gives the speed-up figure")
    _sampling_args(p)
    p.set_defaults(func=cmd_up)

    p = add("generate", "send one request to a gateway and stream the answer")
    p.add_argument("prompt", nargs="?", help="the prompt (sent as a chat message unless --raw)")
    p.add_argument("--gateway", default=None,
                   help="HOST:PORT (default: $DDTREE_GATEWAY, else a running `ddtree-serve up`, else 127.0.0.1:50050)")
    p.add_argument("--prompt-ids", type=_token_ids, help="comma-separated token ids instead of text")
    p.add_argument("--chat", action="store_true", help=argparse.SUPPRESS)  # the chat template is the default now
    p.add_argument("--mode", choices=["ddtree", "dflash", "ar"], help="decoding mode (default: the gateway's)")
    p.add_argument("--budget", type=_int_in(0), default=0, help="DDTree node budget (0: the gateway's)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--priority", type=_int_in(-2**31, 2**31 - 1), default=0,
                   help="admitted before waiting requests of higher values (the gateway's --scheduling-policy "
                        "priority; 0 under fcfs)")
    _sampling_args(p)
    p.set_defaults(func=cmd_generate)

    # its help texts state their defaults themselves
    p = add("train-drafter", "train a DFlash drafter for a target checkpoint", argparse.HelpFormatter)
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
