"""Settings for every test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import structlog

from shared.config import parse_cluster
from tests.support.servers import nats_url, redis_url
from tests.support.stack import Stack, start_stack, tiny_cluster_text

__all__ = ["nats_url", "redis_url"]  # fixtures, registered by the import

# Tests that do not configure logging log through structlog's default console renderer,
# whose rich tracebacks (every frame with its locals) took long enough to render on a
# slow host, synchronously on the loop of the in-process stack, that the stack's
# workers missed their 1 s heartbeat TTL and the gateway saw both gone (503s in the
# tests after test_a_crash_in_the_handler_is_a_500_in_openai_format_and_serving_goes_on).
# Plain tracebacks render in microseconds.
structlog.configure(
    processors=[
        *structlog.get_config()["processors"][:-1],
        structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback),
    ]
)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def stack(nats_url: str, redis_url: str) -> AsyncIterator[Stack]:
    """Two random-tiny workers behind one gateway; shared by the tests that do not break it."""
    cluster = parse_cluster(tiny_cluster_text(nats_url, redis_url))
    s = await start_stack(cluster, num_workers=2)
    yield s
    await s.stop()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]
