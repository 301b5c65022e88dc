"""A real Baton stack for loadgen's end-to-end tests, from the services' test fixtures.

`nats_url` / `redis_url` (real servers on free ports, tests/support/servers.py) and
`start_stack` (gateway on real HTTP, estimator and random-tiny workers in-process,
tests/support/stack.py). Imported here, pytest registers the fixtures anew for
tests/loadgen, so the loadgen tests get their own servers and stack and never
disturb the shared `stack`.
"""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator

import msgspec
import pytest_asyncio

from shared.config import parse_cluster
from tests.support.servers import nats_url, redis_url  # noqa: F401  (fixtures)
from tests.support.stack import Stack, start_stack, tiny_cluster_text

# A replay's bursts can briefly hold more requests than the services' tests admit
# (32); a 429 there would be a test artefact, not a finding.
MAX_IN_FLIGHT = 256


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def baton_stack(nats_url: str, redis_url: str) -> AsyncIterator[Stack]:  # noqa: F811
    """Two random-tiny workers (ids w0, w1) behind one gateway; preset `auto` = round-robin."""
    cluster = parse_cluster(tiny_cluster_text(nats_url, redis_url))
    gateway = msgspec.structs.replace(cluster.gateway, max_in_flight=MAX_IN_FLIGHT)
    cluster = msgspec.structs.replace(cluster, gateway=gateway)
    stack = await start_stack(cluster, num_workers=2)
    yield stack
    try:
        await stack.stop()  # cancels whatever did not stop, then raises
    except AssertionError as exc:
        # A slow shutdown on a loaded machine is the services' tests' concern
        # (they assert it); here it must not turn loadgen's results red.
        warnings.warn(f"Baton test stack stopped uncleanly: {exc}", stacklevel=1)
