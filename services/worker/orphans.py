"""Requests whose owning gateway is gone: a gateway that died leaves no one to read their
tokens, which would otherwise run to their max_tokens.

A gateway counts as gone once its registration has been missing for `grace_s` (the
worker uses two heartbeat TTLs): the grace covers a store that lost its data, since a
live gateway registers again within its next registry refresh. Pure: the worker reads
the live gateways and aborts what `judge` names.
"""

from __future__ import annotations


class OrphanWatch:
    """Since when each owning gateway has been seen unregistered."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.gone_since: dict[str, float] = {}  # gateway id -> monotonic time seen gone

    def forget(self) -> None:
        """After a failed read: no stale "gone since" survives an outage of ours."""
        self.gone_since.clear()

    def judge(self, owners: dict[str, str], alive: set[str], now: float) -> dict[str, list[str]]:
        """owners: request id -> its gateway, as they stood when `alive` was asked for
        (the gateways among them still registered). Returns gateway id -> its requests
        to abort now. Each gateway is judged once: one still unregistered at the next
        check meets a fresh grace, so an abort still queued is never sent twice."""
        gateways = set(owners.values())
        # Kept: the gateways still owning requests and still unregistered; a gateway
        # seen again, or with no request left, starts afresh next time.
        self.gone_since = {g: self.gone_since.get(g, now) for g in gateways if g not in alive}
        orphans: dict[str, list[str]] = {}
        for gid, since in list(self.gone_since.items()):
            if now - since >= self.grace_s:
                orphans[gid] = [rid for rid, g in owners.items() if g == gid]
                del self.gone_since[gid]
        return orphans
