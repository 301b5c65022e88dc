"""The gateway's view of the workers: who is live (the registry), how loaded each is
(its latest snapshot, plus what this gateway sent there that no snapshot shows yet),
and the per-instance gauges that view feeds.

`refresh()` runs every `registry_refresh_s`; it also renews this gateway's own
liveness key, which workers read to abort a dead gateway's requests.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from shared.logging import RetryLog, get_logger
from shared.messages.registry import RegistryEpoch, WorkerInfo, departed
from shared.messages.worker import CALIBRATION_DECODER
from shared.scheduling.unshown import UnshownRequests
from shared.snapshot_decoder import SnapshotDecoder
from shared.store import Store

if TYPE_CHECKING:
    from services.gateway.links import WorkerLinks
    from services.gateway.metrics import GatewayMetrics
    from services.gateway.streams import StreamManager
    from shared.config import ClusterConfig, GatewayConfig

log = get_logger(component="gateway")


class WorkerDirectory:
    """Live workers by instance id, their load, and the links the gateway keeps to them."""

    def __init__(
        self,
        cluster: ClusterConfig,
        settings: GatewayConfig,
        store: Store,
        streams: StreamManager,
        metrics: GatewayMetrics,
        links: WorkerLinks,
        owner_token: str,
    ) -> None:
        self.cluster = cluster
        self._store = store
        self._streams = streams
        self._metrics = metrics
        self.links = links
        self.owner_token = owner_token
        self.workers: dict[str, WorkerInfo] = {}  # live instances, refreshed from Redis
        self._registry_epoch = RegistryEpoch(cluster.worker.heartbeat_ttl_s)
        self._fitted: dict[str, str] = {}  # instance -> feature set of its MAPE gauge
        self.snapshots = SnapshotDecoder(log)
        # Requests in each instance's latest snapshot, and those this gateway sent there
        # that no snapshot shows yet: the load the gateway's own routing reads.
        self._snapshot_load: dict[str, int] = {}
        self.unshown = UnshownRequests()
        # Renewed every refresh: live for at least three of them.
        self._liveness_ttl_s = max(cluster.worker.heartbeat_ttl_s, 3 * settings.registry_refresh_s)
        self._liveness_failures = RetryLog(log, "gateway_register_failed")

    def serving(self, model: str) -> list[WorkerInfo]:
        """Live, non-draining instances that can serve `model` (a real model or a preset)."""
        candidates = set(self.cluster.candidates(model))
        return [w for w in self.routable() if w.model in candidates]

    def routable(self) -> list[WorkerInfo]:
        """Live instances requests may go to: registered, not draining, and not known
        gone before the registry says so (a link that died and whose port refuses)."""
        gone = self.links.unreachable
        return [w for w in self.workers.values() if not w.is_draining and w.instance_id not in gone]

    def load(self, instance_id: str) -> int:
        """Requests at an instance as this gateway sees them."""
        return self._snapshot_load.get(instance_id, 0) + self.unshown.count(instance_id)

    async def refresh(self) -> None:
        """Read the registry, the snapshots and the calibrations; fail the streams of
        workers that went away."""
        # This gateway lives: workers keep its requests (they abort a dead gateway's).
        # On its own: a failed write must not stop the registry read.
        await self._liveness_failures.attempt(
            lambda: self._store.register_gateway(self.owner_token, ttl_s=self._liveness_ttl_s)
        )
        live = await self._store.read_live_workers(self.workers, self._registry_epoch)
        for gone in departed(self.workers, live):
            num = self._streams.fail_instance(
                gone, f"worker {gone} went away while serving the request"
            )
            log.warning("worker_gone", instance_id=gone, num_failed=num)
            self._drop_request_gauges(gone)
            fitted = self._fitted.pop(gone, None)
            if fitted is not None:
                with contextlib.suppress(KeyError):
                    self._metrics.batch_time_fit_mape.remove(gone, fitted)
        self.workers = live
        self.links.sync(live)
        self.snapshots.keep_only(live)
        self._metrics.live_workers.set(sum(not w.is_draining for w in live.values()))
        self._metrics.worker_links.set(self.links.num_up)
        snapshots = self.snapshots.decode(await self._store.read_snapshots(list(live)))
        self._snapshot_load = {iid: snap.num_requests for iid, snap in snapshots.items()}
        self.unshown.refresh(live, snapshots)  # (finish() drops the ended ones)
        requests = self._metrics.instance_requests
        for iid, snap in snapshots.items():
            requests.labels(iid, "running").set(snap.num_running)
            requests.labels(iid, "waiting").set(snap.num_waiting)
            # parked while a peer writes (token routing): they hold KV and request slots
            requests.labels(iid, "pending").set(snap.num_pending)
        for iid in self.snapshots.undecodable:  # no figures rather than stale ones
            self._drop_request_gauges(iid)
        await self._read_calibrations(list(live))

    async def _read_calibrations(self, instance_ids: list[str]) -> None:
        for iid, blob in (await self._store.read_calibrations(instance_ids)).items():
            if blob is None:
                continue
            cal = CALIBRATION_DECODER.decode(blob)
            old = self._fitted.get(iid)
            if old is not None and old != cal.feature_set:
                with contextlib.suppress(KeyError):
                    self._metrics.batch_time_fit_mape.remove(iid, old)
            self._fitted[iid] = cal.feature_set
            self._metrics.batch_time_fit_mape.labels(iid, cal.feature_set).set(cal.mape)

    def _drop_request_gauges(self, instance_id: str) -> None:
        for state in ("running", "waiting", "pending"):
            with contextlib.suppress(KeyError):
                self._metrics.instance_requests.remove(instance_id, state)
