"""The measured-TTFT correction of SFS estimates (sfs/correction.py): pure arithmetic."""

from __future__ import annotations

import math
import random

import pytest

from services.estimator.sfs.correction import TtftCorrection


def feed_loop(corr: TtftCorrection, bias: float, n: int, rng: random.Random) -> list[float]:
    """Decisions and their feedback as the service runs them: each estimate carries the
    factor in force, the engine answers `bias` x the bare replay (with +-10% noise)."""
    ratios = []
    for _ in range(n):
        bare = rng.uniform(0.05, 2.0)
        estimate = bare * corr.factor("a")
        measured = bare * bias * rng.uniform(0.9, 1.1)
        corr.observe("a", estimate, measured)
        ratios.append(measured / estimate)
    return ratios


def test_no_factor_before_warm_up_then_the_steady_bias() -> None:
    corr = TtftCorrection(alpha=0.05, min_samples=20)
    rng = random.Random(1)
    feed_loop(corr, 1.1, 19, rng)
    assert corr.factor("a") == 1.0 and corr.num_observed("a") == 19
    ratios = feed_loop(corr, 1.1, 400, rng)
    assert corr.factor("a") == pytest.approx(1.1, rel=0.03)
    # Corrected estimates are unbiased at the end (median ratio measured / estimate ~1).
    tail = sorted(ratios[-200:])
    assert tail[100] == pytest.approx(1.0, abs=0.04)
    assert corr.factor("b") == 1.0  # per instance


def test_the_factor_is_clamped_and_forgotten() -> None:
    corr = TtftCorrection(alpha=0.5, min_samples=1, max_factor=2.0)
    for _ in range(50):
        corr.observe("a", 0.1 * corr.factor("a"), 1.0)  # the engine is 10x slower
    assert corr.factor("a") == pytest.approx(2.0)
    corr.forget("a")
    assert corr.factor("a") == 1.0 and corr.num_observed("a") == 0


@pytest.mark.parametrize(
    ("estimate", "measured"),
    [(math.inf, 0.5), (0.5, math.nan), (0.005, 0.5), (0.5, 0.005), (0.0, 0.5), (-1.0, 0.5)],
)
def test_unusable_feedback_is_ignored(estimate: float, measured: float) -> None:
    corr = TtftCorrection(min_samples=0)
    corr.observe("a", estimate, measured)
    assert corr.num_observed("a") == 0 and corr.factor("a") == 1.0


def test_bad_settings_are_rejected() -> None:
    for kwargs in ({"alpha": 0.0}, {"alpha": 1.5}, {"min_samples": -1}, {"max_factor": 0.5}):
        with pytest.raises(ValueError):
            TtftCorrection(**kwargs)  # type: ignore[arg-type]
