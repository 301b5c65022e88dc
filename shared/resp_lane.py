"""A Redis connection as a bare asyncio Protocol, for a worker's snapshot writes.

A worker writes its snapshot every few engine steps on the core that runs the steps,
so each write's CPU comes out of the token rate. Through redis-py's asyncio
connection (even under store.py's `_Lane`) one write cost that core ~450 us on the
cold caches a step leaves behind (docs/performance.md, twenty-fourth session): the
command packed in Python, a StreamWriter and a StreamReader between the socket and
the parser, a lock and a deadline per exchange. Here hiredis packs the command and
parses the reply (both in C), the loop hands received bytes straight to the parser
(`data_received`), and each reply resolves the oldest waiting future.

Only plain connections are spoken here: TCP or a Unix socket, with an optional
AUTH, SELECT and CLIENT SETNAME at connect (RESP2). For anything else a URL can ask
for (TLS, RESP3, a credential provider) `RespLane.for_pool` returns None and the
caller keeps redis-py.

Failure rules:
- A lost connection fails every command waiting on it with redis.ConnectionError;
  the next command connects again (nothing is retried: a command may have run).
- A reply that does not come within the pool's socket timeout fails its command with
  redis.TimeoutError and drops the connection (a wedged Redis must not grow a queue
  of unanswered commands behind it).
- An error reply fails only its own command (NoScriptError for NOSCRIPT, as redis-py
  raises it, redis.ResponseError otherwise); the connection stays in step.
- A caller cancelled while it waits leaves its reply to be read and dropped, so the
  replies that follow still reach their own commands.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, cast

import hiredis
import redis.asyncio as redis
from redis.exceptions import NoScriptError


def _pack(args: tuple[str | bytes | int | float, ...]) -> bytes:
    # (hiredis's stub types the argument as a 1-tuple; it takes any length)
    return hiredis.pack_command(args)  # type: ignore[arg-type]


_AUTH_ERRORS = ("NOAUTH", "WRONGPASS", "invalid password", "Client sent AUTH")


def _reply_error(message: str) -> redis.RedisError:
    """An error reply as the exception redis-py would raise for it."""
    if message.startswith("NOSCRIPT"):
        return NoScriptError(message)
    if message.startswith(_AUTH_ERRORS):
        return redis.AuthenticationError(message)
    return redis.ResponseError(message)


class _RespProtocol(asyncio.Protocol):
    """One connection: commands written in order, replies matched to them in order."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._reader = hiredis.Reader()
        self._waiting: deque[asyncio.Future[Any]] = deque()  # one per unanswered command
        self.is_lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (a cast: uvloop's transports do not derive from asyncio.Transport)
        self.transport = cast(asyncio.Transport, transport)

    def send(self, packed: bytes) -> asyncio.Future[Any]:
        """Write one packed command; the future gets its reply."""
        assert self.transport is not None and not self.is_lost
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        self.transport.write(packed)
        return future

    def data_received(self, data: bytes) -> None:
        try:
            self._reader.feed(data)
            while (reply := self._reader.gets()) is not False:
                # (IndexError: a reply nobody asked for; the server is not speaking RESP2)
                future = self._waiting.popleft()
                if future.done():  # its caller was cancelled or timed out
                    continue
                if isinstance(reply, hiredis.ReplyError):
                    future.set_exception(_reply_error(str(reply)))
                else:
                    future.set_result(reply)
        except (hiredis.ProtocolError, IndexError) as exc:
            self.abort(redis.ConnectionError, f"Redis protocol error: {exc!r}")

    def connection_lost(self, exc: Exception | None) -> None:
        reason = "Redis closed the connection" if exc is None else f"lost Redis: {exc}"
        self._fail_all(redis.ConnectionError, reason)

    def abort(self, error: type[redis.RedisError], message: str) -> None:
        """Drop the connection now, failing every unanswered command with `error`."""
        self._fail_all(error, message)
        if self.transport is not None:
            self.transport.abort()

    def _fail_all(self, error: type[redis.RedisError], message: str) -> None:
        self.is_lost = True
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():  # (an instance each: each caller raises its own)
                future.set_exception(error(message))


class RespLane:
    """Commands over one `_RespProtocol` connection, connected on first use and again
    after a failure (module docstring). Any number of callers may wait at once: their
    commands are pipelined on the one connection."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 6379,
        path: str = "",  # a Unix socket's path (instead of host and port)
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
        client_name: str | None = None,
        connect_timeout_s: float | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self._host, self._port, self._path = host, port, path
        self._setup = self._setup_commands(username, password, db, client_name)
        self._connect_timeout_s = connect_timeout_s
        self._timeout_s = timeout_s
        self._protocol: _RespProtocol | None = None
        self._connecting = asyncio.Lock()  # one connect at a time (only taken to connect)
        self._closed = False

    @classmethod
    def for_pool(cls, pool: redis.ConnectionPool) -> RespLane | None:
        """A lane to the pool's server with its settings, or None where the pool asks
        for more than this lane speaks (TLS, RESP3, a credential provider)."""
        kw = pool.connection_kwargs
        if kw.get("credential_provider") is not None or kw.get("protocol") not in (None, 2, "2"):
            return None
        common: dict[str, Any] = {
            "username": kw.get("username"),
            "password": kw.get("password"),
            "db": int(kw.get("db") or 0),
            "client_name": kw.get("client_name"),
            "connect_timeout_s": kw.get("socket_connect_timeout"),
            "timeout_s": kw.get("socket_timeout"),
        }
        # exact classes: a subclass (SSLConnection is one of Connection) adds a layer
        if pool.connection_class is redis.Connection:
            return cls(host=kw.get("host", "localhost"), port=int(kw.get("port", 6379)), **common)
        if pool.connection_class is redis.UnixDomainSocketConnection:
            return cls(path=kw["path"], **common)
        return None

    @staticmethod
    def _setup_commands(
        username: str | None, password: str | None, db: int, client_name: str | None
    ) -> list[tuple[str | bytes | int | float, ...]]:
        setup: list[tuple[str | bytes | int | float, ...]] = []
        if password is not None or username is not None:
            creds = (password or "",) if username is None else (username, password or "")
            setup.append(("AUTH", *creds))
        if db:
            setup.append(("SELECT", db))
        if client_name:
            setup.append(("CLIENT", "SETNAME", client_name))
        return setup

    async def command(self, *args: str | bytes | int | float) -> Any:
        """The reply to one command (packed for this call)."""
        protocol = self._protocol
        if protocol is None or protocol.is_lost:
            protocol = await self._connect()
        return await self._await_reply(protocol, protocol.send(_pack(args)))

    async def _await_reply(self, protocol: _RespProtocol, reply: asyncio.Future[Any]) -> Any:
        if self._timeout_s is None:
            return await reply
        # A timer, not asyncio.timeout(): this runs on the worker's stepping core, and
        # a timer handle is the cheapest deadline the loop has.
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self._timeout_s, self._expire, protocol, reply)
        try:
            return await reply
        finally:
            timer.cancel()

    def _expire(self, protocol: _RespProtocol, reply: asyncio.Future[Any]) -> None:
        if not reply.done():
            protocol.abort(redis.TimeoutError, f"no reply from Redis within {self._timeout_s} s")

    async def _connect(self) -> _RespProtocol:
        async with self._connecting:
            if self._closed:
                raise redis.ConnectionError("the store is closed")
            if self._protocol is not None and not self._protocol.is_lost:
                return self._protocol  # another caller connected meanwhile
            loop = asyncio.get_running_loop()
            where = self._path or f"{self._host}:{self._port}"
            try:
                async with asyncio.timeout(self._connect_timeout_s):
                    if self._path:
                        _, protocol = await loop.create_unix_connection(_RespProtocol, self._path)
                    else:
                        _, protocol = await loop.create_connection(
                            _RespProtocol, self._host, self._port
                        )
            except TimeoutError:
                raise redis.ConnectionError(
                    f"cannot connect to Redis at {where}: no answer within "
                    f"{self._connect_timeout_s} s"
                ) from None
            except OSError as exc:
                raise redis.ConnectionError(f"cannot connect to Redis at {where}: {exc}") from exc
            try:
                await self._set_up(protocol)
                if self._closed:  # closed while this connected
                    raise redis.ConnectionError("the store is closed")
            except BaseException:
                protocol.abort(redis.ConnectionError, "the connection's set-up failed")
                raise
            self._protocol = protocol
            return protocol

    async def _set_up(self, protocol: _RespProtocol) -> None:
        """AUTH, SELECT, CLIENT SETNAME as the URL asks, pipelined under one deadline.
        (gather: every reply is read, so no failed one is left unretrieved.)"""
        if not self._setup:
            return
        replies = [protocol.send(_pack(cmd)) for cmd in self._setup]
        outcomes = await self._await_reply(
            protocol, asyncio.gather(*replies, return_exceptions=True)
        )
        errors = [e for e in outcomes if isinstance(e, BaseException)]
        if not errors:
            return
        if isinstance(errors[0], redis.ResponseError):  # (a SELECT out of range, ...)
            raise redis.ConnectionError(f"Redis refused the connection's set-up: {errors[0]}")
        raise errors[0]  # AuthenticationError, TimeoutError, ConnectionError

    async def close(self) -> None:
        """Drop the connection; commands waiting fail, and none connects again."""
        self._closed = True
        protocol, self._protocol = self._protocol, None
        if protocol is not None:
            protocol.abort(redis.ConnectionError, "the store is closed")
