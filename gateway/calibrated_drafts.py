"""Calibrated acceptance (BENCH-ONLY): rewrites the drafter's top-K lists so that acceptance looks like a real pair's.

Random-weight checkpoints at real shapes (e.g. Qwen3-8B on a GPU) never accept a draft, so speculative speed
cannot be measured with them. In calibrated mode the drafter's forward still runs (its cost is real), but before
the trees are built each sequence's top-K lists are rewritten: the target's own greedy next tokens (known from a
reference `ar` run of the same prompt) are put at ranks drawn, per depth, from a `CalibrationProfile` measured on
a real pair (bench/calibration_profile.py), and the log-probs become the profile's typical sorted log-probs. The
target still verifies every token, so outputs stay exactly the target's (lossless); only acceptance is synthetic.

Never use this to serve: the acceptance it produces is a property of the profile, not of the drafter.
"""
from __future__ import annotations

import bisect
import json
import logging
import math
import os
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gateway.profile_math import extend_sorted, solve_increasing
from gateway.replay_profile import ReplayProfile

log = logging.getLogger(__name__)

PROFILE_KIND = "ddtree-serve calibration profile (bench-only)"
LABEL = "calibrated acceptance (bench-only)"


# ---- the profile --------------------------------------------------------------------------------------------------
@dataclass
class CalibrationProfile:
    """Per depth d = 1..D: P(true token at rank r) for r < K plus a final 'absent from top-K' bucket, and the mean
    sorted log-prob at each rank. Optionally first-order conditioned: the same rows given that depth d - 1's true
    token was at rank 0 ("hit") or not ("miss"); a real drafter's depths are correlated (right at d - 1, likely
    right at d), and independent marginals underestimate its tau (SmolLM2 pair: chain 2.30 vs 3.31 measured)."""

    rank_probs: list[list[float]]      # [D][K + 1], each row sums to 1; the last entry is "absent"
    mean_logprobs: list[list[float]]   # [D][K], non-increasing along each row
    samples: list[int] = field(default_factory=list)   # draft steps measured per depth (provenance only)
    meta: dict = field(default_factory=dict)            # how, where and when it was measured / rescaled
    rank_probs_after_hit: list[list[float]] | None = None    # [D][K + 1]; row 0 unused (no depth 0)
    rank_probs_after_miss: list[list[float]] | None = None   # [D][K + 1]; row 0 unused

    def __post_init__(self) -> None:
        if not self.rank_probs or len(self.rank_probs) != len(self.mean_logprobs):
            raise ValueError("rank_probs and mean_logprobs need the same, non-zero number of depths")
        if (self.rank_probs_after_hit is None) != (self.rank_probs_after_miss is None):
            raise ValueError("rank_probs_after_hit and rank_probs_after_miss go together")
        k = len(self.mean_logprobs[0])
        tables = [self.rank_probs] + ([self.rank_probs_after_hit, self.rank_probs_after_miss]
                                     if self.conditional else [])
        for table in tables:
            if len(table) != len(self.rank_probs):
                raise ValueError("every rank table needs one row per depth")
            for d, p in enumerate(table):
                if len(p) != k + 1:
                    raise ValueError(f"depth {d + 1}: expected {k + 1} rank probabilities")
                if any(x < 0 for x in p) or abs(sum(p) - 1.0) > 1e-6:
                    raise ValueError(f"depth {d + 1}: rank probabilities must be >= 0 and sum to 1")
        if any(len(lp) != k for lp in self.mean_logprobs):
            raise ValueError(f"every depth needs {k} log-probs")
        # Cumulative rows once: sampling is a bisect per depth.
        self._cdf = [_cumsum(p) for p in self.rank_probs]
        self._cdf_hit = [_cumsum(p) for p in self.rank_probs_after_hit] if self.conditional else None
        self._cdf_miss = [_cumsum(p) for p in self.rank_probs_after_miss] if self.conditional else None
        self._logprob_tables: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def conditional(self) -> bool:
        """Whether ranks are drawn given the previous depth's hit/miss (else independently per depth)."""
        return self.rank_probs_after_hit is not None

    @property
    def depths(self) -> int:
        return len(self.rank_probs)

    @property
    def top_k(self) -> int:
        return len(self.mean_logprobs[0])

    def p_top1(self) -> list[float]:
        """P(rank 0) per depth (marginal)."""
        return [p[0] for p in self.rank_probs]

    def chain_p_top1(self) -> list[float]:
        """P(rank 0 at depth d | ranks 0 before), as this profile draws them: the chain's acceptance factors."""
        if not self.conditional:
            return self.p_top1()
        return [self.rank_probs[0][0]] + [p[0] for p in self.rank_probs_after_hit[1:]]

    def chain_tau(self, depth: int | None = None) -> float:
        """Expected acceptance length of the chain: 1 + sum_k prod_{d<=k} P_d(rank 0 | the chain so far)."""
        return chain_tau(self.chain_p_top1()[:depth or self.depths])

    def sample_rank(self, depth_index: int, rng: random.Random, prev_rank: int | None = None) -> int:
        """A rank for depth index d (0-based; deeper than the profile reuses its last depth), given the previous
        depth's rank when the profile is conditional; K means absent. One uniform draw per call."""
        d = min(depth_index, self.depths - 1)
        cdf = self._cdf[d]
        if self.conditional and depth_index > 0 and prev_rank is not None:
            cdf = (self._cdf_hit if prev_rank == 0 else self._cdf_miss)[d]
        return min(bisect.bisect_right(cdf, rng.random()), self.top_k)

    def sample_ranks(self, depth: int, rng: random.Random) -> list[int]:
        """Ranks for depths 0..depth-1 drawn in order."""
        out: list[int] = []
        for d in range(depth):
            out.append(self.sample_rank(d, rng, out[-1] if out else None))
        return out

    def draw(self, n: int, k: int, rng: random.Random) -> tuple[np.ndarray, np.ndarray]:
        """One draft's calibration for n depths and top-k lists: the true token's rank per depth (>= k: absent)
        and the float32 [n, k] log-probs the lists carry."""
        return np.asarray(self.sample_ranks(n, rng)), self.logprob_table(n, k).numpy()

    def logprobs_for(self, depth_index: int, k: int) -> list[float]:
        """The profile's sorted log-probs at one depth for k ranks: truncated, or extended past the profile's K by
        continuing its tail slope (so the list stays non-increasing)."""
        return extend_sorted(self.mean_logprobs[min(depth_index, self.depths - 1)], k)

    def logprob_table(self, depth: int, k: int) -> torch.Tensor:
        """float32 [depth, k]: logprobs_for(d, k) for d < depth, made once per shape (a rewrite per draft reads it)."""
        table = self._logprob_tables.get((depth, k))
        if table is None:
            table = torch.tensor([self.logprobs_for(d, k) for d in range(depth)], dtype=torch.float32)
            self._logprob_tables[(depth, k)] = table
        return table

    def rescaled_to_chain_tau(self, tau: float, tol: float = 1e-6) -> CalibrationProfile:
        """A profile whose chain tau is `tau`: P_d(rank 0) odds times one factor for every depth (bisection), the
        rest of each row rescaled in its measured proportions. Its log-probs are those of a calibrated drafter
        with these rank frequencies (log P_d(rank r)): a drafter that accepts like this is that confident, and the
        measured pair's own log-probs (a weaker drafter's) would shape the trees of a different drafter."""
        top = self.chain_p_top1()
        lo_tau, hi_tau = chain_tau([_scale_odds(p, 1e-12) for p in top]), chain_tau([_scale_odds(p, 1e12) for p in top])
        if not lo_tau - tol <= tau <= hi_tau + tol:
            raise ValueError(f"chain tau {tau} is out of reach of this profile ([{lo_tau:.3f}, {hi_tau:.3f}])")
        factor = math.exp(solve_increasing(lambda x: chain_tau([_scale_odds(p, math.exp(x)) for p in top]), tau,
                                           -28.0, 28.0))  # over the log odds factor
        meta = dict(self.meta, rescaled_to_chain_tau=tau, odds_factor=factor,
                    chain_tau_before_rescaling=self.chain_tau(),
                    logprobs="log of the rescaled rank frequencies per depth (a calibrated drafter)")
        rows = _rescale_rows(self.rank_probs, factor)
        return CalibrationProfile(rows, [calibrated_logprobs(r[:-1]) for r in rows], list(self.samples), meta,
                                  _rescale_rows(self.rank_probs_after_hit, factor) if self.conditional else None,
                                  _rescale_rows(self.rank_probs_after_miss, factor) if self.conditional else None)

    def to_dict(self) -> dict:
        """The JSON form."""
        d = {"kind": PROFILE_KIND, "depths": self.depths, "top_k": self.top_k, "conditional": self.conditional,
             "chain_tau": self.chain_tau(), "p_top1": self.p_top1(), "chain_p_top1": self.chain_p_top1(),
             "samples": self.samples, "meta": self.meta,
             "rank_probs": self.rank_probs, "mean_logprobs": self.mean_logprobs}
        if self.conditional:
            d.update(rank_probs_after_hit=self.rank_probs_after_hit, rank_probs_after_miss=self.rank_probs_after_miss)
        return d

    def save(self, path: str | Path) -> None:
        """Writes the JSON form."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: dict) -> CalibrationProfile:
        """From the JSON form (extra keys are ignored)."""
        def table(key: str) -> list[list[float]] | None:
            return [list(map(float, r)) for r in d[key]] if d.get(key) is not None else None

        return cls(table("rank_probs"), table("mean_logprobs"), list(d.get("samples", [])), dict(d.get("meta", {})),
                   table("rank_probs_after_hit"), table("rank_probs_after_miss"))

    @classmethod
    def load(cls, path: str | Path) -> CalibrationProfile:
        """Reads a profile written by save()."""
        return cls.from_dict(json.loads(Path(path).read_text()))


def calibrated_logprobs(rank_probs: list[float]) -> list[float]:
    """log P(rank r), made non-increasing along the ranks (a sorted top-K list) and floored at -1000."""
    out: list[float] = []
    for p in rank_probs:
        lp = math.log(p) if p > 0 else -1000.0
        out.append(max(-1000.0, min(lp, out[-1]) if out else lp))
    return out


def chain_tau(p_top1: list[float]) -> float:
    """1 + sum_k prod_{d<=k} p_d: the chain's expected acceptance length if depths are independent."""
    total, run = 1.0, 1.0
    for p in p_top1:
        run *= p
        total += run
    return total


