"""The gateway's error for one request: an HTTP status and OpenAI's error body."""

from __future__ import annotations

from collections.abc import Mapping


class GatewayError(Exception):
    """An HTTP error for one request, in OpenAI's format."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        # the response's headers: Retry-After, Allow, and those naming the request
        # (X-Request-Id: asgi.CompletionRoutes adds it; X-Instance-Id: completions.handle,
        # once the request was sent)
        self.headers = dict(headers or {})
        # the requested model, once the gateway knows it serves that name (the metric
        # label: never the client's raw string, whose values would be unbounded)
        self.model = ""
        if retry_after_s is not None:
            self.headers["Retry-After"] = str(retry_after_s)


def no_worker(message: str, retry_after_s: int) -> GatewayError:
    return GatewayError(
        503, message, "service_unavailable", "no_worker", retry_after_s=retry_after_s
    )


def bus_unavailable(retry_after_s: int) -> GatewayError:
    return GatewayError(
        503,
        "the message bus (NATS) is unreachable from this gateway; retry later",
        "service_unavailable",
        "bus_unavailable",
        retry_after_s=retry_after_s,
    )
