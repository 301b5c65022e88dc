"""Workers come and go: a killed worker is noticed by /health and routing; SIGTERM drains."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from services.worker.registration import ORPHAN_GRACE_TTLS
from services.worker.service import WorkerService
from shared.config import parse_cluster
from shared.messages.registry import WorkerInfo
from shared.messages.worker import AbortRequest, SubmitRequest
from shared.sampling import SamplingParams
from tests.support.clusters import instance, sim_model
from tests.support.stack import (
    kill,
    running,
    start_worker,
    tiny_cluster_text,
    worker_process,
)

CHAT = {"model": "random-tiny", "messages": [{"role": "user", "content": "Tell me a story."}]}


async def wait_for(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_killed_worker_is_noticed_by_health_and_routing(
    nats_url: str, redis_url: str, tmp_path: Path
) -> None:
    text = tiny_cluster_text(nats_url, redis_url)
    (tmp_path / "cluster.toml").write_text(text)
    cluster = parse_cluster(text)
    with worker_process(tmp_path / "cluster.toml", "victim") as victim:
        async with running(cluster, num_workers=0) as stack:
            await wait_for(
                lambda: "victim" in stack.gateway.workers and "victim" in stack.estimator.workers,
                90,
            )
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
                assert (await client.get("/health")).status_code == 200
                body = {**CHAT, "stream": True, "max_tokens": 200, "ignore_eos": True}
                async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                    assert resp.status_code == 200
                    lines = resp.aiter_lines()
                    for _ in range(3):  # streaming has begun
                        await anext(lines)
                    os.killpg(victim.pid, signal.SIGKILL)  # no drain, no deregistration
                    rest = [line async for line in lines]
                # the open stream is told in-band that its worker went away: at once by its
                # direct link closing (or by the registry, for a request sent over NATS)
                told = ("lost the connection to worker victim", "went away")
                assert any(t in line for line in rest for t in told), rest[-3:]
                assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"

                # the registry notices within its TTL (the link told the stream sooner)
                await wait_for(lambda: not stack.gateway.is_ready, 10)
                health = await client.get("/health")
                assert health.status_code == 503 and health.json()["workers"] == []
                resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
                assert resp.status_code == 503
                assert resp.headers["retry-after"] == "1"
                assert "no live worker" in resp.json()["error"]["message"]
            await wait_for(lambda: not stack.estimator.workers, 5)


async def test_health_is_degraded_while_a_model_has_no_worker(
    nats_url: str, redis_url: str
) -> None:
    """The cluster file names two models and only one has a live instance: /health
    still answers 200 (the gateway serves that one) but says "degraded" and which
    model has none; requests to it get the 503 that says so."""
    text = tiny_cluster_text(nats_url, redis_url).replace(
        '[models.random-tiny]\ndtype = "float32"\n',
        '[models.random-tiny]\ndtype = "float32"\n[models.random-tiny-b]\ndtype = "float32"\n'
        '[[instances]]\nmodel = "random-tiny-b"\n'
        "[instances.scheduler]\nnum_kv_blocks = 64\nmax_model_len = 256\n",
        1,
    )
    async with (
        running(parse_cluster(text), num_workers=1) as stack,
        httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client,
    ):
        health = await client.get("/health")
        assert health.status_code == 200
        assert health.json()["status"] == "degraded"
        assert health.json()["models"] == {"random-tiny": 1, "random-tiny-b": 0}
        resp = await client.post(
            "/v1/chat/completions", json={**CHAT, "model": "random-tiny-b", "max_tokens": 2}
        )
        assert resp.status_code == 503 and "no live worker" in resp.json()["error"]["message"]


async def stopped_mid_stream(
    client: httpx.AsyncClient, worker: WorkerService, max_tokens: int
) -> list[str]:
    """Stream a request; once its first line came, the worker is told to stop (what
    SIGTERM does). The rest of the stream."""
    body = {**CHAT, "stream": True, "max_tokens": max_tokens, "ignore_eos": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        lines = resp.aiter_lines()
        await anext(lines)
        worker.request_stop()
        return [line async for line in lines]


async def test_sigterm_drains_in_flight_requests(nats_url: str, redis_url: str) -> None:
    cluster = parse_cluster(tiny_cluster_text(nats_url, redis_url))
    async with running(cluster, num_workers=1) as stack:
        worker, task = stack.workers[0], stack.worker_tasks[0]
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            rest = await stopped_mid_stream(client, worker, max_tokens=40)
            assert '"finish_reason":"length"' in "".join(rest)  # the request finished, not aborted
            await asyncio.wait_for(task, 10)  # then the worker exits
            await wait_for(lambda: not stack.gateway.workers, 5)  # and deregistered at once
            assert (await client.get("/health")).status_code == 503


async def test_worker_replaced_under_same_cluster_serves_again(
    nats_url: str, redis_url: str
) -> None:
    cluster = parse_cluster(tiny_cluster_text(nats_url, redis_url))
    async with (
        running(cluster, num_workers=0) as stack,
        httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client,
    ):
        assert (await client.get("/health")).status_code == 503
        worker, task = await start_worker(cluster, "late")
        stack.add_worker(worker, task)
        await wait_for(
            lambda: "late" in stack.gateway.workers and "late" in stack.estimator.workers, 10
        )
        assert (await client.get("/health")).status_code == 200
        resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3})
        assert resp.status_code == 200 and resp.headers["x-instance-id"] == "late"


async def test_drain_timeout_fails_what_still_runs(nats_url: str, redis_url: str) -> None:
    text = tiny_cluster_text(nats_url, redis_url).replace(
        "drain_timeout_s = 3.0", "drain_timeout_s = 0.0"
    )
    async with running(parse_cluster(text), num_workers=1) as stack:
        worker, task = stack.workers[0], stack.worker_tasks[0]
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            rest = await stopped_mid_stream(client, worker, max_tokens=200)
            assert any("shut down before the request finished" in line for line in rest)
            assert rest[-1] == "" or rest[-1] == "data: [DONE]"
            await asyncio.wait_for(task, 10)
            assert (
                await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
            ).status_code == 503


SIM_MODEL = sim_model(
    "sim-a", [2.0e-3, 1.0e-6, 0.0, 1.0e-5, 0.0, 0.0], 7.0, tokenizer="smollm2-135m"
) + instance("sim-a", replicas=1)


async def test_sim_engine_worker_serves_through_the_gateway(nats_url: str, redis_url: str) -> None:
    cluster = parse_cluster(tiny_cluster_text(nats_url, redis_url) + SIM_MODEL)
    async with running(cluster, num_workers=0) as stack:
        worker, task = await start_worker(cluster, "sim0", model="sim-a")
        stack.add_worker(worker, task)
        await wait_for(lambda: "sim0" in stack.gateway.workers, 10)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            resp = await client.post(
                "/v1/chat/completions", json={**CHAT, "model": "sim-a", "max_tokens": 50}
            )
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert out["usage"]["completion_tokens"] == 7  # the sim's fixed output length
        assert out["choices"][0]["finish_reason"] == "stop"


async def test_a_store_that_loses_its_data_fails_no_stream(nats_url: str, redis_url: str) -> None:
    """Every key of the namespace vanishes mid-stream (a Redis restart, a failover): the
    workers register again at their next heartbeat, and meanwhile the gateway keeps them
    (the registry epoch changed), so the open stream finishes and routing never stops."""
    cluster = parse_cluster(tiny_cluster_text(nats_url, redis_url))
    async with running(cluster, num_workers=2) as stack:
        gateway, store = stack.gateway, stack.gateway.store
        await wait_for(lambda: len(gateway.workers) == 2 and len(stack.estimator.workers) == 2)
        reads: list[int] = []  # workers in each of the gateway's registry reads
        read_registry = store.read_registry

        async def counted() -> tuple[list[WorkerInfo], str | None]:
            read = await read_registry()
            reads.append(len(read[0]))
            return read

        store.read_registry = counted  # type: ignore[method-assign]
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            body = {**CHAT, "stream": True, "max_tokens": 120, "ignore_eos": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                lines = resp.aiter_lines()
                for _ in range(3):
                    await anext(lines)
                # The store loses the namespace; a read at once (before the workers'
                # next heartbeat, 0.3 s away) sees no worker: both must stay.
                for _ in range(5):  # again if a heartbeat raced the read
                    names = [k async for k in store.redis.scan_iter(f"{cluster.namespace}:*")]
                    await store.redis.delete(*names)
                    await gateway.directory.refresh()
                    if reads[-1] < 2:
                        break
                assert reads[-1] < 2, reads  # the loss was seen
                assert set(gateway.workers) == {"w0", "w1"}
                rest = [line async for line in lines]
            assert '"finish_reason":"length"' in "".join(rest), rest[-3:]
            assert not any("went away" in line for line in rest)
            resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
            assert resp.status_code == 200, resp.text
            await wait_for(lambda: reads[-1] == 2, 5)  # both registered again
        assert len(stack.estimator.workers) == 2


async def test_a_worker_writes_its_snapshots_again_after_redis_drops_its_connections(
    nats_url: str, redis_url: str
) -> None:
    """The snapshot writes' own connection (Store's write lane) is dropped by Redis:
    the next write connects again, so the snapshots go on advancing."""
    cluster = parse_cluster(tiny_cluster_text(nats_url, redis_url))
    async with running(cluster, num_workers=1) as stack:
        store = stack.gateway.store
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
            assert resp.status_code == 200, resp.text
            lane = stack.workers[0].store.writes
            assert lane is not None
            before = (await store.read_snapshots(["w0"]))["w0"]
            assert before is not None
            # (the lane's own id: the other tests' clients on this server stay connected)
            lane_id = await lane.command("CLIENT", "ID")
            assert await store.redis.execute_command("CLIENT", "KILL", "ID", lane_id) == 1
            resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
            assert resp.status_code == 200, resp.text
            deadline = time.monotonic() + 10
            while True:
                after = (await store.read_snapshots(["w0"]))["w0"]
                if after is not None and after.version > before.version:
                    break
                assert time.monotonic() < deadline, "no snapshot written after the drop"
                await asyncio.sleep(0.05)
            assert await lane.command("CLIENT", "ID") != lane_id  # a new connection


async def test_without_an_estimator_the_gateway_routes_by_itself(
    nats_url: str, redis_url: str
) -> None:
    """The estimator stops (a crash, a restart): requests are still answered, routed by
    the gateway to the instance with the fewest requests, and counted in /metrics."""
    cluster = parse_cluster(tiny_cluster_text(nats_url, redis_url))
    async with running(cluster, num_workers=2) as stack:
        stack.estimator.request_stop()
        await asyncio.wait_for(stack.estimator_task, 10)  # gone
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            body = {**CHAT, "max_tokens": 2}
            resps = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body) for _ in range(4))
            )
            assert [r.status_code for r in resps] == [200] * 4, [r.text for r in resps]
            picked = [r.json()["baton"] for r in resps]
            assert {p["policy"] for p in picked} == {"gateway-fallback"}
            assert {p["instance"] for p in picked} == {"w0", "w1"}  # the load is spread
            metrics = (await client.get("/metrics")).text
            assert "baton_route_fallbacks_total 4.0" in metrics


SLOW_LIMITS = {
    "max_num_seqs": 4,
    "max_num_batched_tokens": 256,
    "num_kv_blocks": 256,
    "max_model_len": 1024,
}
SLOW_SIM = sim_model("slow", [0.02, 0.0, 0.0, 0.0, 0.0, 0.0], 1000.0) + instance(
    "slow", SLOW_LIMITS
)


def submit_to(worker: WorkerService, request_id: str, owner: str) -> SubmitRequest:
    """A long request (1,000 tokens, 20 s on the slow sim) owned by `owner`."""
    return SubmitRequest(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        params=SamplingParams(max_tokens=1000, ignore_eos=True),
        reply_to=f"{worker.cfg.namespace}.nobody.in",
        arrival_time_s=time.time(),
        owner=owner,
    )


async def test_the_requests_of_a_dead_gateway_are_aborted(nats_url: str, redis_url: str) -> None:
    """A request whose owning gateway is not registered (it died) is aborted once the
    grace has passed, and its KV freed; the live gateway's request runs on."""
    text = tiny_cluster_text(nats_url, redis_url).replace("replicas = 2", "replicas = 0")
    cluster = parse_cluster(text + SLOW_SIM)
    async with running(cluster, 1, ["slow"]) as stack:  # 20 ms a step: 1000 tokens take 20 s
        worker = stack.workers[0]
        for rid, owner in (("mine", stack.gateway.owner_token), ("orphan", "gw-dead")):
            await stack.gateway.bus.publish(worker.inbox_subject, submit_to(worker, rid, owner))
        await wait_for(lambda: {"mine", "orphan"} <= set(worker.answers.owners), 5)
        t0 = time.monotonic()
        await wait_for(lambda: "orphan" not in worker.answers.owners, 10)
        waited_s = time.monotonic() - t0
        grace_s = ORPHAN_GRACE_TTLS * cluster.worker.heartbeat_ttl_s
        assert waited_s >= grace_s - 2 * cluster.worker.heartbeat_interval_s, waited_s
        assert "mine" in worker.answers.owners  # the live gateway's request runs on
        sched = worker.engine.scheduler
        assert [r.request_id for r in sched.running] == ["mine"]
        held = sched.config.num_kv_blocks - sched.blocks.num_free_blocks
        assert held == len(sched.running[0].block_ids)  # the orphan's KV is free


