"""Chat prompts built from text units, with a held-out split by document; saving and loading them."""
from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from drafter_svc.train.corpora import KINDS, UNIT_READERS, Corpora, Unit

log = logging.getLogger(__name__)


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
                       for path in files for u in UNIT_READERS[kind](path)]
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
    if n_train > 0 and not any(train for train, _ in pools.values()):
        # Every document fell on the held-out side (a tiny corpus of a few documents: each is held out with
        # probability heldout_doc_fraction): split individual prompts instead, most of them for training.
        log.warning("every document is held out; splitting individual prompts")
        for kind, (_, held_t) in pools.items():
            held_d = docs[kind][1]
            cut = max(1, len(held_t) // 10) if len(held_t) > 1 else 0
            pools[kind] = (held_t[cut:], held_t[:cut])
            docs[kind] = (held_d[cut:], held_d[:cut])
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
