"""Token-level routing when the relay itself dies mid-answer: nothing answers the
hand-offs, so the workers' own safety nets must finish every request (the origin
after `[relay] origin_wait_s`) and free every KV block (the peers' copies after
`guest_idle_s`). Real NATS and Redis, gateway, estimator, two workers."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.relay.service import RelayService
from services.worker.routing.policies import register_token_policy, unregister_token_policy
from shared.config import ClusterConfig, parse_cluster
from tests.services.relay.test_token_routing_e2e import PAIR, blocks_in_use, post_pair
from tests.services.worker.routing.test_runtime import EveryThird
from tests.support.stack import Stack, kill, start_stack, tiny_cluster_text

pytestmark = pytest.mark.asyncio(loop_scope="module")

SAFETY_NETS = """
peer_timeout_s = 1.0
origin_wait_s = 1.5
guest_idle_s = 2.0
"""


async def kill_mid_answer(
    client: httpx.AsyncClient,
    relay: RelayService,
    relay_task: asyncio.Task[None],
    label: str,
) -> list[asyncio.Task[httpx.Response]]:
    """Four answers under way, each with a hand-off the relay forwarded: then the relay
    dies (its books and timers with it). Returns the answers' tasks."""
    pending = [asyncio.create_task(post_pair(client, f"{label} {i}", 120)) for i in range(4)]

    async def handoffs_under_way() -> None:
        while relay.books.counters.forwarded < 4:
            await asyncio.sleep(0.005)

    await asyncio.wait_for(handoffs_under_way(), 30)
    await kill(relay_task)
    return pending


async def copies_freed(stack: Stack) -> None:
    """Every KV block of both workers free within 10 s."""
    for _ in range(100):
        if blocks_in_use(stack) == [0, 0]:
            break
        await asyncio.sleep(0.1)
    assert blocks_in_use(stack) == [0, 0]


def long_nets_cluster(nats_url: str, redis_url: str) -> ClusterConfig:
    """The pair preset with the workers' own nets at 60 s: what a test sees within its
    30 s bounds is the relay's start notice at work, not them."""
    text = tiny_cluster_text(nats_url, redis_url).replace("replicas = 2", "replicas = 1")
    nets = SAFETY_NETS.replace("origin_wait_s = 1.5", "origin_wait_s = 60.0").replace(
        "guest_idle_s = 2.0", "guest_idle_s = 60.0"
    )
    return parse_cluster(text + PAIR.replace("peer_timeout_s = 2.0\n", nets))


async def test_dead_relay_never_strands_a_request_or_its_kv(nats_url: str, redis_url: str) -> None:
    register_token_policy(EveryThird)
    text = tiny_cluster_text(nats_url, redis_url).replace("replicas = 2", "replicas = 1")
    cluster = parse_cluster(text + PAIR.replace("peer_timeout_s = 2.0\n", SAFETY_NETS))
    relay = RelayService(cluster)
    relay_task = asyncio.create_task(relay.run())
    stack = await start_stack(cluster, 2, ["random-tiny", "random-tiny-big"])
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            pending = await kill_mid_answer(client, relay, relay_task, "relay down")
            # bounded: without the safety nets these requests would wait forever
            resps = await asyncio.wait_for(asyncio.gather(*pending), 30)
        for resp in resps:
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 120
        failures = [w.routing.num_peer_failures for w in stack.workers if w.routing is not None]
        assert sum(failures) > 0  # the origins took requests back
        await copies_freed(stack)  # the large worker's copies expire after guest_idle_s
    finally:
        await stack.stop()
        unregister_token_policy("every-third")


