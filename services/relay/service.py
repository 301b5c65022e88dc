"""The relay service: the third loop of token-level routing (docs/token-routing.md).

    {ns}.relay.in (queue group) -> books.on_peer / on_release -> {ns}.worker.{id}.peer
    every 0.1 s: books.check (timeouts, departed peers and origins)
    every registry_refresh_s: live workers + their snapshots (load per instance)

Workers send every hand-off here instead of to each other, so a fast model never
waits on a slow model's loop, a dead or stuck peer is noticed in one place, and
the replica that takes a request's first visit is the least loaded one.

Run one relay per deployment: its books (sequence numbers, holders, timers) live
in this process. Several replicas would need the subject sharded by request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

from services.relay.books import RelayBooks, Send
from shared import subjects
from shared.bus import Bus
from shared.config import ClusterConfig
from shared.logging import RetryLog, get_logger
from shared.messages.health import HEALTH_PROBE_DECODER, HealthProbe, HealthReply
from shared.messages.peer import (
    PEER_MESSAGE_DECODER,
    PEER_QUERY_DECODER,
    PeerMessage,
    PeerQuery,
    PeerQueryReply,
    PeerRelease,
    PeerReq,
    RelayStarted,
)
from shared.messages.registry import RegistryEpoch, WorkerInfo
from shared.scheduling.unshown import UnshownRequests
from shared.snapshot_decoder import SnapshotDecoder
from shared.store import Store

log = get_logger(component="relay")
CHECK_INTERVAL_S = 0.1
# A hand-off to a model with no known worker re-reads the registry, at most this often
# (a peer model that is really gone costs one Redis round trip per interval, not per
# hand-off). Counted from the last re-read a miss triggered, not from any read: the
# read at start (or a periodic one) may be just older than the workers, and a burst of
# first hand-offs within this of it would otherwise all be given back.
RETRY_REFRESH_S = 0.2


class RelayService:
    def __init__(self, cluster: ClusterConfig) -> None:
        self.cluster = cluster
        self.settings = cluster.relay
        self.bus = Bus(cluster.nats_url, name="relay")
        self.store = Store(cluster.redis_url, cluster.namespace)
        self.books = RelayBooks(self.settings.peer_timeout_s, self._pick, self._alive)
        self.workers: dict[str, WorkerInfo] = {}
        self.load: dict[str, int] = {}  # instance -> requests in its latest snapshot
        self._placed = UnshownRequests()  # copies placed here that no snapshot shows yet
        self._snapshots = SnapshotDecoder(log)
        self._last_retry_s = -math.inf  # monotonic time of the last re-read on a miss
        self._refresh_failures = RetryLog(log, "registry_refresh_failed")
        self._registry_epoch = RegistryEpoch(cluster.worker.heartbeat_ttl_s)
        self._stop = asyncio.Event()
        self.started = asyncio.Event()  # set once serving (shared.runtime.run_service)

    def request_stop(self) -> None:
        self._stop.set()

    # -- choosing instances --------------------------------------------------------

    def _alive(self, instance_id: str) -> bool:
        return instance_id in self.workers

    def _serving(self, preset: str, model_index: int) -> list[str]:
        """Live, not draining instances of the preset's model `model_index`."""
        cfg = self.cluster.presets.get(preset)
        if cfg is None or not 0 <= model_index < len(cfg.models):
            return []
        model = cfg.models[model_index]
        return [
            w.instance_id for w in self.workers.values() if w.model == model and not w.is_draining
        ]

    def _release_everywhere(self, msg: PeerRelease) -> list[Send]:
        """A release for a request these books do not hold (this relay started after its
        hand-offs, or gave it back): to every instance of the preset's models but the
        origin, so no copy outlives it until `guest_idle_s` (a worker ignores a release
        of a request it holds no copy of). Origins send one only for a request a peer
        has seen, so this is rare."""
        cfg = self.cluster.presets.get(msg.preset)
        if cfg is None:
            return []
        return [
            (iid, msg)
            for iid, w in sorted(self.workers.items())
            if w.model in cfg.models and iid != msg.origin_instance
        ]

    def _pick(self, preset: str, model_index: int, request_id: str) -> str | None:
        live = self._serving(preset, model_index)
        if not live:
            return None
        best = min(live, key=lambda i: (self.load.get(i, 0) + self._placed.count(i), i))
        self._placed.add(best, request_id)
        return best

    async def _refresh_or_keep(self) -> None:
        """Refresh the view; on a Redis hiccup keep the last one (logged)."""
        await self._refresh_failures.attempt(self.refresh)

    async def refresh(self) -> None:
        self.workers = await self.store.read_live_workers(self.workers, self._registry_epoch)
        self._snapshots.keep_only(self.workers)
        blobs = await self.store.read_snapshots(list(self.workers))
        snapshots = self._snapshots.decode(blobs)
        for iid, snap in snapshots.items():
            self.load[iid] = snap.num_requests
        for iid in self._snapshots.undecodable:  # unknown load, not the last one seen
            self.load.pop(iid, None)
        for iid in set(self.load).difference(self.workers):  # gone
            del self.load[iid]
        self._placed.refresh(self.workers, snapshots, self.books.routes.__contains__)

    async def _query(self, query: PeerQuery) -> PeerQueryReply:
        return PeerQueryReply(pending=self.books.pending(query.request_ids))

    async def health(self, probe: HealthProbe) -> HealthReply:
        return HealthReply(service="relay", detail=f"{len(self.books.routes)} requests routed")

    # -- the loop ------------------------------------------------------------------

    async def _on_message(self, msg: PeerMessage) -> None:
        if isinstance(msg, PeerRelease):
            known = msg.request_id in self.books.routes
            sends = self.books.on_release(msg)
            if not known:
                sends = self._release_everywhere(msg)
        else:
            if msg.to_model != 0 and not self._serving(msg.preset, msg.to_model):
                # A model this view knows no worker of: the registry may simply be older
                # than the workers (the relay starts first); look again before giving
                # the request back, at most once per RETRY_REFRESH_S.
                await self._refresh_soon()
            sends = self.books.on_peer(msg, time.monotonic())
        await self.send(sends)

    async def _refresh_soon(self) -> None:
        now = time.monotonic()
        if now - self._last_retry_s < RETRY_REFRESH_S:
            return
        self._last_retry_s = now
        await self._refresh_or_keep()

    async def send(self, sends: list[Send]) -> None:
        ns = self.cluster.namespace
        for instance_id, msg in sends:
            if isinstance(msg, PeerReq) and msg.failed is not None:
                log.warning(
                    "peer_failover",
                    request_id=msg.request_id,
                    origin=instance_id,
                    reason=msg.failed,
                )
            await self.bus.publish(subjects.worker_peer(ns, instance_id), msg)

    async def run(self) -> None:
        await self.bus.connect()
        await self.store.connect()
        try:
            await self.refresh()
            await self.bus.subscribe(
                subjects.relay_inbox(self.cluster.namespace),
                PEER_MESSAGE_DECODER,
                self._on_message,
                queue=subjects.RELAY_QUEUE_GROUP,
            )
            await self.bus.serve(
                subjects.relay_query(self.cluster.namespace), PEER_QUERY_DECODER, self._query
            )
            await self.bus.serve(
                subjects.health(self.cluster.namespace, "relay"),
                HEALTH_PROBE_DECODER,
                self.health,
            )
            # Workers with requests away ask about them now: this relay knows none of
            # the hand-offs a predecessor held (they come back to their origins).
            await self.bus.publish(
                subjects.relay_started(self.cluster.namespace),
                RelayStarted(started_at_s=time.time()),
            )
            await self.bus.flush()
            self.started.set()
            log.info("relay_ready", live_workers=len(self.workers))
            next_refresh = time.monotonic() + self.settings.registry_refresh_s
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), CHECK_INTERVAL_S)
                now = time.monotonic()
                if now >= next_refresh:
                    next_refresh = now + self.settings.registry_refresh_s
                    await self._refresh_or_keep()
                await self.send(self.books.check(now))
        finally:
            c = self.books.counters
            log.info(
                "relay_stopped",
                forwarded=c.forwarded,
                failovers=c.failovers,
                dropped_stale=c.dropped_stale,
                dropped_unknown=c.dropped_unknown,
                released=c.released,
            )
            await self.bus.close()
            await self.store.close()
