"""One RouteBalance batch: every request assigned to an instance, longest predicted
output first, each assignment dead-reckoned into the chosen instance's load before the
next request is scored (so a batch does not herd onto the instance that looked best at
its start).

Pure: the caller gives each request's predictions per model, the instances' loads
(load.py), the models' prices and a time-per-output-token estimate per instance.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from services.estimator.routebalance.latency import e2e_s
from services.estimator.routebalance.load import InstanceLoad
from services.estimator.routebalance.score import Candidate, Weights, pick, scores, within_budget

# prices of a model: (prompt tokens, output tokens) -> cost units
PriceFn = Callable[[int, float], float]
TpotFn = Callable[[InstanceLoad], float]  # seconds per output token on the instance now


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """A request waiting in the batch, with its predictions for each candidate model."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    models: tuple[str, ...]  # the models it may go to
    quality: Mapping[str, float]  # predicted quality per model
    output_tokens: Mapping[str, int]  # predicted output tokens per model (capped below)
    weights: Weights
    budget: float | None = None  # cost units at most (Eq. 2)

    def predicted_output(self, model: str) -> int:
        return max(1, min(self.max_tokens, self.output_tokens[model]))

    @property
    def longest_output(self) -> int:
        """The order key: the model is not chosen yet, so the longest over its models."""
        return max(self.predicted_output(m) for m in self.models)


@dataclass(slots=True)
class Assignment:
    request_id: str
    instance_id: str
    model: str
    predicted_output_tokens: int
    predicted_cost: float
    predicted_e2e_s: float
    score: float


def assign_batch(
    requests: Sequence[BatchRequest],
    loads: Mapping[str, InstanceLoad],
    prices: Mapping[str, PriceFn],
    tpot_s: TpotFn,
    first_order: int = 0,
) -> list[Assignment]:
    """Assign every request (a request with no live instance of its models is left out);
    `loads` is updated in place. `first_order` numbers the assignments for the
    least-recently-assigned tie-break across batches."""
    by_model: dict[str, list[InstanceLoad]] = {}
    for load in loads.values():
        by_model.setdefault(load.model, []).append(load)
    ordered = sorted(requests, key=lambda r: -r.longest_output)  # stable: FIFO among equals
    out: list[Assignment] = []
    for n, req in enumerate(ordered):
        # 1. the candidates and what each would cost and take
        cands = []
        for model in req.models:
            tokens = req.predicted_output(model)
            for load in by_model.get(model, ()):
                cost = prices[model](req.num_prompt_tokens, tokens)
                latency = e2e_s(load, tpot_s(load), tokens)
                cands.append(Candidate(load, req.quality[model], cost, latency))
        if not cands:
            continue
        # 2. the budget filter, the score, the pick
        cands = within_budget(cands, req.budget)
        score = scores(cands, req.weights)
        best = pick(cands, score)
        chosen = cands[best]
        model = chosen.load.model
        tokens = req.predicted_output(model)
        # 3. dead reckoning: the next request sees this one on its instance
        chosen.load.add(tokens, first_order + n)
        out.append(
            Assignment(
                req.request_id,
                chosen.load.instance_id,
                model,
                tokens,
                chosen.cost,
                chosen.e2e_s,
                score[best],
            )
        )
    return out
