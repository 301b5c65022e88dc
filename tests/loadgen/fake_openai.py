"""A minimal OpenAI-compatible streaming server for loadgen's end-to-end tests.

Routes under /v1 stream a few content chunks with a small delay, then a usage
chunk carrying Baton-style extras (a `baton` object; X-Request-Id and
X-Instance-Id headers), then [DONE]. Under /fail/v1 every request gets
a 500 in OpenAI's error format; under /broken/v1 the stream stops after two
chunks without [DONE].
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.launcher.servers import free_port

CHUNK_DELAY_S = 0.004
MAX_CHUNKS = 6


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def create_app() -> FastAPI:
    """The fake server; `app.state.seen` keeps (headers, body) of every completion request.
    A test that sets `app.state.frozen` to a list gets how many objects the process had
    frozen (gc.freeze) as each request came: the server runs in the client's process, in
    a thread. (Off by default: the count walks the whole frozen list, ms per request.)"""
    app = FastAPI()
    app.state.seen = []
    app.state.frozen = None

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-small", "object": "model"}]}

    async def stream(body: dict[str, Any], is_chat: bool, is_broken: bool) -> AsyncIterator[bytes]:
        num = min(int(body.get("max_tokens", 4)), MAX_CHUNKS)
        yield _sse(
            {"model": "fake-small", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
        )
        for i in range(num):
            await asyncio.sleep(CHUNK_DELAY_S)
            if is_broken and i == 2:
                return
            last = i == num - 1
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
            if is_chat:
                choice["delta"] = {"content": f" tok{i}"}
            else:
                choice["text"] = f" tok{i}"
            yield _sse({"model": "fake-small", "choices": [choice]})
        yield _sse(
            {
                "model": "fake-small",
                "choices": [],
                "usage": {
                    "prompt_tokens": 11,
                    "completion_tokens": num,
                    "total_tokens": 11 + num,
                    "tokens_per_model": {"fake-small": num - 1, "fake-large": 1},
                },
                "baton": {
                    "instance": "fake-small/0",
                    "model": "fake-small",
                    "policy": "fake-policy",
                    "router_overhead_ms": 0.5,
                    "predicted_ttft_ms": 2.0,
                    "cost": 0.001,
                },
            }
        )
        yield b"data: [DONE]\n\n"

    async def complete(
        request: Request, is_chat: bool, is_broken: bool = False
    ) -> StreamingResponse:
        body = await request.json()
        app.state.seen.append((dict(request.headers), body))
        if app.state.frozen is not None:
            app.state.frozen.append(gc.get_freeze_count())
        # as Baton's gateway: its own request id, and an instance header that the
        # body's `baton.instance` overrides
        headers = {"X-Request-Id": f"fake-{len(app.state.seen)}", "X-Instance-Id": "header/0"}
        return StreamingResponse(
            stream(body, is_chat, is_broken), media_type="text/event-stream", headers=headers
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        return await complete(request, is_chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        return await complete(request, is_chat=False)

    @app.post("/broken/v1/chat/completions")
    async def broken(request: Request) -> StreamingResponse:
        return await complete(request, is_chat=True, is_broken=True)

    @app.post("/fail/v1/chat/completions")
    async def fail() -> JSONResponse:
        error = {"message": "engine exploded", "type": "server_error", "code": 500}
        return JSONResponse({"error": error}, status_code=500)

    return app


@contextmanager
def serve_fake_openai() -> Iterator[tuple[str, FastAPI]]:
    """Run the fake server in a thread; yield its base URL and app; stop it on exit."""
    port = free_port()
    app = create_app()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10.0
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=5.0)
