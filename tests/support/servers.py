"""Real NATS and Redis servers on free ports: one pair for the whole test run, and one
more for each package that imports these fixtures into its own conftest."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.launcher.servers import start_nats, start_redis


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = start_nats("127.0.0.1", None, tmp_path_factory.mktemp("nats"))
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    server = start_redis("127.0.0.1", None)
    yield server.url
    server.stop()
