"""RouteBalance inside the estimator: a request waits in the batch queue; when its batch
fires, every instance's load is read once (its fresh snapshot plus the ledger's
dispatches it does not show yet), every request gets its predictions per model, and
the batch is assigned in one pass (assign.py). Each decision is committed as any
other (`commit`: the ledger, the reply); a request whose models have no live instance
is answered with an error.

One task runs the batches, one after the other; several estimator replicas each batch
the requests they receive (the route subject's queue group splits the stream) and see
each other's dispatches through the shared ledger.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from services.estimator.instances import InstanceState
from services.estimator.ledger import Ledger
from services.estimator.predictors import Predictors
from services.estimator.routebalance.assign import Assignment, BatchRequest, assign_batch
from services.estimator.routebalance.batch_queue import (
    BatchLimits,
    BatchQueue,
    adaptive_limits,
)
from services.estimator.routebalance.load import InstanceLoad, load_of
from services.estimator.routebalance.score import Weights
from services.estimator.routebalance.tpot import decode_step_s
from services.estimator.sfs.output_policy import OutputPolicy
from shared.config import ClusterConfig
from shared.logging import get_logger
from shared.messages.estimator import RouteReply, RouteRequest
from shared.scheduling.snapshot import WorkloadSnapshot

log = get_logger(component="estimator")

# (request, chosen instance, predicted output tokens, the decision's start) -> reply
Commit = Callable[[RouteRequest, InstanceState, Assignment, float], RouteReply]


@dataclass(slots=True)
class Waiting:
    request: RouteRequest
    weights: Weights
    reply: asyncio.Future[RouteReply]
    t0: float  # perf_counter at arrival: the reply's decision_ms includes the batch wait


class BatchDecider:
    """The RouteBalance batches of one estimator (`submit`, and `run` as a task)."""

    def __init__(
        self,
        cluster: ClusterConfig,
        instances: Mapping[str, InstanceState],
        ledger: Ledger,
        predictors: Callable[[], Predictors | None],
        commit: Commit,
    ) -> None:
        self.cluster = cluster
        self.settings = cluster.estimator
        self._instances = instances
        self._ledger = ledger
        self._predictors = predictors
        self._commit = commit
        self.queue: BatchQueue[Waiting] = BatchQueue(self._limits, self._is_idle)
        self._lengths = OutputPolicy(default_output_tokens=self.settings.default_output_tokens)
        # (requests, waiting, max_num_seqs) per live instance, counted when a batch's first
        # request came: whether to decide at once, and the adaptive limits
        self._occupancy: list[tuple[int, int, int]] = []
        self._order = 0  # assignments so far: the least-recently-assigned tie-break
        self.num_batches = 0

    def submit(self, request: RouteRequest, weights: Weights) -> asyncio.Future[RouteReply]:
        reply: asyncio.Future[RouteReply] = asyncio.get_running_loop().create_future()
        self.queue.put(Waiting(request, weights, reply, time.perf_counter()))
        return reply

    async def run(self) -> None:
        """Decide batch after batch until cancelled; a failing batch fails its requests
        (no reply: the gateway routes them itself) and the next one goes on."""
        while True:
            batch = await self.queue.next_batch()
            try:
                self._decide(batch)
            except Exception as exc:
                log.exception("routebalance_batch_failed", size=len(batch))
                for w in batch:
                    if not w.reply.done():
                        w.reply.set_exception(exc)

    # -- when a batch fires ----------------------------------------------------------

    def _live(self) -> list[tuple[InstanceState, WorkloadSnapshot | None]]:
        """The instances a batch may go to, each with its snapshot if fresh."""
        now, max_age_s = time.time(), self.settings.snapshot_max_age_s
        return [
            (s, s.snapshot if s.is_fresh(now, max_age_s) else None)
            for s in self._instances.values()
            if not s.info.is_draining
        ]

    def _is_idle(self) -> bool:
        """Every live instance has a free slot: nothing to balance, decide at once. Counts
        requests only (the loads' token sums wait for the batch)."""
        self._occupancy = []
        for state, snap in self._live():
            unseen = len(self._ledger.pending(state.instance_id))
            held = 0 if snap is None else len(snap.request_ids)
            running = 0 if snap is None else snap.num_running
            self._occupancy.append(
                (held + unseen, held - running + unseen, state.info.max_num_seqs)
            )
        return all(requests < seqs for requests, _, seqs in self._occupancy)

    def _limits(self) -> BatchLimits:
        if self.settings.routebalance_batch_size > 0:
            timeout_s = self.settings.routebalance_batch_timeout_ms / 1000.0
            return BatchLimits(self.settings.routebalance_batch_size, timeout_s)
        busy = sum(1 for _, waiting, _ in self._occupancy if waiting > 0)
        return adaptive_limits(busy / max(1, len(self._occupancy)))

    def _read_loads(self) -> dict[str, InstanceLoad]:
        """Every live instance's load as the batch starts (load.py)."""
        return {
            s.instance_id: load_of(
                s.instance_id,
                s.info.model,
                s.info.max_num_seqs,
                snap,
                self._ledger.pending(s.instance_id),
                self._lengths,
            )
            for s, snap in self._live()
        }

    # -- one batch ---------------------------------------------------------------------

    def _decide(self, batch: list[Waiting]) -> None:
        loads = self._read_loads()
        requests = [self._batch_request(w) for w in batch]
        by_id = {w.request.request_id: w for w in batch}
        assignments = assign_batch(
            [r for r in requests if r is not None],
            loads,
            {name: m.cost for name, m in self.cluster.models.items()},
            self._tpot_s,
            self._order,
        )
        self._order += len(assignments)
        self.num_batches += 1
        for a in assignments:
            w = by_id.pop(a.request_id)
            w.reply.set_result(self._commit(w.request, self._instances[a.instance_id], a, w.t0))
        for w in by_id.values():  # no live instance of its models
            w.reply.set_result(
                RouteReply(
                    request_id=w.request.request_id,
                    error=f"no live worker serves model {w.request.model!r}",
                )
            )

    def _batch_request(self, w: Waiting) -> BatchRequest | None:
        req = w.request
        models = tuple(self.cluster.candidates(req.model))
        if not models:
            return None
        predictors = self._predictors()
        predicted = (
            predictors.predict(req.prompt_token_ids, req.task, sorted(models))
            if predictors is not None and req.prompt_token_ids is not None
            else {}
        )
        default = min(req.max_tokens, self.settings.default_output_tokens)
        # Predicted quality and the quality table are different scales: the predictions
        # only when every candidate model has one (as the utility policies do).
        use_predicted = all(m in predicted for m in models)
        quality = {
            m: predicted[m].quality if use_predicted else self.cluster.models[m].accuracy(req.task)
            for m in models
        }
        output = {
            m: req.predicted_output_tokens
            if req.predicted_output_tokens is not None
            else (predicted[m].output_tokens if m in predicted else default)
            for m in models
        }
        return BatchRequest(
            req.request_id,
            req.num_prompt_tokens,
            req.max_tokens,
            models,
            quality,
            output,
            w.weights,
            req.budget,
        )

    def _tpot_s(self, load: InstanceLoad) -> float:
        state = self._instances[load.instance_id]
        context = self.settings.default_output_tokens  # a mid-answer context, tokens
        return decode_step_s(
            state.batch_time_model(), load.decode_batch + 1, context, state.batch_time_speed()
        )
