"""Shared parts of the benchmarks: model/drafter/prompt resolution, hardware description, the three services,
Prometheus scrapes (deltas between two scrapes), concurrent streaming requests and Markdown tables.

Runs from the source tree without installation: `python -m bench.<name>` from the repository root.
"""
from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import math
import os
import platform
import re
import shlex
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python bench/x.py` as well as `python -m bench.x`
    sys.path.insert(0, str(REPO))

RESULTS_DIR = REPO / "bench" / "results"
HELDOUT_PROMPTS = REPO / "bench" / "heldout_prompts.json"

# Used only when bench/heldout_prompts.json is absent (the outputs then say so).
FALLBACK_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain the difference between a list and a tuple in Python.",
    "Summarise the causes of the French Revolution in a few sentences.",
    "What is the capital of Australia, and why was it chosen?",
    "Give three tips for writing clear technical documentation.",
    "Write a short poem about the sea.",
    "How does a hash table handle collisions?",
    "Describe how photosynthesis works to a ten-year-old.",
]


# ---- inputs -----------------------------------------------------------------------------------------------------
def load_prompts(path: str | Path | None, limit: int | None, offset: int = 0) -> tuple[list[dict], str]:
    """[{id, text}] from a held-out prompt file ({"prompts": [{id, text, ...}]} or a list of strings/objects);
    falls back to FALLBACK_PROMPTS when the file is missing. Returns (prompts, description of the source)."""
    p = Path(path) if path else HELDOUT_PROMPTS
    if p.is_file():
        data = json.loads(p.read_text())
        items = data["prompts"] if isinstance(data, dict) else data
        prompts = []
        for i, it in enumerate(items):
            if isinstance(it, str):
                prompts.append({"id": f"prompt-{i}", "text": it})
            else:
                prompts.append({"id": str(it.get("id", f"prompt-{i}")), "text": it["text"],
                                **({"kind": it["kind"]} if "kind" in it else {})})
        try:
            shown = str(p.resolve().relative_to(REPO))
        except ValueError:
            shown = str(p)
        source = f"{shown} ({len(prompts)} prompts in the file)"
    else:
        prompts = [{"id": f"builtin-{i}", "text": t} for i, t in enumerate(FALLBACK_PROMPTS)]
        source = (f"FALLBACK: {p} not found; built-in list of {len(prompts)} generic prompts "
                  "(not held-out data: numbers are only indicative)")
    prompts = prompts[offset:]
    if limit:
        prompts = prompts[:limit]
    return prompts, source


def chat_ids(tokenizer, text: str) -> list[int]:
    """A one-message chat exactly as the gateway renders it (gateway/server.py _render_chat)."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False).input_ids


def resolve_model(model: str | None) -> str:
    """The target directory: --model, else the default SmolLM2-135M-Instruct (converted once from the GGUF)."""
    if model:
        return str(Path(model).expanduser().resolve())
    from ddtree_serve.default_model import ensure_default_model

    return str(ensure_default_model())


def resolve_drafter(drafter: str | None) -> str:
    """The drafter directory: --drafter, else the bundled trained SmolLM2 drafter (must exist)."""
    if drafter:
        return str(Path(drafter).expanduser().resolve())
    from ddtree_serve.default_model import default_drafter_dir

    d = default_drafter_dir()
    if not (d / "model.safetensors").is_file():
        raise SystemExit(f"the trained drafter is not there yet ({d}/model.safetensors); pass --drafter DIR "
                         "(e.g. a random one: tests/fixtures/tiny_drafter.py make_tiny_drafter) and --out-dir "
                         "somewhere other than bench/results")
    return str(d)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def describe_checkpoint(path: str) -> dict:
    """Name, location and a weight fingerprint of a model or drafter directory."""
    d = Path(path)
    out: dict = {"dir": _display_path(d), "name": d.name}
    cfg = d / "config.json"
    if cfg.is_file():
        c = json.loads(cfg.read_text())
        out["architectures"] = c.get("architectures")
        out["num_hidden_layers"] = c.get("num_hidden_layers")
        if "dflash_config" in c or "block_size" in c:
            out["block_size"] = c.get("block_size") or (c.get("dflash_config") or {}).get("block_size")
            out["target_layer_ids"] = (c.get("dflash_config") or {}).get("target_layer_ids")
    weights = d / "model.safetensors"
    if weights.is_file():
        out["weights_sha256"] = _sha256(weights)[:16]
        out["weights_bytes"] = weights.stat().st_size
    from ddtree_serve.default_model import default_drafter_dir

    out["bundled_drafter"] = d.resolve() == default_drafter_dir().resolve()
    return out


def _display_path(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        return str(p)


# ---- where and when ---------------------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def in_process_threads(device: str, threads: int | None) -> int | None:
    """Sets torch's threads for a bench that runs the models in its own process; on a CPU of 2 cores or fewer the
    default is 1 (measured: a 65-node verify takes 0.23 s with 1 thread, 1-5 s with 2 on a busy 2-core box)."""
    import torch

    if threads is None and device == "cpu" and (os.cpu_count() or 1) <= 2:
        threads = 1
    if threads:
        torch.set_num_threads(threads)
    return threads


def hardware(device: str, dtype: str, threads: int | None) -> dict:
    """CPU, accelerator and library versions of this run."""
    import grpc
    import torch
    import transformers

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    hw = {"cpu_model": cpu_model(), "logical_cpus": os.cpu_count(), "usable_cpus": usable,
          "device": device, "dtype": dtype, "torch_threads_per_service": threads,
          "torch": torch.__version__, "transformers": transformers.__version__, "grpcio": grpc.__version__,
          "python": platform.python_version(), "platform": platform.platform()}
    if device.startswith("cuda") and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        hw["gpu"] = torch.cuda.get_device_name(idx)
        hw["gpu_count"] = torch.cuda.device_count()
        hw["cuda"] = torch.version.cuda
    try:
        hw["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return hw


def hardware_tag(hw: dict) -> str:
    """Short file-name tag: e.g. cpu-amd-epyc-2c, cuda-nvidia-h200."""
    if hw.get("gpu"):
        name = hw["gpu"]
        tag = "cuda-" + name
    else:
        tag = f"cpu-{hw['cpu_model']}-{hw['usable_cpus']}c"
    tag = re.sub(r"\((r|tm)\)", "", tag.lower())
    tag = re.sub(r"\b(processor|cpu @.*|with .*)\b", "", tag) if not hw.get("gpu") else tag
    tag = re.sub(r"[^a-z0-9]+", "-", tag).strip("-")
    return re.sub(r"-+", "-", tag)[:48]


# Environment variables that change what a GPU run measures: a command line records them when set.
RECORDED_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "DDTREE_INT8_MATMUL", "DDTREE_INT8_GEMV")


def command_line(module: str) -> str:
    """The command as typed (module form, from the repository root), led by the recorded environment variables
    that are set."""
    env = [f"{k}={os.environ[k]}" for k in RECORDED_ENV if os.environ.get(k)]
    return shlex.join([*env, "python", "-m", module, *sys.argv[1:]])


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def add_pair_args(p) -> None:
    """The flags of a benchmark that runs one target/drafter pair: --model, --drafter, --device, --dtype."""
    p.add_argument("--model", default=None, help="target checkpoint (default: the bundled SmolLM2)")
    p.add_argument("--drafter", default=None, help="DFlash drafter (default: the bundled one)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")


# ---- the services -----------------------------------------------------------------------------------------------
def start_stack(model: str, drafter: str, device: str, dtype: str, threads: int | None, budget: int = 64,
                max_batch: int = 8, max_seq_len: int = 2048, log_dir: str = "", drafter_device: str | None = None,
                gateway_args: list[str] | None = None, transport: str = "inline", target_args: list[str] | None = None,
                step_sockets: bool = False, pin_cpus: bool = False):
    """The three services as processes, with Prometheus endpoints; returns a started LocalStack.
    drafter_device puts the drafter elsewhere (e.g. cuda:1; the last --device on its command line wins);
    gateway_args and target_args are extra flags of those services (e.g. the bench-only calibration flags, the
    target's --quantize); the gateway runs without budget ceilings by batch size unless gateway_args set them, so
    that a system named for its budget runs that budget at every batch size, and without prefix caching unless
    they turn it on; step_sockets: the step calls on bare
    Unix sockets instead of gRPC streams; pin_cpus: each service on CPUs of its own (LocalStack.pin_cpus)."""
    from launch.local_stack import LocalStack

    model_args = ["--max-batch", str(max_batch), "--max-seq-len", str(max_seq_len)]
    gateway_args = list(gateway_args or [])
    if "--batch-budgets" not in gateway_args:
        gateway_args = ["--batch-budgets", "none", *gateway_args]
    if not any(a.endswith("enable-prefix-caching") for a in gateway_args):
        # The systems compared run the same prompts one after another: a later one must not start from an earlier
        # one's cached rows.
        gateway_args.append("--no-enable-prefix-caching")
    drafter_args = model_args + (["--device", drafter_device] if drafter_device else [])
    stack = LocalStack(model=model, drafter=drafter, mode="ddtree", budget=budget, device=device, dtype=dtype,
                       metrics=True, transport=transport, threads=threads, log_dir=log_dir, step_sockets=step_sockets,
                       pin_cpus=pin_cpus,
                       extra={"target": [*model_args, *(target_args or [])], "drafter": drafter_args,
                              "gateway": gateway_args})
    t0 = time.perf_counter()
    stack.start(timeout_s=960)
    print(f"services up in {time.perf_counter() - t0:.1f} s (logs in {stack.log_dir})", flush=True)
    return stack


# ---- Prometheus scrapes -----------------------------------------------------------------------------------------
Samples = dict  # {(sample name, frozenset(labels.items())): value}


def scrape(port: int) -> Samples:
    """One scrape of http://127.0.0.1:port/metrics, as {(name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def wait_for_graphs(stack, timeout_s: float = 900.0, poll_s: float = 1.0) -> float:
    """Waits until the target's verify graph warm-up has no bucket pending (it captures in the background, and a
    step meanwhile waits behind one capture: a timed run would include captures); returns the seconds waited."""
    t0 = last = time.perf_counter()
    port = stack.metrics_ports["target"]
    while True:
        samples = scrape(port)
        pending, captured, eager = (total(samples, "ddtree_target_graph_buckets", state=state)
                                    for state in ("pending", "captured", "eager"))
        if not pending:
            waited = time.perf_counter() - t0
            if waited >= poll_s:
                print(f"verify graphs ready after {waited:.0f} s ({captured:.0f} captured, {eager:.0f} eager)",
                      flush=True)
            return waited
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"the target still has {pending:.0f} verify graph buckets to capture after "
                               f"{timeout_s:.0f} s")
        if time.perf_counter() - last >= 30:
            last = time.perf_counter()
            print(f"waiting for the target's verify graphs: {pending:.0f} buckets pending", flush=True)
        time.sleep(poll_s)


def scrape_all(stack) -> dict[str, Samples]:
    return {name: scrape(port) for name, port in stack.metrics_ports.items()}


def total(samples: Samples, name: str, **labels) -> float:
    """Sum of the values of every series `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def tau_standard_error(drafts: float, accepted_at_depth: dict[int, float]) -> float | None:
    """Standard error of tau (1 + mean accepted draft tokens per draft) from per-depth counts: accepted_at_depth[p]
    drafts accepted a token at depth p + 1 (the gateway's vllm:spec_decode_num_accepted_tokens_per_pos); None
    without drafts. A draft accepting L tokens counts at depths 1..L, so P(L >= j) = count(j - 1) / drafts,
    E[L] = sum_j P(L >= j) and E[L^2] = sum_j (2j - 1) P(L >= j)."""
    if drafts <= 0:
        return None
    at_least = {p + 1: c / drafts for p, c in accepted_at_depth.items() if c > 0}
    mean = sum(at_least.values())
    second = sum((2 * j - 1) * q for j, q in at_least.items())
    return math.sqrt(max(0.0, second - mean * mean) / drafts)


