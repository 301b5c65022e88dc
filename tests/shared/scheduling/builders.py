"""Request and scheduler builders: scheduler tests need no model."""

from __future__ import annotations

from shared.scheduling.scheduler import ScheduledBatch, Scheduler, SchedulerConfig

# Small limits, so tests reach chunking, KV admission and preemption in a few requests.
TEST_LIMITS = {
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    "block_size": 4,
    "num_kv_blocks": 64,
    "max_model_len": 128,
    "max_chunk_beside_guests": 0,
}


def make_scheduler(**limits: int) -> Scheduler:
    """A scheduler under TEST_LIMITS, but for `limits`."""
    return Scheduler(SchedulerConfig(**{**TEST_LIMITS, **limits}))


def limits(
    seqs: int, budget: int, blocks: int, context: int, block_size: int = 16
) -> SchedulerConfig:
    """Engine limits: `seqs` requests at once, `budget` tokens a step, `blocks` KV
    blocks of `block_size` tokens, `context` tokens a request."""
    sizes = {"max_num_seqs": seqs, "max_num_batched_tokens": budget, "max_model_len": context}
    return SchedulerConfig(**sizes, num_kv_blocks=blocks, block_size=block_size)


def commit(scheduler: Scheduler, batch: ScheduledBatch) -> None:
    """Commit `batch` as a model that never stops early would: requests that reached
    max_tokens finish."""
    scheduler.commit(batch)
    for chunk in batch:
        req = chunk.request
        if req.num_output_tokens >= req.max_tokens and not req.is_finished:
            scheduler.finish(req)


def step(scheduler: Scheduler) -> ScheduledBatch:
    """One iteration: schedule, then commit."""
    batch = scheduler.schedule()
    commit(scheduler, batch)
    return batch


def run_until_idle(scheduler: Scheduler, max_steps: int = 10_000) -> list[ScheduledBatch]:
    batches: list[ScheduledBatch] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished:
            return batches
        batches.append(step(scheduler))
    raise AssertionError("scheduler did not drain")


def drain_and_free_all(scheduler: Scheduler) -> None:
    """Run until idle; then every KV block is free again."""
    run_until_idle(scheduler)
    assert scheduler.blocks.num_free_blocks == scheduler.config.num_kv_blocks


def chunk_sizes(batch: ScheduledBatch) -> dict[str, int]:
    return {c.request.request_id: c.num_new_tokens for c in batch}
