"""Snapshot readers (estimator, relay, gateway) treat an undecodable snapshot as missing.

An older writer's row layout, or a blob whose columns disagree, fails to decode
(`msgspec.ValidationError`); the reader skips that instance for the round and keeps
reading the others. The store is a stand-in: only its reads are used.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from services.estimator.service import EstimatorService
from services.gateway.config import GatewayServiceConfig
from services.gateway.service import GatewayService
from services.relay.service import RelayService
from shared.config import parse_cluster
from shared.messages.registry import WorkerInfo
from shared.scheduling.snapshot import RequestCounters, WorkloadSnapshot
from shared.store import VersionedBlob

LIMITS: dict[str, Any] = {
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    "block_size": 16,
    "num_kv_blocks": 64,
    "num_free_blocks": 62,
    "max_model_len": 256,
}


def info(iid: str) -> WorkerInfo:
    return WorkerInfo(
        instance_id=iid,
        model="m",
        inbox=f"ns.worker.{iid}.in",
        max_model_len=256,
        max_num_seqs=8,
        started_at_s=0.0,
        heartbeat_at_s=0.0,
    )


def good(version: int, wall_time_s: float) -> VersionedBlob:
    snap = WorkloadSnapshot.from_rows(
        version=version,
        wall_time_s=wall_time_s,
        running=[RequestCounters("r0", 0, 20, 1, 20, 10), RequestCounters("r1", 1, 20, 1, 20, 10)],
        waiting=[RequestCounters("w0", 2, 30, 0, 0, 10)],
        **LIMITS,
    )
    return VersionedBlob(version, wall_time_s, msgspec.msgpack.encode(snap))


def old_layout(version: int, wall_time_s: float) -> VersionedBlob:
    """What a writer from before the columns stored: rows in running/waiting/pending."""
    data = msgspec.msgpack.encode(
        {
            "version": version,
            "wall_time_s": wall_time_s,
            **LIMITS,
            "running": [["r0", 0, 20, 1, 20, 10, None, 2]],
            "waiting": [],
            "pending": [],
        }
    )
    return VersionedBlob(version, wall_time_s, data)


def unequal_columns(version: int, wall_time_s: float) -> VersionedBlob:
    snap = msgspec.msgpack.decode(good(version, wall_time_s).data)  # as a plain map
    snap["prompt_tokens"] = snap["prompt_tokens"][:1]
    return VersionedBlob(version, wall_time_s, msgspec.msgpack.encode(snap))


class StubStore:
    def __init__(self, snapshots: dict[str, VersionedBlob | None]) -> None:
        self.snapshots = snapshots

    async def live_workers(self) -> list[WorkerInfo]:
        return [info(iid) for iid in self.snapshots]

    async def read_snapshots(self, ids: list[str]) -> dict[str, VersionedBlob | None]:
        return {i: self.snapshots.get(i) for i in ids}

    async def read_snapshots_and_ledgers(
        self, ids: list[str]
    ) -> tuple[dict[str, VersionedBlob | None], dict[str, dict[bytes, bytes]]]:
        return await self.read_snapshots(ids), {i: {} for i in ids}

    async def read_calibrations(self, ids: list[str]) -> dict[str, bytes | None]:
        return dict.fromkeys(ids)


def test_bad_blob_fixture_is_rejected() -> None:
    dec = msgspec.msgpack.Decoder(WorkloadSnapshot)
    for blob in (old_layout(1, 0.0), unequal_columns(1, 0.0)):
        try:
            dec.decode(blob.data)
        except msgspec.ValidationError:
            continue
        raise AssertionError("decoded")


@pytest.mark.parametrize("shared", [True, False])
async def test_estimator_reads_an_undecodable_snapshot_as_missing(shared: bool) -> None:
    text = f"[estimator]\nshared_ledger = {str(shared).lower()}\n"
    svc = EstimatorService(parse_cluster(text, environ={}))
    assert svc.settings.shared_ledger is shared
    stub = StubStore({"bad": good(1, 100.0), "ok": good(1, 100.0)})
    svc.store = stub  # type: ignore[assignment]
    await svc._refresh_workers()
    await svc.refresh_snapshots()
    bad, ok = svc.instances["bad"], svc.instances["ok"]
    assert bad.snapshot is not None and bad.visible == {"r0", "r1", "w0"}
    # The writer restarts with another layout: its blobs stop decoding; the other
    # instance is still read in the same round, the last good one ages out.
    stub.snapshots = {"bad": old_layout(2, 101.0), "ok": good(2, 101.0)}
    await svc.refresh_snapshots()
    assert bad.snapshot_key == (1, 100.0) and bad.snapshot_wall_time_s == 100.0
    assert "num_running" in bad.snapshot_error
    assert not bad.is_fresh(110.0, svc.settings.snapshot_max_age_s)
    assert ok.snapshot_key == (2, 101.0)
    stub.snapshots["bad"] = unequal_columns(3, 102.0)
    await svc.refresh_snapshots()
    assert "unequal length" in bad.snapshot_error and bad.snapshot_key == (1, 100.0)
    stub.snapshots["bad"] = good(4, 103.0)
    await svc.refresh_snapshots()
    assert bad.snapshot_key == (4, 103.0) and bad.snapshot_error == ""


async def test_relay_reads_an_undecodable_snapshot_as_missing() -> None:
    relay = RelayService(parse_cluster("", environ={}))
    relay.store = StubStore(  # type: ignore[assignment]
        {"old": old_layout(1, 0.0), "odd": unequal_columns(1, 0.0), "ok": good(1, 0.0)}
    )
    await relay._refresh()
    assert relay.load == {"ok": 3}
    assert set(relay.workers) == {"old", "odd", "ok"}


async def test_gateway_reads_an_undecodable_snapshot_as_missing() -> None:
    cluster = parse_cluster("", environ={})
    gw = GatewayService(GatewayServiceConfig.from_cluster(cluster, "t"))
    gw.store = StubStore({"old": old_layout(1, 0.0), "ok": good(1, 0.0)})  # type: ignore[assignment]
    await gw._refresh_workers()
    sample = gw.metrics.registry.get_sample_value
    assert sample("baton_instance_requests", {"instance": "ok", "state": "running"}) == 2
    assert sample("baton_instance_requests", {"instance": "ok", "state": "waiting"}) == 1
    assert sample("baton_instance_requests", {"instance": "old", "state": "running"}) is None