def _scale_odds(p: float, factor: float) -> float:
    """p with its odds multiplied by factor (monotone in factor; 0 and 1 stay put)."""
    if p <= 0.0 or p >= 1.0:
        return p
    o = p / (1 - p) * factor
    return o / (1 + o)


def _rescale_rows(rows: list[list[float]], factor: float) -> list[list[float]]:
    """Each row's P(rank 0) odds times factor, the rest of the row rescaled in its proportions."""
    out = []
    for p in rows:
        new0 = _scale_odds(p[0], factor)
        rest = sum(p[1:])
        if rest > 0:
            out.append([new0] + [x * (1 - new0) / rest for x in p[1:]])
        else:  # nothing measured besides rank 0: the freed mass goes to "absent"
            out.append([new0] + [0.0] * (len(p) - 2) + [1 - new0])
    return out


def _cumsum(p: list[float]) -> list[float]:
    out, s = [], 0.0
    for x in p:
        s += x
        out.append(s)
    return out


def simulated_tree_tau(profile: CalibrationProfile, budget: int, trials: int = 20000, seed: int = 0,
                       k: int | None = None, depth: int | None = None) -> float:
    """Expected acceptance length of DDTree-`budget` on calibrated drafts (Monte Carlo over the profile's ranks).
    The calibrated log-probs are the same every step, so the tree's rank structure is fixed: only the ranks vary."""
    from ddtree_serve.decoding.ddtree import build_ddtree_reference

    depth = min(depth or profile.depths, profile.depths)
    k = k or profile.top_k
    lp = torch.tensor([profile.logprobs_for(d, k) for d in range(depth)])
    ids = torch.arange(k).expand(depth, k)  # token = rank
    tree = build_ddtree_reference(lp, ids, budget, depth, root_token=-1)
    children: dict[tuple[int, int], int] = {}  # (parent node, rank) -> node
    for i, (t, par) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
        if i:
            children[(par, t)] = i
    rng = random.Random(seed)
    total = 0
    for _ in range(trials):
        node = 0
        for rank in profile.sample_ranks(depth, rng):
            node = children.get((node, rank), -1)
            if node < 0:
                break
            total += 1
    return 1.0 + total / trials


