"""The two completion routes as plain ASGI, ahead of FastAPI's routing.

Why: on the TTFT path, FastAPI's middleware chain, routing, `Request` and endpoint
machinery cost ~0.3 ms before the handler ran, and Starlette's `StreamingResponse` (an
anyio task group with a disconnect listener per response, and a wrapper around every
send) ~0.4 ms between the first token's event and its first byte (perf_counter stamps
in the gateway, random-tiny; the bare framework costs ~0.12 ms per streamed request
against ~0.01 ms here). So `GatewayApp` (app.py), the
FastAPI app itself, hands POST /v1/chat/completions and /v1/completions to
`CompletionRoutes` before any of its own machinery runs, and everything else (models,
health, metrics, any other path) to FastAPI unchanged. Not a middleware inside
FastAPI's stack: there FastAPI's and Starlette's `__call__` and the error middleware
still run first, 0.08 ms of a request after an idle gap against 0.02 ahead of it.

What FastAPI did for these routes and is done here instead: reading the body (from the
ASGI channel; past `max_request_bytes` a 413 before the rest is read, the one size
check), the optional API-key check, OpenAI-format
errors (GatewayError -> JSON with its status; an unexpected exception -> a logged 500
in the same format), 405 for other methods, and streaming. A streaming client's
disconnect is noticed by the handler's `watch_disconnect` task (it reads `receive` until http.disconnect and wakes the
generation, which aborts the request on the worker), which lives as long as the stream.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from services.gateway import completions
from services.gateway.errors import GatewayError
from services.gateway.ids import new_request_id
from services.gateway.protocol import error_body
from services.gateway.service import GatewayService
from shared.logging import get_logger

log = get_logger(component="gateway")

# path -> is_chat
COMPLETION_PATHS = {"/v1/chat/completions": True, "/v1/completions": False}


def route_path(scope: Scope) -> str:
    """The path the routes see: without the app's root_path (a server or proxy prefix)
    and without a trailing slash (FastAPI answered one with a redirect; here it is
    served)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path.rstrip("/") or "/"


def authorize(headers: Mapping[str, str], api_keys: list[bytes]) -> None:
    """Optional API keys: OpenAI clients send `Authorization: Bearer <key>`."""
    if not api_keys:
        return
    header = headers.get("authorization", "")
    token = header[7:].encode() if header.lower().startswith("bearer ") else b""
    if not any(hmac.compare_digest(token, k) for k in api_keys):
        raise GatewayError(
            401, "invalid or missing API key", "invalid_request_error", "invalid_api_key"
        )


def error_response(service: GatewayService, exc: GatewayError, path: str) -> JSONResponse:
    """A GatewayError as OpenAI's error object, counted (and logged when it is a 5xx)."""
    service.metrics.requests.labels(exc.model, str(exc.status)).inc()
    if exc.status >= 500:
        log.warning(
            "request_failed",
            status=exc.status,
            error=exc.message,
            path=path,
            request_id=exc.headers.get("X-Request-Id"),
        )
    return JSONResponse(
        error_body(exc.message, exc.type, exc.code, exc.param),
        status_code=exc.status,
        headers=exc.headers,
    )


def body_too_large(limit: int) -> GatewayError:
    return GatewayError(
        413,
        f"request body over {limit} bytes ([gateway] max_request_bytes)",
        "invalid_request_error",
    )


def request_headers(scope: Scope) -> dict[str, str]:
    """The request's headers by name (ASGI names them in lower case); where a name
    repeats, its first value, as Starlette's `Headers.get` gives it (the list is read
    from its end, so earlier values overwrite later ones; ASGI promises an iterable)."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in reversed(list(scope["headers"]))}


async def read_body(receive: Receive, headers: Mapping[str, str], limit: int) -> bytes:
    """The request body, refused with a 413 before more than `limit` bytes are held:
    at once when its Content-Length says so, else as soon as the chunks pass it.
    ClientDisconnect when the client leaves before the body is complete.

    Read from the ASGI channel itself: Starlette's `Request` and its body stream took
    ~140 us on the gateway's cold caches against ~58 for this and `request_headers`
    (a probe sweeping 16 MB between calls)."""
    declared = headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect
        if message["type"] != "http.request":
            continue  # (ASGI defines no other; Starlette's stream skips them too)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class CompletionRoutes:
    """The completion routes, served from the ASGI messages directly."""

    def __init__(self, service: GatewayService, api_keys: list[bytes]) -> None:
        self.service = service
        self.api_keys = api_keys

    @staticmethod
    def match(scope: Scope) -> bool | None:
        """For an HTTP request to a completion route: whether it is the chat one; else None."""
        return COMPLETION_PATHS.get(route_path(scope)) if scope["type"] == "http" else None

    async def serve(self, scope: Scope, receive: Receive, send: Send, is_chat: bool) -> None:
        path = scope["path"]
        # Minted first, so that every answer carries it, a refusal too (OpenAI's do: a
        # client reports an error by it)
        request_id = new_request_id("chatcmpl-" if is_chat else "cmpl-")
        try:
            if scope["method"] != "POST":
                raise GatewayError(
                    405,
                    f"{scope['method']} is not allowed on {path}; use POST",
                    "invalid_request_error",
                    headers={"Allow": "POST"},
                )
            headers = request_headers(scope)
            authorize(headers, self.api_keys)
            try:
                raw = await read_body(receive, headers, self.service.settings.max_request_bytes)
            except ClientDisconnect:  # gone before the body was complete: nobody to answer
                return
            response = await completions.handle(
                self.service, raw, is_chat, request_id, headers=headers, receive=receive
            )
        except GatewayError as exc:
            exc.headers.setdefault("X-Request-Id", request_id)
            response = error_response(self.service, exc, path)
        except Exception:
            log.exception("request_crashed", path=path, request_id=request_id)
            crash = GatewayError(
                500,
                "internal error in the gateway; see its log",
                "server_error",
                headers={"X-Request-Id": request_id},
            )
            response = error_response(self.service, crash, path)
        await response(scope, receive, send)
