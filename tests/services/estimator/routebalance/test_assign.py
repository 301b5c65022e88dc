"""A RouteBalance batch: longest predicted output first, dead reckoning inside the
batch, the budget filter, and the logged score rows."""

from __future__ import annotations

import pytest

from services.estimator.routebalance.assign import BatchRequest, assign_batch
from services.estimator.routebalance.load import InstanceLoad
from services.estimator.routebalance.score import COST_FIRST, QUALITY_FIRST, Weights

LATENCY_ONLY = Weights(quality=0.0, latency=1.0, cost=0.0)
PRICES = {"small": lambda p, o: 1e-6 * (p + o), "large": lambda p, o: 1e-5 * (p + o)}
TPOT = {"small": 0.01, "large": 0.04}


def request(rid: str, weights: Weights, out: int = 100, **kw: object) -> BatchRequest:
    return BatchRequest(
        request_id=rid,
        num_prompt_tokens=50,
        max_tokens=512,
        models=("small", "large"),
        quality={"small": 0.3, "large": 0.8},
        output_tokens={"small": out, "large": out},
        weights=weights,
        **kw,  # type: ignore[arg-type]
    )


def loads(small: int = 2, large: int = 1, seqs: int = 1) -> dict[str, InstanceLoad]:
    out = {f"s{i}": InstanceLoad(f"s{i}", "small", seqs) for i in range(small)}
    out |= {f"l{i}": InstanceLoad(f"l{i}", "large", seqs) for i in range(large)}
    return out


def tpot(load: InstanceLoad) -> float:
    return TPOT[load.model]


def test_dead_reckoning_spreads_a_batch_over_identical_instances() -> None:
    batch = [request(f"r{i}", LATENCY_ONLY) for i in range(4)]
    state = loads(small=4, large=0)
    got = assign_batch(batch, state, PRICES, tpot)
    assert sorted(a.instance_id for a in got) == ["s0", "s1", "s2", "s3"]
    assert all(s.num_waiting == 1 for s in state.values())


def test_without_dead_reckoning_the_batch_would_herd() -> None:
    """The same batch one request at a time on fresh copies of the loads: each sees the
    same idle cluster, and every request lands on the same instance."""
    chosen = {
        assign_batch([request(f"r{i}", LATENCY_ONLY)], loads(4, 0), PRICES, tpot)[0].instance_id
        for i in range(4)
    }
    assert chosen == {"s0"}


def test_the_longest_predicted_output_goes_first() -> None:
    batch = [request("short", LATENCY_ONLY, out=10), request("long", LATENCY_ONLY, out=300)]
    got = assign_batch(batch, loads(2, 0), PRICES, tpot)
    assert [a.request_id for a in got] == ["long", "short"]


def test_the_weights_choose_between_quality_and_cost() -> None:
    assert assign_batch([request("q", QUALITY_FIRST)], loads(), PRICES, tpot)[0].model == "large"
    assert assign_batch([request("c", COST_FIRST)], loads(), PRICES, tpot)[0].model == "small"


def test_a_budget_below_the_large_model_s_cost_keeps_it_out() -> None:
    # 150 tokens: small 1.5e-4, large 1.5e-3
    got = assign_batch([request("b", QUALITY_FIRST, budget=1e-3)], loads(), PRICES, tpot)
    assert got[0].model == "small" and got[0].predicted_cost == pytest.approx(1.5e-4)


def test_a_request_whose_models_have_no_instance_is_left_out() -> None:
    got = assign_batch([request("r", QUALITY_FIRST)], loads(0, 0), PRICES, tpot)
    assert got == []


def test_orders_number_the_assignments_for_the_next_batch_s_ties() -> None:
    state = loads(2, 0)
    assign_batch([request("r", LATENCY_ONLY)], state, PRICES, tpot, first_order=10)
    assert {s.instance_id: s.last_assigned for s in state.values()} == {"s0": 10, "s1": -1}
