"""The worker's snapshots report how fast its iterations run against the calibration
the estimator published (WorkloadSnapshot.batch_time_speed, shared/scheduling/speed.py).

A real worker (random-tiny) on real NATS and Redis; calibrations are written to Redis
by hand, as the estimator writes them, so the expected factor is known: a model that
prices every iteration far too short must read as slow (factor up to 2), one that
prices them far too long as fast (down to 1/2), and one near the truth as the same
EWMA a RecentSpeed computes over the samples the worker wrote.
"""

from __future__ import annotations

import asyncio
import statistics

import msgspec
import pytest

from shared.messages import encode
from shared.messages.worker import BatchTimeCalibration
from shared.scheduling.batch_time import SIX_TERM, BatchTimeModel
from shared.scheduling.snapshot import BatchSample, WorkloadSnapshot
from shared.scheduling.speed import RecentSpeed
from tests.services.worker.test_inline_step import running_worker


def calibration(b0_s: float) -> BatchTimeCalibration:
    """A six-term model that prices every iteration at b0_s."""
    return BatchTimeCalibration(
        feature_set=SIX_TERM,
        coefs=[b0_s, 0.0, 0.0, 0.0, 0.0, 0.0],
        mape=0.0,
        mape_all=0.0,
        num_samples=100,
        fitted_at_s=0.0,
    )


async def speed_after_requests(worker: object, client: object, b0_s: float) -> WorkloadSnapshot:
    store = worker.store
    iid = worker.cfg.instance_id  # type: ignore[attr-defined]
    await store.write_calibration(iid, encode(calibration(b0_s)), ttl_s=60.0)
    await worker.writer.read_calibration()  # what the heartbeat does
    for _ in range(4):  # 16 iterations, more than RecentSpeed's 8 to warm up
        await client.generate(worker, 8)  # type: ignore[attr-defined]
    for _ in range(100):
        blob = (await store.read_snapshots([iid]))[iid]
        assert blob is not None
        snap = msgspec.msgpack.decode(blob.data, type=WorkloadSnapshot)
        if snap.batch_time_coefs == calibration(b0_s).coefs and snap.batch_time_speed != 1.0:
            return snap
        await asyncio.sleep(0.02)
    raise AssertionError("no snapshot with the calibration and a measured speed")


async def test_snapshots_carry_the_speed_against_the_calibration(
    nats_url: str, redis_url: str
) -> None:
    async with running_worker(nats_url, redis_url, 16, 3.6e6) as (worker, _, client):
        slow = await speed_after_requests(worker, client, 1e-7)  # every step far over it
        assert slow.batch_time_speed == pytest.approx(2.0, rel=0.03)  # at the clamp
        fast = await speed_after_requests(worker, client, 10.0)  # every step far under it
        assert fast.batch_time_speed == pytest.approx(0.5, rel=0.03)
        # Near the truth: the same EWMA over the iterations the worker recorded.
        raw = await worker.store.read_samples(worker.cfg.instance_id, 64)
        samples = [msgspec.msgpack.decode(b, type=BatchSample) for b in raw]
        typical = statistics.median(s.duration_s for s in samples)
        snap = await speed_after_requests(worker, client, typical)
        raw = await worker.store.read_samples(worker.cfg.instance_id, 64)
        samples = [msgspec.msgpack.decode(b, type=BatchSample) for b in raw]
        model = BatchTimeModel(SIX_TERM, (typical, 0.0, 0.0, 0.0, 0.0, 0.0))
        seen = [s for s in samples if s.wall_time_s < snap.wall_time_s]
        expected = RecentSpeed()
        expected.observe(model, seen[-32:])  # what the worker kept when it re-priced
        # (the worker also faded it by the ms between its last step and the write)
        assert 0.5 < snap.batch_time_speed < 2.0
        assert snap.batch_time_speed == pytest.approx(expected.factor(), rel=0.05)
