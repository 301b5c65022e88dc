"""Workload builders for the SFS tests: a live scheduler, stepped as the engine steps it."""

from __future__ import annotations

import random
from functools import partial

from services.estimator.sfs.replay import PendingRequest
from services.worker.engine.sim import SimEngine, SimEngineConfig
from shared.sampling import SamplingParams
from shared.scheduling.batch_time import SIX_TERM, BatchTimeModel
from shared.scheduling.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from shared.scheduling.snapshot import WorkloadSnapshot
from tests.shared.scheduling import builders as scheduling_builders

# Coefficients large enough that every term moves the sum (seconds per unit).
MODEL = BatchTimeModel(SIX_TERM, (1e-2, 2e-4, 3e-6, 5e-4, 2e-5, 1e-7))

# A small SimEngine on a virtual clock and its batch-time model (tests that run an
# engine on after its snapshot and compare the estimate with the TTFT it gives).
SIM_MODEL = BatchTimeModel(SIX_TERM, (0.01, 1e-3, 0.0, 2e-3, 0.0, 0.0))
SIM_LIMITS = {
    "max_num_seqs": 4,
    "max_num_batched_tokens": 64,
    "block_size": 4,
    "num_kv_blocks": 256,
    "max_model_len": 256,
}


def on_virtual_clock(**limits: int) -> SimEngineConfig:
    """A SimEngine's config on a virtual clock, under SIM_LIMITS but for `limits`."""
    return SimEngineConfig(clock="virtual", scheduler=SchedulerConfig(**{**SIM_LIMITS, **limits}))


SIM_CFG = on_virtual_clock()
LONG = SamplingParams(max_tokens=40, ignore_eos=True)


def three_decoding(engine: SimEngine) -> tuple[WorkloadSnapshot, float]:
    """Three 20-token requests admitted and decoding: the engine's snapshot and time."""
    for rid in ("a", "b", "c"):
        engine.add_request(rid, [1] * 20, LONG)
    engine.step()  # the three prefills
    engine.step()
    return engine.snapshot(), engine.now()


def three_decodes_s(model: BatchTimeModel) -> float:
    """One of three_decoding's iterations (three decodes) under `model`, a model with
    SIM_MODEL's zero context terms (so the contexts, which grow, do not matter)."""
    return model.predict_raw([1, 0, 0, 3, 0, 0, 0, 0, 9, 0])


def run_until(engine: SimEngine, t: float) -> None:
    """Step through every iteration that starts before `t`."""
    while engine.now() < t:
        engine.step()


def query_ttft(engine: SimEngine, arrival: float) -> float:
    """A 12-token query added at `arrival` (after the iterations that start before it):
    seconds to its first token."""
    run_until(engine, arrival)
    engine.add_request("q", [1] * 12, SamplingParams(max_tokens=5, ignore_eos=True))
    while not any(o.request_id == "q" and o.new_token_ids for o in engine.step()):
        pass
    return engine.now() - arrival


# The scheduling tests' builder with a smaller default budget (callers may override).
make_scheduler = partial(scheduling_builders.make_scheduler, max_num_batched_tokens=32)


def step(s: Scheduler) -> ScheduledBatch:
    """One engine iteration: schedule, commit, finish at predicted length (else max_tokens)."""
    batch = s.schedule()
    s.commit(batch)
    for chunk in batch:
        req = chunk.request
        limit = min(req.predicted_output_tokens or req.max_tokens, req.max_tokens)
        if not req.is_finished and req.num_output_tokens >= limit:
            s.finish(req)
    return batch


def as_pairs(batch: ScheduledBatch) -> list[tuple[str, int]]:
    return [(c.request.request_id, c.num_new_tokens) for c in batch]


def random_pending(
    rng: random.Random, prefix: str, most: int, prompt: int, max_tokens: int, predicted: int
) -> list[PendingRequest]:
    """0 to `most` dispatched requests f"{prefix}{k}", each length drawn from 1 to its
    bound: prompt, max_tokens and predicted output tokens."""
    return [
        PendingRequest(
            f"{prefix}{k}",
            rng.randint(1, prompt),
            rng.randint(1, max_tokens),
            rng.randint(1, predicted),
        )
        for k in range(rng.randint(0, most))
    ]


def random_live(rng: random.Random, *, predicted: bool, peer: bool = False) -> Scheduler:
    """A scheduler with a random workload, stepped a random number of iterations.

    Small KV (often less than the requests want) so preemption happens. `peer` parks a
    running request as PENDING (a peer writes its tokens; it keeps its KV).
    """
    s = make_scheduler(
        max_num_seqs=rng.randint(1, 10),
        max_num_batched_tokens=rng.randint(4, 48),
        num_kv_blocks=rng.randint(32, 90),
    )
    for i in range(rng.randint(1, 24)):
        prompt = rng.randint(1, 60)
        req = s.add(f"r{i}", prompt, rng.randint(1, 128 - prompt))
        if predicted and rng.random() < 0.8:
            req.predicted_output_tokens = rng.randint(1, 40)
        for _ in range(rng.randint(0, 2)):
            step(s)
    if peer and s.running:
        s.set_pending(rng.choice(s.running).request_id)
    return s
