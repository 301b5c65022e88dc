"""Query-level routing policies as pure functions over per-instance candidates.

For query i and instance j (SFS paper, "Incorporating latency into the routing
objective"):

    U_ij = acc_ij - lambda * cost_ij
    latency-agnostic:  argmax_j U_ij
    SFS-constraint:    argmax_{j : TTFT_ij <= tau_i} U_ij, or argmin_j TTFT_ij if none
    SFS-Lagrangian:    argmax_j U_ij - delta * TTFT_ij

TTFTs are the predicted ones, in seconds; delta is utility per second. Ties go to the
earliest candidate (callers shuffle candidates for random tie-breaking, as the SFS
code does). Default TTFT target (paper): tau = 158 ms + 3.5e-3 ms per prompt token,
clipped to [150, 1120] ms.

A TTFT is a replay (tens of us per instance), so `choose_sfs_constraint` and
`choose_sfs_lagrangian` ask for each candidate's only when it can still change the
answer, and answer what the formulas above answer on every candidate's TTFT
(tests/services/estimator/sfs/test_utility.py holds the formulas computed on all of them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

TTFT_TARGET_BASE_MS = 158.0
TTFT_TARGET_PER_TOKEN_MS = 3.5e-3
TTFT_TARGET_MIN_MS = 150.0
TTFT_TARGET_MAX_MS = 1120.0


@dataclass(frozen=True, slots=True)
class Candidate:
    """One instance's predictions for the query being routed."""

    instance_id: str
    accuracy: float  # predicted quality, the scale of the accuracy predictor
    cost: float  # predicted price of the query here (currency units)
    ttft_s: float  # predicted TTFT, seconds (inf: cannot serve)


def utility(c: Candidate, lam: float) -> float:
    """U = acc - lambda * cost."""
    return c.accuracy - lam * c.cost


def request_cost(
    num_prompt_tokens: int,
    predicted_output_tokens: float,
    prompt_price_per_token: float,
    output_price_per_token: float,
) -> float:
    """Predicted price: prompt tokens * prompt price + predicted output * output price."""
    return (
        num_prompt_tokens * prompt_price_per_token
        + predicted_output_tokens * output_price_per_token
    )


def default_ttft_target_s(num_prompt_tokens: int) -> float:
    """The paper's TTFT target: clip(158 + 3.5e-3 * prompt_tokens, 150, 1120) ms, in s."""
    ms = TTFT_TARGET_BASE_MS + TTFT_TARGET_PER_TOKEN_MS * num_prompt_tokens
    return min(TTFT_TARGET_MAX_MS, max(TTFT_TARGET_MIN_MS, ms)) / 1000.0


def _first_max(score: Sequence[float]) -> int:
    """Index of the largest score, the earliest among equal ones."""
    if not score:
        raise ValueError("no candidates")
    best = 0
    for j in range(1, len(score)):
        if score[j] > score[best]:
            best = j
    return best


def _by_utility(utilities: Sequence[float]) -> list[int]:
    """Candidate indices, best utility first; equal utilities in candidate order."""
    return sorted(range(len(utilities)), key=lambda j: (-utilities[j], j))


def choose_latency_agnostic(utilities: Sequence[float]) -> int:
    """argmax_j U_j (ignores load)."""
    return _first_max(utilities)


def choose_sfs_constraint(
    utilities: Sequence[float], ttft_s: Callable[[int], float], ttft_target_s: float
) -> int:
    """The best utility among candidates predicted to meet the target, else the fastest.

    Asks `ttft_s(j)` (once each) in order of utility until one meets the target (no
    later candidate has a better utility); every TTFT only when none does."""
    if not utilities:
        raise ValueError("no candidates")
    known: dict[int, float] = {}
    for j in _by_utility(utilities):
        known[j] = ttft_s(j)
        if known[j] <= ttft_target_s:
            return j
    return _first_max([-known[j] for j in range(len(utilities))])


def choose_sfs_lagrangian(
    utilities: Sequence[float], ttft_s: Callable[[int], float], delta: float
) -> int:
    """argmax_j U_j - delta * TTFT_j, asking `ttft_s(j)` (once each) in order of utility.

    A TTFT is never negative, so U_j bounds U_j - delta * TTFT_j from above for
    delta >= 0: once the next utility is below the best score found, no later
    candidate can win (nor tie: ties go to the earliest candidate, kept by comparing
    indices). TTFTs must be >= 0 or inf; delta < 0 asks every one.
    """
    if delta == 0:  # exactly latency-agnostic (and no 0 * inf)
        return _first_max(utilities)
    if not utilities:
        raise ValueError("no candidates")
    can_stop = delta > 0
    best, best_score = -1, -math.inf
    for j in _by_utility(utilities):
        if can_stop and best >= 0 and utilities[j] < best_score:
            break
        score = utilities[j] - delta * ttft_s(j)
        if best < 0 or score > best_score or (score == best_score and j < best):
            best, best_score = j, score
    return best


# The same choices over Candidate records (tests, tools).


def pick_latency_agnostic(cands: Sequence[Candidate], lam: float) -> Candidate:
    return cands[choose_latency_agnostic([utility(c, lam) for c in cands])]


def pick_sfs_constraint(cands: Sequence[Candidate], lam: float, ttft_target_s: float) -> Candidate:
    utilities = [utility(c, lam) for c in cands]
    return cands[choose_sfs_constraint(utilities, lambda j: cands[j].ttft_s, ttft_target_s)]


def pick_sfs_lagrangian(cands: Sequence[Candidate], lam: float, delta: float) -> Candidate:
    utilities = [utility(c, lam) for c in cands]
    return cands[choose_sfs_lagrangian(utilities, lambda j: cands[j].ttft_s, delta)]


def on_time_utility(utilities: Sequence[float], met_target: Sequence[bool]) -> float:
    """OnTimeUtility = (1/N) sum_i U_i * 1{TTFT_i <= tau_i} (misses count zero)."""
    if len(utilities) != len(met_target):
        raise ValueError("one flag per utility")
    if not utilities:
        return 0.0
    return sum(u for u, ok in zip(utilities, met_target, strict=True) if ok) / len(utilities)
