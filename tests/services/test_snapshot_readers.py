"""Snapshot readers (estimator, relay, gateway): an undecodable snapshot reads as
missing, and the gateway's and the relay's own load counts take a request they sent
as unshown until a snapshot shows its id.

An older writer's row layout, or a blob whose columns disagree, fails to decode
(`msgspec.ValidationError`); the reader skips that instance for the round and keeps
reading the others. Real Redis (the suite's server), a fresh namespace per test: the
blobs are written with `Store.write_snapshot` as a worker writes them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import msgspec
import pytest

from services.estimator.service import EstimatorService
from services.gateway.config import GatewayServiceConfig
from services.gateway.router import routed_here
from services.gateway.service import GatewayService
from services.relay.service import RelayService
from shared.config import ClusterConfig, parse_cluster
from shared.messages.estimator import RouteRequest
from shared.messages.peer import PeerRelease, PeerReq
from shared.sampling import SamplingParams
from shared.scheduling.snapshot import RequestCounters, WorkloadSnapshot
from shared.scheduling.unshown import UnshownRequests
from shared.store import Store
from tests.services.estimator.test_policies import info
from tests.shared.scheduling.builders import limits

LIMITS: dict[str, Any] = {
    "scheduler": limits(seqs=8, budget=64, blocks=64, context=256),
    "num_free_blocks": 62,
}


def good(version: int, parked: bool = False) -> bytes:
    """Two running requests and one waiting (`parked`: and a token-routing copy parked)."""
    snap = WorkloadSnapshot.from_rows(
        version=version,
        wall_time_s=0.0,
        running=[RequestCounters("r0", 0, 20, 1, 20, 10), RequestCounters("r1", 1, 20, 1, 20, 10)],
        pending=[RequestCounters("p0", 3, 20, 2, 21, 10)] if parked else [],
        waiting=[RequestCounters("w0", 2, 30, 0, 0, 10)],
        **LIMITS,
    )
    return msgspec.msgpack.encode(snap)


def old_layout(version: int) -> bytes:
    """What a writer from before the columns stored: rows in running/waiting/pending."""
    data = msgspec.msgpack.encode(
        {
            "version": version,
            "wall_time_s": 0.0,
            **LIMITS,
            "running": [["r0", 0, 20, 1, 20, 10, None, 2]],
            "waiting": [],
            "pending": [],
        }
    )
    return data


def unequal_columns(version: int) -> bytes:
    snap = msgspec.msgpack.decode(good(version))  # as a plain map
    snap["prompt_tokens"] = snap["prompt_tokens"][:1]
    return msgspec.msgpack.encode(snap)


def cluster(redis_url: str, text: str = "") -> ClusterConfig:
    """A cluster file on the suite's Redis in a namespace of its own."""
    ns = f"snap{uuid.uuid4().hex[:8]}"
    return parse_cluster(f'namespace = "{ns}"\nredis_url = "{redis_url}"\n{text}', environ={})


async def publish(store: Store, snapshots: dict[str, bytes]) -> None:
    """Register each instance and write its snapshot, as its worker would."""
    for iid, data in snapshots.items():
        await store.register(info(iid), ttl_s=60.0)
        version = int(msgspec.msgpack.decode(data)["version"])
        await store.write_snapshot(iid, version, data, ttl_s=60.0)


def test_bad_blob_fixture_is_rejected() -> None:
    dec = msgspec.msgpack.Decoder(WorkloadSnapshot)
    for data in (old_layout(1), unequal_columns(1)):
        try:
            dec.decode(data)
        except msgspec.ValidationError:
            continue
        raise AssertionError("decoded")


@pytest.mark.parametrize("shared", [True, False])
async def test_estimator_reads_an_undecodable_snapshot_as_missing(
    redis_url: str, shared: bool
) -> None:
    svc = EstimatorService(
        cluster(redis_url, f"[estimator]\nshared_ledger = {str(shared).lower()}\n")
    )
    assert svc.settings.shared_ledger is shared
    await svc.store.connect()
    try:
        await publish(svc.store, {"bad": good(1), "ok": good(1)})
        await svc.refresh_workers()
        await svc.refresh_snapshots()
        bad, ok = svc.instances["bad"], svc.instances["ok"]
        assert bad.snapshot is not None and bad.visible == {"r0", "r1", "w0"}
        first_time = bad.snapshot_wall_time_s
        # The writer restarts with another layout: its blobs stop decoding; the other
        # instance is still read in the same round, the last good one ages out.
        await publish(svc.store, {"bad": old_layout(2), "ok": good(2)})
        await svc.refresh_snapshots()
        assert bad.snapshot_key[0] == 1 and bad.snapshot_wall_time_s == first_time
        assert "num_running" in svc.snapshots.error("bad")
        assert not bad.is_fresh(first_time + 10.0, svc.settings.snapshot_max_age_s)
        assert ok.snapshot_key[0] == 2
        await publish(svc.store, {"bad": unequal_columns(3)})
        await svc.refresh_snapshots()
        assert "unequal length" in svc.snapshots.error("bad") and bad.snapshot_key[0] == 1
        await publish(svc.store, {"bad": good(4)})
        await svc.refresh_snapshots()
        assert bad.snapshot_key[0] == 4 and svc.snapshots.error("bad") == ""
    finally:
        await svc.store.close()


