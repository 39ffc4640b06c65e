"""Calibrated-acceptance runs of the speed benchmark (BENCH-ONLY): the profile, the references, the labels.

Random-weight checkpoints at real shapes never accept a draft. With `python -m bench.speed --calibrated PROFILE`
the gateway rewrites every draft so that the target's own greedy tokens (from a reference `ar` run of the same
prompts, collected first) sit at ranks drawn from a profile measured on a real pair (bench/calibration_profile.py),
optionally rescaled to a chain tau (--calibrate-chain-tau; the DFlash paper's Qwen3-8B MATH-500 chain: 7.79). The
forwards, trees and verify sizes are real; the acceptance is the profile's. Outputs stay the target's own.
"""
from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bench import common
from gateway.calibrated_drafts import LABEL, CalibrationProfile, ReferenceStore, load_profile, simulated_tree_tau


@dataclass
class CalibrationSetup:
    """What a calibrated run hands the gateway, and what its outputs record."""

    profile_path: Path        # the profile the gateway reads (rescaled copy when a chain tau is asked for)
    references_path: Path     # written after the ar reference run; the gateway reloads it
    info: dict = field(default_factory=dict)

    @property
    def gateway_args(self) -> list[str]:
        return ["--calibrated-acceptance", str(self.profile_path),
                "--calibration-references", str(self.references_path)]


def prepare(profile_path: str, chain_tau: float | None, budgets: list[int], max_depth: int = 15,
            trials: int = 20000) -> CalibrationSetup:
    """Loads (and rescales) the profile into a work directory; records the taus it implies."""
    src = Path(profile_path)
    profile = load_profile(src)
    measured = dict(profile.meta)
    if chain_tau:
        profile = profile.rescaled_to_chain_tau(chain_tau)
    work = Path(tempfile.mkdtemp(prefix="ddtree-calibrated-"))
    replay = not isinstance(profile, CalibrationProfile)
    used = work / ("profile.steps.npz" if replay else "profile.json")
    profile.save(used)
    depth = min(max_depth, profile.depths)
    # Step replay simulates every measured step (a few draws each); the rank tables draw `trials` whole steps.
    implied_tree = {b: round(profile.simulated_tree_tau(b, depth=depth) if replay
                             else simulated_tree_tau(profile, b, trials=trials, depth=depth), 3) for b in budgets}
    info = {
        "label": LABEL,
        "profile": common._display_path(src),
        "profile_sha256": hashlib.sha256(src.read_bytes()).hexdigest()[:16],
        "profile_measured_on": {k: measured.get(k) for k in ("target", "drafter", "prompts", "max_tokens", "date",
                                                             "measured_chain_tau")
                                if k in measured},
        "calibrate_chain_tau": chain_tau,
        "kind": "step replay" if replay else "rank tables",
        "odds_factor": profile.meta.get("odds_factor"),
        "temperature": profile.temperature if replay else None,
        "profile_top_k": profile.top_k,
        "p_top1_per_depth": [round(p, 4) for p in profile.p_top1()],
        "implied_chain_tau": round(profile.chain_tau(depth), 3),
        "implied_ddtree_tau": implied_tree,
        "note": "drafts rewritten by the gateway: reference (ar) tokens placed at ranks drawn from the profile, "
                "log-probs the profile's; drafter forward, trees and verify sizes are real, acceptance is synthetic"
                + ("; step replay: each draft replays one measured step's rows (sharpened at the temperature), the "
                   "ranks drawn from those rows" if replay else ""),
    }
    return CalibrationSetup(used, work / "references.json", info)


def collect_references(setup: CalibrationSetup, gateway: str, indexed: list[tuple[int, list[int]]],
                       max_tokens: int, batch: int) -> list[list[int]]:
    """The reference `ar` run of every prompt (EOS honoured), written where the gateway looks for it."""
    reqs = [common.ids_request(ids, max_tokens, "ar") for _, ids in indexed]
    results, wall = common.run_requests(gateway, reqs, batch)
    return save_references(setup, indexed, [r.token_ids for r in results], wall)


def save_references(setup: CalibrationSetup, indexed: list[tuple[int, list[int]]], continuations: list[list[int]],
                    wall: float) -> list[list[int]]:
    """Writes the `ar` continuations of the prompts (in indexed's order) where the gateway looks for them."""
    ReferenceStore({tuple(ids): tokens for (_, ids), tokens in zip(indexed, continuations)}).save(
        setup.references_path)
    setup.info["reference_tokens"] = sum(len(t) for t in continuations)
    print(f"{LABEL}: {len(continuations)} reference ar continuations ({setup.info['reference_tokens']} tokens, "
          f"{wall:.1f} s) written to {setup.references_path}", flush=True)
    return continuations


def markdown(info: dict) -> str:
    """The block every calibrated speed report starts with."""
    implied = ", ".join(f"b{b} {t}" for b, t in info["implied_ddtree_tau"].items())
    if info.get("kind") == "step replay":
        scaled = (f"each draft replaying one measured step's log-prob rows, sharpened at temperature "
                  f"{info['temperature']:.3f} (rescaled to chain tau {info['calibrate_chain_tau']})"
                  if info.get("calibrate_chain_tau") else "each draft replaying one measured step's log-prob rows")
        logprobs = "those rows, and the true token's rank is drawn from them (a calibrated drafter)"
    else:
        scaled = (f"rescaled to chain tau {info['calibrate_chain_tau']} (P(rank 0) odds x {info['odds_factor']:.3f} "
                  f"at every depth)" if info.get("calibrate_chain_tau") else "as measured")
        logprobs = ("those of a calibrated drafter with these rank frequencies (log P_d(rank r))"
                    if info.get("calibrate_chain_tau") else "the profile's measured mean log-probs")
    return f"""> **{LABEL.upper()}.** Draft top-K lists were rewritten by the gateway: the target's own greedy tokens
> (from a reference `ar` run of the same prompts) were put at ranks drawn per depth from the profile
> `{info['profile']}` (sha256 {info['profile_sha256']}…), {scaled}; log-probs are {logprobs}. The drafter
> and target forwards, the trees and the verify sizes are real; **acceptance (tau) is synthetic**, set by the
> profile: implied chain tau {info['implied_chain_tau']}, DDTree {implied}. Outputs are still the target's own.
> Profile measured on: {info['profile_measured_on']}.
"""
