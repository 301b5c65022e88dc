"""The batcher service: routing statistics in, deadlock-free B* tables out.

    RoutingStats (NATS, every worker of a token-level preset)
        -> PresetEstimator per preset (decayed counts and step-time fits)
    every publish_interval_s, per preset:
        1. estimates ready?  no  -> the all-ones table (eager async), until the first estimate
                             yes -> if they moved by recompute_rel_change: the chain's B*(N),
                                    N = 1..max_n, computed off the event loop (the first
                                    at once, later ones within max_compute_share of a core)
        2. a new table gets the next version
        3. publish BatchTables on `subjects.batcher_tables` and SET `keys.batch_tables`
           (so a worker that starts later reads the newest without waiting)

Only two-model presets get chain tables; a preset of more models keeps all-ones.
Every published table satisfies B_0(N) + B_1(N) <= N + 1 (asserted before sending).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import cast

import msgspec

from services.batcher.dtmc import (
    BTable,
    ModelPair,
    best_b,
    eager_table,
    fixed_table,
    is_deadlock_free,
    predicted_throughput,
)
from services.batcher.estimates import ChainInputs, PresetEstimator, Thresholds, check_stats
from shared import keys, subjects
from shared.bus import Bus
from shared.config import ClusterConfig
from shared.logging import get_logger
from shared.messages import encode
from shared.messages.batcher import (
    BATCH_TABLES_DECODER,
    ROUTING_STATS_DECODER,
    BatchTables,
    RoutingStats,
)
from shared.messages.health import HEALTH_PROBE_DECODER, HealthProbe, HealthReply
from shared.store import Store

log = get_logger(component="batcher")


@dataclass
class PresetState:
    estimator: PresetEstimator
    version: int  # of the newest table published (or found in Redis at first sight)
    tables: BatchTables | None = None  # newest published
    used_inputs: ChainInputs | None = None  # the estimates `tables` came from


def compute_table(inputs: ChainInputs, max_n: int) -> BTable:
    """B*(N) for N = 1..max_n from the estimates (CPU-bound: run it off the event loop)."""
    return best_b(model_pair(inputs), max_n)


def model_pair(inputs: ChainInputs) -> ModelPair:
    """The chain's view of a preset's two models from the batcher's estimates."""
    return ModelPair(
        inputs.p,
        inputs.latency_small,
        inputs.latency_large,
        tokens_per_visit_large=inputs.tokens_per_visit,
        rewrite_fraction=inputs.rewrite_fraction,
    )


def pinned_table(inputs: ChainInputs, chain: BTable, fixed_b: list[int]) -> BTable:
    """The pinned pair `[batcher] fixed_b` per N with the chain's prediction for it
    (`chain`: the chain's own table from the same inputs, for its eager figures)."""
    table = fixed_table(len(chain.b_small), fixed_b[0], fixed_b[1])
    pair = model_pair(inputs)
    predicted = [
        predicted_throughput(pair, n, b_small, b_large)
        for n, (b_small, b_large) in enumerate(
            zip(table.b_small, table.b_large, strict=True), start=1
        )
    ]
    return BTable(table.b_small, table.b_large, predicted, chain.eager_throughput_tok_s)


