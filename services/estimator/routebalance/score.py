"""RouteBalance's score of one request on each of its candidate instances (the paper's
Eq. 1), the budget filter (Eq. 2), and the pick.

    S = w_q * quality + w_c * (1 - cost / max cost) + w_l * (1 - E2E / max E2E)
        [+ w_b * (1 - requests / max requests)]

Cost and latency are divided by the maxima over this request's candidates (after the
budget filter), so a 6x cheaper instance scores in proportion rather than 0/1. The
balance term is the paper's public code's fourth weight; off unless asked for. Ties go
to the instance holding fewer requests, then to the one assigned to least recently,
then to the smallest instance id.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.estimator.routebalance.load import InstanceLoad

TIE_TOLERANCE = 1e-12  # scores this close are equal (sums of float products)


@dataclass(frozen=True, slots=True)
class Weights:
    """A point on the simplex: non-negative weights summing to 1."""

    quality: float
    latency: float
    cost: float
    balance: float = 0.0

    def __post_init__(self) -> None:
        parts = (self.quality, self.latency, self.cost, self.balance)
        if any(not math.isfinite(w) or w < 0 for w in parts):
            raise ValueError(f"weights must be finite and >= 0, got {parts}")
        if abs(sum(parts) - 1.0) > 1e-6:
            raise ValueError(f"weights must sum to 1, got {sum(parts)!r} from {parts}")


BALANCED = Weights(quality=1 / 3, latency=1 / 3, cost=1 / 3)
QUALITY_FIRST = Weights(quality=0.8, latency=0.1, cost=0.1)
COST_FIRST = Weights(quality=0.1, latency=0.1, cost=0.8)


@dataclass(slots=True)
class Candidate:
    """One instance for one request, with what RouteBalance predicts there."""

    load: InstanceLoad
    quality: float  # predicted quality of the model's answer, in [0, 1]
    cost: float  # cost units: the prompt and the predicted output at the model's prices
    e2e_s: float  # predicted seconds from dispatch to the last token


def within_budget(candidates: Sequence[Candidate], budget: float | None) -> list[Candidate]:
    """The candidates whose predicted cost fits `budget` (Eq. 2); none fits: the cheapest
    alone (it is clamped at dispatch); no budget: all of them."""
    if budget is None:
        return list(candidates)
    fitting = [c for c in candidates if c.cost <= budget]
    if fitting:
        return fitting
    cheapest = min(c.cost for c in candidates)
    return [c for c in candidates if c.cost == cheapest]


def scores(candidates: Sequence[Candidate], w: Weights) -> list[float]:
    """Eq. 1 for each candidate, normalised over these candidates."""
    max_cost = max(c.cost for c in candidates)
    max_e2e = max(c.e2e_s for c in candidates)
    max_requests = max(c.load.num_requests for c in candidates)
    out = []
    for c in candidates:
        s = w.quality * c.quality
        s += w.cost * (1.0 - c.cost / max_cost if max_cost > 0 else 1.0)
        s += w.latency * (1.0 - c.e2e_s / max_e2e if max_e2e > 0 else 1.0)
        if w.balance:
            s += w.balance * (1.0 - c.load.num_requests / max_requests if max_requests else 1.0)
        out.append(s)
    return out


def pick(candidates: Sequence[Candidate], score: Sequence[float]) -> int:
    """The index of the best candidate (ties as the module docstring says)."""
    top = max(score)

    def key(i: int) -> tuple[int, int, str]:
        load = candidates[i].load
        return (load.num_requests, load.last_assigned, load.instance_id)

    tied = [i for i, s in enumerate(score) if s >= top - TIE_TOLERANCE]
    return min(tied, key=key)
