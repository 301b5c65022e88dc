"""The streaming response: pre-encoded SSE chunks straight onto the ASGI channel."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Mapping

from starlette.types import Receive, Scope, Send

from services.gateway.protocol import SSE_DONE, error_body, sse
from shared.logging import get_logger

log = get_logger(component="gateway")


class SSEResponse:
    """Server-sent events from pre-encoded chunks: one ASGI body message per chunk, the
    last one (it ends with [DONE]) in the message that ends the body.

    `watcher` is the task that notices the client's disconnect; it is cancelled when the
    stream ends. On every way out the chunk generator is closed and `on_close` runs
    (idempotent: it releases admission and aborts an unfinished request on the worker),
    also when the stream ends before the generator started (a cancelled first send),
    where closing the generator runs none of its code. An unexpected exception after the
    headers is logged and reported in-band, as OpenAI reports errors mid-stream.
    """

    def __init__(
        self,
        chunks: AsyncGenerator[bytes, None],
        headers: Mapping[str, str],
        watcher: asyncio.Task[None] | None,
        on_close: Callable[[], None],
    ) -> None:
        self.chunks = chunks
        self.watcher = watcher
        self.on_close = on_close
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            last = b""  # sent with the end of the body, in the same write (below)
            while True:
                try:
                    chunk = await anext(self.chunks)
                except StopAsyncIteration:
                    break
                except Exception:  # a bug in the generation (a failing send is not caught)
                    log.exception("stream_crashed", path=scope.get("path"))
                    err = error_body("internal error in the gateway; see its log", "server_error")
                    last = sse(err) + SSE_DONE
                    break
                if chunk.endswith(SSE_DONE):  # the stream's last chunk
                    last = chunk
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            # The last chunk and the body's end in one write: one wake-up of the client
            # instead of two (16 streams that finish together: 16 writes fewer at once).
            await send({"type": "http.response.body", "body": last, "more_body": False})
        finally:
            try:
                await self.chunks.aclose()
            finally:
                if self.watcher is not None:
                    self.watcher.cancel()
                self.on_close()
