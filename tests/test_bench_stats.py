"""The sampling errors the speed bench prints next to tau and next to the ddtree / dflash ratio (bench/common.py)."""
from __future__ import annotations

import math

import pytest

from bench.common import ratio_standard_error, tau_standard_error


def test_tau_standard_error_is_the_spread_of_accepted_lengths_over_the_square_root_of_the_drafts():
    """Four drafts accepting 0, 1, 2 and 3 tokens: counts 3, 2, 1 at depths 1, 2, 3; variance 1.25."""
    assert tau_standard_error(4, {0: 3, 1: 2, 2: 1}) == pytest.approx(math.sqrt(1.25 / 4))


def test_drafts_that_all_accept_alike_have_no_spread():
    assert tau_standard_error(10, {0: 10, 1: 10, 2: 10}) == pytest.approx(0.0, abs=1e-12)
    assert tau_standard_error(10, {}) == pytest.approx(0.0, abs=1e-12)


def test_no_drafts_no_error():
    assert tau_standard_error(0, {}) is None


def test_the_error_shrinks_as_the_drafts_grow():
    """The same length distribution over 100x the drafts: a tenth of the error."""
    few = tau_standard_error(4, {0: 3, 1: 2, 2: 1})
    many = tau_standard_error(400, {0: 300, 1: 200, 2: 100})
    assert many == pytest.approx(few / 10)


def test_ratio_error_adds_the_relative_errors_in_quadrature():
    assert ratio_standard_error(1.2, 10.0, 0.3, 8.0, 0.32) == pytest.approx(1.2 * math.hypot(0.03, 0.04))
