"""The worker's token-routing I/O: PeerReqs in and out through the relay, the batcher's
B* tables in, RoutingStats out. The books themselves live in runtime.py.

Messages arrive on NATS callbacks and are only queued here; the worker loop applies
them between steps (`apply`), so the engine is never touched while it steps.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING, cast

import msgspec

from services.worker.routing.runtime import TokenRouting
from services.worker.routing.tracked import Outbox, PeerError
from shared import keys, subjects
from shared.bus import Bus
from shared.logging import get_logger
from shared.messages.batcher import BATCH_TABLES_DECODER, BatchTables, RoutingStats
from shared.messages.peer import (
    PEER_MESSAGE_DECODER,
    RELAY_STARTED_DECODER,
    PeerMessage,
    PeerRelease,
    RelayStarted,
)
from shared.store import Store

if TYPE_CHECKING:
    from services.worker.engine.protocol import RoutableEngine

log = get_logger(component="worker-routing")
# Releases sent this recently are sent again when a relay (re)starts: one sent while no
# relay listened is lost (NATS keeps nothing for a subject nobody subscribes), and its
# copies on the peers would hold their KV and slots for `guest_idle_s`. The launcher
# restarts a relay within its backoff (at most 30 s).
RELEASE_RESEND_S = 60.0


class RoutingLink:
    def __init__(
        self,
        books: TokenRouting,
        bus: Bus,
        store: Store,
        namespace: str,
        wakeup: asyncio.Event,
        stats_interval_s: float,
    ) -> None:
        self.books = books
        self._bus, self._store, self._ns = bus, store, namespace
        self._wakeup = wakeup
        self._inbox: deque[PeerMessage] = deque()
        self._relay = subjects.relay_inbox(namespace)
        self._stats_interval_s = stats_interval_s
        self._last_stats_s = time.monotonic()
        # When (monotonic) a relay's start notice came, until the worker asked about the
        # requests it had away by then (RoutingDriver._check_relay_silence); None: none.
        self.relay_started_at_s: float | None = None
        self._recent_releases: deque[tuple[float, PeerRelease]] = deque()  # (sent at, it)

    @property
    def has_messages(self) -> bool:
        return bool(self._inbox)

    async def start(self) -> None:
        """Subscribe to this worker's peer subject and the tables; load the latest tables."""
        peer_subject = subjects.worker_peer(self._ns, self.books.instance_id)
        await self._bus.subscribe(peer_subject, PEER_MESSAGE_DECODER, self._on_peer)
        await self._bus.subscribe(
            subjects.batcher_tables(self._ns), BATCH_TABLES_DECODER, self._on_tables
        )
        await self._bus.subscribe(
            subjects.relay_started(self._ns), RELAY_STARTED_DECODER, self._on_relay_started
        )
        for preset in self.books.policies:
            blob = await self._store.redis.get(keys.batch_tables(self._ns, preset))
            if blob is not None:
                await self._on_tables(BATCH_TABLES_DECODER.decode(cast(bytes, blob)))

    async def _on_peer(self, msg: PeerMessage) -> None:
        self._inbox.append(msg)
        self._wakeup.set()

    async def _on_relay_started(self, msg: RelayStarted) -> None:
        log.info("relay_started", started_at_s=msg.started_at_s)
        self.relay_started_at_s = time.monotonic()
        self._wakeup.set()
        # The releases of the last RELEASE_RESEND_S, again: the new relay sends those it
        # holds no route for to every instance of their preset's models (a peer drops
        # a release of a copy it does not hold).
        self._prune_releases(time.monotonic())
        for _, release in list(self._recent_releases):
            await self._bus.publish(self._relay, release)

    def _prune_releases(self, now_s: float) -> None:
        recent = self._recent_releases
        while recent and now_s - recent[0][0] > RELEASE_RESEND_S:
            recent.popleft()

    async def _on_tables(self, tables: BatchTables) -> None:
        if tables.preset not in self.books.policies:
            return
        current = self.books.tables.get(tables.preset)
        if current is None or tables.version > current.version:
            self.books.tables[tables.preset] = tables
            self._wakeup.set()

    def apply(self, engine: RoutableEngine, outbox: Outbox) -> None:
        """Apply every queued peer message (loop thread, between steps)."""
        while self._inbox:
            msg = self._inbox.popleft()
            if isinstance(msg, PeerRelease):
                self.books.on_release(msg, engine)
                continue
            try:
                self.books.on_peer(msg, engine, outbox)
            except (PeerError, ValueError) as exc:
                # Cannot continue here: give the request back to its origin.
                log.warning("peer_rejected", request_id=msg.request_id, error=str(exc))
                if msg.origin_instance != self.books.instance_id:
                    outbox.peer.append(
                        msgspec.structs.replace(
                            msg,
                            sender_instance=self.books.instance_id,
                            from_model=msg.to_model,
                            to_model=0,
                            suffix=[],
                            seq_no=msg.seq_no + 1,
                            failed=f"{self.books.model} rejected the hand-off: {exc}",
                        )
                    )

    async def publish(self, outbox: Outbox) -> None:
        now = time.monotonic()
        for msg in outbox.peer:
            await self._bus.publish(self._relay, msg)
            if isinstance(msg, PeerRelease):
                self._recent_releases.append((now, msg))
        if outbox.peer:
            self._prune_releases(now)
        outbox.peer.clear()

    async def maybe_send_stats(self) -> None:
        """Send one RoutingStats per preset every stats interval."""
        now = time.monotonic()
        window = now - self._last_stats_s
        if window < self._stats_interval_s:
            return
        self._last_stats_s = now
        for preset, policy in self.books.policies.items():
            counters = self.books.pop_counters(preset)
            if self.books.presets[preset].mode != "baton":
                continue  # the batcher computes tables for `baton` mode only
            if not counters.num_tokens and not counters.step_seconds:
                continue
            stats = RoutingStats(
                instance_id=self.books.instance_id,
                preset=preset,
                models=list(policy.models),
                model_index=policy.model_index,
                window_s=window,
                num_tokens=counters.num_tokens,
                num_handoffs=counters.num_handoffs,
                num_taken_back=counters.num_taken_back,
                step_batch_sizes=counters.step_batch_sizes,
                step_seconds=counters.step_seconds,
                num_active=self.books.num_active(preset),
            )
            await self._bus.publish(subjects.batcher_stats(self._ns), stats)
