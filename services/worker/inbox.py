"""What reached the worker and waits for its loop: submits and aborts, each with the
direct link it came on (None: over NATS). Every arrival wakes the loop."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable

from shared.link import FrameLink
from shared.messages.worker import AbortRequest, SubmitRequest, WorkerInbound


class Inbox:
    """A FIFO of inbound messages that sets `wakeup` on every arrival."""

    def __init__(self, wakeup: asyncio.Event) -> None:
        self.wakeup = wakeup
        self._queue: deque[tuple[WorkerInbound, FrameLink | None]] = deque()

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    async def on_bus(self, msg: WorkerInbound) -> None:
        """A message over NATS (the subscription's callback)."""
        self._queue.append((msg, None))
        self.wakeup.set()

    def on_link(self, msg: WorkerInbound, link: FrameLink) -> None:
        """A message on a gateway's direct link."""
        self._queue.append((msg, link))
        self.wakeup.set()

    def abort(self, request_ids: Iterable[str]) -> None:
        """Queue aborts, as a client's, behind whatever is already waiting (so a submit
        still queued is admitted first, then aborted)."""
        self._queue.extend((AbortRequest(request_id=rid), None) for rid in request_ids)
        self.wakeup.set()

    def submits_from(self, link: FrameLink) -> list[str]:
        """The ids of the submits still queued that came on `link`."""
        return [
            m.request_id for m, lk in self._queue if lk is link and isinstance(m, SubmitRequest)
        ]

    def take(self) -> tuple[WorkerInbound, FrameLink | None] | None:
        """The oldest message, or None when the inbox is empty."""
        return self._queue.popleft() if self._queue else None
