"""How fast an instance's iterations run right now, against its batch-time model.

A CPU instance's step time drifts around any fit of its composition, and the drift
is slow: on smollm2-small (bf16, 1,254 iterations of bursts and steady decode) the
log residual of the seven-term fit has an autocorrelation of 0.73 at one iteration,
0.36 at five and 0.29 at ten, so the last few iterations say much about the next
few, which are what a queued request waits through. Fit on the first half and priced
on the second, the modeled sum of the next 3-25 iterations is 8.4-11.4% off; scaled
by an exponentially weighted mean of the recent log residual (alpha 0.2), 6.0-6.4%.

The worker keeps this factor against the calibration its snapshot carries (it sees
every iteration as it ends; the estimator reads samples only once a second) and
publishes it as `WorkloadSnapshot.batch_time_speed`. The estimator scales an SFS
TTFT estimate T by speed ** exp(-T / horizon) (`horizon_factor`): the residuals
decorrelate within ~10-50 iterations, so the speed of now tells about the first
iterations of a wait, hardly about those a second away. Applied to the whole
estimate, the factor helps TTFTs under 100 ms and hurts those over 300 ms; faded
over 0.3 s it takes the TTFT MAPE of bench_sfs part 1 from 11.4% to 10.8%, a paired
difference of -0.61 +- 0.16 points (docs/sfs.md).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.scheduling.batch_time import BatchTimeModel
from shared.scheduling.snapshot import BatchSample

# Each iteration's residual is clamped to this log ratio before it enters the mean: a
# stall (a page fault storm, the VM descheduled) says little about the next iterations.
MAX_STEP_LOG_RATIO = math.log(2.0)
# Seconds over which the factor fades back to 1 once the instance stops iterating (an
# idle worker keeps publishing snapshots; the residuals decorrelate within ~50
# iterations, about a second here, so an old factor says nothing about the next ones).
IDLE_FADE_S = 0.5
# Iterations kept to re-price when the model changes (a refit): with alpha 0.2 the
# oldest of 32 weighs 0.8^31 ~ 0.1% of the newest.
NUM_KEPT = 32


@dataclass(slots=True)
class RecentSpeed:
    """Exponentially weighted mean of log(measured / modeled) over recent iterations."""

    alpha: float = 0.2  # weight of the newest iteration
    min_samples: int = 8  # iterations seen before the factor differs from 1
    max_factor: float = 2.0  # the factor stays in [1 / max_factor, max_factor]
    _model: BatchTimeModel | None = None
    _log_ratio: float = 0.0
    _count: int = 0
    _last_end_s: float = -math.inf  # wall time the newest observed iteration ended
    _bound: float = field(init=False, default=0.0)
    _kept: deque[BatchSample] = field(init=False, default_factory=lambda: deque(maxlen=NUM_KEPT))

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.max_factor < 1.0:
            raise ValueError(f"max_factor must be >= 1, got {self.max_factor}")
        self._bound = math.log(self.max_factor)

    def observe(self, model: BatchTimeModel, samples: Iterable[BatchSample]) -> None:
        """Iterations that ended, oldest first, priced with `model` (the calibration the
        snapshot carries). When the model changes (a refit), the kept iterations are
        priced again with the new one: residuals of the old model say nothing of it."""
        if model is not self._model and model != self._model:
            self._model, self._log_ratio, self._count = model, 0.0, 0
            self._add(model, list(self._kept))
        samples = list(samples)
        if not samples:
            return
        self._kept.extend(samples)
        self._add(model, samples)
        self._last_end_s = max(self._last_end_s, max(s.wall_time_s + s.duration_s for s in samples))

    def _add(self, model: BatchTimeModel, samples: list[BatchSample]) -> None:
        # (a worker runs this for every iteration it writes, with its caches cold from
        # the step: one pass, the state in locals)
        alpha, bound, cap = self.alpha, self._bound, MAX_STEP_LOG_RATIO
        log_ratio, count = self._log_ratio, self._count
        for sample in samples:
            measured = sample.duration_s
            modeled = model.predict_sample(sample)
            if not (modeled > 0.0 and measured > 0.0):
                continue
            x = min(cap, max(-cap, math.log(measured / modeled)))
            log_ratio = x if count == 0 else log_ratio + alpha * (x - log_ratio)
            log_ratio = min(bound, max(-bound, log_ratio))
            count += 1
        self._log_ratio, self._count = log_ratio, count

    def factor(self, now_s: float | None = None) -> float:
        """Measured / modeled batch time now (1.0 until `min_samples` iterations); with
        `now_s` (wall time), faded toward 1 with the time since the newest iteration."""
        if self._count < self.min_samples:
            return 1.0
        log_ratio = self._log_ratio
        if now_s is not None:
            idle_s = max(0.0, now_s - self._last_end_s)
            log_ratio *= math.exp(-idle_s / IDLE_FADE_S)
        return math.exp(log_ratio)


def horizon_factor(speed: float, ttft_s: float, horizon_s: float) -> float:
    """What a TTFT estimate of `ttft_s` is multiplied by for an instance running at
    `speed` (measured / modeled) now: the speed's weight fades as exp(-ttft / horizon).
    1.0 for a broken speed or horizon 0."""
    if horizon_s <= 0.0 or not (math.isfinite(speed) and speed > 0.0) or ttft_s <= 0.0:
        return 1.0
    return float(speed ** math.exp(-ttft_s / horizon_s))
