"""RouteBalance's score, budget filter and pick on hand-made candidates."""

from __future__ import annotations

import pytest

from services.estimator.routebalance.load import InstanceLoad
from services.estimator.routebalance.score import (
    Candidate,
    Weights,
    pick,
    scores,
    within_budget,
)

THIRD = Weights(quality=1 / 3, latency=1 / 3, cost=1 / 3)


def cand(iid: str, quality: float, cost: float, e2e_s: float, running: int = 0) -> Candidate:
    return Candidate(InstanceLoad(iid, "m", 8, num_running=running), quality, cost, e2e_s)


def test_cost_and_latency_are_divided_by_the_request_s_own_maxima() -> None:
    a, b = cand("a", 0.5, 1.0, 2.0), cand("b", 0.7, 4.0, 1.0)
    got = scores([a, b], THIRD)
    # a: 0.5 + (1 - 1/4) + (1 - 2/2); b: 0.7 + (1 - 4/4) + (1 - 1/2)
    assert got == pytest.approx([(0.5 + 0.75 + 0.0) / 3, (0.7 + 0.0 + 0.5) / 3])


def test_a_term_whose_maximum_is_zero_counts_in_full() -> None:
    free = [cand("a", 0.2, 0.0, 0.0), cand("b", 0.4, 0.0, 0.0)]
    assert scores(free, THIRD) == pytest.approx([(0.2 + 2) / 3, (0.4 + 2) / 3])


def test_the_balance_term_prefers_the_emptier_instance() -> None:
    busy, idle = cand("a", 0.5, 1.0, 1.0, running=4), cand("b", 0.5, 1.0, 1.0, running=1)
    w = Weights(quality=0.25, latency=0.25, cost=0.25, balance=0.25)
    s = scores([busy, idle], w)
    assert s[1] - s[0] == pytest.approx(0.25 * (1 - 1 / 4))


@pytest.mark.parametrize(
    "weights", [(0.5, 0.5, 0.5, 0.0), (1.2, -0.2, 0.0, 0.0), (float("nan"), 0.5, 0.5, 0.0)]
)
def test_weights_off_the_simplex_are_refused(weights: tuple[float, ...]) -> None:
    with pytest.raises(ValueError):
        Weights(*weights)


def test_ties_go_to_fewer_requests_then_least_recently_assigned_then_id() -> None:
    a, b, c = cand("a", 0.5, 1, 1, running=2), cand("b", 0.5, 1, 1), cand("c", 0.5, 1, 1)
    b.load.last_assigned, c.load.last_assigned = 7, 3
    s = scores([a, b, c], THIRD)
    assert pick([a, b, c], s) == 2  # b and c hold fewer; c was assigned to longer ago
    c.load.last_assigned = 7
    assert pick([a, b, c], s) == 1  # then by id
    assert pick([a, b, c], [0.9, 0.1, 0.1]) == 0  # a higher score wins over load


def test_the_budget_keeps_what_fits_else_the_cheapest_alone() -> None:
    cheap, mid, dear = cand("a", 0.1, 1.0, 1), cand("b", 0.5, 2.0, 1), cand("c", 0.9, 5.0, 1)
    assert within_budget([cheap, mid, dear], 2.0) == [cheap, mid]
    assert within_budget([cheap, mid, dear], 0.5) == [cheap]
    assert within_budget([cheap, mid, dear], None) == [cheap, mid, dear]
