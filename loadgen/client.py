"""Streaming OpenAI client: one request in, one filled `RequestRecord` out, never a raise.

Streams with `stream_options.include_usage` and parses SSE lines. TTFT is the
first chunk that carries content (a role-only first chunk, or one with empty
content, does not count). A server error (4xx/5xx), an error event, a stream cut
short, a timeout or a refused connection ends the request as a failure with its
error text.

What Baton's gateway adds, all optional (any OpenAI server works without them):
the `X-Request-Id` and `X-Instance-Id` response headers, and a `baton` object
({model, instance, router_overhead_ms, predicted_ttft_ms, ...}) on a chunk
(normally the final usage chunk) or inside `usage`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadgen.records import RequestRecord, Status

MAX_ERROR_CHARS = 500
NUM_POOLS = 16
DRAIN_TIMEOUT_S = 1.0  # a server that keeps the body open after [DONE] is cut off


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """How to talk to the endpoint."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "chat"  # "chat" -> /v1/chat/completions, "completions" -> /v1/completions
    api_key: str | None = None
    timeout_s: float = 600.0  # whole request, first byte to [DONE]
    ignore_eos: bool = False
    temperature: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    keep_text: bool = False  # keep the generated text in the record

    @property
    def api_root(self) -> str:
        """Base URL ending in /v1."""
        root = self.base_url.rstrip("/")
        return root if root.endswith("/v1") else f"{root}/v1"

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{self.api_root}/{path}"


