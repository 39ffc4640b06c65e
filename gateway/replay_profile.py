"""Step-replay calibration profile (BENCH-ONLY): a calibrated drafter that replays a real drafter's measured rows.

The rank-table profile (calibrated_drafts.CalibrationProfile) keeps per-depth rank frequencies and one mean log-prob
row per depth, so every calibrated draft has the same log-probs and every tree the same shape: it loses what a
tree exploits, a drafter that knows when it is unsure (on the SmolLM2 pair it implies DDTree-64 tau 3.58 where
the pair measured 4.50). This profile keeps every measured draft step whole — the drafter's sorted top-K log-probs
at every depth — and models the drafter as calibrated: at each depth the true token's rank is drawn from the
row's own probabilities (on the SmolLM2 pair: chain 3.17 / DDTree-64 4.40 implied against 3.31 / 4.50 measured).

Rescaling to a stronger drafter (--calibrate-chain-tau) sharpens every row with one temperature T < 1 and keeps
the model calibrated, so the drafter grows both more confident and more often right, and stays unsure where the
real one was. Row probabilities at T: p_r^(1/T) for the top-K; the mass outside the top-K (m) is treated as
tokens no likelier than the K-th, so it becomes m * p_K^(1/T - 1) (an upper bound); then all renormalised.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gateway.profile_math import extend_sorted, solve_increasing

NO_REFERENCE = -1  # a measured depth past the reference's end (EOS came first): no rank


@dataclass
class ReplayProfile:
    """Measured draft steps of a real pair (rows [S, D, K] of sorted log-probs; the measured ranks, kept for
    validation) and the temperature the calibrated drafter sharpens them with."""

    logprobs: torch.Tensor                 # float [S, D, K], non-increasing along K
    ranks: torch.Tensor | None = None      # int [S, D]: measured rank of the reference token (K absent, -1 none)
    temperature: float = 1.0
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.logprobs.dim() != 3 or min(self.logprobs.shape) == 0:
            raise ValueError("logprobs must be [steps, depths, K] with every size > 0")
        if self.ranks is not None and self.ranks.shape != self.logprobs.shape[:2]:
            raise ValueError("ranks must be [steps, depths] like logprobs")
        if not self.temperature > 0:
            raise ValueError("temperature must be > 0")
        self._rows, absent = sharpen(self.logprobs.double(), self.temperature)
        probs = torch.cat([self._rows.exp(), absent.exp()[..., None]], -1)
        self._cdf = probs.cumsum(-1).numpy()          # [S, D, K + 1]; the last column is "absent"
        self._cdf[..., -1] = 1.0
        self._p_top1 = probs[..., 0]                  # [S, D]
        self._rows32 = self._rows.float().numpy()      # what draw() hands out, read per draft on the gateway's loop

    @property
    def steps(self) -> int:
        return int(self.logprobs.shape[0])

    @property
    def depths(self) -> int:
        return int(self.logprobs.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.logprobs.shape[2])

    def p_top1(self) -> list[float]:
        """Mean P(rank 0) per depth at this temperature."""
        return self._p_top1.mean(0).tolist()

    def chain_tau(self, depth: int | None = None) -> float:
        """Expected acceptance length of the chain: the mean over steps of 1 + sum_k prod_{d<=k} P_d(rank 0)."""
        p = self._p_top1[:, :depth or self.depths]
        return float((1 + p.cumprod(1).sum(1)).mean())

    def rescaled_to_chain_tau(self, tau: float, tol: float = 1e-6) -> ReplayProfile:
        """The same steps at the temperature whose chain tau is `tau` (bisection on log T)."""
        def at(x: float) -> float:   # x = -log T: increasing, since a lower T is a sharper, stronger drafter
            return ReplayProfile(self.logprobs, None, math.exp(-x)).chain_tau()

        lo, hi = -math.log(1e3), -math.log(1e-3)
        if not at(lo) - tol <= tau <= at(hi) + tol:
            raise ValueError(f"chain tau {tau} is out of reach of this profile ([{at(lo):.3f}, {at(hi):.3f}])")
        t = math.exp(-solve_increasing(at, tau, lo, hi, tol=1e-9))
        meta = dict(self.meta, rescaled_to_chain_tau=tau, temperature=t, chain_tau_before_rescaling=self.chain_tau())
        return ReplayProfile(self.logprobs, self.ranks, t, meta)

    def draw(self, n: int, k: int, rng: random.Random) -> tuple[np.ndarray, np.ndarray]:
        """One draft's calibration for n depths and top-k lists: a measured step (uniformly), the true token's rank
        per depth drawn from its sharpened rows (>= k: absent from the lists), and those rows as float32 [n, k]."""
        s = rng.randrange(self.steps)
        depth = np.minimum(np.arange(n), self.depths - 1)  # deeper than measured: the last depth again
        u = np.array([rng.random() for _ in range(n)])
        ranks = (self._cdf[s, depth] <= u[:, None]).sum(1)  # inverse CDF, one uniform per depth
        rows = self._rows32[s, depth]
        if k < self.top_k:
            rows = rows[:, :k]
        elif k > self.top_k:
            rows = np.array([extend_sorted(r, k) for r in rows.tolist()], dtype=np.float32)
        return np.minimum(ranks, self.top_k), rows

    def measured_taus(self, budget: int) -> tuple[float, float]:
        """(chain tau, DDTree-budget tau) of the measured ranks on the measured rows: the real pair's own."""
        if self.ranks is None:
            raise ValueError("this profile holds no measured ranks")
        chain = tree = 0
        for s in range(self.steps):
            ranks = self.ranks[s].tolist()
            chain += next((i for i, r in enumerate(ranks) if r != 0), len(ranks))
            tree += _tree_walk(self.logprobs[s].float(), ranks, budget)
        return 1 + chain / self.steps, 1 + tree / self.steps

    def simulated_tree_tau(self, budget: int, trials: int = 4, seed: int = 0, depth: int | None = None) -> float:
        """Expected DDTree-budget tau of calibrated drafts: every step's tree from its sharpened rows, `trials`
        rank draws per step (Monte Carlo)."""
        depth = min(depth or self.depths, self.depths)
        rng, total = random.Random(seed), 0
        for s in range(self.steps):
            rows = self._rows[s, :depth].float()
            children = _children(rows, budget)
            for _ in range(trials):
                node = 0
                for d in range(depth):
                    node = children.get((node, int(np.searchsorted(self._cdf[s, d], rng.random(), side="right"))), -1)
                    if node < 0:
                        break
                    total += 1
        return 1 + total / (self.steps * trials)

    def save(self, path: str | Path) -> None:
        """A compressed .npz: rows (float16), measured ranks, temperature and meta."""
        arrays = {"logprobs": self.logprobs.to(torch.float16).numpy(),
                  "meta": np.array(json.dumps(dict(self.meta, temperature=self.temperature)))}
        if self.ranks is not None:
            arrays["ranks"] = self.ranks.to(torch.int16).numpy()
        with open(path, "wb") as f:  # a file object: np.savez would append .npz to a name without it
            np.savez_compressed(f, **arrays)

    @classmethod
    def load(cls, path: str | Path) -> ReplayProfile:
        """Reads a file written by save()."""
        with np.load(path) as data:
            meta = json.loads(str(data["meta"]))
            ranks = torch.from_numpy(data["ranks"].astype(np.int64)) if "ranks" in data else None
            return cls(torch.from_numpy(data["logprobs"].astype(np.float32)), ranks,
                       float(meta.get("temperature", 1.0)), meta)