async def test_relay_reads_an_undecodable_snapshot_as_missing(redis_url: str) -> None:
    relay = RelayService(cluster(redis_url))
    await relay.store.connect()
    try:
        await publish(relay.store, {"old": old_layout(1), "odd": unequal_columns(1), "ok": good(1)})
        await relay.refresh()
        assert relay.load == {"ok": 3}
        assert set(relay.workers) == {"old", "odd", "ok"}
        # One that stops decoding loses its load figure instead of keeping a stale one.
        await publish(relay.store, {"ok": old_layout(2)})
        await relay.refresh()
        assert relay.load == {}
    finally:
        await relay.store.close()


async def test_gateway_reads_an_undecodable_snapshot_as_missing(redis_url: str) -> None:
    gw = GatewayService(GatewayServiceConfig.from_cluster(cluster(redis_url), "t"))
    await gw.store.connect()
    try:
        await publish(gw.store, {"old": old_layout(1), "ok": good(1, parked=True)})
        await gw.directory.refresh()
        sample = gw.metrics.registry.get_sample_value
        assert sample("baton_instance_requests", {"instance": "ok", "state": "running"}) == 2
        assert sample("baton_instance_requests", {"instance": "ok", "state": "waiting"}) == 1
        assert sample("baton_instance_requests", {"instance": "ok", "state": "pending"}) == 1
        assert sample("baton_instance_requests", {"instance": "old", "state": "running"}) is None
        await publish(gw.store, {"ok": unequal_columns(2)})
        await gw.directory.refresh()
        assert sample("baton_instance_requests", {"instance": "ok", "state": "running"}) is None
        assert sample("baton_instance_requests", {"instance": "ok", "state": "pending"}) is None
    finally:
        await gw.store.close()


def holding(version: int, request_ids: list[str]) -> bytes:
    """A snapshot taken now that shows `request_ids` running."""
    running = [RequestCounters(rid, k, 20, 1, 20, 10) for k, rid in enumerate(request_ids)]
    snap = WorkloadSnapshot.from_rows(
        version=version, wall_time_s=time.time(), running=running, **LIMITS
    )
    return msgspec.msgpack.encode(snap)


async def test_gateway_fallback_counts_a_send_until_a_snapshot_shows_it(
    nats_url: str, redis_url: str
) -> None:
    """Routing without an estimator (the fewest requests): a request the gateway sent
    stays counted until a snapshot shows it, however new a snapshot that does not (one
    taken before the worker took the request in); a shown one is counted once; a
    finished one not at all."""
    cl = cluster(redis_url, f'nats_url = "{nats_url}"\n[models.m]\n')
    gw = GatewayService(GatewayServiceConfig.from_cluster(cl, "t"))
    await gw.store.connect()
    await gw.bus.connect()
    req = RouteRequest(request_id="q", model="m", num_prompt_tokens=2, max_tokens=4)

    async def seen(snapshots: dict[str, bytes]) -> None:
        await publish(gw.store, snapshots)
        await gw.directory.refresh()

    def picks() -> list[str]:  # two picks in a row: a tie would alternate
        return [gw.router.fallback(req).instance_id for _ in range(2)]

    try:
        await seen({"a": holding(1, []), "b": holding(1, ["x"])})
        assert picks() == ["a", "a"]
        sent = [
            await gw.submit(
                routed_here(req, gw.workers["a"], "test"),
                f"r{i}",
                [1, 2],
                SamplingParams(max_tokens=4),
                time.time(),
            )
            for i in range(2)
        ]
        await seen({"a": holding(2, [])})  # newer than the sends, without them
        assert picks() == ["b", "b"]  # a: 2 sent, b: 1
        await seen({"a": holding(3, ["r0", "r1"]), "b": holding(2, ["x", "y", "z"])})
        assert picks() == ["a", "a"]  # a: 2 (not 4), b: 3
        late = await gw.submit(
            routed_here(req, gw.workers["a"], "test"), "r2", [1], SamplingParams(), time.time()
        )
        for stream in [*sent, late]:  # r2 ends before any snapshot shows it
            gw.finish(stream, aborted=False)
        await seen({"a": holding(4, []), "b": holding(3, ["x"])})
        assert picks() == ["a", "a"]
    finally:
        await gw.bus.close()
        await gw.store.close()


