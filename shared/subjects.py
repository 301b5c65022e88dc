"""Every NATS subject Baton uses, built in one place.

All subjects start with the deployment namespace so that two stacks can share one
NATS server. Services never format a subject string themselves.

    {ns}.worker.{instance_id}.in      SubmitRequest | AbortRequest    gateway -> worker
    {ns}.gateway.{gateway_id}.in      DeltaBatch                      worker -> gateway
    {ns}.estimator.route              RouteRequest -> RouteReply      gateway -> estimator (request/reply)
    {ns}.estimator.events             RequestDoneEvent                gateway -> every estimator
    {ns}.batcher.stats                RoutingStats                    worker -> batcher
    {ns}.batcher.tables               BatchTables                     batcher -> every worker
    {ns}.relay.in                     PeerReq | PeerRelease           worker -> relay (queue group)
    {ns}.worker.{instance_id}.peer    PeerReq | PeerRelease           relay -> worker
    {ns}.relay.query                  PeerQuery -> PeerQueryReply     worker -> relay (request/reply)
    {ns}.relay.started                RelayStarted                    relay -> every worker
    {ns}.health.{service}             HealthProbe -> HealthReply      liveness of a service without HTTP
"""

from __future__ import annotations

import re
from collections.abc import Callable

# NATS tokens are separated by dots; ids become single tokens, so they must not
# contain dots, spaces or wildcards.
_TOKEN = re.compile(r"[A-Za-z0-9_\-]+")  # used with fullmatch: `$` admits a final "\n"
_NOT_TOKEN = re.compile(r"[^A-Za-z0-9_\-]")

ESTIMATOR_QUEUE_GROUP = "estimator"
RELAY_QUEUE_GROUP = "relay"


def is_token(value: str) -> bool:
    """Whether `value` is usable as one subject token (and Redis key part)."""
    return bool(_TOKEN.fullmatch(value))


def as_token(raw: str) -> str:
    """`raw` made usable as one subject token: every other character becomes '-'
    (a model named "qwen2.5-7b" gives instance ids "qwen2-5-7b-0", ...)."""
    return _NOT_TOKEN.sub("-", raw) or "-"


def check_token(value: str) -> str:
    """Return `value` if it is usable as one subject token, else raise ValueError."""
    if not _TOKEN.fullmatch(value):
        raise ValueError(f"{value!r} is not a valid subject token (letters, digits, '_' and '-')")
    return value


def _global(*tokens: str) -> Callable[[str], str]:
    def subject(namespace: str) -> str:
        return ".".join((check_token(namespace), *tokens))

    return subject


def _per_id(kind: str, suffix: str = "") -> Callable[[str, str], str]:
    """The subject of one worker's (gateway's, service's) `kind` in a namespace."""

    def subject(namespace: str, ident: str) -> str:
        return f"{check_token(namespace)}.{kind}.{check_token(ident)}{suffix}"

    return subject


# The module docstring lists each subject's messages and direction.
worker_inbox = _per_id("worker", ".in")
gateway_inbox = _per_id("gateway", ".in")
worker_peer = _per_id("worker", ".peer")
estimator_route = _global("estimator", "route")
estimator_events = _global("estimator", "events")
batcher_stats = _global("batcher", "stats")
batcher_tables = _global("batcher", "tables")
relay_inbox = _global("relay", "in")
relay_query = _global("relay", "query")
relay_started = _global("relay", "started")  # a relay's start: workers re-check hand-offs
health = _per_id("health")  # request/reply liveness probe of a service without an HTTP port
