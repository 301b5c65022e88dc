"""Real NATS and Redis for the batcher's service tests: the session fixtures of tests/services."""

from tests.services.conftest import nats_url, redis_url

__all__ = ["nats_url", "redis_url"]
