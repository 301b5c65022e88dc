"""The HTTP server the gateway app runs on: one uvicorn configuration, for `python -m
services.gateway` and for the in-process stacks of the tests alike."""

from __future__ import annotations

import asyncio
import socket
from types import FrameType
from typing import Any

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


class GatewayServer(uvicorn.Server):
    """uvicorn's server, except that a signal before the start is over (the app still
    connecting to NATS and Redis, which it waits for as long as they do not answer)
    ends the start at once: `serve` raises CancelledError. uvicorn only notes the signal
    and stops once the start is over, so with NATS down a SIGTERM did nothing and
    `docker stop` or the launcher had to kill the process. Nothing was accepted yet:
    there is nothing to drain."""

    _main: asyncio.Task[Any] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._main = asyncio.current_task()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        main = self._main
        if not self.started and main is not None and not main.done():
            main.get_loop().call_soon_threadsafe(main.cancel)
