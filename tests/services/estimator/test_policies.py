"""Routing policies and the ledger: pure objects, built from plain data."""

from __future__ import annotations

from services.estimator.ledger import Ledger, LedgerEntry
from services.estimator.policies import InstanceView, RoundRobin, ShortestQueue, create_policy
from shared.messages.estimator import RouteRequest
from shared.messages.registry import WorkerInfo
from shared.scheduling.snapshot import RequestCounters, WorkloadSnapshot
from tests.shared.scheduling.builders import limits
from tests.support.builders import worker_info

REQ = RouteRequest(request_id="r", model="m", num_prompt_tokens=10, max_tokens=10)


def info(iid: str) -> WorkerInfo:
    return worker_info(iid, max_model_len=256, max_num_seqs=8)


def snapshot(num_running: int, free: int = 64) -> WorkloadSnapshot:
    running = [RequestCounters(f"x{i}", i, 10, 1, 11, 10) for i in range(num_running)]
    return WorkloadSnapshot.from_rows(
        version=1,
        wall_time_s=0.0,
        num_free_blocks=free,
        running=running,
        scheduler=limits(seqs=8, budget=256, blocks=64, context=256),
    )


def entry(rid: str, iid: str, t: float = 0.0) -> LedgerEntry:
    return LedgerEntry(rid, iid, 10, 10, t)


def test_shortest_queue_counts_snapshot_and_ledger() -> None:
    policy = ShortestQueue()
    a = InstanceView(
        info("a"), snapshot(1), unseen=[entry("p", "a"), entry("q", "a")]
    )  # 3 requests
    b = InstanceView(info("b"), snapshot(2), unseen=[])  # 2 requests
    assert policy.choose(REQ, [a, b]).instance_id == "b"


def test_shortest_queue_breaks_ties_by_free_kv_then_rotates() -> None:
    policy = ShortestQueue()
    a, b = (
        InstanceView(info("a"), snapshot(1, free=10), []),
        InstanceView(info("b"), snapshot(1, free=50), []),
    )
    assert policy.choose(REQ, [a, b]).instance_id == "b"
    c, d = InstanceView(info("c"), snapshot(0), []), InstanceView(info("d"), snapshot(0), [])
    assert {policy.choose(REQ, [c, d]).instance_id for _ in range(2)} == {"c", "d"}


def test_stale_snapshot_falls_back_to_the_ledger() -> None:
    silent = InstanceView(info("a"), None, unseen=[entry("p", "a")])
    assert silent.num_requests == 1 and silent.num_free_blocks == 0


def test_round_robin_cycles_in_id_order() -> None:
    policy = RoundRobin()
    views = [InstanceView(info(i), None, []) for i in ("b", "a", "c")]
    assert [policy.choose(REQ, views).instance_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert isinstance(create_policy("round-robin"), RoundRobin)


def test_ledger_reconciles_on_visibility_done_and_ttl() -> None:
    ledger = Ledger(ttl_s=10)
    ledger.add(entry("r1", "a", t=0))
    ledger.add(entry("r2", "a", t=0))
    ledger.add(entry("r3", "b", t=5))
    assert ledger.reconcile("a", {"r1", "zz"}) == 1  # r1 now shows in a's snapshot
    assert [e.request_id for e in ledger.pending("a")] == ["r2"]
    assert ledger.remove("r2") and not ledger.remove("r2")  # RequestDoneEvent
    assert ledger.expire(now_s=12) == 0 and ledger.expire(now_s=16) == 1  # r3 outlived its TTL
    assert len(ledger) == 0
    ledger.add(entry("r4", "c"))
    ledger.forget_instance("c")
    assert "r4" not in ledger


def test_departed_sees_expiry_and_restart_under_the_same_id() -> None:
    from msgspec import structs

    from shared.messages.registry import departed

    a, b = info("a"), info("b")
    restarted = structs.replace(b, started_at_s=99.0)
    assert departed({"a": a, "b": b}, {"b": restarted}) == ["a", "b"]
    assert departed({"a": a}, {"a": structs.replace(a, heartbeat_at_s=5.0)}) == []