# ---- the rewrite ----------------------------------------------------------------------------------------------
@dataclass
class CalibrationDraw:
    """One draft's calibration, drawn before the draft arrives: the true tokens of the first n depths, where they
    go (rank per depth, >= k: absent) and the log-probs the lists carry, for a draft of depth x k lists."""

    depth: int
    k: int
    true_tokens: np.ndarray   # int64 [n]
    ranks: np.ndarray         # int [n]
    table: np.ndarray         # float32 [n, k]

    def __post_init__(self) -> None:
        # Where each column's id comes from when the drafter did not draft the true token (the usual case): the
        # drafter's column c before the rank, c - 1 after it; the true token at the rank. Made now, while the
        # Draft is in flight, so that placing it is one gather.
        col = np.arange(self.k)[None, :]
        rank = self.ranks[:, None]
        self.rows = np.arange(len(self.ranks))[:, None]
        self.source = np.minimum(col - (col > rank), self.k - 1)
        self.at_rank = col == rank
        self.true_column = self.true_tokens[:, None]


def draw_calibration(future_tokens: list[int], depth: int, k: int, profile: CalibrationProfile | ReplayProfile,
                     rng: random.Random) -> CalibrationDraw | None:
    """The draws of one draft of depth x k lists (None when no depth has a known future token)."""
    n = min(depth, len(future_tokens))
    if n == 0:
        return None
    # The draws are made against the profile's own K: the same whatever K the gateway asked for.
    ranks, table = profile.draw(n, k, rng)
    return CalibrationDraw(depth, k, np.asarray(future_tokens[:n], dtype=np.int64), ranks, table)


