"""A worker that falls silent: the gateway fails its request with 504 after
`event_timeout_s` without an event, before the first token (an HTTP 504) or mid-stream
(in-band). The registrations are real, in Redis; the worker is played by hand."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from services.gateway.streams import WORKER_SILENT, StreamManager
from shared import subjects
from shared.bus import Bus
from shared.config import parse_cluster
from shared.messages.gateway import DeltaBatch, TokenDelta
from shared.messages.worker import WORKER_INBOUND_DECODER, SubmitRequest, WorkerInbound
from shared.store import Store
from tests.services.worker.test_lifecycle import wait_for
from tests.support.stack import hand_worker_info, start_stack, tiny_cluster_text


def delta(request_id: str, position: int) -> TokenDelta:
    return TokenDelta(request_id, position, [42], None, None, 5)


async def test_only_streams_without_an_event_for_the_timeout_are_marked_once() -> None:
    streams = StreamManager()
    quiet, talking = streams.open("quiet", "w0"), streams.open("talking", "w0")
    t0 = quiet.last_event_at
    await streams.on_batch(DeltaBatch(instance_id="w0", step=1, events=[delta("talking", 0)]))
    talking.last_event_at = t0 + 0.9  # an event 0.9 s after the submit
    assert streams.mark_silent(1.0, t0 + 0.5) == 0
    assert streams.mark_silent(1.0, t0 + 1.5) == 1  # quiet for 1.5 s, talking for 0.6 s
    assert quiet.events.get_nowait() is WORKER_SILENT
    assert talking.events.get_nowait() == delta("talking", 0)  # nothing queued behind it
    assert talking.events.empty()
    assert streams.mark_silent(1.0, t0 + 2.0) == 1  # talking now; quiet is not queued twice
    assert quiet.events.empty()


async def test_silent_worker_times_out_with_504(nats_url: str, redis_url: str) -> None:
    text = tiny_cluster_text(nats_url, redis_url).replace(
        "event_timeout_s = 60.0", "event_timeout_s = 0.3"
    )
    cluster = parse_cluster(text)
    store = Store(redis_url, cluster.namespace)
    await store.connect()
    silent = hand_worker_info(cluster.namespace, "silent")
    stack = await start_stack(cluster, num_workers=0)
    await store.register(silent, ttl_s=30.0)
    try:
        await wait_for(lambda: "silent" in stack.gateway.workers)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            body = {
                "model": "random-tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            }
            t0 = time.perf_counter()
            resp = await client.post("/v1/chat/completions", json=body)
            assert resp.status_code == 504, resp.text
            assert resp.json()["error"]["code"] == "worker_timeout"
            assert time.perf_counter() - t0 >= 0.3
            assert stack.gateway.num_in_flight == 0  # admission released
            # counted once, as what the client got (the abort on the worker is no 499)
            assert (stack.requests_counted("504"), stack.requests_counted("499")) == (1, 0)
    finally:
        await stack.stop()
        await store.deregister("silent")
        await store.close()


async def test_a_worker_silent_after_its_first_token_fails_the_stream_in_band(
    nats_url: str, redis_url: str
) -> None:
    text = tiny_cluster_text(nats_url, redis_url).replace(
        "event_timeout_s = 60.0", "event_timeout_s = 0.4"
    )
    cluster = parse_cluster(text)
    store = Store(redis_url, cluster.namespace)
    await store.connect()
    bus = Bus(nats_url, name="one-token-worker")
    await bus.connect()
    worker = hand_worker_info(cluster.namespace, "onetoken")

    async def one_token_then_silence(msg: WorkerInbound) -> None:
        if isinstance(msg, SubmitRequest):
            first = DeltaBatch(instance_id="onetoken", step=1, events=[delta(msg.request_id, 0)])
            await bus.publish(msg.reply_to, first)

    await bus.subscribe(
        subjects.worker_inbox(cluster.namespace, "onetoken"),
        WORKER_INBOUND_DECODER,
        one_token_then_silence,
    )
    stack = await start_stack(cluster, num_workers=0)
    await store.register(worker, ttl_s=30.0)
    try:
        await wait_for(lambda: "onetoken" in stack.gateway.workers)
        body = {
            "model": "random-tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "stream": True,
        }
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            t0 = time.perf_counter()
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
            waited_s = time.perf_counter() - t0
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert lines[-1] == "data: [DONE]"
        assert any(c.get("choices") and c["choices"][0]["delta"].get("content") for c in chunks)
        assert chunks[-1]["error"]["code"] == "worker_timeout"
        assert waited_s >= 0.4
        for _ in range(100):  # the handler's close() runs as the response ends
            if stack.gateway.num_in_flight == 0:
                break
            await asyncio.sleep(0.02)
        assert stack.gateway.num_in_flight == 0
        assert (stack.requests_counted("504"), stack.requests_counted("499")) == (1, 0)
    finally:
        await stack.stop()
        await store.deregister("onetoken")
        await store.close()
        await bus.close()
