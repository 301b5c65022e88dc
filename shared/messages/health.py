"""Liveness probes for services without an HTTP port (compose healthchecks).

{ns}.health.{service}   HealthProbe -> HealthReply   (request/reply)
"""

from __future__ import annotations

import msgspec


class HealthProbe(msgspec.Struct, frozen=True, kw_only=True):
    """Are you there?"""

    sender: str  # who asks (for logs)


class HealthReply(msgspec.Struct, frozen=True, kw_only=True):
    """The service's loop is alive and its subscriptions are up."""

    service: str  # relay | batcher
    detail: str = ""  # a short human-readable state


HEALTH_PROBE_DECODER = msgspec.msgpack.Decoder(HealthProbe)
HEALTH_REPLY_DECODER = msgspec.msgpack.Decoder(HealthReply)
