"""Workload snapshots on the wire: columns, the row view, validation on decode."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from shared.scheduling.scheduler import Scheduler, SchedulerConfig
from shared.scheduling.snapshot import (
    RequestCounters,
    WorkloadSnapshot,
    restore_scheduler,
    take_snapshot,
)
from tests.shared.scheduling.builders import make_scheduler, step

LIMITS: dict[str, Any] = {
    "version": 3,
    "wall_time_s": 12.5,
    "scheduler": SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_kv_blocks=64, max_model_len=128
    ),
    "num_free_blocks": 50,
}
DECODER = msgspec.msgpack.Decoder(WorkloadSnapshot)


def wire(snap: WorkloadSnapshot) -> WorkloadSnapshot:
    """Through msgpack, as the estimator reads it from Redis."""
    return DECODER.decode(msgspec.msgpack.encode(snap))


def test_take_encode_decode_restore_schedules_the_same_batches() -> None:
    """take_snapshot -> msgpack -> restore_scheduler: the same batches (requests,
    chunk starts and sizes, preemptions) as the live scheduler, pending ones included."""
    rng = random.Random(11)
    live = make_scheduler(num_kv_blocks=24, max_model_len=64, max_num_batched_tokens=24)
    for i in range(14):
        req = live.add(f"r{i}", rng.randint(1, 30), rng.randint(1, 20))
        req.predicted_output_tokens = rng.choice([None, rng.randint(1, 20)])
    for _ in range(6):
        step(live)
    parked = live.running[0].request_id
    live.set_pending(parked)  # a peer writes: KV kept, not scheduled
    step(live)
    snap = wire(take_snapshot(live, 1, 0.0))
    assert snap.num_pending == 1 and snap.request_ids[snap.num_running] == parked
    assert snap.num_running == len(live.running) and snap.num_waiting == len(live.waiting)
    replica = restore_scheduler(snap)
    assert replica.blocks.num_free_blocks == live.blocks.num_free_blocks
    assert list(replica.pending) == [parked]
    for a_req, b_req in zip(
        [*live.running, *live.waiting], [*replica.running, *replica.waiting], strict=True
    ):
        assert a_req.request_id == b_req.request_id
        assert a_req.predicted_output_tokens == b_req.predicted_output_tokens
        assert len(a_req.block_ids) == len(b_req.block_ids)
    while live.has_unfinished and len(live.pending) < live.num_admitted:
        a, b = step(live), step(replica)
        assert [(c.request.request_id, c.start, c.num_new_tokens) for c in a] == [
            (c.request.request_id, c.start, c.num_new_tokens) for c in b
        ]
        assert [r.request_id for r in a.preempted] == [r.request_id for r in b.preempted]
        if len(a) == 0:
            break
    live.resume(parked)
    replica.resume(parked)
    while live.has_unfinished:
        a, b = step(live), step(replica)
        assert [(c.request.request_id, c.start, c.num_new_tokens) for c in a] == [
            (c.request.request_id, c.start, c.num_new_tokens) for c in b
        ]
    assert not replica.has_unfinished


def request_state(s: Scheduler) -> list[tuple[object, ...]]:
    """Every request's counters, status, flags and blocks held, in queue order."""
    return [
        (r.request_id, r.status, r.arrival_seq, r.num_prompt_tokens, r.max_tokens,
         r.num_output_tokens, r.num_computed_tokens, r.predicted_output_tokens,
         r.is_priority, len(r.block_ids))
        for r in [*s.running, *s.pending.values(), *s.waiting]
    ]  # fmt: skip


def test_a_restored_scheduler_equals_the_live_one_guests_and_cap_included() -> None:
    """The snapshot carries the whole SchedulerConfig (the chunk cap beside guests too)
    and each request's priority flag: the replica's state equals the live one, and it
    schedules the same batches, the cap and the guests' precedence included."""
    rng = random.Random(5)
    live = make_scheduler(
        num_kv_blocks=48, max_model_len=64, max_num_batched_tokens=32, max_chunk_beside_guests=6
    )
    for i in range(10):
        live.add(f"r{i}", rng.randint(8, 30), rng.randint(1, 20), priority=i % 3 == 0)
    for _ in range(3):
        step(live)
    live.add("late-guest", 12, 4, priority=True)  # waits ahead of the plain ones
    snap = wire(take_snapshot(live, 1, 0.0))
    assert snap.scheduler == live.config
    assert sum(snap.priority) == sum(r.is_priority for r in live.requests.values()) >= 2
    replica = restore_scheduler(snap)
    assert replica.config == live.config
    assert request_state(replica) == request_state(live)
    assert replica.blocks.num_free_blocks == live.blocks.num_free_blocks
    num_capped = 0
    while live.has_unfinished:
        a, b = step(live), step(replica)
        assert [(c.request.request_id, c.start, c.num_new_tokens) for c in a] == [
            (c.request.request_id, c.start, c.num_new_tokens) for c in b
        ]
        plain_prefill = sum(
            c.num_new_tokens for c in a if not c.is_decode and not c.request.is_priority
        )
        num_capped += plain_prefill == 6
        assert request_state(replica) == request_state(live)
    assert num_capped > 0  # the cap was in force, and the replica kept it


