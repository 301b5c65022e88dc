"""python -m services.worker.health: exit 0 when a worker of this host is registered (compose healthcheck)."""

from __future__ import annotations

import asyncio
import socket
import sys

from shared import subjects
from shared.config import load_cluster
from shared.store import Store


def on_host(instance_id: str, host: str) -> bool:
    """Whether a worker's default id (model-host-pid made a token,
    `worker.config.default_instance_id`) names `host`."""
    return f"-{subjects.as_token(host)}-" in instance_id


async def _check() -> bool:
    cluster = load_cluster()
    store = Store(cluster.redis_url, cluster.namespace)
    await store.connect()
    try:
        host = socket.gethostname()
        workers = await store.live_workers()
        return any(on_host(w.instance_id, host) and not w.is_draining for w in workers)
    finally:
        await store.close()


if __name__ == "__main__":
    try:
        sys.exit(0 if asyncio.run(asyncio.wait_for(_check(), 5)) else 1)
    except Exception as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        sys.exit(1)
