"""The estimator service: answers "which instance?" over NATS request/reply.

    route request -> candidates (live, non-draining instances of the model or preset)
                  -> their snapshots from Redis (one round trip), stale ones dropped
                  -> ledger reconciled with what the snapshots show
                  -> policy.choose -> ledger.add -> reply

nats-py runs one subscription's callbacks one at a time, so decisions (and the
ledger) are serialized within a process. Several estimator replicas share the
route subject through a queue group; each keeps its own ledger (see DESIGN.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec

from services.estimator.ledger import Ledger, LedgerEntry
from services.estimator.policies import InstanceView, Policy, create_policy
from shared import subjects
from shared.bus import Bus
from shared.config import ClusterConfig
from shared.logging import get_logger
from shared.messages.estimator import (
    REQUEST_DONE_DECODER,
    ROUTE_REQUEST_DECODER,
    RequestDoneEvent,
    RouteReply,
    RouteRequest,
)
from shared.messages.registry import WorkerInfo, departed
from shared.scheduling.snapshot import WorkloadSnapshot
from shared.store import Store

log = get_logger(component="estimator")
_SNAPSHOT_DECODER = msgspec.msgpack.Decoder(WorkloadSnapshot)


class EstimatorService:
    def __init__(self, cluster: ClusterConfig) -> None:
        self.cluster = cluster
        self.settings = cluster.estimator
        self.bus = Bus(cluster.nats_url, name="estimator")
        self.store = Store(cluster.redis_url, cluster.namespace)
        self.ledger = Ledger(self.settings.ledger_ttl_s)
        self._default_policy = create_policy(self.settings.policy)
        self._preset_policies: dict[str, Policy] = {
            n: create_policy(p.policy) for n, p in cluster.presets.items()
        }
        self.workers: dict[str, WorkerInfo] = {}
        self._stop = asyncio.Event()
        self.num_decisions = 0

    def request_stop(self) -> None:
        self._stop.set()

    async def start(self) -> None:
        await self.bus.connect()
        await self.store.connect()
        await self._refresh_workers()
        ns = self.cluster.namespace
        await self.bus.serve(
            subjects.estimator_route(ns),
            ROUTE_REQUEST_DECODER,
            self.route,
            queue=subjects.ESTIMATOR_QUEUE_GROUP,
        )
        await self.bus.subscribe(subjects.estimator_events(ns), REQUEST_DONE_DECODER, self._on_done)
        await self.bus.flush()
        log.info(
            "estimator_ready", policy=self._default_policy.name, live_workers=len(self.workers)
        )

    async def run(self) -> None:
        """Serve until request_stop(); refresh the registry and expire the ledger meanwhile."""
        await self.start()
        try:
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.settings.registry_refresh_s)
                try:
                    await self._refresh_workers()
                except Exception as exc:
                    log.warning("registry_refresh_failed", error=str(exc))
                self.ledger.expire(time.monotonic())
        finally:
            await self.close()

    async def close(self) -> None:
        await self.bus.close()
        await self.store.close()

    async def _refresh_workers(self) -> None:
        live = {w.instance_id: w for w in await self.store.live_workers()}
        for gone in departed(self.workers, live):
            self.ledger.forget_instance(gone)
            log.info("worker_gone", instance_id=gone)
        for new in live.keys() - self.workers.keys():
            log.info("worker_seen", instance_id=new, model=live[new].model)
        self.workers = live

    async def _on_done(self, event: RequestDoneEvent) -> None:
        self.ledger.remove(event.request_id)

    async def route(self, request: RouteRequest) -> RouteReply:
        models = set(self.cluster.candidates(request.model))
        if not models:
            return RouteReply(
                request_id=request.request_id, error=f"unknown model {request.model!r}"
            )
        infos = [w for w in self.workers.values() if w.model in models and not w.is_draining]
        if not infos:
            return RouteReply(
                request_id=request.request_id,
                error=f"no live worker serves model {request.model!r}",
            )
        views = await self._views(infos)
        policy = self._preset_policies.get(request.model, self._default_policy)
        chosen = policy.choose(request, views)
        self.ledger.add(
            LedgerEntry(
                request.request_id,
                chosen.instance_id,
                request.num_prompt_tokens,
                request.max_tokens,
                time.monotonic(),
            )
        )
        self.num_decisions += 1
        return RouteReply(
            request_id=request.request_id,
            instance_id=chosen.instance_id,
            model=chosen.info.model,
            inbox=chosen.info.inbox,
        )

    async def _views(self, infos: list[WorkerInfo]) -> list[InstanceView]:
        blobs = await self.store.read_snapshots([w.instance_id for w in infos])
        now = time.time()
        views: list[InstanceView] = []
        for info in infos:
            blob = blobs.get(info.instance_id)
            snapshot = None
            if blob is not None and not blob.is_stale(self.settings.snapshot_max_age_s, now):
                snapshot = _SNAPSHOT_DECODER.decode(blob.data)
                visible = {
                    r.request_id
                    for group in (snapshot.running, snapshot.waiting, snapshot.pending)
                    for r in group
                }
                self.ledger.reconcile(info.instance_id, visible)
            views.append(InstanceView(info, snapshot, self.ledger.pending(info.instance_id)))
        return views
