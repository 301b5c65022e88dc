"""The worker's snapshot writer: its engine's workload and batch samples, to Redis, in
the background of the step loop.

One write runs at a time, at most one per `snapshot_interval_s` when the request set
changed since the last write (a request arrived, finished, or moved between running,
pending and waiting: `request_set`), else at most one per
`snapshot_progress_interval_s` (the same requests, further along: the estimator
replays a snapshot forward by its age, so such a snapshot ages without misleading
it). Steps that end while it runs or waits are folded into the next write, which
takes the newest snapshot and every sample since: when steps outpace the interval (a
fast model), fewer and fuller writes instead of a queue of stale ones, and no
encoding of snapshots nobody reads. Each write costs the worker's core ~0.1 ms (the
encoding, the Redis command, two syscalls): after every 1.5 ms decode step of
random-tiny that is ~5% of the gateway path's token rate; with a write every 5 ms
still ~2.5%, while the estimator reads snapshots every 20 ms.

Every snapshot carries the estimator's batch-time calibration of this instance (read
with the heartbeat, `read_calibration`) and how fast the latest iterations ran
against it (`RecentSpeed`), so a replay prices the next steps at that speed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from shared.logging import RetryLog, get_logger
from shared.messages import encode
from shared.messages.worker import CALIBRATION_DECODER, BatchTimeCalibration
from shared.scheduling.batch_time import BatchTimeModel
from shared.scheduling.snapshot import BatchSample, WorkloadSnapshot, with_calibration
from shared.scheduling.speed import RecentSpeed
from shared.store import Store

if TYPE_CHECKING:
    from services.worker.config import WorkerServiceConfig
    from services.worker.engine.protocol import Engine

log = get_logger(component="worker")


def request_set(snapshot: WorkloadSnapshot) -> tuple[int, int, list[str]]:
    """What a snapshot says of who is where (running, pending, waiting by id): a snapshot
    that differs from the last written one in this is written sooner than one that
    only shows progress."""
    return snapshot.num_running, snapshot.num_pending, snapshot.request_ids


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class SnapshotWriter:
    """Writes one engine's snapshots and batch samples; `record()` after each step."""

    def __init__(
        self,
        cfg: WorkerServiceConfig,
        engine: Engine,
        store: Store,
        num_steps: Callable[[], int],
    ) -> None:
        self.cfg = cfg
        self._engine = engine
        self._store = store
        self._num_steps = num_steps  # the snapshot's version
        self._failures = RetryLog(log, "snapshot_write_failed")  # Redis outages
        self._task: asyncio.Task[None] | None = None
        self._is_pending = False  # a step ended since the writer took its snapshot
        # ... and changed the request set since the last write: written within
        # snapshot_interval_s, not snapshot_progress_interval_s
        self._is_changed = False
        # a writer waiting out the progress interval waits on this: a change resolves it
        # early, a timer at the interval's end otherwise (a future and a timer handle:
        # no task cancelled every 20 ms, as asyncio.timeout would)
        self._wake: asyncio.Future[None] | None = None
        self._written: tuple[int, int, list[str]] | None = None  # (`request_set`)
        self.last_write_s = float("-inf")  # monotonic time the writer last took one
        # not yet written (at most max_batch_samples: Redis keeps no more, so a stalled
        # write drops the oldest)
        self._unsent_samples: list[BatchSample] = []
        self._is_closing = False
        # The estimator's fitted batch-time model of this instance, and it as a model.
        self.calibration: BatchTimeCalibration | None = None
        self._calibrated: BatchTimeModel | None = None
        alpha = cfg.batch_time_speed_alpha
        self._speed = RecentSpeed(alpha=alpha) if alpha > 0 else None

    def record(self, *, samples: bool) -> None:
        """Have the snapshot (and, with `samples`, the steps' new batch samples) written
        in the background."""
        if samples:  # (the speed observes them when they are written: fewer calls)
            self._unsent_samples.extend(self._engine.pop_batch_samples())
            del self._unsent_samples[: -self.cfg.max_batch_samples]
        if not self._is_changed and request_set(self._engine.snapshot()) != self._written:
            self._is_changed = True
            _wake(self._wake)
        self._is_pending = True
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._write())

    async def close(self) -> None:
        """Write the last state now (a writer waiting out an interval stops waiting)."""
        self._is_closing = True
        if self._task is not None:
            _wake(self._wake)
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def read_calibration(self) -> None:
        """Take the estimator's latest calibration of this instance, if it changed."""
        iid = self.cfg.instance_id
        blob = (await self._store.read_calibrations([iid]))[iid]
        if blob is None:
            return
        cal = CALIBRATION_DECODER.decode(blob)
        if cal != self.calibration:
            log.info(
                "calibration_applied",
                feature_set=cal.feature_set,
                mape=round(cal.mape, 4),
                num_samples=cal.num_samples,
            )
            try:
                self._calibrated = BatchTimeModel(cal.feature_set, tuple(cal.coefs))
            except ValueError as exc:  # a feature set this worker does not know: speed 1
                log.warning("calibration_unusable", error=str(exc))
                self._calibrated = None
            if self._speed is not None and self._calibrated is not None:
                # the kept iterations priced with the new model now, not at the next step
                self._speed.observe(self._calibrated, [])
        self.calibration = cal

    async def _write(self) -> None:
        cfg = self.cfg
        while self._is_pending:
            # 1. Wait out the interval (steps ending meanwhile join this write); while
            #    only progress changed, the longer one, cut short by a change.
            interval_s = cfg.snapshot_interval_s
            if not self._is_changed and interval_s > 0:  # (0: after every iteration)
                interval_s = max(interval_s, cfg.snapshot_progress_interval_s)
            wait_s = self.last_write_s + interval_s - time.monotonic()
            if wait_s > 0 and not self._is_closing:
                if self._is_changed:
                    await asyncio.sleep(wait_s)
                else:
                    loop = asyncio.get_running_loop()
                    self._wake = wake = loop.create_future()
                    timer = loop.call_later(wait_s, _wake, wake)
                    try:
                        await wake
                    finally:
                        timer.cancel()
                        self._wake = None
                continue  # (a change came: its shorter interval may be over already)
            # 2. Write the newest state.
            self.last_write_s = time.monotonic()
            self._is_pending = False
            snapshot = self._engine.snapshot()
            self._written, self._is_changed = request_set(snapshot), False
            samples, self._unsent_samples = self._unsent_samples, []
            try:
                await self._store.write_snapshot(
                    cfg.instance_id,
                    self._num_steps(),
                    encode(self._calibrated_snapshot(snapshot, samples)),
                    ttl_s=cfg.snapshot_ttl_s,
                    samples=[msgspec.msgpack.encode(s) for s in samples],
                    max_samples=cfg.max_batch_samples,
                )
            except Exception as exc:  # Redis hiccup: the next iteration writes again
                self._failures.failed(error=str(exc))
            else:
                self._failures.ok()

    def _calibrated_snapshot(
        self, snapshot: WorkloadSnapshot, samples: list[BatchSample]
    ) -> WorkloadSnapshot:
        """The snapshot with the calibration it is read under and the recent speed."""
        if self._speed is not None and self._calibrated is not None:
            self._speed.observe(self._calibrated, samples)
        cal = self.calibration
        if cal is None:
            return snapshot
        speed = (
            1.0
            if self._speed is None or self._calibrated is None
            else self._speed.factor(time.time())
        )
        return with_calibration(snapshot, cal.feature_set, cal.coefs, speed)
