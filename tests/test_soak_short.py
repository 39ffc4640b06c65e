"""CI's short soak: bench/soak.py for a few seconds with cancellations and a drafter and a target kill."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_short_soak_loses_and_corrupts_nothing(tmp_path):
    from bench import soak

    tally = soak.main(["--tiny", "--duration", "24", "--streams", "8", "--prompts", "4", "--max-tokens", "24",
               "--kill-every", "9", "--cancel-rate", "0.2", "--out", str(tmp_path)])   # SystemExit(1) on a loss
    assert tally.completed > 0 and tally.corrupted == 0 and tally.lost == 0
    assert "INTERNAL" not in tally.failed   # a killed service is UNAVAILABLE to its callers, never a crash
    assert tally.cached_tokens > 0   # prefix caching's copies and adoptions ran under the chaos too
    assert len(tally.kills) == 2 and next(tmp_path.glob("soak-*.md")).exists()