def ratio_standard_error(ratio: float, a: float, a_se: float, b: float, b_se: float) -> float:
    """Standard error of a ratio proportional to a / b, from the errors of independent a and b alone (first order)."""
    return ratio * math.sqrt((a_se / a) ** 2 + (b_se / b) ** 2)


def delta(before: Samples, after: Samples, name: str, **labels) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def hist_delta(before: Samples, after: Samples, family: str, **labels) -> dict:
    """{count, sum_s, mean_ms} of a histogram family between two scrapes (series matching labels summed)."""
    n = delta(before, after, family + "_count", **labels)
    s = delta(before, after, family + "_sum", **labels)
    return {"count": round(n), "sum_s": round(s, 6), "mean_ms": round(1000 * s / n, 3) if n else None}


# ---- requests ---------------------------------------------------------------------------------------------------
@dataclass
class Result:
    """One finished generation as the client saw it."""

    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict
    client_latency_s: float
    client_ttft_s: float
    extra: dict = field(default_factory=dict)

    @property
    def drafted_steps(self) -> int | None:
        """Verify steps that carried a draft, recovered from mean_acceptance_length = 1 + accepted / drafted
        (None when nothing was accepted: the stats cannot tell then)."""
        acc, mal = self.stats["accepted_tokens"], self.stats["mean_acceptance_length"]
        if acc > 0 and mal > 1.0:
            return round(acc / (mal - 1.0))
        return None


