"""Per-request event queues: the gateway inbox fans worker events out to waiting handlers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from shared.messages.gateway import DeltaBatch, GatewayEvent, RequestFailed


class ClientGone:
    """Queued by the HTTP side when the client disconnects while its handler waits."""


CLIENT_GONE = ClientGone()


@dataclass(eq=False)
class RequestStream:
    request_id: str
    instance_id: str
    events: asyncio.Queue[GatewayEvent | ClientGone] = field(default_factory=asyncio.Queue)
    # TTFT feedback for the estimator (RequestDoneEvent): the SFS estimate the route
    # used, perf_counter times of the submit and of the first token (Generation)
    predicted_ttft_ms: float | None = None
    submitted_at: float | None = None
    first_token_at: float | None = None

    def ttft_ms(self) -> float | None:
        """Submit -> first token at this gateway, ms (None before the first)."""
        if self.submitted_at is None or self.first_token_at is None:
            return None
        return (self.first_token_at - self.submitted_at) * 1000.0


class StreamManager:
    """Owns the open request streams of this gateway, keyed by request id."""

    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, request_id: str, instance_id: str) -> RequestStream:
        assert request_id not in self._streams, f"request id reused: {request_id}"
        stream = RequestStream(request_id, instance_id)
        self._streams[request_id] = stream
        return stream

    def open_streams(self) -> list[RequestStream]:
        """The requests this gateway is waiting on now."""
        return list(self._streams.values())

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def on_batch(self, batch: DeltaBatch) -> None:
        """Dispatch one worker iteration's events (events of closed streams are dropped)."""
        for event in batch.events:
            stream = self._streams.get(event.request_id)
            if stream is not None:
                stream.events.put_nowait(event)

    def fail_instance(self, instance_id: str, message: str) -> int:
        """A worker is gone: fail every stream it was serving. Returns how many."""
        failed = 0
        for stream in self._streams.values():
            if stream.instance_id == instance_id:
                stream.events.put_nowait(RequestFailed(stream.request_id, 503, message))
                failed += 1
        return failed
