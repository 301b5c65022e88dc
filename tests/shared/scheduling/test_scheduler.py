"""The scheduling policy on plain counters: budget, chunking, KV admission,
preemption, abort, fairness, and snapshot replay."""

from __future__ import annotations

import random

import pytest

from shared.scheduling.request import RequestStatus
from shared.scheduling.scheduler import SchedulerConfig
from shared.scheduling.snapshot import restore_scheduler, take_snapshot
from tests.shared.scheduling.builders import (
    chunk_sizes,
    drain_and_free_all,
    make_scheduler,
    run_until_idle,
    step,
)


def test_budget_is_respected_every_step() -> None:
    s = make_scheduler(max_num_batched_tokens=16)
    for i, n in enumerate((10, 30, 5, 7)):
        s.add(f"r{i}", n, 8)
    for batch in run_until_idle(s):
        assert 0 < batch.num_tokens <= 16


def test_long_prompt_is_chunked_and_mixed_with_decodes() -> None:
    s = make_scheduler(max_num_batched_tokens=16)
    s.add("short", 4, 20)
    step(s)  # short prefills and samples its first token
    s.add("long", 50, 4)
    batch = step(s)
    assert chunk_sizes(batch) == {"short": 1, "long": 15}
    assert not next(c for c in batch if c.request.request_id == "long").samples
    sizes = [chunk_sizes(step(s)).get("long") for _ in range(3)]
    assert sizes == [15, 15, 5]  # 15 + 15 + 15 + 5 = 50 prompt tokens, the last chunk samples
    assert s.requests["long"].num_output_tokens == 1


def test_running_cap() -> None:
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add(f"r{i}", 4, 3)
    step(s)
    assert [r.request_id for r in s.running] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2", "r3"]


def test_admission_waits_for_kv() -> None:
    # 8 blocks of 4 tokens = 32 tokens of KV. A 20-token prompt takes 5 blocks.
    s = make_scheduler(num_kv_blocks=8, max_model_len=32)
    s.add("a", 20, 4)
    s.add("b", 20, 4)
    batch = step(s)
    assert chunk_sizes(batch) == {"a": 20}
    assert s.requests["b"].status is RequestStatus.WAITING
    drain_and_free_all(s)


def test_preemption_drops_newest_and_recomputes() -> None:
    # 6 blocks x 4 = 24 tokens. Two requests of 8 prompt tokens each grow by decoding.
    s = make_scheduler(num_kv_blocks=6, max_model_len=24)
    s.add("old", 8, 12)
    s.add("new", 8, 12)
    preempted_at = None
    for i in range(40):
        batch = step(s)
        if batch.preempted:
            preempted_at = i
            assert [r.request_id for r in batch.preempted] == ["new"]
            assert s.requests["new"].num_computed_tokens == 0
            assert s.waiting[0].request_id == "new"
            break
    assert preempted_at is not None
    drain_and_free_all(s)


def test_recompute_prefills_prompt_and_outputs() -> None:
    s = make_scheduler(num_kv_blocks=6, max_model_len=24)
    s.add("old", 8, 12)
    s.add("new", 8, 12)
    while not (batch := step(s)).preempted:
        pass
    victim = s.requests["new"]
    outputs = victim.num_output_tokens
    assert outputs > 0
    while True:
        batch = step(s)
        chunk = next((c for c in batch if c.request is victim), None)
        if chunk is not None:
            break
    # Readmitted: recomputes every token it had (prompt + outputs), then samples again.
    assert (chunk.start, chunk.num_new_tokens, chunk.samples) == (0, 8 + outputs, True)
    assert victim.num_output_tokens == outputs + 1


def test_abort_frees_kv() -> None:
    s = make_scheduler()
    s.add("a", 10, 10)
    s.add("b", 10, 10)
    step(s)
    held = s.blocks.num_free_blocks
    s.abort("a")
    assert s.blocks.num_free_blocks > held
    assert "a" not in s.requests
    assert s.abort("a") is None  # idempotent
    drain_and_free_all(s)


def test_fifo_head_is_never_overtaken() -> None:
    # A big head-of-line request waits for KV; small later ones must not jump it.
    s = make_scheduler(num_kv_blocks=10, max_model_len=40)
    s.add("running", 20, 10)
    step(s)
    s.add("big", 30, 2)
    s.add("small", 2, 2)
    order = []
    for batch in run_until_idle(s):
        for c in batch:
            if c.start == 0 and c.request.request_id not in order:
                order.append(c.request.request_id)
    assert order.index("big") < order.index("small")


def test_no_starvation_under_random_load() -> None:
    rng = random.Random(1)
    s = make_scheduler(num_kv_blocks=24, max_model_len=64, max_num_batched_tokens=24)
    finished_steps: dict[str, int] = {}
    added = 0
    for t in range(3000):
        if added < 200 and rng.random() < 0.3:
            s.add(f"r{added}", rng.randint(1, 40), rng.randint(1, 24))
            added += 1
        batch = step(s)
        for c in batch:
            if c.request.is_finished:
                finished_steps[c.request.request_id] = t
        if added == 200 and not s.has_unfinished:
            break
    assert len(finished_steps) == 200
    assert s.blocks.num_free_blocks == 24


def test_pending_is_skipped_and_keeps_kv() -> None:
    s = make_scheduler()
    s.add("a", 6, 10)
    s.add("b", 6, 10)
    step(s)
    s.set_pending("a")
    held = len(s.requests["a"].block_ids)
    batch = step(s)
    assert chunk_sizes(batch) == {"b": 1}
    assert len(s.requests["a"].block_ids) == held
    s.resume("a")
    assert [r.request_id for r in s.running] == ["a", "b"]


