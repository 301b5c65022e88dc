"""Two estimator replicas in one queue group, on real NATS/Redis: the shared ledger.

Routes go straight to the route subject (no gateway), so the two random-tiny
workers stay idle and the ledger is the only load signal shortest-queue sees: any
unevenness in a burst is herding by replicas that do not know each other's
decisions.
"""

from __future__ import annotations

import asyncio
import statistics
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest
import pytest_asyncio

from services.estimator.ledger import (
    LEDGER_ENTRY_DECODER,
    LedgerEntry,
    SharedLedger,
    encode_entries,
)
from services.estimator.service import EstimatorService
from shared import subjects
from shared.bus import Bus
from shared.config import ClusterConfig, parse_cluster
from shared.messages.estimator import ROUTE_REPLY_DECODER, RouteReply, RouteRequest
from shared.store import Store
from tests.support.stack import start_worker, tiny_cluster_text

NUM_BURST = 15  # odd: a replica's own alternation cannot hide the other's
NUM_BURSTS = 4


def cluster_for(nats_url: str, redis_url: str, namespace: str, shared: bool) -> ClusterConfig:
    text = tiny_cluster_text(nats_url, redis_url, namespace=namespace)
    text = text.replace(
        '[estimator]\npolicy = "shortest-queue"',
        f'[estimator]\npolicy = "shortest-queue"\nshared_ledger = {str(shared).lower()}',
    )
    text = text.replace('policy = "round-robin"', 'policy = "shortest-queue"')
    return parse_cluster(text)


