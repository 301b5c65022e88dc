"""A worker that takes a request and never answers: the gateway fails it with 504 after
`event_timeout_s` (the registration is real, in Redis; nobody reads its inbox)."""

from __future__ import annotations

import time

import httpx

from shared.config import parse_cluster
from shared.store import Store
from tests.services.conftest import hand_worker_info, start_stack, tiny_cluster_text
from tests.services.test_worker_lifecycle import wait_for


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
    finally:
        await stack.stop()
        await store.deregister("silent")
        await store.close()
