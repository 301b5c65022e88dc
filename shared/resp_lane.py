"""A Redis connection as a bare asyncio Protocol, for a worker's snapshot writes.

A worker writes its snapshot every few engine steps on the core that runs the steps,
so each write's CPU comes out of the token rate. Through redis-py's asyncio
connection (even under store.py's `_Lane`) one write costs that core ~450 us on the
cold caches a step leaves behind: the
command packed in Python, a StreamWriter and a StreamReader between the socket and
the parser, a lock and a deadline per exchange. Here hiredis packs the command and
parses the reply (both in C), the loop hands received bytes straight to the parser
(`data_received`), and each reply resolves the oldest waiting future.

Only plain connections are spoken here: TCP (with redis-py's keepalive settings) or a
Unix socket, with an optional AUTH, SELECT and CLIENT SETNAME at connect, in RESP2 (the
lane's own connection: what protocol the pool's connections speak does not matter to
it). For what else a URL can ask for (TLS, a credential provider, decoded replies)
`RespLane.for_pool` returns None and the caller keeps redis-py.

Failure rules:
- A lost connection fails every command waiting on it with redis.ConnectionError;
  the next command connects again (nothing is retried: a command may have run).
- A reply that does not come within the pool's socket timeout fails its command with
  redis.TimeoutError and drops the connection (a wedged Redis must not grow a queue
  of unanswered commands behind it).
- An error reply fails only its own command, with the class redis-py raises for it
  (NoScriptError for NOSCRIPT, AuthenticationError, ReadOnlyError, ...; else
  redis.ResponseError); the connection stays in step.
- A reply nobody asked for (a server that gives up on the connection at once: "max
  number of clients reached") drops the connection as a redis.ConnectionError.
- A caller cancelled while it waits leaves its reply to be read and dropped, so the
  replies that follow still reach their own commands.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Mapping
from typing import Any, cast

import hiredis
import redis.asyncio as redis
from redis.exceptions import (
    BusyLoadingError,
    MaxClientsReachedError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
)


def _pack(args: tuple[str | bytes | int | float, ...]) -> bytes:
    try:
        # (hiredis's stub types the argument as a 1-tuple; it takes any length)
        return hiredis.pack_command(args)  # type: ignore[arg-type]
    except TypeError as exc:  # (None, a bool, ...: redis-py raises DataError for them)
        name = args[0] if args else ""
        raise redis.DataError(f"invalid argument to Redis's {name!r}: {exc}") from None


# Error replies as redis-py raises them (redis/_parsers/base.py), for those a caller
# may tell apart: by their code, and by the message after "ERR ".
_ERRORS_BY_CODE: dict[str, type[redis.RedisError]] = {
    "NOSCRIPT": NoScriptError,
    "NOAUTH": redis.AuthenticationError,
    "WRONGPASS": redis.AuthenticationError,
    "READONLY": ReadOnlyError,  # a replica (a failover left this client on one)
    "LOADING": BusyLoadingError,
    "OOM": OutOfMemoryError,
}
_ERRORS_BY_MESSAGE: tuple[tuple[str, type[redis.RedisError]], ...] = (
    ("max number of clients reached", MaxClientsReachedError),  # a ConnectionError
    ("invalid password", redis.AuthenticationError),
    ("Client sent AUTH, but no password is set", redis.AuthenticationError),
    ("AUTH <password> called without any password", redis.AuthenticationError),
)


def _reply_error(message: str) -> redis.RedisError:
    """An error reply as the exception redis-py would raise for it."""
    code, _, rest = message.partition(" ")
    if code in _ERRORS_BY_CODE:
        return _ERRORS_BY_CODE[code](rest)
    if code == "ERR":
        for start, error in _ERRORS_BY_MESSAGE:
            if rest.startswith(start):
                return error(rest)
    return redis.ResponseError(message)


class _RespProtocol(asyncio.Protocol):
    """One connection: commands written in order, replies matched to them in order."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._reader = hiredis.Reader()
        self._waiting: deque[asyncio.Future[Any]] = deque()  # one per unanswered command
        self.is_lost = False
        self.lost_because = ""  # why, once lost

    @property
    def is_usable(self) -> bool:
        # (a transport closes before connection_lost runs: a server's EOF, an abort)
        return not self.is_lost and self.transport is not None and not self.transport.is_closing()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (a cast: uvloop's transports do not derive from asyncio.Transport)
        self.transport = cast(asyncio.Transport, transport)

    def send(self, packed: bytes) -> asyncio.Future[Any]:
        """Write one packed command; the future gets its reply."""
        if not self.is_usable:
            raise redis.ConnectionError(self.lost_because or "the Redis connection is closed")
        assert self.transport is not None
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        self.transport.write(packed)
        return future

    def data_received(self, data: bytes) -> None:
        try:
            self._reader.feed(data)
            while (reply := self._reader.gets()) is not False:
                if not self._waiting:  # a reply nobody asked for: the server gives up on
                    # this connection ("max number of clients reached") or is not Redis
                    self.abort(redis.ConnectionError, f"Redis said, unasked: {reply}")
                    return
                future = self._waiting.popleft()
                if future.done():  # its caller was cancelled or timed out
                    continue
                if isinstance(reply, hiredis.ReplyError):
                    future.set_exception(_reply_error(str(reply)))
                else:
                    future.set_result(reply)
        except hiredis.ProtocolError as exc:
            self.abort(redis.ConnectionError, f"Redis protocol error: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        reason = "Redis closed the connection" if exc is None else f"lost Redis: {exc}"
        self._fail_all(redis.ConnectionError, reason)

    def abort(self, error: type[redis.RedisError], message: str) -> None:
        """Drop the connection now, failing every unanswered command with `error`."""
        self._fail_all(error, message)
        if self.transport is not None:
            self.transport.abort()

    def _fail_all(self, error: type[redis.RedisError], message: str) -> None:
        if not self.is_lost:
            self.is_lost, self.lost_because = True, message
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
        keepalive: Mapping[int, int] | None = None,  # TCP: {TCP_KEEPIDLE: s, ...}, {} on
    ) -> None:
        self._host, self._port, self._path = host, port, path
        self._setup = self._setup_commands(username, password, db, client_name)
        self._connect_timeout_s = connect_timeout_s
        self._timeout_s = timeout_s
        self._keepalive = keepalive
        self._protocol: _RespProtocol | None = None
        self._connecting = asyncio.Lock()  # one connect at a time (only taken to connect)
        self._opening: _RespProtocol | None = None  # connected, set-up under way
        self._closed = False

    @classmethod
    def for_pool(cls, pool: redis.ConnectionPool) -> RespLane | None:
        """A lane to the pool's server with its settings (as redis-py reads them, with
        its defaults), or None where the pool asks for more than this lane speaks."""
        # exact classes: a subclass (SSLConnection is one of Connection) adds a layer
        if pool.connection_class not in (redis.Connection, redis.UnixDomainSocketConnection):
            return None
        conn: Any = pool.connection_class(**pool.connection_kwargs)  # (no I/O until used)
        if conn.credential_provider is not None or conn.encoder.decode_responses:
            return None
        common: dict[str, Any] = {
            "username": conn.username,
            "password": conn.password,
            "db": int(conn.db or 0),
            "client_name": conn.client_name,
            "connect_timeout_s": conn.socket_connect_timeout,
            "timeout_s": conn.socket_timeout,
        }
        if isinstance(conn, redis.UnixDomainSocketConnection):
            return cls(path=conn.path, **common)
        keepalive = dict(conn.socket_keepalive_options or {}) if conn.socket_keepalive else None
        return cls(host=conn.host, port=int(conn.port), keepalive=keepalive, **common)

    @staticmethod
    def _setup_commands(
        username: str | None, password: str | None, db: int, client_name: str | None
    ) -> list[tuple[str | bytes | int | float, ...]]:
        """What a new connection sends first. AUTH as redis-py's RESP3 HELLO sends it: a
        password alone is the default user's (a server without a password takes any)."""
        setup: list[tuple[str | bytes | int | float, ...]] = []
        if username or password:
            setup.append(("AUTH", username or "default", password or ""))
        if db:
            setup.append(("SELECT", db))
        if client_name:
            setup.append(("CLIENT", "SETNAME", client_name))
        return setup

    async def command(self, *args: str | bytes | int | float) -> Any:
        """The reply to one command (packed for this call)."""
        packed = _pack(args)
        protocol = self._protocol
        if protocol is None or not protocol.is_usable:
            protocol = await self._connect()
        return await self._await_reply(protocol, protocol.send(packed))

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
            if self._protocol is not None and self._protocol.is_usable:
                return self._protocol  # another caller connected meanwhile
            protocol = await self._open()
            self._opening = protocol  # (close() aborts it from here on)
            try:
                await self._set_up(protocol)
                if self._closed:  # closed while this connected
                    raise redis.ConnectionError("the store is closed")
            except BaseException:
                protocol.abort(redis.ConnectionError, "the connection's set-up failed")
                raise
            finally:
                self._opening = None
            self._protocol = protocol
            return protocol

    async def _open(self) -> _RespProtocol:
        loop = asyncio.get_running_loop()
        where = self._path or f"{self._host}:{self._port}"
        try:
            async with asyncio.timeout(self._connect_timeout_s) as deadline:
                if self._path:
                    _, protocol = await loop.create_unix_connection(_RespProtocol, self._path)
                else:
                    _, protocol = await loop.create_connection(
                        _RespProtocol, self._host, self._port
                    )
        except TimeoutError as exc:
            if not deadline.expired():  # the OS's own ETIMEDOUT
                raise redis.ConnectionError(f"cannot connect to Redis at {where}: {exc}") from exc
            raise redis.ConnectionError(
                f"cannot connect to Redis at {where}: no answer within {self._connect_timeout_s} s"
            ) from None
        except OSError as exc:
            raise redis.ConnectionError(f"cannot connect to Redis at {where}: {exc}") from exc
        if self._keepalive is not None:
            self._set_keepalive(protocol)
        return protocol

    def _set_keepalive(self, protocol: _RespProtocol) -> None:
        """TCP keepalive as redis-py sets it: a peer gone without a word is noticed."""
        assert protocol.transport is not None and self._keepalive is not None
        sock = protocol.transport.get_extra_info("socket")
        if sock is None:
            return
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in self._keepalive.items():
            sock.setsockopt(socket.IPPROTO_TCP, option, value)

    async def _set_up(self, protocol: _RespProtocol) -> None:
        """AUTH, SELECT, CLIENT SETNAME as the URL asks, pipelined under one deadline.
        (gather: every reply is read, so no failed one is left unretrieved.)"""
        if not self._setup:
            return
        errors = await self._run_set_up(protocol)
        auth = self._setup[0]
        if errors and auth[0] == "AUTH" and "wrong number of arguments" in str(errors[0]):
            # a server older than Redis 6 (no ACL users): AUTH takes the password alone
            self._setup[0] = ("AUTH", auth[2])
            errors = await self._run_set_up(protocol)
        if not errors:
            return
        if isinstance(errors[0], redis.ResponseError):  # (a SELECT out of range, ...)
            raise redis.ConnectionError(f"Redis refused the connection's set-up: {errors[0]}")
        raise errors[0]  # AuthenticationError, TimeoutError, ConnectionError

    async def _run_set_up(self, protocol: _RespProtocol) -> list[BaseException]:
        replies = [protocol.send(_pack(cmd)) for cmd in self._setup]
        outcomes = await self._await_reply(
            protocol, asyncio.gather(*replies, return_exceptions=True)
        )
        return [e for e in outcomes if isinstance(e, BaseException)]

    async def close(self) -> None:
        """Drop the connection (and one being set up); commands waiting fail, and none
        connects again."""
        self._closed = True
        for protocol in (self._protocol, self._opening):
            if protocol is not None:
                protocol.abort(redis.ConnectionError, "the store is closed")
        self._protocol = None
