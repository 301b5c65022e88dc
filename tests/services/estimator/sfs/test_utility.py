"""Routing policies pick as their formulas say."""

from __future__ import annotations

import collections
import math
import random

import pytest

from services.estimator.sfs.utility import (
    Candidate,
    choose_latency_agnostic,
    choose_sfs_constraint,
    choose_sfs_lagrangian,
    default_ttft_target_s,
    on_time_utility,
    pick_latency_agnostic,
    pick_sfs_constraint,
    pick_sfs_lagrangian,
    request_cost,
    utility,
)

# small: cheap, weak, idle; big: strong, pricey, congested; mid in between.
SMALL = Candidate("small", accuracy=0.35, cost=0.05, ttft_s=0.05)
MID = Candidate("mid", accuracy=0.79, cost=0.30, ttft_s=0.40)
BIG = Candidate("big", accuracy=0.90, cost=0.60, ttft_s=2.00)
ALL = [SMALL, MID, BIG]


def test_latency_agnostic_maximises_accuracy_minus_lambda_cost() -> None:
    assert pick_latency_agnostic(ALL, lam=0.0) is BIG
    # lambda = 0.5: U = 0.325, 0.64, 0.60
    assert utility(MID, 0.5) == pytest.approx(0.64)
    assert pick_latency_agnostic(ALL, lam=0.5) is MID
    assert pick_latency_agnostic(ALL, lam=5.0) is SMALL


def test_sfs_constraint_best_feasible_else_fastest() -> None:
    assert pick_sfs_constraint(ALL, lam=0.0, ttft_target_s=3.0) is BIG
    assert pick_sfs_constraint(ALL, lam=0.0, ttft_target_s=0.5) is MID  # big infeasible
    assert pick_sfs_constraint(ALL, lam=0.0, ttft_target_s=0.1) is SMALL
    assert pick_sfs_constraint([MID, BIG], lam=0.0, ttft_target_s=0.1) is MID  # none: fastest
    inf = Candidate("down", 1.0, 0.0, math.inf)
    assert pick_sfs_constraint([inf, BIG], lam=0.0, ttft_target_s=0.1) is BIG


def test_sfs_lagrangian_trades_utility_for_latency() -> None:
    assert pick_sfs_lagrangian(ALL, lam=0.0, delta=0.0) is BIG  # delta 0: latency-agnostic
    # delta = 0.1/s: 0.345, 0.75, 0.70
    assert pick_sfs_lagrangian(ALL, lam=0.0, delta=0.1) is MID
    # delta = 2/s: 0.25, -0.01, -3.1
    assert pick_sfs_lagrangian(ALL, lam=0.0, delta=2.0) is SMALL
    inf = Candidate("down", 1.0, 0.0, math.inf)
    assert pick_sfs_lagrangian([inf, SMALL], lam=0.0, delta=0.0) is inf  # no 0 * inf nan
    assert pick_sfs_lagrangian([inf, SMALL], lam=0.0, delta=1.0) is SMALL


def test_ties_go_to_the_first_candidate() -> None:
    twin = Candidate("twin", MID.accuracy, MID.cost, MID.ttft_s)
    assert pick_latency_agnostic([MID, twin], 0.3) is MID
    assert pick_latency_agnostic([twin, MID], 0.3) is twin
    with pytest.raises(ValueError):
        pick_latency_agnostic([], 0.0)


def test_default_ttft_target_rule() -> None:
    assert default_ttft_target_s(0) == pytest.approx(0.158)
    assert default_ttft_target_s(10_000) == pytest.approx((158 + 35) / 1000)
    assert default_ttft_target_s(10**6) == pytest.approx(1.120)  # clipped above
    assert default_ttft_target_s(-5000) == pytest.approx(0.150)  # clipped below


def test_cost_and_on_time_utility() -> None:
    # Qwen3-8B prices per token (paper: $0.072 / $0.287 per M)
    assert request_cost(1000, 200, 0.072e-6, 0.287e-6) == pytest.approx(
        1000 * 0.072e-6 + 200 * 0.287e-6
    )
    assert on_time_utility([0.5, 0.8, 0.2], [True, False, True]) == pytest.approx(0.7 / 3)
    assert on_time_utility([], []) == 0.0