def sharpen(logprobs: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [..., K], absent [...]): top-K log-probs at the temperature and the log mass outside the top-K."""
    tail = (1 - logprobs.exp().sum(-1)).clamp_min(1e-30).log()
    scaled = logprobs / temperature
    tail = tail + logprobs[..., -1] * (1 / temperature - 1)
    z = torch.logsumexp(torch.cat([scaled, tail[..., None]], -1), -1)
    return scaled - z[..., None], tail - z


def _children(rows: torch.Tensor, budget: int) -> dict[tuple[int, int], int]:
    """The DDTree of one step's rows with token = rank: (parent node, rank) -> node."""
    from ddtree_serve.decoding.ddtree import build_ddtree_reference

    ids = torch.arange(rows.shape[1]).expand(rows.shape[0], -1)
    tree = build_ddtree_reference(rows, ids, budget, rows.shape[0], root_token=-1)
    return {(p, t): i for i, (t, p) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())) if i}


def _tree_walk(rows: torch.Tensor, ranks: list[int], budget: int) -> int:
    """How many depths of one step the DDTree of its rows accepts, given the true ranks."""
    children, node, accepted = _children(rows, budget), 0, 0
    for r in ranks:
        node = children.get((node, r), -1) if r >= 0 else -1
        if node < 0:
            break
        accepted += 1
    return accepted
