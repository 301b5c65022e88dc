"""`python -m shared.health SERVICE`: exit 0 when SERVICE (relay, batcher) answers its
liveness probe on NATS; the compose healthcheck of services without an HTTP port."""

from __future__ import annotations

import asyncio
import sys

from shared import subjects
from shared.bus import Bus, is_no_responders
from shared.config import ClusterConfig, load_cluster
from shared.messages.health import HEALTH_REPLY_DECODER, HealthProbe


async def check(service: str, cluster: ClusterConfig | None = None) -> bool:
    """Whether `service` answers within 2 s (cluster: default $BATON_CLUSTER's)."""
    cluster = cluster or load_cluster()
    bus = Bus(cluster.nats_url, f"{service}-health")
    await bus.connect()
    try:
        reply = await bus.request(
            subjects.health(cluster.namespace, service),
            HealthProbe(sender="healthcheck"),
            HEALTH_REPLY_DECODER,
            timeout_s=2,
        )
        return reply.service == service
    except TimeoutError:
        return False
    except Exception as exc:
        if is_no_responders(exc):
            return False
        raise
    finally:
        await bus.close()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m shared.health SERVICE", file=sys.stderr)
        sys.exit(2)
    try:
        sys.exit(0 if asyncio.run(check(sys.argv[1])) else 1)
    except Exception as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        sys.exit(1)
