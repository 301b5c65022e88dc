"""structlog configured once per process: one JSON object per line on stdout.

The launcher redirects each service's stdout to logs/<service>.log. Bind
`request_id` into log calls that concern one request so a request can be
followed across processes with grep.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from shared.config import Env


def configure_logging(service: str, level: str | None = None) -> structlog.stdlib.BoundLogger:
    """Configure structlog (JSON lines) and stdlib logging; return the service's logger."""
    level_name = (level or Env.LOG_LEVEL.get() or "info").upper()
    numeric = logging.getLevelName(level_name)
    if not isinstance(numeric, int):
        numeric = logging.INFO
    logging.basicConfig(
        stream=sys.stdout,
        level=max(numeric, logging.WARNING),
        format="%(name)s %(levelname)s %(message)s",
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger(service=service)


def get_logger(**bound: object) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(**bound)


class RetryLog:
    """The warnings of one loop that retries a failing step every period (a Redis or
    NATS outage): the first failure of a stretch is logged at once, then at most one
    every `every_s` with the number left out since, and the first success after a
    stretch logs the event with `_failed` replaced by `_recovered`, with the count and
    how long it lasted. A loop that retries every 20 ms would otherwise write 50 lines
    a second while the store is down, burying whatever else the log says."""

    def __init__(
        self, logger: Any, event: str, every_s: float = 10.0, *, recovered: str | None = None
    ) -> None:
        self._log = logger
        self.event = event
        # the success's event: by default the failure's with _failed -> _recovered
        self.recovered = recovered or event.removesuffix("_failed") + "_recovered"
        self.every_s = every_s
        self.num_failed = 0  # failures in the current stretch
        self._since_s = 0.0  # monotonic time the stretch began
        self._last_logged_s = 0.0
        self._num_quiet = 0  # failures not logged since the last line

    def failed(self, **fields: Any) -> None:
        now = time.monotonic()
        if self.num_failed == 0:
            self._since_s = now
        self.num_failed += 1
        if self.num_failed == 1 or now - self._last_logged_s >= self.every_s:
            extra = {"left_out": self._num_quiet} if self.num_failed > 1 else {}
            self._log.warning(self.event, failures=self.num_failed, **extra, **fields)
            self._last_logged_s, self._num_quiet = now, 0
        else:
            self._num_quiet += 1

    async def attempt(self, step: Callable[[], Awaitable[object]]) -> bool:
        """await step(): an exception is logged as a failure of the stretch, a return as
        a success. Returns whether it succeeded."""
        try:
            await step()
        except Exception as exc:
            self.failed(error=str(exc) or type(exc).__name__)
            return False
        self.ok()
        return True

    def ok(self) -> None:
        if self.num_failed:
            self._log.info(
                self.recovered,
                failures=self.num_failed,
                lasted_s=round(time.monotonic() - self._since_s, 3),
            )
            self.num_failed, self._num_quiet = 0, 0
