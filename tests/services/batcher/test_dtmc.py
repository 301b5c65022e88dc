"""The chain: deadlock bound, exact cases, agreement with the Monte-Carlo sim, ranking."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from services.batcher.dtmc import (
    AffineLatency,
    ModelPair,
    best_b,
    best_pair,
    fixed_table,
    is_deadlock_free,
    is_feasible,
    predicted_throughput,
    solve_chain,
)
from services.batcher.simulate import simulate

SMALL = AffineLatency(0.010, 0.001)  # s: a fast entry model
LARGE = AffineLatency(0.050, 0.0005)  # s: a slow model whose step barely grows with b


def has_deadlock_split(n: int, b_small: int, b_large: int) -> bool:
    """Brute force: some split of N requests leaves both models holding."""
    return any(w < b_small and n - w < b_large for w in range(n + 1))


def test_feasible_is_exactly_deadlock_free() -> None:
    for n in range(1, 9):
        for b_s, b_l in itertools.product(range(1, n + 1), repeat=2):
            assert is_feasible(n, b_s, b_l) == (not has_deadlock_split(n, b_s, b_l))


@pytest.mark.parametrize("p", [0.0, 0.02, 0.2, 0.7, 1.0])
@pytest.mark.parametrize("tokens_per_visit", [1.0, 4.0])
@pytest.mark.parametrize(
    "small,large",
    [
        (SMALL, LARGE),
        (AffineLatency(0.004, 0.004), AffineLatency(0.02, 0.01)),  # steep: batching costs
        (AffineLatency(0.010, 0.0), AffineLatency(0.200, 0.0)),  # flat: batching is free
    ],
)
def test_tables_obey_the_deadlock_bound(
    p: float, tokens_per_visit: float, small: AffineLatency, large: AffineLatency
) -> None:
    table = best_b(ModelPair(p, small, large, tokens_per_visit_large=tokens_per_visit), 7)
    assert is_deadlock_free(table.b_small, table.b_large)
    assert all(1 <= b <= n for n, b in enumerate(table.b_small, 1))
    assert all(1 <= b <= n for n, b in enumerate(table.b_large, 1))
    # B* is never worse than eager: (1, 1) is one of the pairs searched.
    assert all(
        t >= e * (1 - 1e-9)
        for t, e in zip(table.throughput_tok_s, table.eager_throughput_tok_s, strict=True)
    )


def test_fixed_tables_are_clamped_into_the_bound() -> None:
    table = fixed_table(6, 2, 4)
    assert table.b_small == [1, 2, 2, 2, 2, 2]
    assert table.b_large == [1, 1, 2, 3, 4, 4]
    assert is_deadlock_free(table.b_small, table.b_large)
    with pytest.raises(ValueError, match=">= 1"):
        fixed_table(4, 0, 2)


def test_tables_that_break_the_bound_are_refused() -> None:
    assert not is_deadlock_free([1, 2, 3], [1, 1, 2])  # N=3: 3 + 2 > 4
    assert not is_deadlock_free([1, 1], [1, 3])  # N=2: B_L > N
    with pytest.raises(ValueError, match="infeasible"):
        predicted_throughput(ModelPair(0.1, SMALL, LARGE), 4, 3, 3)
    with pytest.raises(ValueError, match="p must be"):
        predicted_throughput(ModelPair(1.5, SMALL, LARGE), 4, 1, 1)
    with pytest.raises(ValueError, match="needs 4 entries"):
        predicted_throughput(ModelPair(0.1, [0.01, 0.02], LARGE), 4, 1, 1)
    with pytest.raises(ValueError, match="> 0 s"):
        predicted_throughput(ModelPair(0.1, [0.01, -1.0], LARGE), 2, 1, 1)


def test_an_infeasible_pair_deadlocks_and_the_timeout_rescues_it() -> None:
    # N = 4, B = (3, 3): a 2/2 split holds on both sides; only the timeout moves it.
    res = simulate(
        ModelPair(0.3, SMALL, LARGE), 4, 3, 3, num_steps=5_000, hold_timeout_s=0.1, seed=3
    )
    assert res.num_timeouts > 0 and res.throughput_tok_s > 0
    with pytest.raises(ValueError, match="deadlock"):
        simulate(ModelPair(0.3, SMALL, LARGE), 4, 3, 3)


def test_one_request_matches_the_closed_form() -> None:
    # N = 1 alternates: 1/p S tokens (the last one taken back with prob rho), then a
    # geometric run of m L tokens: tokens per cycle / seconds per cycle.
    p, m, rho = 0.2, 3.0, 0.5
    t_s, t_l = SMALL(1), LARGE(1)
    expected = (1 / p - rho + m) / (t_s / p + m * t_l)
    got = predicted_throughput(ModelPair(p, SMALL, LARGE, m, rewrite_fraction=rho), 1, 1, 1)
    assert got == pytest.approx(expected, rel=1e-9)


def test_no_routing_means_no_holding() -> None:
    # p = 0: every request stays at S, which always holds all N, so B changes nothing;
    # ties go to the least holding.
    for n in (1, 3, 6):
        best = best_pair(ModelPair(0.0, SMALL, LARGE), n)
        assert (best.b_small, best.b_large) == (1, 1)
        assert best.throughput_tok_s == pytest.approx(n / SMALL(n))


CASES = [  # N, B_S, B_L, p, small, large, tokens per visit, rewrite fraction
    (4, 1, 2, 0.2, SMALL, LARGE, 1.0, 0.0),
    (6, 2, 3, 0.3, AffineLatency(0.01, 0.002), AffineLatency(0.04, 0.005), 3.0, 0.0),
    (5, 1, 5, 0.1, SMALL, AffineLatency(0.06, 0.0), 1.0, 1.0),
]


SLOWED = (AffineLatency(0.015, 0.003), AffineLatency(0.070, 0.001))  # s, while both step


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("colocated", [False, True])
def test_chain_equals_simulation_under_its_assumption(case: tuple, colocated: bool) -> None:  # type: ignore[type-arg]
    """With memoryless step times the chain is exact: the sim must agree within noise
    (also when each model's step slows down while the other one steps)."""
    n, b_s, b_l, p, small, large, m, rho = case
    alone = ModelPair(p, small, large, m, rho)
    pair = (
        dataclasses.replace(
            alone, overlap_latency_s_small=SLOWED[0], overlap_latency_s_large=SLOWED[1]
        )
        if colocated
        else alone
    )
    chain = solve_chain(pair, n, b_s, b_l)
    sim = simulate(pair, n, b_s, b_l, durations="exponential", num_steps=200_000, seed=11)
    if colocated:  # slower than the same system uncontended, unless B_L = N: then the
        # models strictly alternate and never step at the same time
        alone_tok_s = solve_chain(alone, n, b_s, b_l).throughput_tok_s
        if b_l == n:
            assert chain.throughput_tok_s == pytest.approx(alone_tok_s, rel=1e-9)
        else:
            assert chain.throughput_tok_s < alone_tok_s
    assert sim.throughput_tok_s == pytest.approx(chain.throughput_tok_s, rel=0.015)
    sim_steps = (sim.num_small_steps / sim.elapsed_s, sim.num_large_steps / sim.elapsed_s)
    assert sim_steps[0] == pytest.approx(chain.small_steps_per_s, rel=0.02)
    assert sim_steps[1] == pytest.approx(chain.large_steps_per_s, rel=0.03)


def test_chain_ranks_clearly_separated_b_like_deterministic_steps() -> None:
    """Real steps take t(b), not a memoryless time: the chain's level is off by a few %,
    but B values it separates by > 8% must come out in the same order."""
    n, p = 6, 0.1
    pair = ModelPair(p, SMALL, LARGE)
    chain = [predicted_throughput(pair, n, 1, b) for b in range(1, n + 1)]
    sim = [
        simulate(pair, n, 1, b, num_steps=60_000, seed=5).throughput_tok_s for b in range(1, n + 1)
    ]
    separated = [
        (i, j)
        for i, j in itertools.combinations(range(n), 2)
        if abs(chain[i] - chain[j]) > 0.08 * max(chain[i], chain[j])
    ]
    assert len(separated) >= 5
    for i, j in separated:
        assert np.sign(chain[i] - chain[j]) == np.sign(sim[i] - sim[j]), (i + 1, j + 1)
