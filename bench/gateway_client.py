"""The gateway benchmark's HTTP client: chat completion streams, timed to the first token.

Not loadgen's OpenAIClient (loadgen/client.py), which lacks what this benchmark needs: the
client runs on the machine under test, taking CPU from the services it measures, and
by default it is aiohttp on uvloop (what vLLM's and SGLang's serving benchmarks use),
whose HTTP floor here is half that of httpx (loadgen's and the openai SDK's client;
--client httpx measures with it); its one pool holds a round's streams, opened before
the first round; and it keeps the gateway's own stamps of each answer (`baton`:
prepare_ms, first_token_ms) for ServerSplit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import httpx

from bench.gateway_settings import prompt
from bench.gateway_ttft_split import PathObserver, ServerSplit

CLIENTS = ("aiohttp", "httpx")
CLIENT_ERRORS = (OSError, aiohttp.ClientError, httpx.HTTPError)


class Client:
    """One connection pool of `kind` (CLIENTS), for `async with`."""

    def __init__(self, kind: str, base_url: str, max_connections: int = 8) -> None:
        if kind not in CLIENTS:
            raise ValueError(f"client {kind!r}: use one of {', '.join(CLIENTS)}")
        self.kind, self.base_url, self.max_connections = kind, base_url, max_connections
        self._session: Any = None

    async def __aenter__(self) -> Client:
        if self.kind == "aiohttp":
            self._session = aiohttp.ClientSession(
                self.base_url,
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                timeout=aiohttp.ClientTimeout(total=600),
            )
        else:
            limits = httpx.Limits(
                max_connections=self.max_connections,
                max_keepalive_connections=self.max_connections,
            )
            self._session = httpx.AsyncClient(base_url=self.base_url, timeout=600, limits=limits)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.kind == "aiohttp":
            await self._session.close()
        else:
            await self._session.aclose()

    @contextlib.asynccontextmanager
    async def post_stream(
        self, path: str, body: dict[str, Any]
    ) -> AsyncIterator[tuple[Mapping[str, str], AsyncIterator[bytes]]]:
        """POST `body` as JSON; yields the response headers and its lines (bytes)."""
        if self.kind == "aiohttp":
            async with self._session.post(path, json=body) as resp:
                resp.raise_for_status()
                yield resp.headers, resp.content.__aiter__()
        else:
            async with self._session.stream("POST", path, json=body) as resp:
                resp.raise_for_status()

                async def lines() -> AsyncIterator[bytes]:
                    async for line in resp.aiter_lines():
                        yield line.encode()

                yield resp.headers, lines()


async def stream_one(
    client: Client,
    i: int,
    max_tokens: int,
    observer: PathObserver | None = None,
    split: ServerSplit | None = None,
) -> tuple[float, int]:
    """The i-th prompt, streamed to exactly `max_tokens` tokens: (TTFT in s, tokens).
    The TTFT counts to the first chunk with content (not the empty role chunk); without
    one, the whole request's time."""
    body = {
        "model": "bench-model",
        "messages": [{"role": "user", "content": prompt(i)}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, num_tokens = 0.0, 0
    baton: dict[str, Any] | None = None
    async with client.post_stream("/v1/chat/completions", body) as (headers, lines):
        async for line in lines:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if not ttft and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            baton = chunk.get("baton", baton)
    if observer is not None and ttft:
        observer.record(headers["x-request-id"], t0, t0 + ttft)
    if split is not None and ttft:
        split.record(ttft, baton)
    return ttft or (time.perf_counter() - t0), num_tokens


async def gateway_streams(client: Client, num: int, max_tokens: int) -> tuple[int, float]:
    """`num` streams at once, each to `max_tokens`: (tokens, wall time in s)."""
    t0 = time.perf_counter()
    results = await asyncio.gather(*(stream_one(client, i, max_tokens) for i in range(num)))
    return sum(n for _, n in results), time.perf_counter() - t0
