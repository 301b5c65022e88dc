"""Online estimates and the hold rule."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from services.batcher.estimates import DecayedAffineFit, PresetEstimator, Thresholds, check_stats
from shared.hold import may_step, wait_left_s
from tests.services.batcher.builders import duo_stats as stats

NEED = Thresholds(min_tokens=500, min_handoffs=20, min_step_samples=20)


def test_affine_fit_recovers_the_line_and_stays_positive() -> None:
    fit = DecayedAffineFit()
    rng = np.random.default_rng(0)
    for _ in range(400):
        b = int(rng.integers(1, 9))
        fit.add(b, 0.02 + 0.003 * b + float(rng.normal(0, 1e-4)))
    line = fit.fit()
    assert line.intercept_s == pytest.approx(0.02, rel=0.02)
    assert line.per_request_s == pytest.approx(0.003, rel=0.03)
    one = DecayedAffineFit()
    one.add(4, 0.05)  # one batch size: no slope to see
    assert (one.fit().intercept_s, one.fit().per_request_s) == (0.05, 0.0)
    falling = DecayedAffineFit()
    for b, t in ((1, 0.01), (8, 0.2)):  # a line through a negative intercept
        falling.add(b, t)
    assert falling.fit().intercept_s >= 0 and falling.fit()(1) > 0


def test_estimates_wait_for_samples_then_match_the_counts() -> None:
    est = PresetEstimator(["small", "large"], half_life_s=60.0, now_s=0.0)
    est.add(stats(0, 100, 10, [(4, 0.01)] * 5), now_s=0.0)
    assert est.inputs(0.0, NEED) is None  # too few of everything
    est.add(
        stats(0, 1000, 100, [(b, 0.005 + 0.001 * b) for b in (1, 2, 3, 4)] * 10, num_taken_back=25),
        1.0,
    )
    est.add(stats(1, 300, 100, [(b, 0.04 + 0.002 * b) for b in (1, 2, 3)] * 10), 1.0)
    got = est.inputs(1.0, NEED)
    assert got is not None
    # Counts decay together, so ratios are what was reported (to the decay of the first report).
    assert got.p == pytest.approx(110 / 1100, rel=0.01)
    assert got.rewrite_fraction == pytest.approx(25 / 110, rel=0.02)
    assert got.tokens_per_visit == pytest.approx(3.0)
    assert got.latency_large.intercept_s == pytest.approx(0.04, rel=0.01)
    # After many half lives without reports the counts fall below the thresholds.
    assert est.inputs(1.0 + 60.0 * 20, NEED) is None


def test_reports_from_outside_are_checked() -> None:
    assert check_stats(stats(0, 10, 1, [(1, 0.01)])) is None
    assert "outside models" in (check_stats(stats(2, 10, 1, [])) or "")
    unequal = msgspec.structs.replace(stats(0, 1, 0, [(1, 0.01)]), step_seconds=[])
    assert "differ in length" in (check_stats(unequal) or "")
    assert "exceeds" in (check_stats(stats(0, 10, 1, [], num_taken_back=2)) or "")
    assert "outside (0, 3600)" in (check_stats(stats(0, 10, 1, [(1, float("nan"))])) or "")
    assert "batch size" in (check_stats(stats(0, 10, 1, [(0, 0.01)])) or "")
    not_a_token = msgspec.structs.replace(stats(0, 1, 0, []), preset="a.b")
    assert "subject token" in (check_stats(not_a_token) or "")


def test_hold_rule() -> None:
    assert not may_step(0, 4, 1, 0.0, 0.02)  # nothing ready
    assert not may_step(2, 4, 3, 0.01, 0.02)  # holding for a third
    assert may_step(3, 4, 3, 0.0, 0.02)  # B reached
    assert may_step(2, 2, 3, 0.0, 0.02)  # every active request is here
    assert may_step(1, 4, 3, 0.02, 0.02)  # the oldest waited the timeout
    assert wait_left_s(0, 0.0, 0.02) is None
    assert wait_left_s(2, 0.015, 0.02) == pytest.approx(0.005)
