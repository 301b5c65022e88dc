"""Query-level routing policies: pure objects over plain data (no I/O, no clocks).

A policy sees one request and the candidate instances, each with its latest
fresh snapshot (or None when missing or stale), the ledger's not-yet-visible
dispatches and, for the utility policies, the request's predicted accuracy, cost
and TTFT there (`Scores`, filled by the service when `needs_scores`), and picks one.

    latency-agnostic  argmax acc - lambda * cost
    sfs-constraint    argmax acc - lambda * cost over instances with TTFT <= target,
                      else argmin TTFT
    sfs-lagrangian    argmax acc - lambda * cost - delta * TTFT (seconds)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from services.estimator.ledger import LedgerEntry
from services.estimator.routebalance.score import BALANCED, Weights
from services.estimator.sfs.utility import (
    choose_latency_agnostic,
    choose_sfs_constraint,
    choose_sfs_lagrangian,
    default_ttft_target_s,
)
from shared.config import EstimatorConfig, PresetConfig
from shared.messages.estimator import RouteRequest
from shared.messages.registry import WorkerInfo
from shared.scheduling.snapshot import WorkloadSnapshot


class TtftLike(Protocol):
    """A predicted TTFT (`instances.TtftEstimate`)."""

    @property
    def ttft_s(self) -> float: ...
    @property
    def source(self) -> str: ...


TtftThunk = Callable[[], TtftLike]  # computes the prediction when first needed


class Scores:
    """The request's predictions on one instance.

    The TTFT is given, or computed by `estimate` on first read (once): an SFS replay
    costs tens of us per instance, and a utility policy reads it only for the
    candidates that can still change its pick (sfs/utility.py, `choose_*`).
    """

    __slots__ = ("_estimate", "_ttft_s", "_ttft_source", "accuracy", "cost")

    def __init__(
        self,
        accuracy: float,  # the model's judged quality for the request's task
        cost: float,  # cost units: prompt and predicted output tokens at the model's prices
        ttft_s: float = math.nan,  # predicted TTFT, s (nan: not computed; inf: cannot serve)
        ttft_source: str = "",  # "sfs" (replay on a fresh snapshot) | "lps" (queue model)
        *,
        estimate: TtftThunk | None = None,  # computes ttft_s and ttft_source when first read
    ) -> None:
        self.accuracy = accuracy
        self.cost = cost
        self._ttft_s = ttft_s
        self._ttft_source = ttft_source
        self._estimate = estimate

    def _resolve(self) -> None:
        if self._estimate is not None:
            e = self._estimate()
            self._ttft_s, self._ttft_source = e.ttft_s, e.source
            self._estimate = None

    @property
    def ttft_s(self) -> float:
        self._resolve()
        return self._ttft_s

    @property
    def ttft_source(self) -> str:
        self._resolve()
        return self._ttft_source

    @property
    def ttft_known(self) -> bool:
        """Whether the TTFT was given or has been computed (not merely computable)."""
        return self._estimate is None

    def __repr__(self) -> str:
        ttft = f"{self._ttft_s!r}" if self._estimate is None else "<not computed>"
        return f"Scores(accuracy={self.accuracy!r}, cost={self.cost!r}, ttft_s={ttft})"


@dataclass(slots=True)  # not frozen: a frozen __init__ costs ~1 us a view, 13 a decision
class InstanceView:
    """One candidate as a policy sees it (built per decision; policies only read it)."""

    info: WorkerInfo
    snapshot: WorkloadSnapshot | None  # None: missing or older than the staleness bound
    unseen: list[LedgerEntry]  # dispatched here, not yet in the snapshot
    scores: Scores | None = None  # filled for policies with needs_scores

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    @property
    def num_requests(self) -> int:
        """Requests this instance holds or is about to hold.

        Without a fresh snapshot only the ledger is known (it then holds every
        dispatch not yet ended), the average-case fallback for a silent instance.
        """
        known = self.snapshot.num_requests if self.snapshot is not None else 0
        return known + len(self.unseen)

    @property
    def num_free_blocks(self) -> int:
        return self.snapshot.num_free_blocks if self.snapshot is not None else 0


class Policy(Protocol):
    name: str
    needs_scores: bool  # the service fills InstanceView.scores (accuracy, cost)
    needs_ttft: bool  # ... and the predicted TTFT

    def choose(self, request: RouteRequest, candidates: list[InstanceView]) -> InstanceView:
        """Pick one of `candidates` (never empty)."""
        ...


class RoundRobin:
    """Each candidate set in turn, independent of load."""

    name = "round-robin"
    needs_scores = False
    needs_ttft = False

    def __init__(self) -> None:
        self._next: dict[tuple[str, ...], int] = {}

    def choose(self, request: RouteRequest, candidates: list[InstanceView]) -> InstanceView:
        ordered = sorted(candidates, key=lambda c: c.instance_id)
        key = tuple(c.instance_id for c in ordered)
        i = self._next.get(key, 0)
        self._next[key] = i + 1
        return ordered[i % len(ordered)]


class ShortestQueue:
    """Fewest requests (snapshot + ledger); ties go to more free KV, then rotate."""

    name = "shortest-queue"
    needs_scores = False
    needs_ttft = False

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: RouteRequest, candidates: list[InstanceView]) -> InstanceView:
        ordered = sorted(candidates, key=lambda c: c.instance_id)
        best = min((c.num_requests, -c.num_free_blocks) for c in ordered)
        ties = [c for c in ordered if (c.num_requests, -c.num_free_blocks) == best]
        self._turn += 1
        return ties[self._turn % len(ties)]


class UtilityPolicy:
    """latency-agnostic, sfs-constraint or sfs-lagrangian over the views' Scores.

    lambda: utility per cost unit; delta: utility per second of TTFT (Lagrangian);
    the TTFT target is the request's `ttft_target_ms`, else `default_target_s(prompt)`.
    Ties in utility (replicas of one model) go to the candidate holding fewer requests
    (snapshot + ledger), then to the smallest instance id: by id alone, sfs-constraint
    kept sending to the first replica while it still met the target and left its twins
    idle (13 simulated instances, 20 req/s: 296 requests to one 72B replica, 1 to the
    other). The SFS code breaks ties at random; RouteBalance's by running + waiting.
    """

    def __init__(
        self,
        name: str,
        lam: float,
        delta: float,
        default_target_s: Callable[[int], float],
    ) -> None:
        if name not in UTILITY_POLICIES:
            raise ValueError(f"not a utility policy: {name!r}")
        self.name = name
        self.lam = lam
        self.delta = delta
        self.default_target_s = default_target_s
        self.needs_scores = True
        self.needs_ttft = name != "latency-agnostic"

    def target_s(self, request: RouteRequest) -> float:
        if request.ttft_target_ms is not None:
            return request.ttft_target_ms / 1000.0
        return self.default_target_s(request.num_prompt_tokens)

    def choose(self, request: RouteRequest, candidates: list[InstanceView]) -> InstanceView:
        # the choices below break ties to the earliest candidate in this order
        ordered = sorted(candidates, key=lambda c: (c.num_requests, c.instance_id))
        scores: list[Scores] = []
        for c in ordered:
            assert c.scores is not None, "the service fills scores for utility policies"
            scores.append(c.scores)
        utilities = [s.accuracy - self.lam * s.cost for s in scores]

        def ttft_s(j: int) -> float:
            return scores[j].ttft_s

        if self.name == "latency-agnostic":
            return ordered[choose_latency_agnostic(utilities)]
        if self.name == "sfs-constraint":
            return ordered[choose_sfs_constraint(utilities, ttft_s, self.target_s(request))]
        return ordered[choose_sfs_lagrangian(utilities, ttft_s, self.delta)]


UTILITY_POLICIES = ("latency-agnostic", "sfs-constraint", "sfs-lagrangian")


def create_policy(
    name: str,
    lam: float = 0.0,
    delta: float = 0.0,
    default_target_s: Callable[[int], float] = default_ttft_target_s,
) -> Policy:
    """A fresh policy object; ValueError for a name this estimator does not implement."""
    if name == "round-robin":
        return RoundRobin()
    if name == "shortest-queue":
        return ShortestQueue()
    if name in UTILITY_POLICIES:
        return UtilityPolicy(name, lam, delta, default_target_s)
    raise ValueError(
        f"policy {name!r} is not available in this estimator yet: use one of round-robin, "
        f"shortest-queue, {', '.join(UTILITY_POLICIES)}"
    )


class PolicyTable:
    """Which policy decides a request: its own (x-baton-policy), else its preset's, else
    the estimator's default. Built up front, so a cluster file naming a policy this
    estimator cannot run fails at start (ValueError), not at the first request."""

    def __init__(self, settings: EstimatorConfig, presets: Mapping[str, PresetConfig]) -> None:
        self.settings = settings
        self.presets = presets
        self.default = self._create(settings.policy, None)
        self._by_preset = {n: self._create(p.policy, p) for n, p in presets.items()}
        self._overrides: dict[tuple[str, str], Policy | Weights] = {}  # (model, name) -> it

    def default_ttft_target_s(self, num_prompt_tokens: int) -> float:
        """The TTFT target of a request without x-slo-ttft-ms (SFS rule, [estimator] keys)."""
        st = self.settings
        ms = st.ttft_slo_base_ms + st.ttft_slo_per_prompt_token_ms * num_prompt_tokens
        return min(st.ttft_slo_max_ms, max(st.ttft_slo_min_ms, ms)) / 1000.0

    def _create(self, name: str, preset: PresetConfig | None) -> Policy | Weights:
        """The policy `name` with the preset's knobs (None: the [estimator] ones);
        routebalance decides in batches: its weights stand for it."""
        if name == "routebalance":
            weights = preset.routebalance_weights if preset is not None else []
            return Weights(*weights) if weights else BALANCED
        lam = preset.lambda_ if preset is not None else self.settings.lambda_
        delta = preset.delta if preset is not None else self.settings.delta
        return create_policy(name, lam, delta, self.default_ttft_target_s)

    def for_request(self, request: RouteRequest) -> Policy | Weights:
        """What decides `request`: a policy, or RouteBalance's weights (in a batch);
        ValueError for an override it cannot run."""
        if request.policy is None:
            policy = self._by_preset.get(request.model, self.default)
        else:
            key = (request.model, request.policy)
            found = self._overrides.get(key)
            if found is None:
                preset = self.presets.get(request.model)
                found = self._overrides[key] = self._create(request.policy, preset)
            policy = found
        if isinstance(policy, Weights) and request.weights:
            return Weights(*request.weights)  # the request's own (x-baton-weights)
        return policy
