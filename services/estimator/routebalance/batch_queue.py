"""The requests waiting for their RouteBalance batch, and when a batch fires.

A batch fires when `max_size` requests wait, or `timeout_s` after the first one came,
whichever is first; an idle cluster (every candidate has a free slot: nothing to
balance) fires at once, so a quiet deployment pays no batching wait. The limits adapt
to the share of busy instances as the paper's public code does:

    busy share < 0.3   4 requests / 50 ms
    busy share < 0.7   16 requests / 100 ms
    else               32 requests / 200 ms

A request waits at most its batch's timeout, plus the decision of the batch before it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_size: int  # requests at most in one batch
    timeout_s: float  # the longest the first request of a batch waits

    def __post_init__(self) -> None:
        if self.max_size < 1 or not self.timeout_s >= 0:
            raise ValueError(f"a batch needs max_size >= 1 and timeout_s >= 0, got {self}")


ADAPTIVE: tuple[tuple[float, BatchLimits], ...] = (
    (0.3, BatchLimits(4, 0.05)),
    (0.7, BatchLimits(16, 0.1)),
    (float("inf"), BatchLimits(32, 0.2)),
)


def adaptive_limits(busy_share: float) -> BatchLimits:
    """The limits for a cluster with this share of busy instances (module docstring)."""
    return next(limits for bound, limits in ADAPTIVE if busy_share < bound)


class BatchQueue(Generic[T]):
    """FIFO of waiting items; `next_batch` returns the next batch when it fires."""

    def __init__(
        self,
        limits: Callable[[], BatchLimits],
        is_idle: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limits = limits
        self._is_idle = is_idle
        self._clock = clock
        self._items: list[tuple[float, T]] = []  # (arrival, item)
        self._arrived = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T) -> None:
        self._items.append((self._clock(), item))
        self._arrived.set()

    async def next_batch(self) -> list[T]:
        """Wait for the first item, then until the batch fires; the oldest first."""
        while not self._items:
            self._arrived.clear()
            await self._arrived.wait()
        if self._is_idle():
            return self._take(len(self._items))
        limits = self._limits()
        deadline = self._items[0][0] + limits.timeout_s
        while len(self._items) < limits.max_size:
            left = deadline - self._clock()
            if left <= 0:
                break
            self._arrived.clear()
            try:
                async with asyncio.timeout(left):
                    await self._arrived.wait()
            except TimeoutError:
                break
        return self._take(limits.max_size)

    def _take(self, n: int) -> list[T]:
        batch, self._items = self._items[:n], self._items[n:]
        return [item for _, item in batch]
