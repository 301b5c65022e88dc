"""The worker's registry entry: registration, the heartbeat that renews it, and the
drain flag routers read from it.

Each heartbeat renews the entry, reads the estimator's batch-time calibration for
the snapshot writer, and checks that the gateways owning this worker's requests are
still registered (orphans.py): requests of one gone past the grace are aborted
through the inbox.
"""

from __future__ import annotations

import asyncio
import time

from services.worker.answers import Answers
from services.worker.config import WorkerServiceConfig
from services.worker.inbox import Inbox
from services.worker.links import GatewayLinks
from services.worker.orphans import OrphanWatch
from services.worker.snapshot_writer import SnapshotWriter
from shared.logging import RetryLog, get_logger
from shared.messages.registry import WorkerInfo
from shared.store import Store

log = get_logger(component="worker")
# heartbeat TTLs a request's owning gateway may stay unregistered before its requests
# are aborted (`check_owners`, orphans.py)
ORPHAN_GRACE_TTLS = 2.0


class Registration:
    """This worker in the store's registry, kept alive by `heartbeat` until `close`."""

    def __init__(self, cfg: WorkerServiceConfig, store: Store, inbox_subject: str) -> None:
        self.cfg = cfg
        self.store = store
        self.inbox_subject = inbox_subject
        self.started_at_s = time.time()
        self.is_draining = False
        self.links: GatewayLinks | None = None  # set when the worker listens for links
        self.orphans = OrphanWatch(ORPHAN_GRACE_TTLS * cfg.heartbeat_ttl_s)
        self._closing = False

    def info(self) -> WorkerInfo:
        """This worker's registry entry as it stands now."""
        links = self.links
        return WorkerInfo(
            instance_id=self.cfg.instance_id,
            model=self.cfg.model,
            inbox=self.inbox_subject,
            max_model_len=self.cfg.instance.scheduler.max_model_len,
            max_num_seqs=self.cfg.instance.scheduler.max_num_seqs,
            started_at_s=self.started_at_s,
            heartbeat_at_s=time.time(),
            is_draining=self.is_draining,
            link_addr="" if links is None else links.addr,
            link_unix_name="" if links is None else links.unix_name,
        )

    async def register(self) -> None:
        await self.store.register(self.info(), ttl_s=self.cfg.heartbeat_ttl_s)

    async def begin_drain(self, num_in_flight: int) -> float:
        """Stop accepting: re-register as draining so routers skip this instance now.
        Returns the monotonic deadline of the drain."""
        self.is_draining = True
        log.info("drain_started", num_in_flight=num_in_flight, timeout_s=self.cfg.drain_timeout_s)
        try:
            await asyncio.wait_for(self.register(), 2.0)
        except Exception as exc:  # routers still notice when the registration expires
            log.warning("drain_register_failed", error=repr(exc))
        return time.monotonic() + self.cfg.drain_timeout_s

    def stop_beating(self) -> None:
        """End the heartbeat at its next wake-up."""
        self._closing = True

    async def deregister(self) -> None:
        """Leave the registry (bounded; a failure only means the entry expires)."""
        if not self.store.is_connected:
            return
        try:
            await asyncio.wait_for(self.store.deregister(self.cfg.instance_id), 2.0)
        except Exception as exc:
            log.warning("deregister_failed", error=str(exc))

    async def heartbeat(self, writer: SnapshotWriter, answers: Answers, inbox: Inbox) -> None:
        """Renew the entry every heartbeat interval until `stop_beating`."""
        # The loop also ends on `_closing`: redis-py can swallow a cancellation that
        # lands inside a command, and the task would then sleep on for ever.
        failures = RetryLog(log, "heartbeat_failed")
        orphan_failures = RetryLog(log, "owner_check_failed")
        while not self._closing:
            await asyncio.sleep(self.cfg.heartbeat_interval_s)
            if self._closing:
                return
            await failures.attempt(lambda: self._renew(writer))
            # on its own: a calibration that keeps failing must not stop it
            await orphan_failures.attempt(lambda: self.check_owners(answers, inbox))

    async def _renew(self, writer: SnapshotWriter) -> None:
        await self.register()
        await writer.read_calibration()

    async def check_owners(self, answers: Answers, inbox: Inbox) -> None:
        """Abort the requests whose owning gateway is gone (orphans.py), through the
        inbox as a client's abort. The owners are copied before the read: requests
        admitted while it is awaited wait for the next check."""
        owned = {rid: o.gateway for rid, o in answers.owners.items() if o.gateway}
        gids = set(owned.values())
        try:
            alive = await self.store.live_gateways(gids) if gids else set()
        except Exception:
            self.orphans.forget()
            raise
        for gid, orphans in self.orphans.judge(owned, alive, time.monotonic()).items():
            log.warning("owner_gone", gateway_id=gid, num_aborted=len(orphans))
            inbox.abort(orphans)
