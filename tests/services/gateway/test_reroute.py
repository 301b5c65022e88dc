"""A stream's headers go out when the request is submitted, before its first token; what
fails after that is in-band. A 503 before the first token (a draining worker, a worker
or link gone) is not the client's to see: the gateway sends the request to another
instance. The workers that misbehave are played by hand over real NATS, with real
registrations in Redis, next to a real worker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from services.gateway.config import GatewayServiceConfig
from services.gateway.generation import Generation
from services.gateway.preparation import prepare
from services.gateway.service import GatewayService
from services.gateway.streams import CLIENT_GONE
from shared import subjects
from shared.bus import Bus
from shared.config import ClusterConfig, parse_cluster
from shared.messages.estimator import REQUEST_DONE_DECODER, RequestDoneEvent
from shared.messages.gateway import DeltaBatch, RequestFailed, TokenDelta
from shared.messages.worker import WORKER_INBOUND_DECODER, SubmitRequest, WorkerInbound
from shared.store import Store
from tests.services.worker.test_lifecycle import wait_for
from tests.support.stack import Stack, hand_worker_info, running, tiny_cluster_text

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
DRAINING = "the worker is shutting down; retry"


class HandWorker:
    """A registered worker whose answers to each SubmitRequest the test writes."""

    def __init__(self, cluster: ClusterConfig, nats_url: str, redis_url: str, iid: str) -> None:
        self.cluster, self.iid = cluster, iid
        self.bus = Bus(nats_url, name=f"hand-{iid}")
        self.store = Store(redis_url, cluster.namespace)
        self.submits: list[SubmitRequest] = []
        self.answer: Callable[[SubmitRequest], Awaitable[None]] = self.refuse

    async def start(self) -> None:
        await self.bus.connect()
        await self.store.connect()
        await self.bus.subscribe(
            subjects.worker_inbox(self.cluster.namespace, self.iid),
            WORKER_INBOUND_DECODER,
            self._on_inbound,
        )

    async def register(self) -> None:
        await self.store.register(hand_worker_info(self.cluster.namespace, self.iid), ttl_s=30)

    async def close(self) -> None:
        await self.store.deregister(self.iid)
        await self.store.close()
        await self.bus.close()

    async def _on_inbound(self, msg: WorkerInbound) -> None:
        if isinstance(msg, SubmitRequest):
            self.submits.append(msg)
            await self.answer(msg)

    async def send(self, msg: SubmitRequest, *events: TokenDelta | RequestFailed) -> None:
        batch = DeltaBatch(instance_id=self.iid, step=1, events=list(events))
        await self.bus.publish(msg.reply_to, batch)

    async def refuse(self, msg: SubmitRequest) -> None:
        """What a draining worker answers."""
        await self.send(msg, RequestFailed(msg.request_id, 503, DRAINING))


@pytest.fixture
async def cluster(nats_url: str, redis_url: str) -> ClusterConfig:
    return parse_cluster(tiny_cluster_text(nats_url, redis_url))


@pytest.fixture
async def hand(cluster: ClusterConfig, nats_url: str, redis_url: str) -> AsyncIterator[HandWorker]:
    worker = HandWorker(cluster, nats_url, redis_url, "hand")
    await worker.start()
    try:
        yield worker
    finally:
        await worker.close()


@asynccontextmanager
async def stack_with(
    cluster: ClusterConfig, num_workers: int, hand: HandWorker
) -> AsyncIterator[Stack]:
    """A running stack of `num_workers` real workers that also knows the hand worker."""
    async with running(cluster, num_workers) as stack:
        await hand.register()
        await wait_for(
            lambda: hand.iid in stack.gateway.workers and hand.iid in stack.estimator.workers
        )
        yield stack


def data_lines(lines: list[str]) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


async def test_a_streams_headers_come_before_its_first_token(
    cluster: ClusterConfig, hand: HandWorker
) -> None:
    """The 200 and the headers arrive while the worker has sent nothing yet."""
    go = asyncio.Event()

    async def answer_when_told(msg: SubmitRequest) -> None:
        await go.wait()
        await hand.send(msg, TokenDelta(msg.request_id, 0, [42, 43], None, "length", 5))

    hand.answer = answer_when_told
    async with stack_with(cluster, 0, hand) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            body = {**CHAT, "model": "random-tiny", "stream": True, "max_tokens": 2}
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                assert resp.headers["x-instance-id"] == "hand"
                assert not go.is_set()  # the worker has answered nothing yet
                await wait_for(lambda: len(hand.submits) == 1)
                go.set()
                lines = data_lines([line async for line in resp.aiter_lines()])
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(line) for line in lines[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert stack.gateway.num_in_flight == 0
        # the first token's metrics, counted after its chunk went out
        assert stack.metric("baton_ttft_seconds_sum", model="random-tiny") > 0
        assert stack.metric("baton_queued_requests") == 0


async def test_a_draining_workers_503_sends_the_request_elsewhere_unseen(
    cluster: ClusterConfig, hand: HandWorker
) -> None:
    """Round robin (the `auto` preset) alternates the refusing hand worker and a real
    one: every request, streamed or not, is answered by the real one, and those the hand
    worker refused were rerouted once each, under their request id."""
    async with stack_with(cluster, 1, hand) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            for i in range(6):
                body = {**CHAT, "model": "auto", "stream": i % 2 == 0}
                if body["stream"]:
                    body["stream_options"] = {"include_usage": True}
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        assert r.status_code == 200
                        lines = data_lines([line async for line in r.aiter_lines()])
                    last = json.loads(lines[-2])
                    assert last["usage"]["completion_tokens"] == 3, lines
                    baton = last["baton"]
                else:
                    resp = await client.post("/v1/chat/completions", json=body)
                    assert resp.status_code == 200, resp.text
                    baton = resp.json()["baton"]
                assert baton["instance"] == "w0"
        assert hand.submits, "round robin sent nothing to the hand worker"
        assert stack.metric("baton_reroutes_total") == len(hand.submits)
        assert len({m.request_id for m in hand.submits}) == len(hand.submits)
        assert stack.gateway.num_in_flight == 0


async def test_the_503_stands_when_no_other_instance_serves(
    cluster: ClusterConfig, hand: HandWorker
) -> None:
    """Nowhere else to go: a stream is told in-band (its 200 is sent), a non-stream
    request gets the 503 itself; the estimator hears once that each is done."""
    done: list[str] = []

    async def on_done(event: RequestDoneEvent) -> None:
        done.append(event.request_id)

    await hand.bus.subscribe(
        subjects.estimator_events(cluster.namespace), REQUEST_DONE_DECODER, on_done
    )
    async with stack_with(cluster, 0, hand) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            body = {**CHAT, "model": "random-tiny"}
            resp = await client.post("/v1/chat/completions", json=body)
            assert resp.status_code == 503 and DRAINING in resp.json()["error"]["message"]
            async with client.stream(
                "POST", "/v1/chat/completions", json={**body, "stream": True}
            ) as r:
                assert r.status_code == 200
                lines = data_lines([line async for line in r.aiter_lines()])
        assert lines[-1] == "[DONE]"
        error = json.loads(lines[-2])["error"]
        assert DRAINING in error["message"] and error["type"] == "service_unavailable"
        assert len(hand.submits) == 2
        assert stack.metric("baton_reroutes_total") == 0
        await wait_for(lambda: len(done) >= 2)
        await asyncio.sleep(0.2)  # a second done event would have come by now
        assert sorted(done) == sorted(m.request_id for m in hand.submits)
        assert stack.gateway.num_in_flight == 0


async def test_what_a_worker_would_refuse_is_a_status_before_a_stream_starts(
    cluster: ClusterConfig, hand: HandWorker
) -> None:
    """Checked at the gateway, since a stream's status goes out before the worker
    answers: prompt token ids outside the vocabulary."""
    async with stack_with(cluster, 0, hand) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            body = {"model": "random-tiny", "prompt": [1, 10**9], "stream": True}
            resp = await client.post("/v1/completions", json=body)
        assert resp.status_code == 400
        assert resp.json()["error"]["message"].startswith("prompt token ids must be in [0, ")
        assert not hand.submits


async def test_a_client_that_leaves_during_a_reroute_is_seen_on_the_new_stream(
    cluster: ClusterConfig,
) -> None:
    """The disconnect watcher wakes the stream the request waits on; one that left
    while the request was being sent again is passed on to the new stream. (The
    service is built, not started: no bus or store is touched.)"""
    service = GatewayService(GatewayServiceConfig.from_cluster(cluster, "gw-unit"))
    for iid in ("a", "b"):
        service.workers[iid] = hand_worker_info(cluster.namespace, iid)
    body = json.dumps({**CHAT, "model": "random-tiny", "stream": True}).encode()
    p = prepare(service, body, True, "chatcmpl-unit")
    run = Generation(service, p, service.streams.open(p.request_id, "a"), "random-tiny")
    old = run.stream
    run.client_left()
    assert old.events.get_nowait() is CLIENT_GONE
    assert service.streams.close(old) and not service.streams.close(old)
    new = service.streams.open(p.request_id, "b")
    run.restart(new, "random-tiny", {"instance": "b"})
    assert new.events.get_nowait() is CLIENT_GONE
    assert run.tried == {"a", "b"} and run.baton["instance"] == "b"
