"""The completion routes refuse a body over [gateway] max_request_bytes with a 413
before holding more of it than the limit: at once by its Content-Length, else as the
chunks pass the limit (asgi.read_body)."""

from __future__ import annotations

import pytest
from starlette.requests import ClientDisconnect
from starlette.types import Message

from services.gateway.asgi import read_body, request_headers
from services.gateway.errors import GatewayError

CHUNK = b"x" * 1000


class Body:
    """An ASGI receive channel delivering `num_chunks` chunks; counts what was read."""

    def __init__(self, num_chunks: int) -> None:
        self.num_chunks, self.read = num_chunks, 0

    async def __call__(self) -> Message:
        self.read += 1
        more = self.read < self.num_chunks
        return {"type": "http.request", "body": CHUNK, "more_body": more}


def headers(content_length: int | None) -> dict[str, str]:
    raw = [] if content_length is None else [(b"content-length", b"%d" % content_length)]
    return request_headers({"type": "http", "headers": raw})


async def test_a_body_within_the_limit_is_read_whole() -> None:
    body = Body(5)
    assert await read_body(body, headers(5000), 5000) == CHUNK * 5
    assert body.read == 5


async def test_a_declared_length_over_the_limit_is_refused_unread() -> None:
    body = Body(1000)
    with pytest.raises(GatewayError) as exc:
        await read_body(body, headers(1_000_000), 5000)
    assert exc.value.status == 413 and "max_request_bytes" in exc.value.message
    assert body.read == 0


async def test_an_undeclared_body_is_refused_once_it_passes_the_limit() -> None:
    body = Body(1000)  # chunked: no Content-Length
    with pytest.raises(GatewayError) as exc:
        await read_body(body, headers(None), 5000)
    assert exc.value.status == 413
    assert body.read == 6  # the chunk that crossed 5000 bytes, nothing after it


async def test_a_client_gone_before_the_body_ends_is_noticed() -> None:
    messages = iter(
        [
            {"type": "http.request", "body": CHUNK, "more_body": True},
            {"type": "http.disconnect"},
        ]
    )

    async def receive() -> Message:
        return next(messages)

    with pytest.raises(ClientDisconnect):
        await read_body(receive, headers(None), 5000)


def test_a_repeated_header_gives_its_first_value() -> None:
    raw = [(b"x-baton-task", b"first"), (b"x-baton-task", b"second")]
    assert request_headers({"type": "http", "headers": raw})["x-baton-task"] == "first"
    # ASGI promises an iterable, not a list
    assert request_headers({"type": "http", "headers": iter(raw)})["x-baton-task"] == "first"


async def test_a_content_length_of_other_digits_is_not_a_length() -> None:
    """ "²" is a digit to str.isdigit, not to int(): read the body, do not crash."""
    assert await read_body(Body(1), {"content-length": "\u00b2"}, 5000) == CHUNK
