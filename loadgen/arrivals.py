"""Arrival processes: when each request is due, as offsets from the run's origin.

Every open-loop process here is one mechanism: a piecewise-constant rate profile
(constant, ramp, square wave, MMPP) and a renewal process of unit-mean gamma gaps
(shape B = burstiness; B = 1 is Poisson) laid onto it by time-rescaling. A gap of
g units of "operational time" consumes g expected arrivals of the profile, so the
mean rate follows the profile exactly while B sets the burstiness. The gamma gaps
have coefficient of variation 1/sqrt(B).

Offsets are computed up front; `ArrivalSchedule` then sleeps until origin + offset
(an absolute schedule) so event-loop lag never accumulates.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

# A ramp is approximated by this many constant-rate steps.
NUM_RAMP_STEPS = 200


@dataclass(frozen=True, slots=True)
class RatePiece:
    """A stretch of time with one arrival rate."""

    duration_s: float  # math.inf for a final open-ended piece
    rate: float  # requests/s, >= 0
    is_high: bool = False  # MMPP/square: whether this is the high-rate state


def constant_profile(rate: float) -> Iterator[RatePiece]:
    """One open-ended piece at `rate` req/s."""
    yield RatePiece(math.inf, rate)


def two_level_rates(mean_rate: float, ratio: float, high_share: float) -> tuple[float, float]:
    """(low, high) rates whose time-weighted mean is `mean_rate` (high = ratio * low)."""
    assert ratio >= 1.0 and 0.0 < high_share < 1.0
    low = mean_rate / ((1.0 - high_share) + high_share * ratio)
    return low, ratio * low


def square_profile(
    mean_rate: float, ratio: float, high_share: float, period_s: float
) -> Iterator[RatePiece]:
    """Alternating high/low rates: high for high_share * period_s, then low; forever."""
    low, high = two_level_rates(mean_rate, ratio, high_share)
    while True:
        yield RatePiece(high_share * period_s, high, is_high=True)
        yield RatePiece((1.0 - high_share) * period_s, low, is_high=False)


def mmpp_profile(
    mean_rate: float,
    ratio: float,
    high_share: float,
    sojourn_s: float,
    rng: np.random.Generator,
) -> Iterator[RatePiece]:
    """Two-state Markov-modulated rate path (the SFS evaluation's MMPP-2).

    Switching rates q(low->high) = f / tau and q(high->low) = (1 - f) / tau, so the
    chain spends a share f of time high and relaxes with time constant tau; the
    mean dwell is tau / (1 - f) in the high state and tau / f in the low state.
    The first state is drawn from the stationary distribution.
    """
    low, high = two_level_rates(mean_rate, ratio, high_share)
    mean_dwell_high = sojourn_s / (1.0 - high_share)
    mean_dwell_low = sojourn_s / high_share
    is_high = bool(rng.random() < high_share)
    while True:
        mean_dwell = mean_dwell_high if is_high else mean_dwell_low
        yield RatePiece(float(rng.exponential(mean_dwell)), high if is_high else low, is_high)
        is_high = not is_high


def ramp_profile(
    strategy: str, start_rate: float, end_rate: float, ramp_s: float
) -> Iterator[RatePiece]:
    """Linear or exponential ramp from start_rate to end_rate over ramp_s, then hold."""
    assert strategy in ("linear", "exponential")
    assert strategy == "linear" or start_rate > 0, "exponential ramp needs start rate > 0"
    step_s = ramp_s / NUM_RAMP_STEPS
    for i in range(NUM_RAMP_STEPS):
        progress = (i + 0.5) / NUM_RAMP_STEPS
        if strategy == "linear":
            rate = start_rate + (end_rate - start_rate) * progress
        else:
            rate = start_rate * (end_rate / start_rate) ** progress
        yield RatePiece(step_s, rate)
    yield RatePiece(math.inf, end_rate)


def ramp_duration_for(strategy: str, start_rate: float, end_rate: float, num: int) -> float:
    """Ramp length whose expected number of arrivals is `num`."""
    if strategy == "linear":
        return 2.0 * num / (start_rate + end_rate)
    if math.isclose(start_rate, end_rate):
        return num / start_rate
    return num * math.log(end_rate / start_rate) / (end_rate - start_rate)


def arrival_offsets(
    pieces: Iterable[RatePiece],
    burstiness: float,
    rng: np.random.Generator,
    max_count: int | None,
    max_time_s: float | None,
) -> np.ndarray:
    """Arrival offsets (s, ascending) of a gamma renewal process on a rate profile.

    Stops at `max_count` arrivals or past `max_time_s`, whichever comes first;
    at least one of them must be set.
    """
    assert burstiness > 0
    assert max_count is not None or max_time_s is not None
    limit_n = max_count if max_count is not None else math.inf
    limit_t = max_time_s if max_time_s is not None else math.inf
    pieces_it = iter(pieces)
    piece = next(pieces_it)
    piece_start = 0.0
    piece_left = _capacity(piece)  # operational time left in this piece
    now = 0.0
    offsets: list[float] = []
    while len(offsets) < limit_n:
        batch = 1024 if max_count is None else min(1024, int(limit_n - len(offsets)))
        if math.isinf(burstiness):
            gaps = np.ones(batch)
        else:
            gaps = rng.gamma(shape=burstiness, scale=1.0 / burstiness, size=batch)
        for gap in gaps:
            need = float(gap)
            while need > piece_left or piece.rate <= 0:
                if math.isinf(piece.duration_s):
                    return np.asarray(offsets)  # a final rate of 0: no more arrivals
                need -= piece_left
                piece_start += piece.duration_s
                piece = next(pieces_it)
                piece_left = _capacity(piece)
                now = piece_start
            piece_left -= need
            now += need / piece.rate
            if now > limit_t:
                return np.asarray(offsets)
            offsets.append(now)
    return np.asarray(offsets)


def _capacity(piece: RatePiece) -> float:
    """Expected arrivals in a piece (operational time it spans)."""
    return piece.duration_s * piece.rate if piece.rate > 0 else 0.0


class ArrivalSchedule:
    """Sleeps until each offset, measured from one origin (no drift)."""

    def __init__(self, origin_ns: int) -> None:
        self.origin_ns = origin_ns  # time.perf_counter_ns() at offset 0

    def now_s(self) -> float:
        """Seconds since the origin."""
        return (time.perf_counter_ns() - self.origin_ns) / 1e9

    async def wait_until(self, offset_s: float) -> None:
        """Return at origin + offset_s (at once if that is past)."""
        delay = offset_s - self.now_s()
        if delay > 0:
            await asyncio.sleep(delay)