def place_calibration(draw: CalibrationDraw, logprobs: torch.Tensor | np.ndarray, ids: torch.Tensor | np.ndarray
                      ) -> tuple[torch.Tensor, torch.Tensor] | tuple[np.ndarray, np.ndarray]:
    """The draft's lists with each true token moved to its drawn rank (or removed), the other ids distinct, kept in
    their order and never the true token, the log-probs the draw's; depths past the draw keep the drafter's lists.
    Numpy arrays in (the gateway's drafts), numpy arrays out; tensors in, tensors out on their device."""
    if tuple(ids.shape) != (draw.depth, draw.k):
        raise ValueError(f"a calibration drawn for [{draw.depth}, {draw.k}] lists cannot place a {tuple(ids.shape)} draft")
    n, k = len(draw.ranks), draw.k
    # In numpy throughout, on host copies: this runs for every sequence of every step on the gateway's event loop,
    # where torch's per-op overhead on [15, 64] tensors cost ~0.5 ms a draft.
    arrays = isinstance(logprobs, np.ndarray)
    out_lp = np.array(logprobs, dtype=np.float32) if arrays else logprobs.float().numpy(force=True).copy()
    out_ids = np.array(ids) if arrays else ids.numpy(force=True).copy()
    out_lp[:n] = draw.table
    rows = out_ids[:n]
    is_true = rows == draw.true_column
    if not is_true.any():   # no true token drafted: the gather made ready in the draw (the same lists as below)
        out_ids[:n] = np.where(draw.at_rank, draw.true_column, rows[draw.rows, draw.source])
        return _like(out_lp, out_ids, logprobs, ids)
    ranks = draw.ranks[:, None]
    true = draw.true_tokens.astype(rows.dtype)[:, None]
    row = np.arange(n)[:, None]
    # Each row's other ids in their order, then the true token where it was drafted (a stable sort moves it last).
    others = rows[row, np.argsort(is_true, axis=1, kind="stable")]
    # Column j takes others[j] before the rank, the true token at it, others[j - 1] after it (rank K: absent).
    col = np.arange(k)[None, :]
    new = np.where(col == ranks, true, others[row, col - (col > ranks)])
    # An absent true token that was drafted sits in the last column: one filler there, distinct from all.
    for d in np.flatnonzero((ranks[:, 0] >= k) & is_true.any(axis=1)):
        used = set(new[d, :k - 1].tolist()) | {int(true[d, 0])}
        filler = 0
        while filler in used:
            filler += 1
        new[d, k - 1] = filler
    out_ids[:n] = new
    return _like(out_lp, out_ids, logprobs, ids)


