"""Monte-Carlo discrete-event simulation of the two-model delayed-batching system.

The same system as the chain (services/batcher/dtmc.py): N requests, Bernoulli(p)
hand-offs after each S token, geometric runs at L, a model steps when >= B_m are
ready, a step takes every ready request. Two duration laws:

    "exponential"    the chain's assumption: its prediction is exact, the sim checks it
    "deterministic"  t_m(b) exactly, as real steps are: measures the chain's error

Colocated models may slow each other: a step runs at its "overlapped" speed while
the other model is mid-step (the chain's state-dependent rates). Optionally a hold timeout: an idle model that holds fewer than B_m starts anyway
once its oldest ready request has waited hold_timeout_s (the runtime's safety net).
Pure Python + numpy; no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

import numpy as np

from services.batcher.dtmc import ModelPair, is_feasible

DurationLaw = Literal["exponential", "deterministic"]


@dataclass(frozen=True)
class SimResult:
    throughput_tok_s: float  # output tokens per second over the measured window
    num_tokens: int  # output tokens in the window
    elapsed_s: float  # simulated seconds in the window
    num_small_steps: int  # S steps completed in the window
    num_large_steps: int  # L steps completed in the window
    num_timeouts: int  # steps started by the hold timeout (whole run)


class _Model:
    """One model's step loop: ready requests (their arrival times) and the step in flight."""

    def __init__(self, solo: np.ndarray, overlap: np.ndarray, hold: int) -> None:
        self.solo, self.overlap = solo, overlap  # seconds per step at batch b (index b-1)
        self.hold = hold
        self.ready: deque[float] = deque()  # arrival time of each ready request, oldest first
        self.batch = 0  # requests in the step in flight (0 = idle)
        self.work_left = 0.0  # of the step in flight, in units of one whole step

    def speed(self, other_busy: bool) -> float:
        """Steps per second now: the step slows down while the other model steps too."""
        return 1.0 / float((self.overlap if other_busy else self.solo)[self.batch - 1])


def simulate(
    pair: ModelPair,
    num_active: int,
    b_small: int,
    b_large: int,
    *,
    durations: DurationLaw = "deterministic",
    num_steps: int = 100_000,
    warmup_steps: int = 2_000,
    hold_timeout_s: float | None = None,
    seed: int = 0,
) -> SimResult:
    """Run until num_steps events; measure after warmup_steps. A step is an amount of
    work (1, or Exp(1) for memoryless steps) done at speed 1 / t_m(b), or 1 / overlapped
    t_m(b) while the other model is mid-step."""
    n = num_active
    if not is_feasible(n, b_small, b_large) and hold_timeout_s is None:
        raise ValueError(f"({b_small}, {b_large}) can deadlock at N = {n} without a hold timeout")
    rng = np.random.default_rng(seed)
    p, q = pair.p, 1.0 / pair.tokens_per_visit_large
    t_s, t_l, o_s, o_l = pair.tables(n)
    small, large = _Model(t_s, o_s, b_small), _Model(t_l, o_l, b_large)
    small.ready.extend([0.0] * n)  # every request starts at the entry model
    now = 0.0
    num_timeouts = 0
    counted = {"tokens": 0, "small": 0, "large": 0}
    t_measure = 0.0

    def try_start(model: _Model) -> None:
        nonlocal num_timeouts
        if model.batch or not model.ready:
            return
        is_timed_out = hold_timeout_s is not None and now - model.ready[0] >= hold_timeout_s - 1e-12
        if len(model.ready) >= model.hold or is_timed_out:
            num_timeouts += len(model.ready) < model.hold
            model.batch = len(model.ready)
            model.ready.clear()
            model.work_left = float(rng.exponential()) if durations == "exponential" else 1.0

    def done_at(model: _Model, other: _Model) -> float:
        if not model.batch:
            return math.inf
        return now + model.work_left / model.speed(other.batch > 0)

    def timeout_at(model: _Model) -> float:
        if hold_timeout_s is None or model.batch or not model.ready:
            return math.inf
        return model.ready[0] + hold_timeout_s

    try_start(small)
    for step in range(num_steps):
        if step == warmup_steps:
            t_measure, counted = now, {"tokens": 0, "small": 0, "large": 0}
        # 1. Next event: a step completion, else a hold timeout; advance both steps to it.
        ends = (done_at(small, large), done_at(large, small))
        nxt = min(*ends, timeout_at(small), timeout_at(large))
        assert nxt < math.inf, "deadlock: both models hold and no timeout is set"
        speeds = (
            small.speed(large.batch > 0) if small.batch else 0.0,
            large.speed(small.batch > 0) if large.batch else 0.0,
        )
        small.work_left -= speeds[0] * (nxt - now)
        large.work_left -= speeds[1] * (nxt - now)
        now = nxt
        # 2. Complete the step (or fire the timeout) and move requests.
        if ends[0] == nxt:
            batch, small.batch = small.batch, 0
            sent = int(rng.binomial(batch, p))
            kept_back = int(rng.binomial(sent, pair.rewrite_fraction)) if sent else 0
            counted["tokens"] += batch - kept_back
            counted["small"] += 1
            large.ready.extend([now] * sent)
            small.ready.extend([now] * (batch - sent))
        elif ends[1] == nxt:
            batch, large.batch = large.batch, 0
            back = int(rng.binomial(batch, q))
            counted["tokens"] += batch
            counted["large"] += 1
            small.ready.extend([now] * back)
            large.ready.extend([now] * (batch - back))
        # 3. Start whatever may start now (a timeout event lands here too).
        try_start(small)
        try_start(large)
    elapsed = now - t_measure
    return SimResult(
        throughput_tok_s=counted["tokens"] / elapsed,
        num_tokens=counted["tokens"],
        elapsed_s=elapsed,
        num_small_steps=counted["small"],
        num_large_steps=counted["large"],
        num_timeouts=num_timeouts,
    )