def stats_dict(s) -> dict:
    return {"prompt_tokens": s.prompt_tokens, "generated_tokens": s.generated_tokens, "steps": s.steps,
            "accepted_tokens": s.accepted_tokens, "mean_acceptance_length": s.mean_acceptance_length,
            "draft_tokens": s.draft_tokens, "ttft_seconds": s.ttft_seconds, "e2e_seconds": s.e2e_seconds,
            "mode": s.mode, "budget": s.budget, "cached_prompt_tokens": s.cached_prompt_tokens}


async def stream_many(channel, requests: list, concurrency: int = 1, timeout_s: float = 3600.0) -> list[Result]:
    """Streams the requests over an open channel, at most `concurrency` at a time -> results in request order."""
    from ddtree_serve.proto import gateway_pb2_grpc

    sem = asyncio.Semaphore(max(1, concurrency))
    stub = gateway_pb2_grpc.GatewayStub(channel)

    async def one(req) -> Result:
        async with sem:
            t0 = time.perf_counter()
            ids, text, final, ttft = [], [], None, 0.0
            async for msg in stub.GenerateStream(req, timeout=timeout_s):
                if not ttft and msg.token_ids:
                    ttft = time.perf_counter() - t0
                ids.extend(msg.token_ids)
                text.append(msg.text)
                final = msg
            return Result(ids, "".join(text), final.finish_reason, stats_dict(final.stats),
                          time.perf_counter() - t0, ttft)

    return list(await asyncio.gather(*(one(r) for r in requests)))


