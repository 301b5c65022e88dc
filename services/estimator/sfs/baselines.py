"""Cheaper TTFT estimates: the throughput baseline and the average-case LPS queue.

Throughput estimator (SFS paper, "A throughput-based estimator"):

    TTFT_hat = sum_{q in R} prefill_q / theta_pre  +  prompt / theta_pre  +  T_dec

R = the resident set (running, waiting, and ledger entries not yet visible),
prefill_q = tokens of q not yet in the KV cache except a decode's one token,
theta_pre = profiled prefill throughput (tokens/s), T_dec = mean decode-step time (s).

Limited-processor-sharing queue (SFS paper, "Average-case estimation without
workload visibility"), for instances without a fresh snapshot: up to k queries share
the server, the rest wait FCFS; with arrival rate alpha and service rate mu (both
requests/s) and rho = alpha / mu < 1,

    W_hat = rho^k / (mu - alpha)     (seconds; infinite when rho >= 1)

The SFS public code adds the probe's own prefill, prompt / theta_pre, and caps W at
60 s; k is the instance's concurrency (running requests in the last snapshot, or the
time-averaged parallelism, ~25 in the paper's fit).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.estimator.sfs.replay import PendingLike, snapshot_ids
from shared.scheduling.snapshot import BatchSample, WorkloadSnapshot

LPS_WAIT_CAP_S = 60.0  # SFS public code's cap on the queue estimate


def outstanding_prefill_tokens(
    snapshot: WorkloadSnapshot, pending: Iterable[PendingLike] = ()
) -> int:
    """Tokens of the resident set still to prefill (decodes' single token excluded)."""
    total = 0
    for prompt, out, comp in zip(
        snapshot.prompt_tokens, snapshot.output_tokens, snapshot.computed_tokens, strict=True
    ):
        missing = prompt + out - comp
        if missing > 1 or out == 0:
            total += missing
    visible = snapshot_ids(snapshot)
    seen: set[str] = set()
    for e in pending:
        if e.request_id not in visible and e.request_id not in seen:
            seen.add(e.request_id)
            total += e.num_prompt_tokens
    return total


def throughput_ttft_s(
    snapshot: WorkloadSnapshot,
    num_prompt_tokens: int,
    prefill_tps: float,
    mean_decode_step_s: float,
    pending: Iterable[PendingLike] = (),
) -> float:
    """The throughput baseline's TTFT (seconds, from the snapshot)."""
    backlog = outstanding_prefill_tokens(snapshot, pending)
    return (backlog + num_prompt_tokens) / prefill_tps + mean_decode_step_s


@dataclass(frozen=True, slots=True)
class ThroughputProfile:
    """What the throughput baseline needs, measured from recorded iterations."""

    prefill_tps: float  # prefill tokens / total seconds of iterations that prefilled
    mean_decode_step_s: float  # mean seconds of decode-only iterations


def profile_throughput(samples: Sequence[BatchSample]) -> ThroughputProfile:
    """theta_pre and T_dec from samples, as a profiler would measure them.

    Iterations that mix decodes into a prefill count entirely as prefill time: that is
    the baseline's known bias (it ignores decode interference), kept on purpose.
    """
    pre_tokens = sum(s.num_prefill_tokens for s in samples if s.num_prefill_tokens > 0)
    pre_time = sum(s.duration_s for s in samples if s.num_prefill_tokens > 0)
    dec = [s.duration_s for s in samples if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0]
    if pre_tokens == 0 or pre_time <= 0:
        raise ValueError("no prefill iterations to profile")
    return ThroughputProfile(pre_tokens / pre_time, sum(dec) / len(dec) if dec else 0.0)


def lps_wait_s(
    arrival_rate: float, service_rate: float, k: int, cap_s: float = LPS_WAIT_CAP_S
) -> float:
    """LPS queue wait W = rho^k / (mu - alpha), rho = alpha/mu; capped at cap_s (inf
    only when cap_s is inf and rho >= 1)."""
    if service_rate <= 0:
        return cap_s
    if arrival_rate >= service_rate:
        return cap_s
    rho = arrival_rate / service_rate
    return min(cap_s, rho ** max(k, 0) / (service_rate - arrival_rate))


def lps_ttft_s(
    arrival_rate: float,
    service_rate: float,
    k: int,
    num_prompt_tokens: int,
    prefill_tps: float,
    cap_s: float = LPS_WAIT_CAP_S,
) -> float:
    """Average-case TTFT: LPS wait plus the probe's own prefill at theta_pre."""
    return lps_wait_s(arrival_rate, service_rate, k, cap_s) + num_prompt_tokens / prefill_tps


class ArrivalRateEstimator:
    """EWMA of requests/s over fixed windows (SFS public code: 1 s windows, weight 0.2).

    Feed it dispatch times (seconds, any monotonic clock); `rate(now)` closes the
    windows that ended before `now`, counting empty ones as zero arrivals.
    """

    def __init__(self, window_s: float = 1.0, weight: float = 0.2, prior_rps: float = 0.0) -> None:
        self.window_s = window_s
        self.weight = weight
        self._rate = prior_rps
        self._start: float | None = None
        self._count = 0

    def observe(self, t_s: float) -> None:
        self._roll(t_s)
        self._count += 1

    def rate(self, now_s: float) -> float:
        self._roll(now_s)
        return self._rate

    def _roll(self, t_s: float) -> None:
        if self._start is None:
            self._start = t_s
            return
        elapsed = math.floor((t_s - self._start) / self.window_s)
        if elapsed <= 0:
            return
        w = self.weight
        self._rate = (1 - w) * self._rate + w * self._count / self.window_s
        # Windows with no arrival after the first closed one decay the rate geometrically.
        self._rate *= (1 - w) ** (elapsed - 1)
        self._count = 0
        self._start += elapsed * self.window_s


def is_fresh(snapshot: WorkloadSnapshot, now_s: float, max_age_s: float) -> bool:
    """Replay only on snapshots younger than max_age_s (wall clock); else use the queue."""
    return now_s - snapshot.wall_time_s <= max_age_s