async def test_an_owner_seen_gone_once_gets_the_whole_grace_again(
    nats_url: str, redis_url: str
) -> None:
    """check_owners, called by hand (the heartbeat's own calls stopped): a gateway seen
    gone once whose requests then all ended starts afresh; a new request of it absent
    again is not aborted before a whole grace."""
    text = tiny_cluster_text(nats_url, redis_url).replace("replicas = 2", "replicas = 0")
    cluster = parse_cluster(text + SLOW_SIM)
    async with running(cluster, 1, ["slow"]) as stack:
        worker = stack.workers[0]
        store = stack.gateway.store
        assert worker.heartbeat_task is not None
        await kill(worker.heartbeat_task)  # only the calls below check owners
        await store.register_gateway("gw-a", ttl_s=60)
        await store.register_gateway("gw-b", ttl_s=60)
        for rid, owner in (("r1", "gw-b"), ("r2", "gw-a")):
            await stack.gateway.bus.publish(worker.inbox_subject, submit_to(worker, rid, owner))
        await wait_for(lambda: {"r1", "r2"} <= set(worker.answers.owners), 5)
        await store.deregister_gateway("gw-b")
        await worker.registration.check_owners(worker.answers, worker.inbox)  # gw-b seen gone once
        assert "r1" in worker.answers.owners and set(worker.registration.orphans.gone_since) == {
            "gw-b"
        }
        await stack.gateway.bus.publish(worker.inbox_subject, AbortRequest(request_id="r1"))
        await wait_for(lambda: "r1" not in worker.answers.owners, 5)  # gw-b owns nothing now
        await worker.registration.check_owners(worker.answers, worker.inbox)
        assert worker.registration.orphans.gone_since == {}
        await asyncio.sleep(ORPHAN_GRACE_TTLS * cluster.worker.heartbeat_ttl_s)
        await stack.gateway.bus.publish(worker.inbox_subject, submit_to(worker, "r3", "gw-b"))
        await wait_for(lambda: "r3" in worker.answers.owners, 5)
        await worker.registration.check_owners(
            worker.answers, worker.inbox
        )  # gw-b absent again: the grace starts now
        await asyncio.sleep(0.1)
        assert {"r2", "r3"} <= set(worker.answers.owners)


