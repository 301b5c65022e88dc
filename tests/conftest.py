"""Settings for every test."""

from __future__ import annotations

import structlog

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