class GatewayClient:
    """One event loop and one open channel to the gateway for a whole run, as a serving client keeps its connection
    (vLLM's benchmark keeps one HTTP session): a new loop, channel and connection per call cost ~4 ms a request on
    a 2-core CPU (2026-12-07), which the wall time of each one-prompt chunk at batch 1 counted."""

    def __init__(self, address: str) -> None:
        import grpc

        async def open_channel():
            return grpc.aio.insecure_channel(address)

        self.loop = asyncio.new_event_loop()
        self.channel = self.loop.run_until_complete(open_channel())

    def run(self, requests: list, concurrency: int = 1, timeout_s: float = 3600.0) -> tuple[list[Result], float]:
        """Streams the requests, at most `concurrency` at a time (1 = one after another) -> (results in request
        order, the wall time of the whole set)."""
        t0 = time.perf_counter()
        results = self.loop.run_until_complete(stream_many(self.channel, requests, concurrency, timeout_s))
        return results, time.perf_counter() - t0

    def close(self) -> None:
        """Closes the channel and the loop."""
        self.loop.run_until_complete(self.channel.close())
        self.loop.close()

    def __enter__(self) -> "GatewayClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_requests(address: str, requests: list, concurrency: int = 1,
                 timeout_s: float = 3600.0) -> tuple[list[Result], float]:
    """Streams the requests through a client of their own (GatewayClient.run; the wall time includes opening it)."""
    t0 = time.perf_counter()
    with GatewayClient(address) as client:
        results, _ = client.run(requests, concurrency, timeout_s)
    return results, time.perf_counter() - t0


def tokenize_chat(address: str, texts: list[str]) -> list[list[int]]:
    """Prompt ids exactly as the gateway renders a one-message chat (its Tokenize RPC with the chat template)."""
    import grpc

    from ddtree_serve.proto import gateway_pb2, gateway_pb2_grpc

    async def go():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            return [list((await stub.Tokenize(gateway_pb2.TokenizeRequest(text=t, apply_chat_template=True),
                                              timeout=60)).ids) for t in texts]

    return asyncio.run(go())


def chat_request(text: str, max_tokens: int, mode: str, budget: int = 0):
    """A greedy chat GenerateRequest (one user message, the target's chat template)."""
    from launch.cli import build_request

    return build_request(text, None, max_tokens, 0.0, None, mode, budget if mode == "ddtree" else 0, chat=True)


def ids_request(prompt_ids: list[int], max_tokens: int, mode: str, budget: int = 0):
    """A greedy GenerateRequest over token ids (EOS honoured)."""
    from launch.cli import build_request

    return build_request(None, ",".join(map(str, prompt_ids)), max_tokens, 0.0, None, mode,
                         budget if mode == "ddtree" else 0, chat=False)


# ---- output -----------------------------------------------------------------------------------------------------
def md_table(headers: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def write_outputs(out_dir: str | Path, stem: str, data: dict, markdown: str) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jp, mp = out / f"{stem}.json", out / f"{stem}.md"
    jp.write_text(json.dumps(data, indent=1) + "\n")
    mp.write_text(markdown.rstrip() + "\n")
    print(f"wrote {_display_path(jp)} and {_display_path(mp)}", flush=True)
    return jp, mp


def random_parents(n: int, max_depth: int, gen) -> list[int]:
    """Parents of a random n-node tree no deeper than max_depth, parents before children (torch.Generator gen;
    max_depth >= n - 1: any shape): the trees the tree-verify tests and benches draw."""
    import torch

    parents, depth = [-1], [0]
    for i in range(1, n):
        while True:
            p = int(torch.randint(0, i, (1,), generator=gen))
            if depth[p] < max_depth:
                break
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents
