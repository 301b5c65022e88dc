"""Deltas that are already queued when a stream's handler wakes go out as one SSE chunk.

A hand-driven worker (registered in Redis, its inbox read here over real NATS) answers
each submit with one DeltaBatch holding several one-token deltas, so all of them sit in
the request's queue before its handler runs: the client must get their text in one
chunk, the finish and the usage right, and a failure queued behind text still reported.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import msgspec

from shared.bus import Bus
from shared.config import parse_cluster
from shared.messages.gateway import DeltaBatch, GatewayEvent, RequestFailed, TokenDelta
from shared.messages.worker import WORKER_INBOUND_DECODER, SubmitRequest
from shared.store import Store
from tests.services.worker.test_lifecycle import wait_for
from tests.support.stack import hand_worker_info, start_stack, tiny_cluster_text

Answer = Callable[[SubmitRequest], list[GatewayEvent]]


def deltas(req: SubmitRequest, ids: list[int], finish: str | None) -> list[GatewayEvent]:
    """One TokenDelta per id; the last carries `finish`."""
    n = len(req.prompt_token_ids)
    return [
        TokenDelta(req.request_id, i, [t], None, finish if i == len(ids) - 1 else None, n)
        for i, t in enumerate(ids)
    ]


async def stream_chunks(base_url: str, body: dict) -> list[dict]:
    """Every SSE data object of one streamed completion (without [DONE]), in order."""
    chunks: list[dict] = []
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


async def with_hand_worker(nats_url: str, redis_url: str, answer: Answer, body: dict) -> list:
    cluster = parse_cluster(tiny_cluster_text(nats_url, redis_url))
    store = Store(redis_url, cluster.namespace)
    await store.connect()
    bus = Bus(nats_url, "hand-worker")
    await bus.connect()

    async def on_submit(msg: object) -> None:
        if isinstance(msg, SubmitRequest):
            batch = DeltaBatch(instance_id="hand", step=1, events=answer(msg))
            await bus.nc.publish(msg.reply_to, msgspec.msgpack.encode(batch))

    info = hand_worker_info(cluster.namespace, "hand")
    await bus.subscribe(info.inbox, WORKER_INBOUND_DECODER, on_submit)
    stack = await start_stack(cluster, num_workers=0)
    await store.register(info, ttl_s=30.0)
    try:
        await wait_for(lambda: "hand" in stack.gateway.workers)
        return await stream_chunks(stack.base_url, body)
    finally:
        await stack.stop()
        await store.deregister("hand")
        await store.close()
        await bus.close()


BODY = {
    "model": "random-tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 8,
    "stream": True,
    "stream_options": {"include_usage": True},
}


async def test_queued_deltas_go_out_in_one_chunk(nats_url: str, redis_url: str) -> None:
    ids = [1000, 1001, 1002, 1003, 1004]
    chunks = await with_hand_worker(
        nats_url, redis_url, lambda req: deltas(req, ids, "length"), BODY
    )
    text_chunks = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    # role chunk, then one chunk with all five tokens' text and the finish, then usage
    assert len(text_chunks) == 1, chunks
    assert text_chunks[0]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == len(ids)


async def test_failure_queued_behind_text_is_reported(nats_url: str, redis_url: str) -> None:
    def answer(req: SubmitRequest) -> list[GatewayEvent]:
        failed = RequestFailed(req.request_id, 503, "the worker is gone")
        return [*deltas(req, [1000, 1001, 1002], None), failed]

    chunks = await with_hand_worker(nats_url, redis_url, answer, BODY)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c.get("choices"))
    assert text  # the three tokens' text went out before the failure
    assert chunks[-1]["error"]["message"] == "the worker is gone", chunks