class BatcherService:
    def __init__(self, cluster: ClusterConfig) -> None:
        self.cluster = cluster
        self.settings = cluster.batcher
        self.bus = Bus(cluster.nats_url, name="batcher")
        self.store = Store(cluster.redis_url, cluster.namespace)
        self.need = Thresholds(
            min_tokens=self.settings.min_tokens,
            min_handoffs=self.settings.min_handoffs,
            min_step_samples=self.settings.min_step_samples,
        )
        self.presets: dict[str, PresetState] = {}
        self._stop = asyncio.Event()
        self.started = asyncio.Event()  # set once subscribed (shared.runtime.run_service)
        self.num_rejected = 0  # reports that failed check_stats
        self.num_recomputes = 0
        # Monotonic time before which no chain is recomputed ([batcher] max_compute_share).
        self.next_compute_s = 0.0

    def request_stop(self) -> None:
        self._stop.set()

    async def start(self) -> None:
        await self.bus.connect()
        await self.store.connect()
        await self.bus.subscribe(
            subjects.batcher_stats(self.cluster.namespace), ROUTING_STATS_DECODER, self._on_stats
        )
        await self.bus.serve(
            subjects.health(self.cluster.namespace, "batcher"), HEALTH_PROBE_DECODER, self._health
        )
        await self.bus.flush()
        self.started.set()
        log.info("batcher_ready", max_n=self.settings.max_n)

    async def _health(self, probe: HealthProbe) -> HealthReply:
        return HealthReply(service="batcher")

    async def run(self) -> None:
        """Publish every publish_interval_s until request_stop()."""
        await self.start()
        try:
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.settings.publish_interval_s)
                if self._stop.is_set():
                    break
                try:
                    await self.publish_all()
                except Exception as exc:  # Redis or NATS hiccup: retried next interval
                    log.warning("publish_failed", error=repr(exc))
        finally:
            await self.close()

    async def close(self) -> None:
        self._stop.set()
        await self.bus.close()
        await self.store.close()

    # -- statistics in ------------------------------------------------------

    async def _on_stats(self, stats: RoutingStats) -> None:
        preset = self.cluster.presets.get(stats.preset)
        if preset is None or preset.mode != "baton":
            return  # only `baton` mode holds steps by the tables: nothing to compute
        problem = check_stats(stats)
        state = self.presets.get(stats.preset)
        if problem is None and state is not None and state.estimator.models != stats.models:
            problem = f"models {stats.models} differ from earlier reports {state.estimator.models}"
        if problem is not None:
            self.num_rejected += 1
            log.warning(
                "bad_stats", instance_id=stats.instance_id, preset=stats.preset, why=problem
            )
            return
        if state is None:
            state = await self._first_sight(stats)
        state.estimator.add(stats, time.monotonic())

    async def _first_sight(self, stats: RoutingStats) -> PresetState:
        """A new preset: continue the version of any table a previous batcher left."""
        blob = await self.store.redis.get(keys.batch_tables(self.cluster.namespace, stats.preset))
        version = 0
        if blob is not None:
            with contextlib.suppress(msgspec.DecodeError):
                version = BATCH_TABLES_DECODER.decode(cast(bytes, blob)).version
        estimator = PresetEstimator(stats.models, self.settings.half_life_s, time.monotonic())
        state = PresetState(estimator=estimator, version=version)
        self.presets[stats.preset] = state
        log.info("preset_seen", preset=stats.preset, models=stats.models)
        return state

    # -- tables out -----------------------------------------------------------

    async def publish_all(self) -> None:
        for name, state in list(self.presets.items()):
            tables = await self._next_tables(name, state)
            assert all(
                is_deadlock_free(tables.b[0], tables.b[m]) for m in range(1, len(tables.b))
            ), tables
            await self.bus.publish(subjects.batcher_tables(self.cluster.namespace), tables)
            await self.store.redis.set(
                keys.batch_tables(self.cluster.namespace, name), encode(tables)
            )

    async def _next_tables(self, name: str, state: PresetState) -> BatchTables:
        """The table to publish now: the previous one unless the estimates moved."""
        st = self.settings
        inputs = state.estimator.inputs(time.monotonic(), self.need)
        if inputs is None:
            if state.tables is not None:
                return state.tables  # eager until the first estimate; then keep the last one
            table = fixed_table(st.max_n, *st.fixed_b) if st.fixed_b else eager_table(st.max_n)
            used = None
        elif state.used_inputs is None or (
            time.monotonic() >= self.next_compute_s
            and inputs.moved_from(state.used_inputs, st.recompute_rel_change, st.max_n)
        ):
            # A preset's first estimated table is computed at once; later ones wait out
            # the compute budget ([batcher] max_compute_share), the last table standing.
            t0 = time.perf_counter()
            chain = await asyncio.to_thread(compute_table, inputs, st.max_n)
            table, used = chain, inputs
            if st.fixed_b:  # pinned (experiments): publish the pair, log what the chain says
                table = await asyncio.to_thread(pinned_table, inputs, chain, st.fixed_b)
            elapsed = time.perf_counter() - t0
            self.num_recomputes += 1
            log.info(
                "tables_recomputed",
                preset=name,
                p=round(inputs.p, 4),
                tokens_per_visit=round(inputs.tokens_per_visit, 3),
                rewrite_fraction=round(inputs.rewrite_fraction, 3),
                step_small_ms=[
                    round(1e3 * inputs.latency_small.intercept_s, 2),
                    round(1e3 * inputs.latency_small.per_request_s, 2),
                ],
                step_large_ms=[
                    round(1e3 * inputs.latency_large.intercept_s, 2),
                    round(1e3 * inputs.latency_large.per_request_s, 2),
                ],
                b_small=table.b_small,
                b_large=table.b_large,
                predicted_tok_s=[round(x, 1) for x in table.throughput_tok_s],
                chain_b_large=chain.b_large,
                chain_tok_s=[round(x, 1) for x in chain.throughput_tok_s],
                eager_tok_s=[round(x, 1) for x in chain.eager_throughput_tok_s],
                seconds=round(elapsed, 3),
            )
            self.next_compute_s = time.monotonic() + elapsed / st.max_compute_share
        else:
            assert state.tables is not None
            return state.tables
        return self._tables(name, state, table, used)

    def _tables(
        self, name: str, state: PresetState, table: BTable, used: ChainInputs | None
    ) -> BatchTables:
        """`table` as the preset's next BatchTables version (`used`: the estimates behind it)."""
        st = self.settings
        state.version += 1
        state.used_inputs = used
        num_models = len(state.estimator.models)
        rows = [table.b_small, table.b_large] if num_models == 2 else [[1] * st.max_n] * num_models
        state.tables = BatchTables(
            preset=name,
            version=state.version,
            models=list(state.estimator.models),
            b=rows,
            hold_timeout_ms=st.hold_timeout_ms,
            is_estimated=used is not None,
            published_at_s=time.time(),
            p=None if used is None else used.p,
            tokens_per_visit=None if used is None else used.tokens_per_visit,
            step_intercept_s=[]
            if used is None
            else [used.latency_small.intercept_s, used.latency_large.intercept_s],
            step_per_request_s=[]
            if used is None
            else [used.latency_small.per_request_s, used.latency_large.per_request_s],
            predicted_tok_s=table.throughput_tok_s,
            eager_tok_s=table.eager_throughput_tok_s,
        )
        return state.tables
