"""A Redis connection of its own for commands a process repeats at a high rate.

Commands are packed once per key list, which skips the pool's per-command work (13
snapshots, paired: 239 -> 173 us; with the ledger hashes 462 -> 298 us), under one
deadline per exchange instead of redis-py's timeout per send and per reply (a further
22-36 us). It drives redis-py's asyncio Connection directly (pack_commands,
send_packed_command, read_response, disconnect): pyproject.toml pins the major
version it was written against.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as redis


class Lane:
    """A connection of its own for commands a process repeats at a high rate.

    Reads that every refresh repeats with the same keys are packed once per key list
    (`execute`: redis-py packs and encodes every argument on every call, and its pool
    takes a lock and records metrics per command); other commands are packed per call
    (`command`). Replies are read in order. A failure (a dropped connection, a timeout,
    a cancellation between send and reply) closes the connection, so no reply is ever
    read by the wrong call; the next call reconnects. A connection that turns out dead
    when a call sends is retried once, as the pool's clients do. An error reply
    (redis.ResponseError) is raised and leaves the connection open: it was read whole.
    """

    _MAX_PACKED = 8  # key lists kept packed (the live instance set changes rarely)

    def __init__(self, pool: redis.ConnectionPool) -> None:
        # The pool's settings, not its lock, and no socket timeout of its own: redis-py
        # wraps every send in `asyncio.wait_for` (a task) and every reply in a timeout
        # context; one deadline (the pool's socket timeout) over each attempt's
        # exchange bounds it the same (13 snapshots: ~30 us of ~200 us).
        kwargs = pool.connection_kwargs
        self.timeout_s: float | None = kwargs.get("socket_timeout")
        self._conn = pool.connection_class(**{**kwargs, "socket_timeout": None})
        self._lock = asyncio.Lock()  # one request-reply exchange at a time
        self._packed: dict[tuple[str, ...], list[bytes]] = {}
        self._closed = False  # close() was called: no call reconnects

    @property
    def is_connected(self) -> bool:
        return bool(self._conn.is_connected)

    async def execute(
        self, cache_key: tuple[str, ...], commands: list[tuple[str, ...]]
    ) -> list[Any]:
        """The replies to `commands` (one per command, in order); `cache_key` names
        the command list (the same key: the same commands)."""
        packed = self._packed.get(cache_key)
        if packed is None:
            if len(self._packed) >= self._MAX_PACKED:
                self._packed.clear()
            packed = self._packed[cache_key] = self._conn.pack_commands(commands)
        return await self._exchange(packed, len(commands))

    async def command(self, *args: str | bytes | int) -> Any:
        """The reply to one command, packed for this call."""
        return (await self._exchange(self._conn.pack_command(*args), 1))[0]

    async def _exchange(self, packed: list[bytes], num_replies: int) -> list[Any]:
        async with self._lock:
            for attempt in (1, 2):
                if self._closed:
                    raise redis.ConnectionError("the store is closed")
                replies: list[Any] = []
                try:
                    async with asyncio.timeout(self.timeout_s):
                        await self._conn.send_packed_command(packed, check_health=False)
                        while len(replies) < num_replies:
                            replies.append(await self._conn.read_response())
                        return replies
                except redis.ResponseError:
                    # An error reply, read whole: the connection stays in step unless
                    # replies of this exchange are still unread.
                    if len(replies) + 1 < num_replies:
                        await self._conn.disconnect(nowait=True)
                    raise
                except redis.ConnectionError:
                    await self._conn.disconnect(nowait=True)
                    if attempt == 2:
                        raise
                except TimeoutError:  # the deadline: as redis-py's own timeout says it
                    await self._conn.disconnect(nowait=True)
                    raise redis.TimeoutError(
                        f"no reply from Redis within {self.timeout_s} s"
                    ) from None
                except BaseException:
                    await self._conn.disconnect(nowait=True)
                    raise
        raise AssertionError("unreachable")

    async def close(self) -> None:
        self._closed = True  # a call in flight fails instead of reconnecting
        await self._conn.disconnect()