def _like(out_lp: np.ndarray, out_ids: np.ndarray, logprobs, ids):
    """The placed lists as the draft came: numpy arrays, or tensors of its devices and dtypes."""
    if isinstance(logprobs, np.ndarray):
        return out_lp, out_ids
    return (torch.from_numpy(out_lp).to(logprobs.device, logprobs.dtype),
            torch.from_numpy(out_ids).to(ids.device, ids.dtype))


def rewrite(logprobs: torch.Tensor, ids: torch.Tensor, future_tokens: list[int], profile: CalibrationProfile | ReplayProfile,
            rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K lists [D, K] with the true token of each depth that has one (future_tokens[d]) at a rank drawn from
    the profile (or removed, for 'absent'), other ids distinct and not the true token, log-probs the profile's.
    Depths without a known future token keep the drafter's own lists."""
    draw = draw_calibration(future_tokens, int(ids.shape[0]), int(ids.shape[1]), profile, rng)
    return (logprobs, ids) if draw is None else place_calibration(draw, logprobs, ids)


# ---- references ---------------------------------------------------------------------------------------------------
class ReferenceStore:
    """Prompt ids -> the target's reference greedy continuation (from an `ar` run of the same prompt)."""

    def __init__(self, references: dict[tuple[int, ...], list[int]] | None = None) -> None:
        self.references = dict(references or {})

    def future_tokens(self, prompt_ids: list[int], output_ids: list[int], n: int) -> list[int]:
        """Up to n reference tokens after the output so far; [] unless the output is a prefix of the reference."""
        ref = self.references.get(tuple(prompt_ids))
        if ref is None or len(output_ids) > len(ref) or ref[:len(output_ids)] != list(output_ids):
            return []
        return ref[len(output_ids):len(output_ids) + n]

    def __len__(self) -> int:
        return len(self.references)

    def to_dict(self) -> dict:
        """The JSON form: {"references": [{"prompt_ids": [...], "output_ids": [...]}]}."""
        return {"kind": "ddtree-serve calibration references (bench-only)",
                "references": [{"prompt_ids": list(p), "output_ids": o} for p, o in self.references.items()]}

    def save(self, path: str | Path) -> None:
        """Writes atomically (write + rename): a gateway watching the file never reads half of it."""
        path = Path(path)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict()) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> ReferenceStore:
        """Reads a file written by save()."""
        data = json.loads(Path(path).read_text())
        return cls({tuple(r["prompt_ids"]): list(r["output_ids"]) for r in data["references"]})


class WatchedReferences:
    """A references file that may appear or change while the gateway runs: reloaded when its mtime changes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._mtime: float | None = None
        self.store = ReferenceStore()

    def current(self) -> ReferenceStore:
        """The store as of the file's latest complete version (a stat per call; reload only on change)."""
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return self.store
        if mtime != self._mtime:
            try:
                self.store = ReferenceStore.load(self.path)
                self._mtime = mtime
                log.warning("%s: loaded %d reference continuations from %s", LABEL, len(self.store), self.path)
            except (OSError, ValueError, KeyError) as exc:  # keep the previous store; retry on the next change
                log.error("%s: cannot read references %s: %s", LABEL, self.path, exc)
                self._mtime = mtime
        return self.store


# ---- what the engine holds ----------------------------------------------------------------------------------------
@dataclass
class CalibrationCounters:
    """How many draft depths were rewritten and how many were left as drafted (no reference / mismatch)."""

    rewritten_depths: int = 0
    unchanged_depths: int = 0


