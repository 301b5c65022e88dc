"""The worker writes its snapshot at most once per `snapshot_interval_ms`, and the
newest state always: steps that end between writes are folded into the next one.

A real worker on real NATS and Redis; its store's writes are counted on the way."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from typing import Any

import msgspec

from services.worker.service import WorkerService
from shared.scheduling.snapshot import WorkloadSnapshot
from tests.services.worker.test_inline_step import running_worker

NUM_TOKENS = 48


def count_writes(worker: WorkerService) -> list[float]:
    """The monotonic time of each snapshot write the worker starts from now on: the time
    its writer took it (a clock read here, after the snapshot was built, would also
    count how long the build was preempted)."""
    times: list[float] = []
    store = worker.store
    write = store.write_snapshot

    async def counted(*args: Any, **kwargs: Any) -> None:
        times.append(worker.writer.last_write_s)
        await write(*args, **kwargs)

    store.write_snapshot = counted  # type: ignore[method-assign]
    return times


async def stored_snapshot(worker: WorkerService) -> tuple[int, WorkloadSnapshot]:
    blob = (await worker.store.read_snapshots([worker.cfg.instance_id]))[worker.cfg.instance_id]
    assert blob is not None
    return blob.version, msgspec.msgpack.decode(blob.data, type=WorkloadSnapshot)


async def test_writes_keep_the_interval_and_the_last_state_is_written(
    nats_url: str, redis_url: str
) -> None:
    interval_s = 0.1
    async with running_worker(nats_url, redis_url, 16, 3.6e6, snapshot_interval_s=interval_s) as (
        worker,
        _,
        client,
    ):
        writes = count_writes(worker)
        t0 = time.monotonic()
        await client.generate(worker, 8, NUM_TOKENS)
        elapsed = time.monotonic() - t0
        # the state after the last step lands within an interval (and a write's time)
        await asyncio.sleep(interval_s + 0.5)
        version, snapshot = await stored_snapshot(worker)
        assert version == worker.num_steps >= NUM_TOKENS
        assert snapshot.request_ids == []  # the finished request is gone
        gaps = [b - a for a, b in itertools.pairwise(writes)]
        assert all(g >= interval_s * 0.99 for g in gaps), gaps
        assert len(writes) <= math.ceil((elapsed + interval_s + 0.5) / interval_s) + 1


async def test_interval_zero_writes_after_steps_without_waiting(
    nats_url: str, redis_url: str
) -> None:
    async with running_worker(nats_url, redis_url, 16, 3.6e6, snapshot_interval_s=0.0) as (
        worker,
        _,
        client,
    ):
        writes = count_writes(worker)
        await client.generate(worker, 8, NUM_TOKENS)
        await asyncio.sleep(0.3)
        version, snapshot = await stored_snapshot(worker)
        assert version == worker.num_steps and snapshot.request_ids == []
        # one write in flight at a time, none held back: more than an interval's worth
        assert len(writes) >= 2


async def test_progress_alone_waits_the_longer_interval_a_change_does_not(
    nats_url: str, redis_url: str
) -> None:
    """While one request decodes, its snapshots (progress only) are written at most every
    snapshot_progress_interval_s; its arrival and its end (changes of the request set)
    are written within snapshot_interval_s."""
    progress_s = 1.0  # (its bounds below are 0.6 of it: room for a slow machine)
    async with running_worker(
        nats_url,
        redis_url,
        16,
        3.6e6,
        snapshot_interval_s=0.005,
        snapshot_progress_interval_s=progress_s,
    ) as (worker, _, client):
        await asyncio.sleep(progress_s)  # the start-up write's interval is over
        writes = count_writes(worker)
        t0 = time.monotonic()
        await client.generate(worker, 8, 240)  # ~0.3-1 s of decode steps
        t_end = time.monotonic()
        for _ in range(100):  # the end is a change: written well within progress_s
            _, snapshot = await stored_snapshot(worker)
            if snapshot.request_ids == []:
                break
            await asyncio.sleep(0.01)
        seen_empty_after_s = time.monotonic() - t_end
        assert snapshot.request_ids == []
        assert seen_empty_after_s < progress_s * 0.6, seen_empty_after_s
        # the arrival's write (a change), then progress at most every progress_s, then
        # the end's: no write per 5 ms of decode
        elapsed = time.monotonic() - t0
        assert len(writes) <= 2 + math.ceil(elapsed / progress_s), (writes, elapsed)
        assert writes[0] - t0 < progress_s * 0.6  # the arrival was not held back
