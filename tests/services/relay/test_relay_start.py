"""The relay starts before the workers (as the launcher starts it): its first view of
the registry is empty, and a hand-off must not be given back just because the view is
older than the workers. Real NATS and Redis, gateway, estimator, two workers; the
relay's periodic registry read is pushed past the test, so only the re-read that a
hand-off to an unknown model triggers can find the peer."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from services.relay.service import RelayService
from services.worker.routing.policies import register_token_policy, unregister_token_policy
from shared.config import parse_cluster
from tests.services.relay.test_token_routing_e2e import PAIR, post_pair
from tests.services.worker.routing.test_runtime import EveryThird
from tests.support.stack import start_stack, tiny_cluster_text

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_a_relay_older_than_the_workers_forwards_their_first_hand_offs(
    nats_url: str, redis_url: str
) -> None:
    register_token_policy(EveryThird)
    text = tiny_cluster_text(nats_url, redis_url).replace("replicas = 2", "replicas = 1")
    cluster = parse_cluster(
        text + PAIR.replace("registry_refresh_s = 0.2", "registry_refresh_s = 3600.0")
    )
    relay = RelayService(cluster)
    relay_task = asyncio.create_task(relay.run())
    for _ in range(1000):  # ready: subscribed, with the (empty) registry it read at start
        if relay.bus.is_connected and relay.store.is_connected:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    assert relay.workers == {}
    stack = await start_stack(cluster, 2, ["random-tiny", "random-tiny-big"])
    # As if a registry read had just found nothing (the relay's read at start, when the
    # workers come up within RETRY_REFRESH_S of it): the hand-off's re-read must still run.
    await relay.refresh()
    relay.workers = {}
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            resp = await asyncio.wait_for(post_pair(client, "relay starts first", 24), 60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["tokens_by_model"]["random-tiny-big"] > 0
        assert relay.books.counters.forwarded > 0
        assert relay.books.counters.failovers == 0
    finally:
        relay.request_stop()
        with contextlib.suppress(asyncio.CancelledError):
            await relay_task
        await stack.stop()
        unregister_token_policy("every-third")