class OpenAIClient:
    """Sends requests over a few pooled httpx.AsyncClients.

    httpcore assigns requests to connections by scanning its whole pool, which
    costs O(connections) per request; at hundreds of streams in flight that
    scan dominated the client's CPU. Sharding requests over NUM_POOLS pools
    divides it.
    """

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self._run_id = f"loadgen-{uuid.uuid4().hex[:8]}"  # request ids unique across runs
        headers = {"Accept": "text/event-stream", **config.headers}
        if config.api_key:
            headers["Authorization"] = f"Bearer {config.api_key}"
        tls = ssl.create_default_context()  # built once: each is a few ms
        self._pools = [
            httpx.AsyncClient(
                headers=headers,
                timeout=httpx.Timeout(config.timeout_s),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                verify=tls,
            )
            for _ in range(NUM_POOLS)
        ]

    async def close(self) -> None:
        for pool in self._pools:
            await pool.aclose()

    async def list_models(self) -> list[str]:
        """Model ids from GET /v1/models ([] if the server does not answer)."""
        try:
            reply = await self._pools[0].get(f"{self.config.api_root}/models", timeout=10.0)
            reply.raise_for_status()
            return [m["id"] for m in reply.json().get("data", [])]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return []

    def body_for(self, record: RequestRecord) -> dict[str, Any]:
        """The JSON body of one request."""
        spec = record.spec
        body: dict[str, Any] = {
            "model": spec.model,
            "max_tokens": spec.max_tokens,
            "temperature": self.config.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.config.endpoint == "chat":
            body["messages"] = spec.messages or [{"role": "user", "content": spec.text}]
        else:
            body["prompt"] = spec.text
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.config.extra_body)
        return body

    def request_id_for(self, record: RequestRecord) -> str:
        """The x-request-id loadgen sends: unique across runs, ends in the request's index."""
        return f"{self._run_id}-{record.spec.index}"

    def headers_for(self, record: RequestRecord) -> dict[str, str]:
        """Per-request headers: loadgen's request id, the task, the TTFT target, the budget.

        `x-slo-ttft-ms` follows llm-d's convention; `x-baton-task` and
        `x-baton-budget` are Baton's own. Other servers ignore all three.
        """
        headers = {"x-request-id": self.request_id_for(record)}
        task = record.spec.task
        if task and task.isascii() and task.isprintable():  # header values are ASCII
            headers["x-baton-task"] = task
        if record.spec.slo_ttft_ms is not None:
            headers["x-slo-ttft-ms"] = f"{record.spec.slo_ttft_ms:.3f}"
        if record.spec.budget is not None:
            headers["x-baton-budget"] = repr(record.spec.budget)
        return headers

    async def send(self, record: RequestRecord, origin_ns: int) -> None:
        """Run one request, filling `record`; all failures end up in record.status."""
        record.start_ns = time.perf_counter_ns() - origin_ns
        try:
            async with asyncio.timeout(self.config.timeout_s):
                await self._stream(record, origin_ns)
        except TimeoutError:
            _fail(record, Status.TIMEOUT, f"no answer within {self.config.timeout_s} s")
        except httpx.TimeoutException as exc:
            _fail(record, Status.TIMEOUT, f"{type(exc).__name__}: {exc}")
        except httpx.ConnectError as exc:
            _fail(record, Status.CONNECT_ERROR, f"{type(exc).__name__}: {exc}")
        except (httpx.HTTPError, OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            _fail(record, Status.STREAM_ERROR, f"{type(exc).__name__}: {exc}")
        except asyncio.CancelledError:
            _fail(record, Status.CANCELLED, "cancelled at the end of the run")
            raise
        finally:
            if not record.end_ns:
                record.end_ns = time.perf_counter_ns() - origin_ns

    async def _stream(self, record: RequestRecord, origin_ns: int) -> None:
        body = self.body_for(record)
        headers = self.headers_for(record)
        record.request_id = headers["x-request-id"]
        async with self._pools[record.spec.index % NUM_POOLS].stream(
            "POST", self.config.url, json=body, headers=headers
        ) as reply:
            record.http_status = reply.status_code
            # Baton's gateway sends both; `baton.instance` in the body wins if present
            record.server_request_id = reply.headers.get("x-request-id", "")
            record.instance = reply.headers.get("x-instance-id", "")
            if reply.status_code >= 400:
                raw = (await reply.aread()).decode("utf-8", "replace")
                _fail(record, Status.HTTP_ERROR, f"HTTP {reply.status_code}: {_error_text(raw)}")
                return
            pieces: list[str] = []
            is_done = False
            lines = reply.aiter_lines()
            async for line in lines:
                if not line.startswith("data:"):
                    continue  # blank separators, comments, `event:` lines
                payload = line[5:].strip()
                if payload == "[DONE]":
                    is_done = True
                    record.end_ns = time.perf_counter_ns() - origin_ns
                    break
                now_ns = time.perf_counter_ns() - origin_ns
                chunk = json.loads(payload)
                if "error" in chunk:
                    _fail(record, Status.STREAM_ERROR, f"error event: {_error_text(payload)}")
                    return
                content = _read_chunk(record, chunk)
                if content:
                    if not record.first_token_ns:
                        record.first_token_ns = now_ns
                    record.chunk_ns.append(now_ns)
                    if self.config.keep_text:
                        pieces.append(content)
            if not is_done and not record.finish_reason:
                _fail(record, Status.STREAM_ERROR, "stream ended before [DONE]")
                return
            record.text = "".join(pieces)
            record.status = Status.OK
            if is_done:
                await _drain(lines)


async def _drain(lines: AsyncIterator[str]) -> None:
    """Read the body's end after [DONE] so the connection goes back to the pool.

    Closing a response with unread bytes closes its connection, and a new TCP
    connect per request costs the client CPU it needs for sending on time.
    """
    with contextlib.suppress(TimeoutError, httpx.HTTPError):
        async with asyncio.timeout(DRAIN_TIMEOUT_S):
            async for _ in lines:
                pass


def _read_chunk(record: RequestRecord, chunk: dict[str, Any]) -> str:
    """Update record from one chunk; return the chunk's content text ('' if none)."""
    if chunk.get("model"):
        record.served_model = record.served_model or str(chunk["model"])
    if chunk.get("id") and not record.server_request_id:
        record.server_request_id = str(chunk["id"])
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        _read_usage(record, usage)
    baton = chunk.get("baton")
    if isinstance(baton, dict):
        _read_baton(record, baton)
    content = ""
    for choice in chunk.get("choices") or []:
        if "delta" in choice:
            delta = choice["delta"] or {}
            content += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        else:
            content += choice.get("text") or ""
        if choice.get("finish_reason"):
            record.finish_reason = str(choice["finish_reason"])
    return content


def _read_usage(record: RequestRecord, usage: dict[str, Any]) -> None:
    _read_fields(record, usage, _USAGE_FIELDS)
    if isinstance(usage.get("baton"), dict):
        _read_baton(record, usage["baton"])  # its token split wins over the usage's
    _read_fields(record, usage, (_COST,))  # the usage's cost wins over baton's


def _read_baton(record: RequestRecord, baton: dict[str, Any]) -> None:
    """Baton's optional per-response routing fields."""
    record.has_baton = True
    if baton.get("model"):
        record.served_model = str(baton["model"])  # wins over the echoed `model`
    if baton.get("policy"):
        record.policy = str(baton["policy"])
    _read_fields(record, baton, _BATON_FIELDS)


# (response key, record attribute, conversion) of the optional numbers and names
_Field = tuple[str, str, Callable[[Any], Any]]
_TOKENS_PER_MODEL: _Field = (
    "tokens_per_model",
    "tokens_per_model",
    lambda v: {str(k): int(n) for k, n in v.items()} if isinstance(v, dict) else None,
)
_COST: _Field = ("cost", "cost", float)
_USAGE_FIELDS: tuple[_Field, ...] = (
    ("prompt_tokens", "prompt_tokens", int),
    ("completion_tokens", "completion_tokens", int),
    _TOKENS_PER_MODEL,
)
_BATON_FIELDS: tuple[_Field, ...] = (
    ("instance", "instance", str),
    ("router_overhead_ms", "router_overhead_ms", float),
    ("predicted_ttft_ms", "predicted_ttft_ms", float),
    _COST,
    _TOKENS_PER_MODEL,
)


def _read_fields(record: RequestRecord, obj: dict[str, Any], fields: Sequence[_Field]) -> None:
    """Each field the response carries (not null), converted onto the record."""
    for key, attr, convert in fields:
        if obj.get(key) is not None and (value := convert(obj[key])) is not None:
            setattr(record, attr, value)


def _fail(record: RequestRecord, status: Status, error: str) -> None:
    record.status = status
    record.error = error[:MAX_ERROR_CHARS]


def _error_text(raw: str) -> str:
    """The `message` of an OpenAI error body, else the raw text."""
    try:
        parsed = json.loads(raw)
        error = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:MAX_ERROR_CHARS]
    except ValueError:
        pass
    return raw.strip()[:MAX_ERROR_CHARS]
