"""The HTTP server the gateway app runs on: one uvicorn configuration, for `python -m
services.gateway` and for the in-process stacks of the tests alike."""

from __future__ import annotations

import uvicorn
from starlette.types import ASGIApp

from shared.config import GatewayConfig

# Seconds a stopping gateway lets open streams finish before it closes them.
GRACEFUL_SHUTDOWN_S = 10


def server_config(app: ASGIApp, settings: GatewayConfig) -> uvicorn.Config:
    """uvicorn on uvloop and httptools (the fast parser; h11 is pure Python), no access
    log (a line per request on the TTFT path; /metrics counts requests), and the
    cluster file's keep-alive rather than uvicorn's 5 s, which races clients that keep
    an idle connection as long or longer (GatewayConfig.keep_alive_s). Proxy headers
    are applied by the app, to the routes that read them (app.GatewayApp)."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        lifespan="on",  # the service connects to the bus and the store at startup
        http="httptools",
        log_level="warning",
        access_log=False,
        proxy_headers=False,  # (app.GatewayApp applies them past the completion routes)
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
