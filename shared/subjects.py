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
"""

from __future__ import annotations

import re

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


def worker_inbox(namespace: str, instance_id: str) -> str:
    return f"{check_token(namespace)}.worker.{check_token(instance_id)}.in"


def gateway_inbox(namespace: str, gateway_id: str) -> str:
    return f"{check_token(namespace)}.gateway.{check_token(gateway_id)}.in"


def estimator_route(namespace: str) -> str:
    return f"{check_token(namespace)}.estimator.route"


def estimator_events(namespace: str) -> str:
    return f"{check_token(namespace)}.estimator.events"


def batcher_stats(namespace: str) -> str:
    return f"{check_token(namespace)}.batcher.stats"


def batcher_tables(namespace: str) -> str:
    return f"{check_token(namespace)}.batcher.tables"


def relay_inbox(namespace: str) -> str:
    return f"{check_token(namespace)}.relay.in"


def relay_query(namespace: str) -> str:
    return f"{check_token(namespace)}.relay.query"


def relay_started(namespace: str) -> str:
    """A relay announces its start here (RelayStarted): workers re-check hand-offs."""
    return f"{check_token(namespace)}.relay.started"


def worker_peer(namespace: str, instance_id: str) -> str:
    return f"{check_token(namespace)}.worker.{check_token(instance_id)}.peer"


def health(namespace: str, service: str) -> str:
    """Request/reply liveness probe of a service without an HTTP port."""
    return f"{check_token(namespace)}.health.{check_token(service)}"
