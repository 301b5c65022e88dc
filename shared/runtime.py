"""Running a service process: uvloop, SIGTERM/SIGINT -> graceful stop, exit codes."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable
from typing import Protocol

from shared.logging import get_logger


class StoppableService(Protocol):
    def request_stop(self) -> None: ...

    def run(self) -> Awaitable[None]: ...


def run_service(service: StoppableService, name: str) -> int:
    """Run service on uvloop until it returns; signals begin its graceful stop.

    Returns the process exit code: 0 after a clean stop, 1 if the service failed
    (logged with its traceback; compose or the launcher restarts the process).
    """
    log = get_logger(component=name)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.request_stop)
        await service.run()

    try:
        import uvloop

        uvloop.run(run())
    except Exception:
        log.exception(f"{name}_failed")
        return 1
    return 0


__all__ = ["StoppableService", "run_service"]