class DraftCalibrator:
    """Rewrites each sequence's draft with its future reference tokens; seeded per (prompt, position), so a given
    position gets the same rank draws in every mode and batch."""

    def __init__(self, profile: CalibrationProfile | ReplayProfile, references: WatchedReferences | ReferenceStore,
                 seed: int = 0) -> None:
        self.profile = profile
        self.references = references
        self.seed = seed
        self.counters = CalibrationCounters()
        self._warned: set[tuple[tuple[int, ...], bool]] = set()

    def _store(self) -> ReferenceStore:
        refs = self.references
        return refs.current() if isinstance(refs, WatchedReferences) else refs

    def draw(self, prompt_ids: list[int], output_ids: list[int], depth: int, k: int,
             count: bool = True) -> CalibrationDraw | None:
        """The calibration of the sequence's next draft of depth x k lists, drawable before that draft arrives (the
        engine draws while the Draft is in flight, so that only the placing is on the step's path); None when the
        reference has no future tokens for it (the draft is then left as drafted)."""
        store = self._store()
        future = store.future_tokens(prompt_ids, output_ids, depth)
        if count:
            self.counters.rewritten_depths += len(future)
            self.counters.unchanged_depths += depth - len(future)
        if not future:
            ref = store.references.get(tuple(prompt_ids))
            if len(store) and (ref is None or len(output_ids) < len(ref)):  # a miss a benchmark should hear about
                key = (tuple(prompt_ids), ref is None)
                if key not in self._warned:
                    self._warned.add(key)
                    log.warning("%s: %s (prompt of %d tokens, %d output tokens): this draft is left as drafted",
                                LABEL, "no reference for this prompt" if ref is None else
                                "output diverged from its reference", len(prompt_ids), len(output_ids))
            return None
        # Seeded per (prompt, position): a given position gets the same draws in every mode and batch.
        key = f"{self.seed}:{len(output_ids)}:{','.join(map(str, prompt_ids))}".encode()
        return draw_calibration(future, depth, k, self.profile, random.Random(zlib.crc32(key)))

    def rewrite_sequence(self, prompt_ids: list[int], output_ids: list[int], logprobs: torch.Tensor,
                         ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The calibrated (logprobs, ids) of one sequence's draft; the bonus token is output_ids[-1]."""
        draw = self.draw(prompt_ids, output_ids, int(ids.shape[0]), int(ids.shape[1]))
        return (logprobs, ids) if draw is None else place_calibration(draw, logprobs, ids)

    def apply(self, draw: CalibrationDraw | None, prompt_ids: list[int], output_ids: list[int],
              logprobs: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft rewritten with the draw made for it before it arrived (drawn again, uncounted, should the
        drafter have answered other shapes than asked)."""
        if draw is not None and (draw.depth, draw.k) != tuple(ids.shape):
            draw = self.draw(prompt_ids, output_ids, int(ids.shape[0]), int(ids.shape[1]), count=False)
        return (logprobs, ids) if draw is None else place_calibration(draw, logprobs, ids)

    @classmethod
    def from_files(cls, profile_path: str | Path, references_path: str | Path, chain_tau: float | None = None,
                   seed: int = 0) -> DraftCalibrator:
        """The gateway's calibrator from its flags (profile optionally rescaled to a chain tau)."""
        profile = load_profile(profile_path)
        if chain_tau:
            profile = profile.rescaled_to_chain_tau(chain_tau)
        return cls(profile, WatchedReferences(references_path), seed)


def load_profile(path: str | Path) -> CalibrationProfile | ReplayProfile:
    """Either kind of profile: a step-replay .npz (gateway/replay_profile.py) or a rank-table JSON."""
    if str(path).endswith(".npz"):
        return ReplayProfile.load(path)
    return CalibrationProfile.load(path)


def calibrator_from_args(profile_path: str, references_path: str | None) -> DraftCalibrator:
    """The gateway's calibrator from --calibrated-acceptance / --calibration-references, with a loud warning."""
    if not references_path:
        raise SystemExit("--calibrated-acceptance needs --calibration-references REFS.json")
    calibrator = DraftCalibrator.from_files(profile_path, references_path)
    p = calibrator.profile
    log.warning("%s: drafts are REWRITTEN from profile %s (depths %d, top-%d, chain tau %.3f%s) with reference "
                "continuations from %s. Outputs are still the target's own, but acceptance is synthetic: "
                "for benchmarks only, never for serving.", LABEL.upper(), profile_path, p.depths, p.top_k,
                p.chain_tau(), f", rescaled to {p.meta['rescaled_to_chain_tau']}"
                if "rescaled_to_chain_tau" in p.meta else "", references_path)
    return calibrator
