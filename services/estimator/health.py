"""python -m services.estimator.health: exit 0 when an estimator answers a routing request (compose healthcheck)."""

from __future__ import annotations

import asyncio
import sys

from shared import subjects
from shared.bus import Bus
from shared.config import load_cluster
from shared.messages.estimator import ROUTE_REPLY_DECODER, RouteRequest


async def _check() -> bool:
    cluster = load_cluster()
    bus = Bus(cluster.nats_url, "estimator-health")
    await bus.connect()
    try:
        probe = RouteRequest(request_id="healthcheck", model="", num_prompt_tokens=0, max_tokens=0)
        reply = await bus.request(
            subjects.estimator_route(cluster.namespace), probe, ROUTE_REPLY_DECODER, timeout_s=2
        )
        return reply.request_id == "healthcheck"
    finally:
        await bus.close()


if __name__ == "__main__":
    try:
        sys.exit(0 if asyncio.run(_check()) else 1)
    except Exception as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        sys.exit(1)