async def test_relay_counts_a_placed_copy_until_a_snapshot_shows_it(redis_url: str) -> None:
    """The relay puts a request's first visit to a peer model on its least loaded
    instance: a copy it placed counts there until a snapshot shows its id (a newer
    snapshot without it does not drop it), then once; a route that ended, nowhere."""
    relay = RelayService(
        cluster(redis_url, '[models.m]\n[models.x]\n[presets.p]\nmodels = ["x", "m"]\n')
    )
    await relay.store.connect()

    def visit(rid: str) -> str:  # where the relay sends the hand-off of `rid` to model m
        msg = PeerReq(
            request_id=rid,
            preset="p",
            origin_instance="o",
            sender_instance="o",
            from_model=0,
            to_model=1,
            loc=0,
            suffix=[],
            num_prompt_tokens=1,
            max_tokens=4,
            params=SamplingParams(max_tokens=4),
            seq_no=1,
        )
        ((target, _),) = relay.books.on_peer(msg, time.monotonic())
        return target

    def release(rid: str) -> None:  # the origin ended the request
        relay.books.on_release(PeerRelease(request_id=rid, preset="p", origin_instance="o"))

    async def seen(snapshots: dict[str, bytes]) -> None:
        await publish(relay.store, snapshots)
        await relay.refresh()

    try:
        await seen({"a": holding(1, []), "b": holding(1, ["y"])})
        assert visit("r0") == "a"
        await seen({"a": holding(2, []), "b": holding(2, [])})  # newer, without r0
        assert visit("r1") == "b"  # a: r0 placed, b: none
        release("r1")
        await seen({"a": holding(3, ["r0"]), "b": holding(3, ["y"])})
        assert visit("r2") == "a"  # a: r0 once (not twice), b: 1 (r1 released); ties by id
        assert visit("r3") == "b"  # a: 1 + r2, b: 1
        release("r3")  # before any snapshot showed it
        await seen({"a": holding(4, ["r2"]), "b": holding(4, [])})
        assert visit("r4") == "b"  # a: 1, b: 0 (r3's route ended)
    finally:
        await relay.store.close()


async def test_gateway_refresh_loop_ends_on_close_without_its_cancellation(
    nats_url: str, redis_url: str
) -> None:
    """close() also ends the registry refresh loop by a flag: a cancellation can be
    lost on Python 3.11 (asyncio.wait_for inside redis-py), and the loop must not
    run on against a closed store."""
    cl = cluster(redis_url, f'nats_url = "{nats_url}"\n[gateway]\nregistry_refresh_s = 0.05\n')
    gw = GatewayService(GatewayServiceConfig.from_cluster(cl, "t"))
    await gw.start()
    task = gw.refresh_task
    assert task is not None
    try:
        await asyncio.sleep(0.12)
        assert not task.done()
        gw.is_closing = True  # as close() sets it, without the cancel that may be lost
        await asyncio.wait_for(asyncio.shield(task), 2.0)
    finally:
        await gw.close()


def test_unshown_requests_count_until_shown_ended_or_their_instance_gone() -> None:
    """The bookkeeping behind the two tests above (`shared.scheduling.unshown`)."""
    u = UnshownRequests()
    for iid, rid in (("a", "r1"), ("a", "r2"), ("a", "r3"), ("b", "r4")):
        u.add(iid, rid)
    assert (u.count("a"), u.count("b"), u.count("c")) == (3, 1, 0)
    snapshot = msgspec.msgpack.Decoder(WorkloadSnapshot).decode
    u.refresh({"a", "b"}, {"a": snapshot(holding(1, []))})  # not shown: still counted
    assert u.count("a") == 3
    u.refresh({"a", "b"}, {"a": snapshot(holding(2, ["r1", "x"]))})  # counted there now
    assert u.count("a") == 2
    u.discard("a", "r2")  # ended
    u.discard("c", "r9")  # an unknown instance: nothing to do
    assert u.count("a") == 1
    u.refresh({"a", "b"}, {}, is_open=lambda rid: rid != "r3")  # ended, told by the caller
    assert u.count("a") == 0
    u.refresh({"a"}, {})  # b left the registry
    assert u.count("b") == 0
    u.add("b", "r5")  # back: counts afresh
    assert u.count("b") == 1
