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


def delayed_loop(corr: TtftCorrection, bias: float, n: int, lag: int, *, note: bool) -> list[float]:
    """As feed_loop, but each TTFT comes back `lag` decisions after its own (a queue):
    the factor in force has moved by then. Returns the factor after every decision."""
    rng = random.Random(3)
    sent: list[tuple[str, float, float]] = []
    factors = []
    for k in range(n):
        bare = rng.uniform(0.05, 2.0)
        rid = f"r{k}"
        if note:
            corr.note(rid, "a")
        sent.append((rid, bare * corr.factor("a"), bare * bias * rng.uniform(0.9, 1.1)))
        if k >= lag:
            back, estimate, measured = sent[k - lag]
            corr.observe("a", estimate, measured, request_id=back if note else None)
        factors.append(corr.factor("a"))
    return factors


def test_a_noted_factor_keeps_delayed_feedback_stable() -> None:
    """With 40 decisions between an estimate and its TTFT, the factor each estimate
    carried must be the one un-applied: the one in force at feedback time made the loop
    chase its own moves (it overshot to the clamp; the noted one settles at the bias)."""
    noted = delayed_loop(TtftCorrection(alpha=0.05, min_samples=20), 1.3, 3000, 40, note=True)
    assert max(noted[500:]) < 1.4 and min(noted[500:]) > 1.2
    assert noted[-1] == pytest.approx(1.3, rel=0.05)
    unnoted = delayed_loop(TtftCorrection(alpha=0.05, min_samples=20), 1.3, 3000, 40, note=False)
    assert max(unnoted[500:]) - min(unnoted[500:]) > 2 * (max(noted[500:]) - min(noted[500:]))


def test_notes_are_bounded_and_used_once() -> None:
    corr = TtftCorrection(alpha=1.0, min_samples=0, max_noted=2)
    corr.observe("a", 1.0, 2.0)  # factor 2 now
    corr.note("x", "a")
    corr.note("y", "a")
    corr.note("z", "a")  # "x" dropped: at most two kept
    corr.observe("a", 1.0, 1.0, request_id="y")  # its estimate carried 2: bare 0.5 -> 2x
    assert corr.factor("a") == pytest.approx(2.0)
    assert not corr.is_noted("y") and not corr.is_noted("x")
    corr.observe("a", 2.0, 2.0, request_id="x")  # not noted (dropped): the factor in force
    assert corr.factor("a") == pytest.approx(2.0)
    corr.note("w", "a")
    corr.observe("a", math.nan, math.nan, request_id="w")  # no TTFT (failed): note dropped
    assert not corr.is_noted("w") and corr.factor("a") == pytest.approx(2.0)
    with pytest.raises(ValueError):
        TtftCorrection(max_noted=-1)
