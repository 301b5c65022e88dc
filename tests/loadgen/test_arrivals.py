"""Arrival processes: rates, burstiness, MMPP dwell times, square wave, ramp, schedule."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from loadgen import arrivals


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.mark.parametrize("rate", [0.5, 5.0, 80.0])
def test_poisson_mean_rate_within_tolerance(rate: float) -> None:
    offsets = arrivals.arrival_offsets(arrivals.constant_profile(rate), 1.0, _rng(), 20_000, None)
    assert len(offsets) == 20_000
    assert np.all(np.diff(offsets) >= 0)
    assert len(offsets) / offsets[-1] == pytest.approx(rate, rel=0.03)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_gaps_have_cv_one_over_sqrt_b(burstiness: float) -> None:
    offsets = arrivals.arrival_offsets(
        arrivals.constant_profile(10.0), burstiness, _rng(1), 40_000, None
    )
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(0.1, rel=0.04)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0 / np.sqrt(burstiness), rel=0.05)


def test_infinite_burstiness_is_evenly_spaced() -> None:
    offsets = arrivals.arrival_offsets(
        arrivals.constant_profile(4.0), float("inf"), _rng(), 10, None
    )
    assert np.allclose(np.diff(offsets), 0.25)


def test_duration_bound_stops_before_the_limit() -> None:
    offsets = arrivals.arrival_offsets(arrivals.constant_profile(20.0), 1.0, _rng(), None, 30.0)
    assert offsets[-1] <= 30.0
    assert len(offsets) == pytest.approx(600, rel=0.1)


def test_same_seed_same_offsets() -> None:
    a = arrivals.arrival_offsets(arrivals.constant_profile(3.0), 0.5, _rng(7), 100, None)
    b = arrivals.arrival_offsets(arrivals.constant_profile(3.0), 0.5, _rng(7), 100, None)
    assert np.array_equal(a, b)


def test_two_level_rates_keep_the_mean() -> None:
    low, high = arrivals.two_level_rates(6.0, ratio=4.0, high_share=0.2)
    assert high == pytest.approx(4 * low)
    assert 0.8 * low + 0.2 * high == pytest.approx(6.0)


def test_mmpp_dwell_times_and_share_of_time_high() -> None:
    f, tau = 0.2, 2.0
    pieces = list(itertools.islice(arrivals.mmpp_profile(5.0, 4.0, f, tau, _rng(3)), 20_000))
    assert all(a.is_high != b.is_high for a, b in itertools.pairwise(pieces))
    high = np.array([p.duration_s for p in pieces if p.is_high])
    low = np.array([p.duration_s for p in pieces if not p.is_high])
    assert high.mean() == pytest.approx(tau / (1 - f), rel=0.05)
    assert low.mean() == pytest.approx(tau / f, rel=0.05)
    assert high.sum() / (high.sum() + low.sum()) == pytest.approx(f, rel=0.05)


def test_mmpp_arrivals_keep_the_mean_rate_and_are_overdispersed() -> None:
    offsets = arrivals.arrival_offsets(
        arrivals.mmpp_profile(5.0, 6.0, 0.2, 2.0, _rng(4)), 1.0, _rng(5), None, 4_000.0
    )
    assert len(offsets) / 4_000.0 == pytest.approx(5.0, rel=0.05)
    counts = np.histogram(offsets, bins=np.arange(0.0, 4_001.0, 1.0))[0]
    assert counts.var() / counts.mean() > 2.0  # Poisson would be 1


def test_square_wave_alternates_high_then_low() -> None:
    profile = arrivals.square_profile(10.0, ratio=3.0, high_share=0.5, period_s=20.0)
    offsets = arrivals.arrival_offsets(profile, 1.0, _rng(6), None, 2_000.0)
    phase = np.mod(offsets, 20.0)
    num_high = int((phase < 10.0).sum())
    num_low = int((phase >= 10.0).sum())
    assert num_high / num_low == pytest.approx(3.0, rel=0.08)
    assert len(offsets) / 2_000.0 == pytest.approx(10.0, rel=0.04)


@pytest.mark.parametrize("strategy", ["linear", "exponential"])
def test_ramp_reaches_its_count_in_the_expected_time(strategy: str) -> None:
    ramp_s = arrivals.ramp_duration_for(strategy, 2.0, 20.0, 2_000)
    offsets = arrivals.arrival_offsets(
        arrivals.ramp_profile(strategy, 2.0, 20.0, ramp_s), 1.0, _rng(8), 2_000, None
    )
    assert offsets[-1] == pytest.approx(ramp_s, rel=0.05)
    early = (offsets < ramp_s / 4).sum()
    late = (offsets > 3 * ramp_s / 4).sum()
    assert late > 2 * early


async def test_schedule_is_absolute_so_lag_does_not_accumulate() -> None:
    schedule = arrivals.ArrivalSchedule(time.perf_counter_ns())
    for i in range(1, 21):
        await schedule.wait_until(i * 0.005)
        time.sleep(0.002)  # work on the loop between arrivals
    # on time: 0.1 + the last 2 ms of work; with lag accumulating, 20 x 7 ms = 0.14
    assert 0.1 <= schedule.now_s() < 0.13
    await asyncio.sleep(0)


def test_ahead_buffer_builds_only_what_is_due_soon() -> None:
    from loadgen.runner import AheadBuffer

    built: list[int] = []

    def specs() -> Iterator[Any]:
        for i in itertools.count():
            built.append(i)
            yield i

    buffer = AheadBuffer([0.0, 0.0, 1.0, 5.0, 9.0], specs())
    buffer.fill(until_s=2.0)
    assert built == [0, 1, 2, 3]  # the first pair past the horizon is built, then it stops
    assert buffer.pop() == (0.0, 0)
    assert [buffer.pop() for _ in range(4)] == [(0.0, 1), (1.0, 2), (5.0, 3), (9.0, 4)]
    assert buffer.pop() is None
