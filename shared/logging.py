"""structlog configured once per process: one JSON object per line on stdout.

The launcher redirects each service's stdout to logs/<service>.log. Bind
`request_id` into log calls that concern one request so a request can be
followed across processes with grep.
"""

from __future__ import annotations

import logging
import sys

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
