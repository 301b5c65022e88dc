"""Requests a router sent to each instance that no snapshot of the instance shows yet.

A router that counts an instance's load itself (the gateway routing without an
estimator, the relay placing a request's first visit to a peer model) takes the
requests the instance's latest snapshot shows, plus the ones it sent there since.
"Since" is by request id, not by time: a snapshot taken after a send but before the
worker took the request in does not show it, however new (the estimator's ledger
reconciles the same way, `services.estimator.ledger`). An id leaves when a snapshot
of its instance shows it (counted there from then on), when its request ends, or
with its instance.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping

from shared.scheduling.snapshot import WorkloadSnapshot


class UnshownRequests:
    """Per instance, the ids sent there that no snapshot of it has shown yet."""

    def __init__(self) -> None:
        self._ids: dict[str, set[str]] = {}

    def add(self, instance_id: str, request_id: str) -> None:
        self._ids.setdefault(instance_id, set()).add(request_id)

    def discard(self, instance_id: str, request_id: str) -> None:
        """The request ended."""
        if (ids := self._ids.get(instance_id)) is not None:
            ids.discard(request_id)

    def count(self, instance_id: str) -> int:
        return len(self._ids.get(instance_id, ()))

    def refresh(
        self,
        live: Container[str],
        snapshots: Mapping[str, WorkloadSnapshot],
        is_open: Callable[[str], bool] | None = None,
    ) -> None:
        """After a read of the registry and the snapshots: instances not `live` go with
        their ids, ids a snapshot shows leave, and with `is_open`, so do the ids of
        requests that ended (for a caller that does not `discard` them itself)."""
        for iid, ids in list(self._ids.items()):
            if iid not in live:
                del self._ids[iid]
                continue
            if ids and (snapshot := snapshots.get(iid)) is not None:
                ids.difference_update(snapshot.request_ids)
            if ids and is_open is not None:
                self._ids[iid] = {rid for rid in ids if is_open(rid)}
