"""Measuring the estimator offline: error metrics, distribution distances, curve areas,
and the SFS estimate of a request arriving while its instance runs an iteration.

Used by `scripts/bench_sfs.py` (SFS benchmark) and `scripts/sfs_bias.py`; pure.

In-flight-aware SFS estimate (`estimate_from_now`): an engine publishes its snapshot
at the end of an iteration and starts the next one at once, so a query that arrives
`age` seconds after the snapshot finds that next iteration already running, and
cannot join it. The replay therefore runs the snapshot's iterations alone (the first
started at the snapshot's time; when the snapshot is older than one iteration, the
ones after it too) up to the one in flight at `age`, then queues the ledger's
entries and the probe, and continues:

    TTFT_hat(now) = max(0, end_hat(iteration in flight) - age) + TTFT_hat(rest)

(the SFS public code ships the in-flight batch in its snapshot). The
estimator service's `SfsReplayer.estimate` counts from the snapshot instead and lets
the probe join the first replayed batch: high by up to `age`, low by up to one batch.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.estimator.sfs import replay
from services.estimator.sfs.output_policy import OutputPolicy
from shared.scheduling.batch_time import BatchTimeModel
from shared.scheduling.snapshot import WorkloadSnapshot


def mape(predicted: Sequence[float], actual: Sequence[float]) -> float:
    """Mean absolute percentage error, a fraction: mean(|p - a| / a) over a > 0.

    nan when no actual value is positive; an infinite prediction makes it inf.
    """
    if len(predicted) != len(actual):
        raise ValueError("one prediction per actual value")
    terms = [abs(p - a) / a for p, a in zip(predicted, actual, strict=True) if a > 0]
    return sum(terms) / len(terms) if terms else math.nan


def signed_relative_errors(predicted: Sequence[float], actual: Sequence[float]) -> list[float]:
    """(p - a) / a per pair with a > 0 (positive: over-estimate)."""
    if len(predicted) != len(actual):
        raise ValueError("one prediction per actual value")
    return [(p - a) / a for p, a in zip(predicted, actual, strict=True) if a > 0]


def ks_distance(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: sup_x |F_a(x) - F_b(x)| (0 = same)."""
    if not a or not b:
        raise ValueError("both samples must be non-empty")
    sa, sb = sorted(a), sorted(b)
    d = 0.0
    for x in sa + sb:  # the sup is reached at a sample point
        fa = bisect.bisect_right(sa, x) / len(sa)
        fb = bisect.bisect_right(sb, x) / len(sb)
        d = max(d, abs(fa - fb))
    return d


def trapezoid_area(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Area under the piecewise-linear curve through (x, y), x strictly increasing."""
    if len(xs) != len(ys):
        raise ValueError("one y per x")
    if any(b <= a for a, b in itertools.pairwise(xs)):
        raise ValueError("x values must be strictly increasing")
    return sum(
        (x1 - x0) * (y0 + y1) / 2.0 for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:], strict=False)
    )


def auc_ratio(
    curves: dict[str, dict[float, float]], policy: str, baselines: Iterable[str]
) -> tuple[float, str]:
    """AUC of `policy`'s curve over the best baseline's, on the rates all of them share.

    curves: policy -> {rate: value}. Returns (ratio, best baseline's name); ValueError
    if fewer than two rates are shared.
    """
    names = [policy, *baselines]
    missing = [n for n in names if n not in curves]
    if missing:
        raise ValueError(f"no curve for {missing}")
    rates = sorted(set.intersection(*(set(curves[n]) for n in names)))
    if len(rates) < 2:
        raise ValueError("need at least two shared rates for an area")
    areas = {n: trapezoid_area(rates, [curves[n][r] for r in rates]) for n in names}
    best = max((n for n in names if n != policy), key=lambda n: areas[n])
    if areas[best] <= 0:
        return math.inf, best
    return areas[policy] / areas[best], best


@dataclass(frozen=True, slots=True)
class FromNowEstimate:
    """SFS TTFT of a probe, seconds from now (not from the snapshot)."""

    ttft_s: float  # inf: the probe never starts in the replay
    in_flight_s: float  # modeled end of the iteration in flight, from the snapshot (0: idle)
    age_s: float  # now - snapshot time, seconds
    num_steps: int = 0  # iterations to the first token, the one in flight included


def estimate_from_now(
    snapshot: WorkloadSnapshot,
    model: BatchTimeModel,
    probe: replay.Probe,
    pending: Iterable[replay.PendingLike],
    age_s: float,
    *,
    joined: Iterable[replay.PendingLike] = (),
    pending_offsets_s: Sequence[float] | None = None,
    policy: OutputPolicy | None = None,
    max_steps: int = 200_000,
) -> FromNowEstimate:
    """In-flight-aware SFS estimate (module docstring).

    The iterations the snapshot's state schedules are taken to run back to back since
    the snapshot, up to the one in flight `age_s` after it (`replay.run_in_flight`);
    when the state schedules nothing the engine is idle and the probe starts at the
    next iteration. `joined`: dispatched requests the snapshot does not show that
    reached the engine before its iteration in flight began (they queue ahead of it
    and may be in it); `pending`: the ones that arrived since, dispatched
    `pending_offsets_s` after the snapshot (one per entry; default: all during the
    iteration in flight, so they queue behind it, ahead of the probe).
    """
    policy = (policy or OutputPolicy()).for_snapshot(snapshot)
    st = replay.kernel_state(snapshot, policy)
    coefs = model.raw
    joined, pending = list(joined), list(pending)
    offsets = [age_s] * len(pending) if pending_offsets_s is None else list(pending_offsets_s)
    if len(offsets) != len(pending):
        raise ValueError("one offset per pending entry")
    offset = {e.request_id: t for e, t in zip(pending, offsets, strict=True)}
    offset.update((e.request_id, -math.inf) for e in joined)  # in the first iteration
    entries, _ = replay.admissible_pending([*joined, *pending], snapshot)
    unseen = replay.in_dispatch_order(entries, offset)
    in_flight, later = replay.run_in_flight(st, coefs, age_s, max_steps, policy, unseen)
    r = replay.run_on_state(
        st,
        later,
        probe,
        coefs,
        policy,
        max_model_len=snapshot.scheduler.max_model_len,
        max_steps=max_steps,
    )
    return FromNowEstimate(
        max(0.0, in_flight - age_s) + r.ttft_s,
        in_flight,
        age_s,
        int(in_flight > age_s) + r.num_steps_ttft,
    )