async def test_a_restarted_relay_sends_the_requests_it_never_saw_home(
    nats_url: str, redis_url: str
) -> None:
    """A relay that restarts knows none of the hand-offs its predecessor held. Its start
    notice makes every origin ask about its requests away at once: they come back and
    finish alone long before `origin_wait_s` (60 s here, above the test's 30 s bound),
    their releases free the peers' copies though the new relay never placed them, and
    later requests route through the new relay."""
    register_token_policy(EveryThird)
    cluster = long_nets_cluster(nats_url, redis_url)
    relay = RelayService(cluster)
    relay_task = asyncio.create_task(relay.run())
    stack = await start_stack(cluster, 2, ["random-tiny", "random-tiny-big"])
    new_relay: RelayService | None = None
    new_task: asyncio.Task[None] | None = None
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=90) as client:
            pending = await kill_mid_answer(client, relay, relay_task, "relay restarts")
            new_relay = RelayService(cluster)
            new_task = asyncio.create_task(new_relay.run())
            resps = await asyncio.wait_for(asyncio.gather(*pending), 30)
            for resp in resps:
                assert resp.status_code == 200, resp.text
                assert resp.json()["usage"]["completion_tokens"] == 120
            failures = [w.routing.num_peer_failures for w in stack.workers if w.routing]
            assert sum(failures) > 0  # taken back on the notice, not after 60 s
            # the origins' releases reach the copies the new relay never placed: no
            # copy waits out guest_idle_s (60 s here)
            await copies_freed(stack)
            # the new relay carries the next request's hand-offs
            resp = await asyncio.wait_for(post_pair(client, "after the restart", 60), 30)
            assert resp.status_code == 200, resp.text
            assert new_relay.books.counters.forwarded > 0
    finally:
        if new_task is not None:
            await kill(new_task)
        await stack.stop()
        unregister_token_policy("every-third")


async def test_releases_sent_while_no_relay_listens_are_sent_again(
    nats_url: str, redis_url: str
) -> None:
    """Clients that leave while the relay is dead: their origins' releases go nowhere.
    When a relay starts, the origins send their recent releases again, and the peers'
    copies are freed long before `guest_idle_s` (60 s here); they held KV and request
    slots (a probe: 12 copies held smollm2-135m's slots for 300 s)."""
    register_token_policy(EveryThird)
    cluster = long_nets_cluster(nats_url, redis_url)
    relay = RelayService(cluster)
    relay_task = asyncio.create_task(relay.run())
    stack = await start_stack(cluster, 2, ["random-tiny", "random-tiny-big"])
    new_task: asyncio.Task[None] | None = None
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=90) as client:
            pending = await kill_mid_answer(client, relay, relay_task, "clients leave")
            for task in pending:  # the clients go: the origins release into the void
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            origin = stack.workers[0]
            for _ in range(100):  # the origin ended them all (and sent their releases)
                if origin.routing is not None and not origin.routing.requests:
                    break
                await asyncio.sleep(0.05)
            assert blocks_in_use(stack)[1] > 0  # the large worker still holds the copies
            new_task = asyncio.create_task(RelayService(cluster).run())
            await copies_freed(stack)
    finally:
        if new_task is not None:
            await kill(new_task)
        await stack.stop()
        unregister_token_policy("every-third")


async def test_health_tells_a_hung_or_missing_relay(nats_url: str, redis_url: str) -> None:
    """Where a preset routes per token, the gateway probes the relay: /health says
    "unresponsive" (degraded) for one that does not answer, "down" for none, "ok"."""
    register_token_policy(EveryThird)
    text = tiny_cluster_text(nats_url, redis_url).replace("replicas = 2", "replicas = 1")
    cluster = parse_cluster(text + PAIR)
    hung = RelayService(cluster)

    async def never(probe: object) -> object:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    hung.health = never  # type: ignore[method-assign]
    hung_task = asyncio.create_task(hung.run())
    stack = await start_stack(cluster, 2, ["random-tiny", "random-tiny-big"])
    new_task: asyncio.Task[None] | None = None

    async def health_reads(relay: str, status: str) -> None:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
            for _ in range(100):  # probed every 2 s
                body = (await client.get("/health")).json()
                if (body.get("relay"), body["status"]) == (relay, status):
                    return
                await asyncio.sleep(0.1)
        raise AssertionError(f"/health never said relay {relay!r}, status {status!r}: {body}")

    try:
        await health_reads("unresponsive", "degraded")
        await kill(hung_task)
        await health_reads("down", "degraded")
        new_task = asyncio.create_task(RelayService(cluster).run())
        await health_reads("ok", "ok")
    finally:
        if new_task is not None:
            await kill(new_task)
        if not hung_task.done():
            await kill(hung_task)
        await stack.stop()
        unregister_token_policy("every-third")
