"""The batcher service on real NATS and Redis: stats in, tables out."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import msgspec
import pytest
import pytest_asyncio

from services.batcher.dtmc import (
    AffineLatency,
    ModelPair,
    best_b,
    is_deadlock_free,
    predicted_throughput,
)
from services.batcher.service import BatcherService
from shared import keys, subjects
from shared.bus import Bus
from shared.config import ClusterConfig, ConfigError, parse_cluster
from shared.messages.batcher import BATCH_TABLES_DECODER, BatchTables, RoutingStats
from tests.services.batcher.builders import duo_stats
from tests.support.clusters import preset

MAX_N = 6
SMALL = AffineLatency(0.010, 0.001)  # s, the workers' "measured" steps below
LARGE = AffineLatency(0.050, 0.0005)
DUO = ["small", "large"]


def cluster(nats_url: str, redis_url: str, namespace: str) -> ClusterConfig:
    return parse_cluster(
        f"""
namespace = "{namespace}"
nats_url = "{nats_url}"
redis_url = "{redis_url}"
[batcher]
publish_interval_s = 0.1
max_n = {MAX_N}
min_tokens = 1000
min_handoffs = 50
min_step_samples = 40
hold_timeout_ms = 15.0
[models.small]
[models.large]
{preset("duo", DUO, token_policy="r2r")}
{preset("duo-eager", DUO, token_policy="r2r", mode="eager_async")}
""",
        environ={},
    )


def report(model_index: int, tokens: int, handoffs: int, latency: AffineLatency) -> RoutingStats:
    steps = [(b, latency(b)) for b in (1 + i % MAX_N for i in range(60))]
    return duo_stats(model_index, tokens, handoffs, steps, num_active=4)


class Tables:
    """Every BatchTables seen on the bus, with a way to wait for one that matches."""

    def __init__(self) -> None:
        self.seen: list[BatchTables] = []
        self._new = asyncio.Event()

    async def on(self, tables: BatchTables) -> None:
        self.seen.append(tables)
        self._new.set()

    async def wait_for(self, pred, timeout_s: float = 30.0) -> BatchTables:  # type: ignore[no-untyped-def]
        async def loop() -> BatchTables:
            while True:
                for t in self.seen:
                    if pred(t):
                        return t
                self._new.clear()
                await self._new.wait()

        return await asyncio.wait_for(loop(), timeout_s)


@pytest_asyncio.fixture
async def stack(nats_url: str, redis_url: str) -> AsyncIterator[tuple[ClusterConfig, Bus, Tables]]:
    cfg = cluster(nats_url, redis_url, f"b{uuid.uuid4().hex[:8]}")
    bus = Bus(nats_url, "test")
    await bus.connect()
    tables = Tables()
    await bus.subscribe(subjects.batcher_tables(cfg.namespace), BATCH_TABLES_DECODER, tables.on)
    yield cfg, bus, tables
    await bus.close()


async def run_service(cfg: ClusterConfig) -> tuple[BatcherService, asyncio.Task[None]]:
    service = BatcherService(cfg)
    task = asyncio.create_task(service.run())
    while not service.bus.is_connected or not service.store.is_connected:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # subscription flushed in start()
    return service, task


async def stop(service: BatcherService, task: asyncio.Task[None]) -> None:
    service.request_stop()
    await asyncio.wait_for(task, 10)


async def test_all_ones_first_then_the_chain_table(stack) -> None:  # type: ignore[no-untyped-def]
    cfg, bus, tables = stack
    service, task = await run_service(cfg)
    try:
        stats_subject = subjects.batcher_stats(cfg.namespace)
        # 1. A few samples: the eager all-ones table.
        await bus.publish(stats_subject, report(0, 200, 20, SMALL))
        eager = await tables.wait_for(lambda t: t.preset == "duo")
        assert not eager.is_estimated and eager.b == [[1] * MAX_N, [1] * MAX_N]
        assert eager.hold_timeout_ms == 15.0 and eager.models == ["small", "large"]
        # 2. A bad report is rejected, not folded in.
        await bus.publish(stats_subject, report(5, 10, 1, SMALL))
        # 3. Enough samples: p = 0.1, one token per visit at L.
        for _ in range(5):
            await bus.publish(stats_subject, report(0, 1000, 100, SMALL))
            await bus.publish(stats_subject, report(1, 100, 100, LARGE))
        est = await tables.wait_for(lambda t: t.is_estimated)
        assert est.version > eager.version
        assert est.p == pytest.approx(0.1, rel=0.02) and est.tokens_per_visit == pytest.approx(1.0)
        assert est.step_intercept_s == pytest.approx([0.010, 0.050], rel=1e-3)
        expected = best_b(ModelPair(est.p, SMALL, LARGE, est.tokens_per_visit), MAX_N)
        assert est.b == [expected.b_small, expected.b_large]
        assert is_deadlock_free(est.b[0], est.b[1])
        assert est.b != eager.b  # this case holds L for more than one (a real change)
        assert service.num_rejected == 1
        # Stats of a preset that does not hold steps by the tables are not worked on.
        eager_stats = msgspec.structs.replace(report(0, 200, 20, SMALL), preset="duo-eager")
        await bus.publish(stats_subject, eager_stats)
        await bus.flush()
        await asyncio.sleep(0.3)
        assert "duo-eager" not in service.presets
        # 4. Redis holds the newest table for a restarted worker.
        blob = await service.store.redis.get(keys.batch_tables(cfg.namespace, "duo"))
        assert isinstance(blob, bytes)
        stored = BATCH_TABLES_DECODER.decode(blob)
        assert stored.is_estimated and stored.version >= est.version
        assert stored.b_for(1, 100) == est.b[1][-1]  # N past the table clamps to its end
    finally:
        await stop(service, task)
    # 5. A restarted batcher continues the version (workers ignore older versions).
    service, task = await run_service(cfg)
    try:
        await bus.publish(subjects.batcher_stats(cfg.namespace), report(0, 10, 1, SMALL))
        again = await tables.wait_for(lambda t: t.version > stored.version)
        assert not again.is_estimated
    finally:
        await stop(service, task)


async def test_fixed_b_pins_the_table_for_every_n(stack) -> None:  # type: ignore[no-untyped-def]
    cfg, bus, tables = stack
    pinned = msgspec.structs.replace(
        cfg, batcher=msgspec.structs.replace(cfg.batcher, fixed_b=[1, 3])
    )
    service, task = await run_service(pinned)
    try:
        await bus.publish(subjects.batcher_stats(cfg.namespace), report(0, 10, 1, SMALL))
        got = await tables.wait_for(lambda t: t.preset == "duo")
        assert got.b == [[1] * MAX_N, [1, 2, 3, 3, 3, 3]] and not got.is_estimated
        assert service.num_recomputes == 0
        # With estimates the pair stays pinned and carries the chain's prediction for it.
        for _ in range(5):
            await bus.publish(subjects.batcher_stats(cfg.namespace), report(0, 1000, 100, SMALL))
            await bus.publish(subjects.batcher_stats(cfg.namespace), report(1, 100, 100, LARGE))
        est = await tables.wait_for(lambda t: t.is_estimated)
        assert est.b == got.b
        assert est.p is not None and est.tokens_per_visit is not None
        small, large = (
            AffineLatency(i, c)
            for i, c in zip(est.step_intercept_s, est.step_per_request_s, strict=True)
        )
        want = predicted_throughput(ModelPair(est.p, small, large, est.tokens_per_visit), 4, 1, 3)
        assert est.predicted_tok_s[3] == pytest.approx(want)
    finally:
        await stop(service, task)


def test_fixed_b_must_be_a_pair_of_positive_values() -> None:
    with pytest.raises(ConfigError, match="fixed_b"):
        parse_cluster("[batcher]\nfixed_b = [0, 2]\n", environ={})


@pytest.mark.parametrize("share", [1.0, 1e-6])
async def test_recomputes_stay_within_the_compute_budget(stack, share: float) -> None:  # type: ignore[no-untyped-def]
    cfg, bus, tables = stack
    budgeted = msgspec.structs.replace(
        cfg, batcher=msgspec.structs.replace(cfg.batcher, max_compute_share=share)
    )
    service, task = await run_service(budgeted)
    stats_subject = subjects.batcher_stats(cfg.namespace)
    try:
        for _ in range(5):
            await bus.publish(stats_subject, report(0, 1000, 100, SMALL))
            await bus.publish(stats_subject, report(1, 100, 100, LARGE))
        await tables.wait_for(lambda t: t.is_estimated)
        assert service.num_recomputes == 1  # the first estimated table: at once
        # p moves from 0.1 towards 0.5: the estimates move well past recompute_rel_change.
        for _ in range(10):
            await bus.publish(stats_subject, report(0, 1000, 500, SMALL))
            await bus.publish(stats_subject, report(1, 500, 500, LARGE))
        await bus.flush()
        await asyncio.sleep(1.0)  # ten publish intervals
        if share == 1.0:
            assert service.num_recomputes >= 2
        else:  # the first table's compute time / 1e-6 is far in the future: held
            assert service.num_recomputes == 1
            estimated = {t.version: t.p for t in tables.seen if t.is_estimated}
            assert len(set(estimated.values())) == 1  # the same estimate, republished
    finally:
        await stop(service, task)


def test_max_compute_share_must_be_a_fraction() -> None:
    text = '[batcher]\nmax_compute_share = {}\n[models.a]\n[presets.p]\nmodels = ["a"]\n'
    assert parse_cluster(text.format(0.5), environ={}).batcher.max_compute_share == 0.5
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ConfigError, match="max_compute_share"):
            parse_cluster(text.format(bad), environ={})
