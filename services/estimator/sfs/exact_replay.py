"""The SFS replay on the engine's own `Scheduler`: the reference the kernel is checked
against batch for batch (tests, debugging), ~80-300x slower than `replay.estimate`."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from services.estimator.sfs.kernel import RunResult
from services.estimator.sfs.output_policy import OutputPolicy
from services.estimator.sfs.replay import (
    PROBE_ID,
    PendingLike,
    Probe,
    ReplayEstimate,
    admissible_pending,
    probe_max_tokens,
    to_estimate,
)
from shared.scheduling.batch_time import BatchTimeModel
from shared.scheduling.snapshot import WorkloadSnapshot, restore_scheduler


@dataclass(frozen=True, slots=True)
class ExactReplay:
    """`replay_exact`'s result: the estimate and every batch as [(request_id, tokens)]."""

    estimate: ReplayEstimate
    batches: list[list[tuple[str, int]]]
    batch_times_s: list[float]


def replay_exact(
    snapshot: WorkloadSnapshot,
    model: BatchTimeModel,
    probe: Probe,
    pending: Iterable[PendingLike] = (),
    *,
    want_e2e: bool = False,
    policy: OutputPolicy = OutputPolicy(),
    max_steps: int = 100_000,
) -> ExactReplay:
    """The replay on the engine's own `Scheduler` (restore, add, schedule + commit)."""
    sched = restore_scheduler(snapshot)
    policy = policy.for_snapshot(snapshot)
    targets = {
        c.request_id: policy.target(
            c.predicted_output_tokens, c.max_tokens, c.num_output_tokens, c.request_id
        )
        for c in (*snapshot.running, *snapshot.waiting)
    }
    entries, num_visible = admissible_pending(pending, snapshot)
    for rid, prompt, max_tokens, predicted in entries:
        req = sched.add(rid, prompt, max_tokens)
        req.predicted_output_tokens = predicted
        targets[rid] = policy.target(predicted, max_tokens, 0, rid)
    batches: list[list[tuple[str, int]]] = []
    times: list[float] = []
    cap = probe_max_tokens(probe, snapshot.scheduler.max_model_len)
    ttft, e2e, steps_ttft = math.inf, math.inf, 0
    if probe.num_prompt_tokens >= 1 and cap >= 1:
        assert PROBE_ID not in sched.requests
        probe_req = sched.add(PROBE_ID, probe.num_prompt_tokens, cap)
        targets[PROBE_ID] = min(max(probe.predicted_output_tokens, 1), cap)
        clock = 0.0
        while len(batches) < max_steps:
            batch = sched.schedule()
            if len(batch) == 0:
                break
            dt = model.predict(batch)
            batches.append([(c.request.request_id, c.num_new_tokens) for c in batch])
            times.append(dt)
            clock += dt
            sched.commit(batch)
            for chunk in batch:
                req = chunk.request
                if not req.is_finished and req.num_output_tokens >= targets[req.request_id]:
                    sched.finish(req)
            if math.isinf(ttft) and probe_req.num_output_tokens >= 1:
                ttft, steps_ttft = clock, len(batches)
                if not want_e2e:
                    break
            if probe_req.is_finished:
                e2e = clock
                break
    r = RunResult(ttft, e2e if want_e2e else math.nan, steps_ttft, len(batches))
    return ExactReplay(to_estimate(r, want_e2e, len(entries), num_visible), batches, times)