def test_priority_request_goes_before_long_prompts() -> None:
    """A peer's copy (priority) arriving behind long prompts: admitted at once, it
    takes the budget before their chunks, where FIFO kept it waiting for them all."""
    s = make_scheduler(max_num_batched_tokens=16, num_kv_blocks=24, max_model_len=64)
    for i in range(3):
        s.add(f"long{i}", 40, 4)  # 10 blocks each; one 16-token chunk a step
    step(s)
    s.add("plain", 4, 4)
    s.add("peer", 6, 2, priority=True)
    assert [r.request_id for r in s.waiting] == ["peer", "long1", "long2", "plain"]
    batch = step(s)
    assert next(iter(batch)).request.request_id == "peer"
    assert chunk_sizes(batch) == {"peer": 6, "long0": 10}
    assert s.requests["peer"].num_output_tokens == 1
    assert chunk_sizes(step(s))["peer"] == 1  # and decodes first while it runs
    drain_and_free_all(s)


def test_priority_requests_keep_their_order_and_preempt_plain_ones_first() -> None:
    # 6 blocks x 4 = 24 tokens: the peer's growth needs the plain request's KV.
    s = make_scheduler(num_kv_blocks=6, max_model_len=24)
    s.add("plain", 8, 12)
    step(s)
    s.add("peer1", 8, 12, priority=True)
    s.add("peer2", 4, 1, priority=True)
    assert [r.request_id for r in s.waiting] == ["peer1", "peer2"]
    for _ in range(40):
        batch = step(s)
        if batch.preempted:
            assert [r.request_id for r in batch.preempted] == ["plain"]
            # requeued behind any waiting priority request, at the plain ones' head
            assert all(r.is_priority for r in list(s.waiting)[:-1])
            assert s.waiting[-1].request_id == "plain"
            break
    else:
        raise AssertionError("no preemption")
    drain_and_free_all(s)


def test_plain_prefill_chunks_shrink_while_a_priority_request_is_here() -> None:
    """Each of a guest's visits waits out the step in flight: while one is here (running,
    or parked between visits) the plain prompts' chunks take at most
    max_chunk_beside_guests tokens of a step between them; the guest's own prefill and
    plain decodes are not counted."""
    s = make_scheduler(max_num_batched_tokens=32, max_chunk_beside_guests=8)
    s.add("chat", 4, 40)
    step(s)
    s.add("long", 100, 2)
    assert chunk_sizes(step(s)) == {"chat": 1, "long": 31}  # no guest: the whole budget
    s.add("peer", 12, 4, priority=True)
    assert chunk_sizes(step(s)) == {"peer": 12, "chat": 1, "long": 8}
    s.set_pending("peer")  # parked between visits: still here
    assert chunk_sizes(step(s)) == {"chat": 1, "long": 8}
    s.add("late", 40, 2)  # the cap is spent on "long": it waits for a step with room
    assert chunk_sizes(step(s)) == {"chat": 1, "long": 8}
    assert s.requests["late"].status is RequestStatus.WAITING
    s.finish(s.requests["long"])
    assert chunk_sizes(step(s)) == {"chat": 1, "late": 8}  # capped from its first chunk
    s.add("more", 40, 2)  # the plain prompts share the cap: it waits
    assert chunk_sizes(step(s)) == {"chat": 1, "late": 8}
    s.finish(s.requests["peer"])  # gone: the budget again
    assert chunk_sizes(step(s)) == {"chat": 1, "late": 24, "more": 7}
    uncapped = make_scheduler(max_num_batched_tokens=32)  # the default: no cap
    uncapped.add("long", 100, 2)
    uncapped.add("peer", 4, 4, priority=True)
    assert chunk_sizes(step(uncapped)) == {"peer": 4, "long": 28}
    with pytest.raises(ValueError, match="max_chunk_beside_guests"):
        SchedulerConfig(max_chunk_beside_guests=-1)


def test_priority_requests_respect_the_running_cap() -> None:
    s = make_scheduler(max_num_seqs=2)
    s.add("a", 4, 8)
    s.add("b", 4, 8)
    step(s)
    s.add("peer", 4, 2, priority=True)
    step(s)
    assert s.requests["peer"].status is RequestStatus.WAITING  # no slot: it waits, first
    s.finish(s.requests["a"])
    step(s)
    assert s.requests["peer"].status is RequestStatus.RUNNING


def test_config_rejects_kv_smaller_than_one_request() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerConfig(block_size=16, num_kv_blocks=4, max_model_len=128)


def test_snapshot_replay_gives_the_same_schedule() -> None:
    """The estimator's replay: a scheduler restored from a snapshot makes the very
    same batches (same requests, same chunk sizes, same order) as the live one."""
    rng = random.Random(3)
    live = make_scheduler(num_kv_blocks=20, max_model_len=64, max_num_batched_tokens=20)
    for i in range(12):
        live.add(f"r{i}", rng.randint(1, 30), rng.randint(1, 20))
    for _ in range(7):
        step(live)
    replica = restore_scheduler(take_snapshot(live, 1, 0.0))
    assert replica.blocks.num_free_blocks == live.blocks.num_free_blocks
    while live.has_unfinished:
        a, b = step(live), step(replica)
        assert [(c.request.request_id, c.start, c.num_new_tokens) for c in a] == [
            (c.request.request_id, c.start, c.num_new_tokens) for c in b
        ]
        assert [r.request_id for r in a.preempted] == [r.request_id for r in b.preempted]
    assert not replica.has_unfinished
