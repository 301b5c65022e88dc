"""Refusals before a launcher starts anything: a gateway port in use, a namespace whose
workers are live on the same Redis (two deployments would share them)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from services.launcher.servers import ServerError, is_reachable
from shared.config import ClusterConfig
from shared.store import Store


def check_gateway_port(cluster: ClusterConfig) -> None:
    gw = cluster.gateway
    if is_reachable(gw.host, gw.port):
        raise ServerError(
            f"port {gw.port} on {gw.host} is in use: set BATON_PORT or [gateway] port"
        )


def check_namespace_free(
    cluster: ClusterConfig, redis_url: str, redis_started_here: bool, say: Callable[[str], None]
) -> None:
    """Refuse to start a second deployment in a namespace whose workers are live.

    Two deployments on one NATS/Redis and namespace share workers, snapshots and relay
    subjects without knowing it (hand-offs time out, routing counts the other's load). A
    deployment that was killed leaves registrations that expire within the heartbeat
    TTL, so one wait of that long tells a dead deployment from a live one. A Redis this
    launcher started holds no one's workers.
    """
    if redis_started_here:
        return
    live = live_worker_ids(cluster, redis_url)
    if live:
        wait_s = cluster.worker.heartbeat_ttl_s + 0.5
        say(
            f"namespace {cluster.namespace!r} lists workers ({', '.join(live)}); "
            f"waiting {wait_s:.1f} s for the registrations of a stopped deployment to expire"
        )
        time.sleep(wait_s)
        live = live_worker_ids(cluster, redis_url)
    if live:
        raise ServerError(
            f"namespace {cluster.namespace!r} at {redis_url} already has live "
            f"workers ({', '.join(live)}): another Baton deployment is running there. "
            "Stop it, or give this one its own namespace "
            "(BATON_NAMESPACE=<name> or `namespace` in the cluster file)"
        )


def live_worker_ids(cluster: ClusterConfig, redis_url: str) -> list[str]:
    store = Store(redis_url, cluster.namespace)

    async def read() -> list[str]:
        try:
            await store.connect()
            return [w.instance_id for w in await store.live_workers()]
        finally:
            await store.close()

    try:
        return asyncio.run(read())
    except RedisError as exc:  # it answers on the port but not as we need (auth, ...)
        raise ServerError(f"the Redis server at {redis_url} failed: {exc}") from None
