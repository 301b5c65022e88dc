"""RecentSpeed (the snapshot's batch_time_speed) and the fade of an estimate's factor
(LatencyEstimator's use of it: tests/services/estimator/test_latency.py)."""

from __future__ import annotations

import math

import msgspec
import pytest

from shared.scheduling.batch_time import SIX_TERM, BatchTimeModel
from shared.scheduling.snapshot import BatchSample
from shared.scheduling.speed import (
    IDLE_FADE_S,
    MAX_STEP_LOG_RATIO,
    RecentSpeed,
    horizon_factor,
)

MODEL = BatchTimeModel(SIX_TERM, (2e-3, 1e-5, 0.0, 1e-4, 0.0, 0.0))


def decode_step(num_decode: int, duration_s: float) -> BatchSample:
    return BatchSample(
        wall_time_s=0.0,
        duration_s=duration_s,
        num_prefill_tokens=0,
        num_decode_tokens=num_decode,
        chunk_sizes=[],
        context_lens=[100] * num_decode,
        num_running=num_decode,
        num_waiting=0,
    )


def at(ratio: float, model: BatchTimeModel, n: int, start: int = 1) -> list[BatchSample]:
    """n decode iterations of sizes start.. running `ratio` x what `model` says."""
    out = []
    for k in range(start, start + n):
        sample = decode_step(k, 1.0)
        out.append(decode_step(k, ratio * model.predict(sample)))
    return out


def test_one_until_warm_then_the_measured_ratio() -> None:
    speed = RecentSpeed(alpha=0.2, min_samples=8)
    speed.observe(MODEL, at(1.5, MODEL, 7))
    assert speed.factor() == 1.0  # 7 < min_samples
    speed.observe(MODEL, at(1.5, MODEL, 1, start=8))
    assert speed.factor() == pytest.approx(1.5)
    speed.observe(MODEL, at(0.8, MODEL, 60))  # the machine sped up: it follows
    assert speed.factor() == pytest.approx(0.8, rel=1e-3)


def test_a_stall_moves_the_factor_by_at_most_its_clamp() -> None:
    speed = RecentSpeed(alpha=0.2, min_samples=1)
    speed.observe(MODEL, at(1.0, MODEL, 20))
    speed.observe(MODEL, at(50.0, MODEL, 1))  # a 50x stall
    assert speed.factor() == pytest.approx(math.exp(0.2 * MAX_STEP_LOG_RATIO))


def test_a_new_model_prices_the_kept_iterations_again() -> None:
    speed = RecentSpeed(alpha=0.2, min_samples=8)
    steps = at(1.2, MODEL, 20)
    speed.observe(MODEL, steps)
    assert speed.factor() == pytest.approx(1.2)
    # A refit that prices everything 1.2x higher: the same iterations now run at 1.0 of it.
    refit = BatchTimeModel(SIX_TERM, tuple(1.2 * c for c in MODEL.coefs))
    speed.observe(refit, [])
    assert speed.factor() == pytest.approx(1.0)


def test_an_idle_instance_fades_back_to_one() -> None:
    speed = RecentSpeed(alpha=0.2, min_samples=1)
    steps = [
        msgspec.structs.replace(s, wall_time_s=10.0 + 0.01 * i)
        for i, s in enumerate(at(1.5, MODEL, 20))
    ]
    speed.observe(MODEL, steps)
    end = max(s.wall_time_s + s.duration_s for s in steps)
    assert speed.factor(end) == pytest.approx(1.5)
    assert speed.factor(end + IDLE_FADE_S) == pytest.approx(1.5 ** math.exp(-1.0))
    assert speed.factor(end + 20 * IDLE_FADE_S) == pytest.approx(1.0, abs=1e-6)
    assert speed.factor() == pytest.approx(1.5)  # no time given: no fade


def test_bad_settings_and_unpriceable_iterations() -> None:
    with pytest.raises(ValueError, match="alpha"):
        RecentSpeed(alpha=0.0)
    with pytest.raises(ValueError, match="max_factor"):
        RecentSpeed(max_factor=0.5)
    speed = RecentSpeed(min_samples=1)
    speed.observe(MODEL, [decode_step(1, 0.0)])  # no duration: skipped
    assert speed.factor() == 1.0
    speed = RecentSpeed(alpha=1.0, min_samples=1, max_factor=1.5)
    speed.observe(MODEL, at(1.9, MODEL, 3))
    assert speed.factor() == pytest.approx(1.5)  # clamped to max_factor


def test_horizon_factor_fades_the_speed_with_the_wait() -> None:
    assert horizon_factor(1.5, 1e-9, 0.3) == pytest.approx(1.5)
    assert horizon_factor(1.5, 0.3, 0.3) == pytest.approx(1.5 ** math.exp(-1.0))
    assert horizon_factor(1.5, 30.0, 0.3) == pytest.approx(1.0)
    assert horizon_factor(0.5, 0.1, 0.3) < 1.0
    for speed, ttft, horizon in ((1.5, 0.1, 0.0), (math.nan, 0.1, 0.3), (-1.0, 0.1, 0.3)):
        assert horizon_factor(speed, ttft, horizon) == 1.0
