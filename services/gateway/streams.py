"""Per-request event queues: the gateway inbox fans worker events out to waiting handlers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.messages.gateway import DeltaBatch, GatewayEvent, RequestFailed

if TYPE_CHECKING:
    from shared.link import FrameLink


class ClientGone:
    """Queued by the HTTP side when the client disconnects while its handler waits."""


CLIENT_GONE = ClientGone()


class WorkerSilent:
    """Queued by the gateway's silence watch when the worker sent nothing for the
    stream in `event_timeout_s` (StreamManager.mark_silent)."""


WORKER_SILENT = WorkerSilent()
StreamEvent = GatewayEvent | ClientGone | WorkerSilent


@dataclass(eq=False)
class RequestStream:
    request_id: str
    instance_id: str
    events: asyncio.Queue[StreamEvent] = field(default_factory=asyncio.Queue)
    # monotonic time of the worker's latest event for it (of the submit before the first)
    last_event_at: float = field(default_factory=time.monotonic)
    # TTFT feedback for the estimator (RequestDoneEvent): the SFS estimate the route
    # used, perf_counter times of the submit and of the first token (Generation)
    predicted_ttft_ms: float | None = None
    submitted_at: float | None = None
    first_token_at: float | None = None
    link: FrameLink | None = None  # the direct link it was submitted on; None: over NATS

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

    def close(self, stream: RequestStream) -> bool:
        """Forget the stream; False when it was closed already (a rerouted request's id
        may be open again, on its next stream)."""
        if self._streams.get(stream.request_id) is not stream:
            return False
        del self._streams[stream.request_id]
        return True

    async def on_batch(self, batch: DeltaBatch) -> None:
        """The NATS inbox's handler: `dispatch`."""
        self.dispatch(batch)

    def dispatch(self, batch: DeltaBatch) -> None:
        """Dispatch one worker iteration's events (events of closed streams are dropped)."""
        now = time.monotonic()
        for event in batch.events:
            stream = self._streams.get(event.request_id)
            if stream is not None:
                stream.last_event_at = now
                stream.events.put_nowait(event)

    def mark_silent(self, timeout_s: float, now: float) -> int:
        """Queue WORKER_SILENT on every stream with no event for more than timeout_s (its
        handler fails the request with 504). Returns how many.

        Why a sweep and not a timer around each wait: a timer is armed and cancelled per
        event, ~10% of the gateway's CPU while it streams (py-spy, random-tiny at 16
        streams); the sweep costs one clock read per batch."""
        silent = 0
        for stream in self._streams.values():
            if now - stream.last_event_at > timeout_s:
                stream.events.put_nowait(WORKER_SILENT)
                stream.last_event_at = now  # queued once: the handler ends the stream
                silent += 1
        return silent

    def fail_link(self, link: FrameLink, message: str) -> int:
        """A direct link closed: fail every stream submitted on it (its worker aborts
        them on its side). Returns how many."""
        return self._fail(lambda s: s.link is link, message)

    def fail_instance(self, instance_id: str, message: str) -> int:
        """A worker is gone: fail every stream it was serving. Returns how many."""
        return self._fail(lambda s: s.instance_id == instance_id, message)

    def _fail(self, match: Callable[[RequestStream], bool], message: str) -> int:
        """Queue a 503 on every stream that matches. Returns how many."""
        failed = [s for s in self._streams.values() if match(s)]
        for stream in failed:
            stream.events.put_nowait(RequestFailed(stream.request_id, 503, message))
        return len(failed)
