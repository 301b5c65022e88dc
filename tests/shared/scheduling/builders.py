"""Request and scheduler builders: scheduler tests need no model."""

from __future__ import annotations

from shared.scheduling.scheduler import ScheduledBatch, Scheduler, SchedulerConfig


def make_scheduler(
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    block_size: int = 4,
    num_kv_blocks: int = 64,
    max_model_len: int = 128,
    max_chunk_beside_guests: int = 0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_model_len=max_model_len,
            max_chunk_beside_guests=max_chunk_beside_guests,
        )
    )


def step(scheduler: Scheduler) -> ScheduledBatch:
    """One iteration with a model that never stops early: schedule, then commit;
    requests that reached max_tokens finish."""
    batch = scheduler.schedule()
    scheduler.commit(batch)
    for chunk in batch:
        req = chunk.request
        if req.num_output_tokens >= req.max_tokens and not req.is_finished:
            scheduler.finish(req)
    return batch


def run_until_idle(scheduler: Scheduler, max_steps: int = 10_000) -> list[ScheduledBatch]:
    batches = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished:
            return batches
        batches.append(step(scheduler))
    raise AssertionError("scheduler did not drain")


def chunk_sizes(batch: ScheduledBatch) -> dict[str, int]:
    return {c.request.request_id: c.num_new_tokens for c in batch}
