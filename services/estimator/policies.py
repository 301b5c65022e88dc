"""Query-level routing policies: pure objects over plain data (no I/O, no clocks).

A policy sees one request and the candidate instances, each with its latest
fresh snapshot (or None when missing or stale) and the ledger's not-yet-visible
dispatches, and picks one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from services.estimator.ledger import LedgerEntry
from shared.messages.estimator import RouteRequest
from shared.messages.registry import WorkerInfo
from shared.scheduling.snapshot import WorkloadSnapshot


@dataclass(frozen=True, slots=True)
class InstanceView:
    info: WorkerInfo
    snapshot: WorkloadSnapshot | None  # None: missing or older than the staleness bound
    unseen: list[LedgerEntry]  # dispatched here, not yet in the snapshot

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

    def choose(self, request: RouteRequest, candidates: list[InstanceView]) -> InstanceView:
        """Pick one of `candidates` (never empty)."""
        ...


class RoundRobin:
    """Each candidate set in turn, independent of load."""

    name = "round-robin"

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

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: RouteRequest, candidates: list[InstanceView]) -> InstanceView:
        ordered = sorted(candidates, key=lambda c: c.instance_id)
        best = min((c.num_requests, -c.num_free_blocks) for c in ordered)
        ties = [c for c in ordered if (c.num_requests, -c.num_free_blocks) == best]
        self._turn += 1
        return ties[self._turn % len(ties)]


def create_policy(name: str) -> Policy:
    if name == "round-robin":
        return RoundRobin()
    if name == "shortest-queue":
        return ShortestQueue()
    raise ValueError(
        f"policy {name!r} is not available in this estimator yet: use round-robin or shortest-queue"
    )
