"""Routing policies pick as their formulas say."""

from __future__ import annotations

import math

import pytest

from services.estimator.sfs.utility import (
    Candidate,
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
