"""When a RouteBalance batch fires: at its size, at its timeout, at once when idle; and
no request waits past its batch's timeout (plus the decision before it)."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.estimator.routebalance.batch_queue import BatchLimits, BatchQueue, adaptive_limits

SLACK_S = 0.5  # scheduling noise on a loaded machine: far below what a missed bound costs


def queue(limits: BatchLimits, idle: bool = False) -> BatchQueue[int]:
    return BatchQueue(lambda: limits, lambda: idle, asyncio.get_running_loop().time)


async def test_a_full_batch_fires_without_waiting_for_its_timeout() -> None:
    q = queue(BatchLimits(4, 60.0))
    for i in range(6):
        q.put(i)
    assert await asyncio.wait_for(q.next_batch(), 5) == [0, 1, 2, 3]
    assert len(q) == 2


async def test_a_batch_fires_at_its_timeout_with_what_came_meanwhile() -> None:
    q = queue(BatchLimits(8, 0.2))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    q.put(1)
    loop.call_later(0.05, q.put, 2)
    assert await q.next_batch() == [1, 2]
    assert loop.time() - t0 >= 0.2


async def test_an_idle_cluster_fires_at_once() -> None:
    q = queue(BatchLimits(8, 60.0), idle=True)
    q.put(7)
    assert await asyncio.wait_for(q.next_batch(), 5) == [7]


async def test_no_request_waits_past_its_timeout_plus_the_decision() -> None:
    limits, decision_s = BatchLimits(4, 0.05), 0.02
    q: BatchQueue[float] = queue(limits)  # type: ignore[assignment]
    loop = asyncio.get_running_loop()
    rng = random.Random(3)
    waits: list[float] = []

    async def produce() -> None:
        for _ in range(60):
            q.put(loop.time())
            await asyncio.sleep(rng.expovariate(100.0))

    async def consume() -> None:
        while len(waits) < 60:
            batch = await q.next_batch()
            now = loop.time()
            waits.extend(now - t for t in batch)
            await asyncio.sleep(decision_s)  # the decision, before the next batch

    await asyncio.wait_for(asyncio.gather(produce(), consume()), 30)
    assert max(waits) <= limits.timeout_s + decision_s + SLACK_S
    assert len(waits) == 60


@pytest.mark.parametrize(
    ("busy", "size", "timeout_s"), [(0.0, 4, 0.05), (0.29, 4, 0.05), (0.5, 16, 0.1), (1.0, 32, 0.2)]
)
def test_the_limits_grow_with_the_busy_share(busy: float, size: int, timeout_s: float) -> None:
    assert adaptive_limits(busy) == BatchLimits(size, timeout_s)


def test_limits_without_room_are_refused() -> None:
    with pytest.raises(ValueError):
        BatchLimits(0, 0.1)