def test_take_snapshot_writes_the_columns_in_slot_order() -> None:
    live = make_scheduler(max_num_seqs=2)
    for i in range(4):
        live.add(f"r{i}", 6, 5)
    step(live)
    live.set_pending("r0")
    snap = take_snapshot(live, 1, 0.0)
    assert snap.request_ids == ["r1", "r0", "r2", "r3"]  # running, pending, waiting
    assert (snap.num_running, snap.num_pending, snap.num_waiting) == (1, 1, 2)
    assert snap.num_requests == 4
    assert snap.predicted_output_tokens == [-1, -1, -1, -1]
    assert snap.num_blocks == [2, 2, 0, 0]  # 6 prompt + 1 sampled token in 4-token blocks
    assert [c.request_id for c in snap.running] == ["r1"]
    assert [c.request_id for c in snap.pending] == ["r0"]
    assert [c.request_id for c in snap.waiting] == ["r2", "r3"]


def test_from_rows_and_the_row_properties_round_trip() -> None:
    running = [
        RequestCounters("a", 0, 10, 3, 12, 20, 7, 4),
        RequestCounters("b", 2, 9, 0, 4, 8, None, 3),
    ]
    pending = [RequestCounters("p", 1, 5, 2, 6, 9, 4, 2)]
    waiting = [RequestCounters("w", 3, 30, 0, 0, 16, 12, 0)]
    snap = WorkloadSnapshot.from_rows(running=running, pending=pending, waiting=waiting, **LIMITS)
    assert (snap.num_running, snap.num_pending, snap.num_waiting) == (2, 1, 1)
    assert snap.request_ids == ["a", "b", "p", "w"]
    assert snap.predicted_output_tokens == [7, -1, 4, 12]
    for s in (snap, wire(snap)):
        assert s.running == running
        assert s.pending == pending
        assert s.waiting == waiting
        assert s.version == 3 and s.num_free_blocks == 50
    assert wire(snap) == snap


def test_from_rows_derives_missing_blocks_as_the_allocation_holds_them() -> None:
    snap = WorkloadSnapshot.from_rows(
        running=[
            RequestCounters("decode", 0, 10, 3, 12, 20),  # 12 computed -> 3 blocks
            RequestCounters("prefill", 1, 9, 0, 4, 8),  # all 9 prompt tokens -> 3 blocks
        ],
        waiting=[RequestCounters("w", 2, 30, 0, 0, 16)],
        **LIMITS,
    )
    assert snap.num_blocks == [3, 3, 0]
    assert snap.running[0].num_blocks == 3
    with pytest.raises(TypeError, match="scheduler"):
        WorkloadSnapshot.from_rows(
            running=[RequestCounters("a", 0, 1, 0, 0, 1)],
            **{k: v for k, v in LIMITS.items() if k != "scheduler"},
        )


def test_an_idle_snapshot_has_empty_columns() -> None:
    snap = wire(take_snapshot(make_scheduler(), 1, 0.0))
    assert snap.num_requests == 0 and snap.request_ids == [] and snap.num_blocks == []
    assert snap.running == [] and snap.waiting == [] and snap.pending == []


def _encoded(**changes: object) -> bytes:
    snap = WorkloadSnapshot.from_rows(
        running=[RequestCounters("a", 0, 10, 3, 12, 20, 7, 4)],
        waiting=[RequestCounters("w", 1, 30, 0, 0, 16, None, 0)],
        **LIMITS,
    )
    return msgspec.msgpack.encode({**msgspec.structs.asdict(snap), **changes})


def test_mismatched_columns_are_rejected_on_decode() -> None:
    DECODER.decode(_encoded())  # the unchanged one decodes
    with pytest.raises(msgspec.ValidationError, match="columns of unequal length") as err:
        DECODER.decode(_encoded(prompt_tokens=[10]))
    assert "prompt_tokens 1" in str(err.value) and "request_ids 2" in str(err.value)
    with pytest.raises(msgspec.ValidationError, match="unequal length"):
        DECODER.decode(_encoded(num_blocks=[4, 0, 0]))
    with pytest.raises(msgspec.ValidationError, match="do not fit its 2 rows"):
        DECODER.decode(_encoded(num_running=2, num_pending=1))
    with pytest.raises(msgspec.ValidationError, match="do not fit"):
        DECODER.decode(_encoded(num_pending=-1))
    with pytest.raises(ValueError, match="unequal length"):  # and on construction
        WorkloadSnapshot(**LIMITS, num_running=0, num_pending=0, request_ids=["x"])


def test_a_newer_writers_scheduler_fields_are_skipped() -> None:
    """A limit a newer worker knows and this reader does not: the snapshot still reads
    (a rolling upgrade keeps routing on snapshots)."""
    blob = msgspec.msgpack.decode(_encoded())
    blob["scheduler"]["max_prefill_chunks"] = 3
    snap = DECODER.decode(msgspec.msgpack.encode(blob))
    assert snap.scheduler == LIMITS["scheduler"]


def test_an_older_writers_rows_do_not_decode() -> None:
    """The row layout (running / waiting / pending lists of per-request arrays) must
    fail, not read as an idle instance: num_running is required for that."""
    old = msgspec.msgpack.encode(
        {**LIMITS, "running": [["a", 0, 10, 3, 12, 20, 7, 4]], "waiting": [], "pending": []}
    )
    with pytest.raises(msgspec.ValidationError, match="num_running"):
        DECODER.decode(old)
