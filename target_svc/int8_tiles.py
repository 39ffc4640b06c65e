"""Measured per-GPU tilings of the int8 weight-only kernels: a table per device name, written by the sweeps.

`int8_matmul.choose_config` picks tiles by a rule fitted to a few sweeps; a rule shared by every projection leaves
a few percent per shape on the table (an H100 sweep at 64 rows: the 8B gate_up 8 % faster on 128-deep K steps, its
qkv 4 %, its o_proj 7 %). As vLLM does for its fused-MoE kernels, the sweep's winners per (rows, N, K) are kept in a
JSON file per GPU model, `int8_tiles/<device-name>.json` beside this module (e.g. `nvidia-h200.json`), written by
`python -m bench.int8_kernel --dot-sweep --write-tiles FILE` (and `--gemv-sweep --write-tiles`). A shape or row
count the table does not hold keeps the rule's tiles. The table is read once per process (per device name and
DDTREE_INT8_TILES value), so it never changes a launch between a graph's warm-up and its replay.

DDTREE_INT8_TILES=PATH takes that file instead of the device's, DDTREE_INT8_TILES=off no table at all (an A/B).

File format: {"device": name, "date": ..., "command": ..., "tiles": [entry, ...]}, each entry
{"rows": [lo, hi], "n": N, "k": K, "kernel": "dot" | "gemv", "config": [...], "ms": t, "default_ms": t0}: for
m rows with lo <= m <= hi of an [m, K] x [K, N] int8 product, launch `kernel` with `config` (TileConfig's fields
in order for "dot": BLOCK_M, BLOCK_N, BLOCK_K, split, swap AB, warps, stages; GemvConfig's for "gemv": BLOCK_N,
BLOCK_K, split, warps, stages). ms / default_ms: what the sweep timed for it and for the rule's tiles.
"""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

TILES_ENV = "DDTREE_INT8_TILES"
TABLE_DIR = Path(__file__).resolve().parent / "int8_tiles"
KERNELS = {"dot": 7, "gemv": 5}   # kernel -> number of config fields


@dataclass(frozen=True)
class TunedTile:
    """One measured winner: `kernel` with `config` for rows_lo..rows_hi rows of an [m, k] x [k, n] product."""

    rows_lo: int
    rows_hi: int
    n: int
    k: int
    kernel: str
    config: tuple
    ms: float = 0.0
    default_ms: float = 0.0


def device_slug(name: str) -> str:
    """A file stem for a GPU's name: 'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def parse_entry(entry: dict) -> TunedTile:
    """One table entry -> TunedTile; ValueError naming what is wrong."""
    try:
        lo, hi = (int(v) for v in entry["rows"])
        n, k, kernel, config = int(entry["n"]), int(entry["k"]), str(entry["kernel"]), list(entry["config"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"int8 tile entry {entry!r}: {exc}") from None
    if kernel not in KERNELS or len(config) != KERNELS[kernel]:
        raise ValueError(f"int8 tile entry {entry!r}: kernel must be one of {sorted(KERNELS)} with "
                         f"{KERNELS.get(kernel, '?')} config fields")
    if not 1 <= lo <= hi or n < 1 or k < 1:
        raise ValueError(f"int8 tile entry {entry!r}: rows must be 1 <= lo <= hi, n and k positive")
    if kernel == "dot":
        config[4] = bool(config[4])   # swap AB
        ints = config[:4] + config[5:]
    else:
        ints = config
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in ints):
        raise ValueError(f"int8 tile entry {entry!r}: tile sizes, split, warps and stages are positive integers")
    return TunedTile(lo, hi, n, k, kernel, tuple(config), float(entry.get("ms", 0.0)),
                     float(entry.get("default_ms", 0.0)))


def load_table(path: str | Path) -> tuple[TunedTile, ...]:
    """The entries of a tile file; ValueError (with the path) where it does not parse."""
    try:
        data = json.loads(Path(path).read_text())
        entries = data["tiles"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"int8 tile table {path}: {exc}") from None
    tiles = tuple(parse_entry(e) for e in entries)
    for i, a in enumerate(tiles):
        for b in tiles[i + 1:]:
            if (a.n, a.k) == (b.n, b.k) and a.rows_lo <= b.rows_hi and b.rows_lo <= a.rows_hi:
                raise ValueError(f"int8 tile table {path}: entries for N {a.n}, K {a.k} overlap in rows")
    return tiles


def table_path(device_name: str, chosen: str | None = None) -> Path | None:
    """The table a device takes: `chosen` (DDTREE_INT8_TILES's value when None) names a file, or none for 'off';
    else int8_tiles/<slug>.json where there is one."""
    chosen = os.environ.get(TILES_ENV, "") if chosen is None else chosen
    chosen = chosen.strip()
    if chosen.lower() in ("off", "0", "none"):
        return None
    if chosen:
        return Path(chosen)
    path = TABLE_DIR / f"{device_slug(device_name)}.json"
    return path if path.is_file() else None


@functools.lru_cache(maxsize=16)
def _table_for(device_name: str, chosen: str) -> tuple[TunedTile, ...]:
    path = table_path(device_name, chosen)
    return () if path is None else load_table(path)


def device_table(device_name: str) -> tuple[TunedTile, ...]:
    """The tuned entries for a GPU model (empty where it has no table). Read once per process and setting: every
    launch of a shape, a graph's warm-up and its replays alike, takes the same tiles (and no call pays a file
    system lookup)."""
    return _table_for(device_name, os.environ.get(TILES_ENV, ""))


def lookup(table: tuple[TunedTile, ...], m: int, n: int, k: int) -> TunedTile | None:
    """The entry for m rows of an [m, k] x [k, n] product, None where the table holds none."""
    return next((t for t in table if t.n == n and t.k == k and t.rows_lo <= m <= t.rows_hi), None)


def to_entry(tile: TunedTile) -> dict:
    """A TunedTile as the file writes it."""
    return {"rows": [tile.rows_lo, tile.rows_hi], "n": tile.n, "k": tile.k, "kernel": tile.kernel,
            "config": list(tile.config), "ms": round(tile.ms, 5), "default_ms": round(tile.default_ms, 5)}


def merge(old: tuple[TunedTile, ...], new: list[TunedTile]) -> list[TunedTile]:
    """old's entries with new's: a new entry replaces the old ones of its (n, k) whose rows overlap its own, unless
    one of them covers the same rows and was timed faster (then the new one is dropped)."""
    merged = list(old)
    for t in new:
        clash = [o for o in merged if (o.n, o.k) == (t.n, t.k) and o.rows_lo <= t.rows_hi and t.rows_lo <= o.rows_hi]
        if any((o.rows_lo, o.rows_hi) == (t.rows_lo, t.rows_hi) and o.ms <= t.ms for o in clash):
            continue
        merged = [o for o in merged if o not in clash] + [t]
    return sorted(merged, key=lambda t: (t.n, t.k, t.rows_lo))
