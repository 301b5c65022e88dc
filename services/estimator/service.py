"""The estimator service: answers "which instance?" over NATS request/reply.

    route request -> candidates (live, non-draining instances of the model or preset)
                  -> their cached snapshots (read and parsed by the refresh loop,
                     `instances.py`), stale ones dropped
                  -> predictions per candidate model from the prompt's token ids
                     (`predictors.py`: output length and quality; none without ids
                     or files, or for models the predictor does not know)
                  -> scores for utility policies: accuracy (predicted quality when
                     every candidate has one, else the quality table), cost (prices x
                     prompt + predicted output), TTFT (SFS replay on a fresh snapshot
                     with the ledger as pending, else LPS queue model)
                  -> policy.choose -> ledger.add -> reply

Background: the refresh loop reads every snapshot each `snapshot_refresh_s`, parses
new versions for the replay and reconciles the ledger; the fit loop feeds the batch
samples to one OnlineBatchTimeFitter per instance and publishes each refit (`fits.py`).

nats-py runs one subscription's callbacks one at a time, so decisions (and the
ledger) are serialized within a process. Several estimator replicas share the
route subject through a queue group; with `shared_ledger` their ledgers are kept
in step through Redis (`ledger.SharedLedger`: a decision only queues its entry; a
writer task writes it, the refresh loop reads the others' with the snapshots),
else each replica knows only its own decisions.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from functools import partial

from services.estimator.fits import fit_batch_times
from services.estimator.instances import InstanceState, LatencyEstimator, create_instance_state
from services.estimator.ledger import LedgerEntry, SharedLedger, encode_entries
from services.estimator.policies import InstanceView, Policy, PolicyTable, Scores
from services.estimator.predictors import Prediction, Predictors
from services.estimator.routebalance.assign import Assignment
from services.estimator.routebalance.decider import BatchDecider
from services.estimator.routebalance.score import Weights
from services.estimator.sfs import native
from services.estimator.sfs.replay import Probe
from shared import subjects
from shared.bus import Bus
from shared.config import ClusterConfig
from shared.logging import RetryLog, get_logger
from shared.messages.estimator import (
    REQUEST_DONE_DECODER,
    ROUTE_REQUEST_DECODER,
    RequestDoneEvent,
    RouteReply,
    RouteRequest,
)
from shared.messages.registry import RegistryEpoch, WorkerInfo, departed
from shared.model_store import REPO_ROOT
from shared.snapshot_decoder import SnapshotDecoder
from shared.store import Store

log = get_logger(component="estimator")


class EstimatorService:
    def __init__(self, cluster: ClusterConfig) -> None:
        self.cluster = cluster
        self._registry_epoch = RegistryEpoch(cluster.worker.heartbeat_ttl_s)
        self.settings = cluster.estimator
        self.bus = Bus(cluster.nats_url, name="estimator")
        self.store = Store(cluster.redis_url, cluster.namespace)
        self.snapshots = SnapshotDecoder(log)
        # The decisions' ledger is the shared one's local copy; without `shared_ledger`
        # nothing is written to or merged from Redis.
        self.shared_ledger = SharedLedger(self.settings.ledger_ttl_s)
        self.ledger = self.shared_ledger.ledger
        self._ledger_dirty = asyncio.Event()  # wakes the ledger writer
        self.latency = LatencyEstimator(self.settings)
        self.policies = PolicyTable(self.settings, cluster.presets)  # fails at start
        self.workers: dict[str, WorkerInfo] = {}
        self.instances: dict[str, InstanceState] = {}
        self.predictors: Predictors | None = None  # loaded in start()
        # RouteBalance's batches (requests whose policy is routebalance)
        self.batches = BatchDecider(
            cluster, self.instances, self.ledger, lambda: self.predictors, self._commit_batched
        )
        self._stop = asyncio.Event()
        self.started = asyncio.Event()  # set once serving (shared.runtime.run_service)
        self._loops: list[asyncio.Task[None]] = []
        self.num_decisions = 0

    def request_stop(self) -> None:
        self._stop.set()

    def reload(self, cluster: ClusterConfig) -> None:
        """Take the routing knobs of a re-read cluster file without a restart: the
        policies of `[estimator]` and of the presets, with their lambda, delta and
        RouteBalance weights (ValueError, and nothing changes, for one it cannot run).
        Everything else (models, instances, prices, the other keys) needs a restart."""
        self.policies = PolicyTable(cluster.estimator, cluster.presets)
        log.info(
            "routing_reloaded",
            policy=cluster.estimator.policy,
            presets={n: p.policy for n, p in cluster.presets.items()},
        )

    async def start(self) -> None:
        if self.settings.predictors:  # a relative path is the repository's
            self.predictors = Predictors.load(REPO_ROOT / self.settings.predictors)
        await self.bus.connect()
        await self.store.connect()
        await self.refresh_workers()
        await self.refresh_snapshots()
        ns = self.cluster.namespace
        await self.bus.serve(
            subjects.estimator_route(ns),
            ROUTE_REQUEST_DECODER,
            self.route,
            queue=subjects.ESTIMATOR_QUEUE_GROUP,
        )
        await self.bus.subscribe(subjects.estimator_events(ns), REQUEST_DONE_DECODER, self._on_done)
        await self.bus.flush()
        self._loops = [
            asyncio.create_task(
                self._every(self.settings.snapshot_refresh_s, self.refresh_snapshots, "snapshots"),
                name="snapshot-refresh",
            ),
            asyncio.create_task(
                self._every(self.settings.fit_interval_s, self.fit_batch_times, "fit"),
                name="batch-time-fit",
            ),
            asyncio.create_task(self.batches.run(), name="routebalance-batches"),
        ]
        if self.settings.shared_ledger:
            self._loops.append(asyncio.create_task(self._write_ledger(), name="ledger-writer"))
        self.started.set()
        log.info(
            "estimator_ready",
            policy=self.settings.policy,
            live_workers=len(self.workers),
            predictors=self.predictors is not None,
            sfs_kernel=native.IMPL_NOTE,
        )

    async def run(self) -> None:
        """Serve until request_stop(); refresh the registry and expire the ledger meanwhile."""
        await self.start()
        registry_failures = RetryLog(log, "registry_refresh_failed")
        try:
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.settings.registry_refresh_s)
                await registry_failures.attempt(self.refresh_workers)
                if self.settings.shared_ledger:
                    self.shared_ledger.expire(time.time())
                    self._ledger_dirty.set()
                else:
                    self.ledger.expire(time.time())
                for task in self._loops:
                    if task.done():  # a background loop must never die silently
                        task.result()
        finally:
            await self.close()

    async def close(self) -> None:
        self._stop.set()
        for task in self._loops:
            task.cancel()
        if self._loops:  # bounded: see _every
            await asyncio.wait(self._loops, timeout=5.0)
        self._loops = []
        await self.bus.close()
        await self.store.close()

    async def _every(self, period_s: float, step: Callable[[], Awaitable[None]], what: str) -> None:
        """Run `step` every period_s; a failure is logged and retried next period.

        Also ends on `_stop`: redis-py can swallow a cancellation that lands inside a
        command, and the loop would then run on after close().
        """
        failures = RetryLog(log.bind(step=what), "background_step_failed")
        while not self._stop.is_set():
            await asyncio.sleep(period_s)
            if self._stop.is_set():
                return
            await failures.attempt(step)

    async def refresh_workers(self) -> None:
        live = await self.store.read_live_workers(self.workers, self._registry_epoch)
        for gone in departed(self.workers, live):
            self.shared_ledger.forget_instance(gone)
            self.instances.pop(gone, None)
            self.latency.forget(gone)
            log.info("worker_gone", instance_id=gone)
        self.snapshots.keep_only(live)
        for iid, info in live.items():
            state = self.instances.get(iid)
            if state is None:
                log.info("worker_seen", instance_id=iid, model=info.model)
                self.instances[iid] = create_instance_state(
                    info, self.cluster.models.get(info.model), self.settings
                )
            else:
                state.info = info
        self.workers = live

    async def refresh_snapshots(self) -> None:
        """Read every live instance's snapshot (and shared-ledger hash); parse new
        versions, reconcile the ledger and merge the other replicas' entries."""
        ids = list(self.instances)
        shared = self.settings.shared_ledger
        if shared:
            blobs, stored = await self.store.read_snapshots_and_ledgers(ids)
        else:
            blobs, stored = await self.store.read_snapshots(ids), {}
        now_wall = time.time()
        for iid, blob in blobs.items():
            state = self.instances.get(iid)
            if state is None:
                continue
            if shared:  # before the snapshot: a merged entry it shows is reconciled below
                self.shared_ledger.merge(iid, stored.get(iid, {}), state.visible, now_wall)
            if blob is None:
                continue
            key = (blob.version, blob.wall_time_s)
            if key == state.snapshot_key:
                continue
            snapshot = self.snapshots.decode_one(iid, blob.data)
            if snapshot is None:  # as missing: the last one read ages out
                continue
            state.take_snapshot(snapshot, key)
            if shared:
                self.shared_ledger.reconcile(iid, state.visible, now_wall)
            else:
                self.ledger.reconcile(iid, state.visible)
            self.latency.prepare(state)
        if shared and self.shared_ledger.has_writes():
            self._ledger_dirty.set()

    async def _write_ledger(self) -> None:
        """Move queued entries and deletions to Redis, one pipeline per wake-up.

        Off the decision path: a decision only queues its entry and sets the event. A
        failed write is logged and its entries are lost to the other replicas (they
        still count here until reconciled or expired).
        """
        ledger_failures = RetryLog(log, "ledger_write_failed")
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ledger_dirty.wait(), 1.0)
            self._ledger_dirty.clear()
            adds, deletes = self.shared_ledger.take_writes()
            if not adds and not deletes:
                continue
            try:
                await self.store.write_ledger(
                    encode_entries(adds), deletes, ttl_s=self.settings.ledger_ttl_s
                )
            except Exception as exc:
                ledger_failures.failed(error=repr(exc), entries=len(adds))
            else:
                ledger_failures.ok()

    async def fit_batch_times(self) -> None:
        await fit_batch_times(self.store, self.instances)

    async def _on_done(self, event: RequestDoneEvent) -> None:
        predicted, measured, correction = (
            event.predicted_ttft_ms,
            event.ttft_ms,
            self.latency.correction,
        )
        if correction is not None:  # also without a TTFT: it drops the decision's note
            correction.observe(
                event.instance_id,
                math.nan if predicted is None else predicted / 1e3,
                math.nan if measured is None else measured / 1e3,
                request_id=event.request_id,
            )
        if self.settings.shared_ledger:
            self.shared_ledger.done(event.request_id, event.instance_id, time.time())
            self._ledger_dirty.set()
        else:
            self.ledger.remove(event.request_id)

    async def route(self, request: RouteRequest) -> RouteReply | asyncio.Future[RouteReply]:
        t0 = time.perf_counter()
        models = set(self.cluster.candidates(request.model))
        if not models:
            return RouteReply(
                request_id=request.request_id, error=f"unknown model {request.model!r}"
            )
        states = [
            s for s in self.instances.values() if s.info.model in models and not s.info.is_draining
        ]
        if not states:
            return RouteReply(
                request_id=request.request_id,
                error=f"no live worker serves model {request.model!r}",
            )
        try:
            policy = self.policies.for_request(request)
        except ValueError as exc:
            return RouteReply(request_id=request.request_id, error=str(exc))
        if isinstance(policy, Weights):  # RouteBalance: answered when its batch is decided
            return self.batches.submit(request, policy)
        predictions = self._predict(request, models)
        views = self._views(request, states, policy, predictions)
        chosen = policy.choose(request, views)
        # before the ledger and the arrival rate change (a TTFT the policy did not
        # read would be computed here, on the state it decided on)
        ttft = chosen.scores.ttft_s if chosen.scores is not None else math.nan
        source = chosen.scores.ttft_source if chosen.scores is not None else ""
        predicted = self._predicted_output(request, chosen.info.model, predictions)
        self._record(request, chosen.instance_id, predicted)
        if source == "sfs" and self.latency.correction is not None:
            # the factor the estimate carried, for its feedback (correction.py)
            self.latency.correction.note(request.request_id, chosen.instance_id)
        return RouteReply(
            request_id=request.request_id,
            instance_id=chosen.instance_id,
            model=chosen.info.model,
            inbox=chosen.info.inbox,
            policy=policy.name,
            predicted_ttft_ms=ttft * 1000.0 if math.isfinite(ttft) else None,
            predicted_ttft_source=source or None,
            predicted_output_tokens=predicted,
            decision_ms=(time.perf_counter() - t0) * 1000.0,
        )

    def _record(self, request: RouteRequest, instance_id: str, predicted: int | None) -> None:
        """A decision made: into the ledger and the instance's arrival rate."""
        entry = LedgerEntry(
            request.request_id,
            instance_id,
            request.num_prompt_tokens,
            request.max_tokens,
            time.time(),
            predicted,
        )
        if self.settings.shared_ledger:  # memory only: the writer task does the I/O
            self.shared_ledger.record(entry)
            self._ledger_dirty.set()
        else:
            self.ledger.add(entry)
        self.instances[instance_id].arrivals.observe(time.monotonic())
        self.num_decisions += 1

    def _commit_batched(
        self, request: RouteRequest, state: InstanceState, a: Assignment, t0: float
    ) -> RouteReply:
        """A RouteBalance assignment made: recorded and answered (decision_ms includes
        the batch wait)."""
        self._record(request, a.instance_id, a.predicted_output_tokens)
        return RouteReply(
            request_id=request.request_id,
            instance_id=a.instance_id,
            model=a.model,
            inbox=state.info.inbox,
            policy="routebalance",
            predicted_output_tokens=a.predicted_output_tokens,
            decision_ms=(time.perf_counter() - t0) * 1000.0,
        )

    def _predict(self, request: RouteRequest, models: set[str]) -> dict[str, Prediction]:
        """Length and quality per candidate model the predictor knows (~tens of µs)."""
        if self.predictors is None or request.prompt_token_ids is None:
            return {}
        return self.predictors.predict(request.prompt_token_ids, request.task, sorted(models))

    def _predicted_output(
        self, request: RouteRequest, model: str, predictions: dict[str, Prediction]
    ) -> int | None:
        """Output tokens assumed for `model`: the request's own figure, else the
        predictor's (at most max_tokens), else None (the default length applies)."""
        if request.predicted_output_tokens is not None:
            return request.predicted_output_tokens
        p = predictions.get(model)
        return None if p is None else min(request.max_tokens, p.output_tokens)

    def _views(
        self,
        request: RouteRequest,
        states: list[InstanceState],
        policy: Policy,
        predictions: dict[str, Prediction],
    ) -> list[InstanceView]:
        now_wall, now_mono = time.time(), time.monotonic()
        max_age_s = self.settings.snapshot_max_age_s
        default_output = min(request.max_tokens, self.settings.default_output_tokens)
        # Predicted quality and the quality table are different scales: use the
        # predictions only when every candidate has one.
        use_quality = bool(predictions) and all(s.info.model in predictions for s in states)
        views: list[InstanceView] = []
        for state in states:
            fresh = state.snapshot if state.is_fresh(now_wall, max_age_s) else None
            pending = self.ledger.pending(state.instance_id)
            scores = None
            if policy.needs_scores:
                name = state.info.model
                model = self.cluster.models[name]
                predicted = self._predicted_output(request, name, predictions)
                num_output = max(1, default_output if predicted is None else predicted)
                estimate = None
                if policy.needs_ttft:  # computed only if the policy reads it
                    probe = Probe(request.num_prompt_tokens, num_output, request.max_tokens)
                    estimate = partial(self.latency.ttft, state, probe, pending, now_wall, now_mono)
                accuracy = (
                    predictions[name].quality if use_quality else model.accuracy(request.task)
                )
                scores = Scores(
                    accuracy, model.cost(request.num_prompt_tokens, num_output), estimate=estimate
                )
            views.append(InstanceView(state.info, fresh, pending, scores))
        return views