# -- the lazy choices: same pick as the formulas, fewer TTFTs -------------------------


def _lazy_case(
    rng: random.Random,
) -> tuple[list[Candidate], list[float], float]:
    """Candidates with repeated utilities (replicas of one model) and TTFTs with ties
    and infinities, as a router sees them."""
    n = rng.randint(1, 9)
    levels = [rng.choice([0.2, 0.5, 0.8]) for _ in range(n)]
    ttfts = [rng.choice([0.0, 0.1, 0.3, 0.3, 0.9, 2.0, math.inf]) for _ in range(n)]
    cands = [Candidate(f"i{j}", levels[j], 0.0, ttfts[j]) for j in range(n)]
    return cands, [utility(c, 0.0) for c in cands], rng.choice([0.05, 0.3, 1.0, 5.0])


class _Asked:
    """ttft_s(j) that counts each index it is asked for."""

    def __init__(self, cands: list[Candidate]) -> None:
        self.cands, self.asked = cands, collections.Counter[int]()

    def __call__(self, j: int) -> float:
        self.asked[j] += 1
        return self.cands[j].ttft_s


def _formula_constraint(cands: list[Candidate], lam: float, target: float) -> Candidate:
    """SFS-constraint as the paper states it, every TTFT computed; ties: the earliest."""
    feasible = [c for c in cands if c.ttft_s <= target]
    pool, key = (feasible, lambda c: utility(c, lam)) if feasible else (cands, lambda c: -c.ttft_s)
    return max(pool, key=key)  # max keeps the first of equal keys


def _formula_lagrangian(cands: list[Candidate], lam: float, delta: float) -> Candidate:
    return max(cands, key=lambda c: utility(c, lam) - delta * c.ttft_s)


def test_lazy_choices_pick_what_the_formulas_pick() -> None:
    rng = random.Random(7)
    saved = 0
    for _ in range(3000):
        cands, utilities, knob = _lazy_case(rng)
        ask = _Asked(cands)
        j = choose_sfs_constraint(utilities, ask, knob)
        assert cands[j] is _formula_constraint(cands, 0.0, knob)
        assert max(ask.asked.values()) == 1  # each TTFT asked at most once
        saved += len(cands) - len(ask.asked)
        ask = _Asked(cands)
        j = choose_sfs_lagrangian(utilities, ask, knob)
        assert cands[j] is _formula_lagrangian(cands, 0.0, knob)
        assert max(ask.asked.values()) == 1
        saved += len(cands) - len(ask.asked)
        assert cands[choose_latency_agnostic(utilities)] is max(
            cands, key=lambda c: utility(c, 0.0)
        )
    assert saved > 3000  # the point: most decisions skip some replays


def test_lazy_constraint_stops_at_the_first_feasible_best_utility() -> None:
    ask = _Asked(ALL)
    # lambda 0: utilities big > mid > small; big meets 3 s: only its TTFT is needed
    assert choose_sfs_constraint([utility(c, 0.0) for c in ALL], ask, 3.0) == 2
    assert set(ask.asked) == {2}
    ask = _Asked(ALL)  # none meets 0.01 s: every TTFT, the fastest wins
    assert choose_sfs_constraint([utility(c, 0.0) for c in ALL], ask, 0.01) == 0
    assert set(ask.asked) == {0, 1, 2}


def test_lazy_lagrangian_stops_when_utility_bounds_the_rest() -> None:
    # delta 0.01/s: big's score 0.90 - 0.02 = 0.88 beats mid's utility 0.79: one TTFT
    ask = _Asked(ALL)
    assert choose_sfs_lagrangian([utility(c, 0.0) for c in ALL], ask, 0.01) == 2
    assert set(ask.asked) == {2}
    # delta 1/s: big 0.90 - 2 < mid 0.79 - 0.4 = 0.39 > small's utility 0.35: two
    ask = _Asked(ALL)
    assert choose_sfs_lagrangian([utility(c, 0.0) for c in ALL], ask, 1.0) == 1
    assert set(ask.asked) == {1, 2}
    with pytest.raises(ValueError, match="no candidates"):
        choose_sfs_lagrangian([], ask, 1.0)
    with pytest.raises(ValueError, match="no candidates"):
        choose_sfs_constraint([], ask, 1.0)
