"""Streamed answers of the OpenAI API, read whole: what most streaming tests check."""

from __future__ import annotations

import json
from typing import Any

import httpx


async def streamed(
    base_url: str, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> tuple[httpx.Response, list[str]]:
    """POST `body` to `path` and read the answer to its end: the response (status and
    headers) and every line of its body."""
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=60) as client,
        client.stream("POST", path, json=body) as resp,
    ):
        return resp, [line async for line in resp.aiter_lines()]


def sse_events(lines: list[str]) -> list[dict[str, Any] | str]:
    """The data of each SSE event: a decoded JSON object, or "[DONE]"."""
    events: list[dict[str, Any] | str] = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
