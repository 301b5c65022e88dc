"""The streaming response: pre-encoded SSE chunks straight onto the ASGI channel."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping

from starlette.types import Receive, Scope, Send


class SSEResponse:
    """Server-sent events from pre-encoded chunks: one ASGI body message per chunk.

    `watcher` is the task that notices the client's disconnect; it is cancelled when the
    stream ends. The chunk generator is closed on every way out, so its `finally` (which
    aborts an unfinished request on the worker) always runs.
    """

    def __init__(
        self,
        chunks: AsyncGenerator[bytes, None],
        headers: Mapping[str, str],
        watcher: asyncio.Task[None] | None,
    ) -> None:
        self.chunks = chunks
        self.watcher = watcher
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.chunks.aclose()
            if self.watcher is not None:
                self.watcher.cancel()