async def test_a_hung_estimator_costs_one_timeout_per_window(nats_url: str, redis_url: str) -> None:
    """An estimator that takes route requests but never answers: the first request waits
    route_timeout_s and is routed by the gateway; requests within the next window go
    straight to the gateway's fallback (the hung estimator sees none of them); after
    it, one request asks the estimator again while the others fall back at once."""
    text = tiny_cluster_text(nats_url, redis_url).replace(
        "[gateway]\n", "[gateway]\nroute_timeout_s = 2.0\n", 1
    )
    cluster = parse_cluster(text)
    async with running(cluster, num_workers=2) as stack:
        asked: list[bytes] = []
        stack.estimator.request_stop()
        await asyncio.wait_for(stack.estimator_task, 10)

        async def hung(msg: Any) -> None:  # takes the request, answers nothing
            asked.append(msg.data)

        await stack.gateway.bus.nc.subscribe(stack.gateway.router.route_subject, cb=hung)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            body = {**CHAT, "max_tokens": 2}

            async def three() -> list[str]:
                resps = await asyncio.gather(
                    *(client.post("/v1/chat/completions", json=body) for _ in range(3))
                )
                assert [r.status_code for r in resps] == [200] * 3, [r.text for r in resps]
                return [r.json()["baton"]["policy"] for r in resps]

            first = await client.post("/v1/chat/completions", json=body)
            assert first.json()["baton"]["policy"] == "gateway-fallback"
            assert len(asked) == 1
            assert await three() == ["gateway-fallback"] * 3
            assert len(asked) == 1  # within the window: not asked
            await asyncio.sleep(cluster.gateway.route_timeout_s)
            assert await three() == ["gateway-fallback"] * 3
            assert len(asked) == 2  # after it: one probe, not three


def test_the_warm_up_request_leaves_no_trace_in_the_engine() -> None:
    """create_engine runs one short request before the worker serves; nothing of it is
    left: no request, no KV, no batch sample for the calibration."""
    from services.worker.config import WorkerServiceConfig, warm_up
    from services.worker.engine.engine import LLMEngine

    cluster = parse_cluster(tiny_cluster_text("nats://127.0.0.1:1", "redis://127.0.0.1:1"))
    engine = LLMEngine.create(
        WorkerServiceConfig.from_cluster(cluster, "random-tiny", "w").engine_config()
    )
    assert warm_up(engine) > 0
    assert not engine.has_unfinished()
    assert engine.pop_batch_samples() == []
    snap = engine.snapshot()
    assert snap.request_ids == [] and snap.num_free_blocks == snap.scheduler.num_kv_blocks