async def wait_until(cond: Callable[[], bool], what: str, limit_s: float = 30.0) -> None:
    """Liveness wait (no timing is asserted: the limit only turns a hang into an error)."""
    for _ in range(int(limit_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(what)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def workers(nats_url: str, redis_url: str) -> AsyncIterator[str]:
    """Two idle random-tiny workers w0, w1 in a fresh namespace (yielded)."""
    ns = f"t{uuid.uuid4().hex[:8]}"
    cluster = cluster_for(nats_url, redis_url, ns, shared=True)
    started = await asyncio.gather(*(start_worker(cluster, f"w{i}") for i in range(2)))
    yield ns
    for w, _ in started:
        w.request_stop()
    await asyncio.wait([t for _, t in started], timeout=30)


class Replicas:
    """Two EstimatorServices of one cluster file, and a client bus."""

    def __init__(self, cluster: ClusterConfig) -> None:
        self.cluster = cluster
        self.estimators = [EstimatorService(cluster), EstimatorService(cluster)]
        self.client = Bus(cluster.nats_url, name="test-client")
        self.tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Replicas:
        self.tasks = [asyncio.create_task(e.run()) for e in self.estimators]
        await self.client.connect()
        await wait_until(
            lambda: all(
                len(e.instances) == 2 and all(s.snapshot is not None for s in e.instances.values())
                for e in self.estimators
            ),
            "replicas see both workers' snapshots",
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        for e in self.estimators:
            e.request_stop()
        await asyncio.wait(self.tasks, timeout=30)
        await self.client.close()

    async def route(self, rid: str) -> RouteReply:
        req = RouteRequest(request_id=rid, model="auto", num_prompt_tokens=16, max_tokens=8)
        subject = subjects.estimator_route(self.cluster.namespace)
        reply = await self.client.request(subject, req, ROUTE_REPLY_DECODER, timeout_s=10)
        assert reply.error is None and reply.instance_id is not None, reply
        return reply


async def sequential_burst(
    r: Replicas, tag: str, split: Counter[str], decision_ms: list[float]
) -> list[int]:
    """Requests one at a time; with the shared ledger each waits until every replica's
    ledger holds the previous one, without it only for its reply. Adds to `split` (per
    instance, all bursts so far); returns |w0 - w1| of it after each request."""
    gaps: list[int] = []
    for i in range(NUM_BURST):
        rid = f"{tag}-{i}"
        reply = await r.route(rid)
        split[reply.instance_id or ""] += 1
        decision_ms.append(reply.decision_ms or 0.0)
        gaps.append(abs(split["w0"] - split["w1"]))
        if r.cluster.estimator.shared_ledger:
            await wait_until(
                lambda rid=rid: all(rid in e.ledger for e in r.estimators),  # type: ignore[misc]
                f"{rid} reaches both ledgers",
            )
    return gaps


async def concurrent_burst(r: Replicas, tag: str) -> tuple[Counter[str], list[float]]:
    replies = await asyncio.gather(*(r.route(f"{tag}-{i}") for i in range(NUM_BURST)))
    return Counter(x.instance_id or "" for x in replies), [x.decision_ms or 0.0 for x in replies]


@pytest.mark.parametrize("shared", [True, False])
async def test_two_replicas_split_a_burst(
    shared: bool, workers: str, nats_url: str, redis_url: str
) -> None:
    # A fresh namespace per case would need fresh workers; instead each case uses its
    # own request ids and starts with empty estimator ledgers (new replicas).
    cluster = cluster_for(nats_url, redis_url, workers, shared)
    async with Replicas(cluster) as r:
        split: Counter[str] = Counter()
        gaps: list[int] = []
        seq_ms: list[float] = []
        for k in range(NUM_BURSTS):
            gaps += await sequential_burst(
                r, f"seq-{shared}-{k}-{uuid.uuid4().hex[:6]}", split, seq_ms
            )
        per_replica = {i: e.num_decisions for i, e in enumerate(r.estimators)}
        conc, decision_ms = await concurrent_burst(r, f"conc-{shared}-{uuid.uuid4().hex[:6]}")
        print(
            f"\nshared_ledger={shared}: {NUM_BURSTS} sequential bursts of {NUM_BURST} -> "
            f"{dict(sorted(split.items()))} (decisions per replica {per_replica}); "
            f"largest |w0 - w1| after any request {max(gaps)}; one "
            f"concurrent burst of {NUM_BURST} -> {dict(sorted(conc.items()))}; decision_ms "
            f"p50 {statistics.median(seq_ms):.4f} mean {statistics.fmean(seq_ms):.4f} "
            f"(sequential), p50 {statistics.median(decision_ms):.4f} (concurrent)"
        )
        assert sum(split.values()) == NUM_BURSTS * NUM_BURST
        if shared:
            # Every replica knew every earlier decision: shortest-queue alternates.
            assert max(gaps) <= 1
            # ... and the entries are in Redis, keyed by instance.
            store = Store(redis_url, workers)
            await store.connect()
            try:
                _, stored = await store.read_snapshots_and_ledgers(["w0", "w1"])
            finally:
                await store.close()
            ids = [k.decode() for h in stored.values() for k in h]
            assert len([i for i in ids if i.startswith("seq-True")]) == NUM_BURSTS * NUM_BURST


# ---- SharedLedger bookkeeping (pure) -----------------------------------------------


def entry(rid: str, iid: str = "a", t: float = 100.0) -> LedgerEntry:
    return LedgerEntry(rid, iid, 10, 10, t, 5)


def stored(*entries: LedgerEntry) -> dict[bytes, bytes]:
    return {rid.encode(): data for _, rid, data in encode_entries(entries)}


def test_entries_round_trip_through_msgpack() -> None:
    e = entry("r1")
    assert LEDGER_ENTRY_DECODER.decode(encode_entries([e])[0][2]) == e
    assert msgspec.msgpack.encode(e)  # array_like: compact


def test_merge_adds_others_entries_and_drops_them_when_redis_does() -> None:
    a, b = SharedLedger(ttl_s=10), SharedLedger(ttl_s=10)
    a.record(entry("r1"))
    adds, _ = a.take_writes()
    assert b.merge("a", stored(*adds), set(), now_s=101) == 1
    assert [e.request_id for e in b.ledger.pending("a")] == ["r1"]
    b.merge("a", {}, set(), now_s=102)  # reconciled elsewhere: gone from Redis
    assert "r1" not in b.ledger
    # this replica's own entry stays although not written yet
    b.record(entry("own"))
    b.merge("a", {}, set(), now_s=102)
    assert "own" in b.ledger


def test_done_visible_and_expired_entries_are_not_re_added() -> None:
    s = SharedLedger(ttl_s=10)
    s.done("r1", "a", now_s=101)  # the event came before the entry was read
    assert s.merge("a", stored(entry("r1")), set(), now_s=101) == 0
    assert s.merge("a", stored(entry("r2")), {"r2"}, now_s=101) == 0  # snapshot shows it
    assert s.merge("a", stored(entry("old", t=80)), set(), now_s=101) == 0  # past its TTL
    _, deletes = s.take_writes()
    assert ("a", "old") in deletes and ("a", "r1") not in deletes  # r1 was not held here
    s.record(entry("r4"))
    s.done("r4", "a", now_s=101)
    assert "r4" not in s.ledger and ("a", "r4") in s.take_writes()[1]
    s.record(entry("r3"))
    assert s.reconcile("a", {"r3"}, now_s=102) == 1
    assert s.merge("a", stored(entry("r3")), set(), now_s=102) == 0  # tombstone
    assert ("a", "r3") in s.take_writes()[1]
    assert s.expire(now_s=200) == 0 and s.merge("a", stored(entry("r3", t=195)), set(), 200) == 1
