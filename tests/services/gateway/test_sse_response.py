"""services/gateway/sse.py: the ASGI messages a stream's chunks become."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

from services.gateway.protocol import SSE_DONE
from services.gateway.sse import SSEResponse


async def run(chunks: AsyncGenerator[bytes, None]) -> tuple[list[dict[str, Any]], int]:
    """The ASGI messages sent, and how many times on_close ran."""
    sent: list[dict[str, Any]] = []
    closed = 0

    def on_close() -> None:
        nonlocal closed
        closed += 1

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        raise AssertionError("the response never reads")

    await SSEResponse(chunks, {"X-Request-Id": "r1"}, None, on_close)({}, receive, send)
    return sent, closed


def bodies(sent: list[dict[str, Any]]) -> list[tuple[bytes, bool]]:
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"x-request-id", b"r1") in sent[0]["headers"]
    return [(m["body"], m["more_body"]) for m in sent[1:]]


async def test_the_last_chunk_ends_the_body_in_the_same_message() -> None:
    finished = []

    async def chunks() -> AsyncGenerator[bytes, None]:
        try:
            yield b"data: 1\n\n"
            yield b"data: 2\n\n"
            yield b"data: 3\n\n" + SSE_DONE
            raise AssertionError("not resumed after the last chunk")
        finally:
            finished.append(True)  # closed, so its own clean-up ran

    sent, closed = await run(chunks())
    assert bodies(sent) == [
        (b"data: 1\n\n", True),
        (b"data: 2\n\n", True),
        (b"data: 3\n\n" + SSE_DONE, False),
    ]
    assert finished == [True] and closed == 1


async def test_a_stream_that_stops_without_done_still_ends_its_body() -> None:
    async def chunks() -> AsyncGenerator[bytes, None]:
        yield b"data: 1\n\n"  # (a client that left: the generation returns)

    sent, closed = await run(chunks())
    assert bodies(sent) == [(b"data: 1\n\n", True), (b"", False)]
    assert closed == 1


async def test_a_crash_is_reported_in_band_and_ends_the_body() -> None:
    async def chunks() -> AsyncGenerator[bytes, None]:
        yield b"data: 1\n\n"
        raise RuntimeError("a bug")

    sent, closed = await run(chunks())
    (first, more), (last, end) = bodies(sent)
    assert (first, more, end) == (b"data: 1\n\n", True, False)
    assert last.endswith(SSE_DONE)
    error = json.loads(last.removesuffix(SSE_DONE).removeprefix(b"data: "))
    assert error["error"]["type"] == "server_error"
    assert closed == 1
