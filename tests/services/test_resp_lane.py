"""shared/resp_lane.py against real Redis servers: replies in order, error replies,
lost connections, deadlines, cancellation, the connection's set-up, and the Store
taking it for its snapshot writes. A few failures no real server shows on demand (a
pre-6 server's AUTH, a server that gives up on a connection at once, one that never
answers) are played by a small RESP server here."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import hiredis
import pytest
import redis.asyncio as redis
import uvloop
from redis.exceptions import NoScriptError

from services.launcher.servers import find_redis_server, free_port, is_reachable, start_redis
from shared import keys
from shared.resp_lane import RespLane
from shared.store import _WRITE_SNAPSHOT_SHA, Store


def lane_for(url: str, **kwargs: object) -> RespLane:
    lane = RespLane.for_pool(redis.ConnectionPool.from_url(url, **kwargs))  # type: ignore[arg-type]
    assert lane is not None
    return lane


def on_uvloop(run: Callable[[], Awaitable[None]]) -> None:
    """The worker runs on uvloop, whose transports are not asyncio's classes (and which
    hands a connection's first bytes over before create_connection returns)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def own_redis() -> Iterator[str]:
    """A server of this module's own, for the tests that drop or pause its clients."""
    server = start_redis("127.0.0.1", None)
    yield server.url
    server.stop()


async def client_id(lane: RespLane) -> int:
    return int(await lane.command("CLIENT", "ID"))


async def replies_in_order(url: str) -> None:
    lane = lane_for(url, socket_timeout=5.0)
    try:
        assert await lane.command("SET", "resp:k", b"v\r\nx") == b"OK"
        assert await lane.command("GET", "resp:k") == b"v\r\nx"
        assert await lane.command("GET", "resp:missing") is None
        await lane.command("DEL", "resp:l")  # (both loops' tests run on one server)
        assert await lane.command("RPUSH", "resp:l", 1, 2.5, "three") == 3
        assert await lane.command("LRANGE", "resp:l", 0, -1) == [b"1", b"2.5", b"three"]
        # many callers at once: their commands share the connection, each gets its own
        await asyncio.gather(*(lane.command("SET", f"resp:n{i}", i) for i in range(200)))
        got = await asyncio.gather(*(lane.command("GET", f"resp:n{i}") for i in range(200)))
        assert got == [str(i).encode() for i in range(200)]
        with pytest.raises(redis.DataError, match="'SET'"):
            await lane.command("SET", "resp:k", None)  # type: ignore[arg-type]
        assert await lane.command("GET", "resp:k") == b"v\r\nx"
    finally:
        await lane.close()


async def test_replies_reach_their_commands(redis_url: str) -> None:
    await replies_in_order(redis_url)


def test_replies_reach_their_commands_under_uvloop(redis_url: str) -> None:
    on_uvloop(lambda: replies_in_order(redis_url))


async def test_an_error_reply_fails_only_its_command(redis_url: str) -> None:
    lane = lane_for(redis_url)
    try:
        await lane.command("SET", "resp:str", b"v")
        protocol = lane._protocol
        wrong, ok = await asyncio.gather(
            lane.command("HGETALL", "resp:str"),
            lane.command("GET", "resp:str"),
            return_exceptions=True,
        )
        assert isinstance(wrong, redis.ResponseError) and "WRONGTYPE" in str(wrong)
        assert ok == b"v"
        with pytest.raises(NoScriptError):
            await lane.command("EVALSHA", "0" * 40, 0)
        assert lane._protocol is protocol  # the same connection throughout
    finally:
        await lane.close()


async def test_a_lost_connection_fails_its_waiting_command_and_the_next_reconnects(
    own_redis: str,
) -> None:
    lane = lane_for(own_redis)
    admin = redis.Redis.from_url(own_redis)
    try:
        first = await client_id(lane)
        waiting = asyncio.create_task(lane.command("BLPOP", "resp:never", 5))
        await asyncio.sleep(0.1)
        assert await admin.execute_command("CLIENT", "KILL", "ID", first) == 1
        with pytest.raises(redis.ConnectionError):
            await asyncio.wait_for(waiting, 2)
        assert await client_id(lane) != first  # a new connection
    finally:
        await lane.close()
        await admin.aclose()


async def test_a_reply_past_the_deadline_fails_and_drops_the_connection(own_redis: str) -> None:
    lane = lane_for(own_redis, socket_timeout=0.1)
    admin = redis.Redis.from_url(own_redis)
    try:
        lane._timeout_s = 5.0  # the commands meant to succeed get room on a slow machine
        await lane.command("SET", "resp:d", b"before")
        first = lane._protocol
        await admin.execute_command("CLIENT", "PAUSE", "1500", "ALL")
        lane._timeout_s = 0.1
        with pytest.raises(redis.TimeoutError, match=r"no reply from Redis within 0\.1 s"):
            await lane.command("GET", "resp:d")
        assert first is not None and first.is_lost
        lane._timeout_s = 5.0
        await asyncio.sleep(0.4)
        # the next command's reply is its own, not the one that came too late
        assert await lane.command("SET", "resp:d", b"after") == b"OK"
        assert await lane.command("GET", "resp:d") == b"after"
    finally:
        await lane.close()
        await admin.aclose()


async def test_a_cancelled_command_leaves_the_replies_after_it_in_step(redis_url: str) -> None:
    lane = lane_for(redis_url)
    try:
        await lane.command("SET", "resp:c", b"mine")
        blocked = asyncio.create_task(lane.command("BLPOP", "resp:empty", 0.3))
        await asyncio.sleep(0.05)
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        # sent behind the BLPOP on the same connection: answered after its (dropped) nil
        assert await lane.command("GET", "resp:c") == b"mine"
    finally:
        await lane.close()


async def test_a_closed_lane_fails_its_waiting_commands_and_never_reconnects(
    redis_url: str,
) -> None:
    lane = lane_for(redis_url)
    waiting = asyncio.create_task(lane.command("BLPOP", "resp:never", 5))
    await asyncio.sleep(0.05)
    await lane.close()
    with pytest.raises(redis.ConnectionError, match="closed"):
        await waiting
    with pytest.raises(redis.ConnectionError, match="closed"):
        await lane.command("PING")


async def test_a_server_that_is_not_there_is_a_clear_connection_error() -> None:
    port = free_port()
    lane = lane_for(f"redis://127.0.0.1:{port}/0", socket_connect_timeout=1.0)
    with pytest.raises(redis.ConnectionError, match=f"cannot connect to Redis at 127.0.0.1:{port}"):
        await lane.command("PING")


@pytest.fixture(scope="module")
def secured_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """A redis-server with a password, on a TCP port and a Unix socket."""
    sock = tmp_path_factory.mktemp("redis") / "r.sock"
    port = free_port()
    proc = subprocess.Popen(
        [
            *(find_redis_server(), "--port", str(port), "--bind", "127.0.0.1"),
            *("--unixsocket", str(sock), "--requirepass", "s3cret"),
            *("--save", "", "--appendonly", "no"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not (is_reachable("127.0.0.1", port, 0.2) and sock.exists()):
            assert proc.poll() is None, "redis-server exited"
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)
        yield port, sock
    finally:
        proc.terminate()
        proc.wait(5)


async def test_the_set_up_authenticates_selects_and_names_over_tcp_and_unix(
    secured_redis: tuple[int, Path],
) -> None:
    port, sock = secured_redis
    admin = redis.Redis.from_url(f"redis://:s3cret@127.0.0.1:{port}/0")
    await admin.execute_command("ACL", "SETUSER", "baton", "on", ">pw2", "~*", "&*", "+@all")
    try:
        for url, user in (
            (f"redis://:s3cret@127.0.0.1:{port}/3?client_name=baton-w", b"default"),
            (f"redis://baton:pw2@127.0.0.1:{port}/3?client_name=baton-w", b"baton"),
            (f"unix://:s3cret@{sock}?db=3&client_name=baton-w", b"default"),
        ):
            lane = lane_for(url)
            reader = redis.Redis.from_url(url)
            try:
                assert await lane.command("ACL", "WHOAMI") == user
                assert await lane.command("CLIENT", "GETNAME") == b"baton-w"
                await lane.command("SET", "resp:db", url)
                assert await reader.get("resp:db") == url.encode()  # db 3, as the URL says
                await reader.execute_command("SELECT", 0)
                assert await reader.get("resp:db") is None
            finally:
                await lane.close()
                await reader.aclose()
        for url in (
            f"redis://:nope@127.0.0.1:{port}/0",
            f"redis://baton:s3cret@127.0.0.1:{port}/0",
        ):
            wrong = lane_for(url)
            with pytest.raises(redis.AuthenticationError, match="invalid username-password"):
                await wrong.command("PING")
        missing = lane_for(f"redis://127.0.0.1:{port}/0")
        with pytest.raises(redis.AuthenticationError, match="Authentication required"):
            await missing.command("PING")  # no password: the command's own error
        await missing.close()
    finally:
        await admin.aclose()


async def test_a_password_for_a_server_without_one_is_taken_as_redis_py_takes_it(
    redis_url: str,
) -> None:
    """redis-py (RESP3 by default) authenticates as the default user, which a server
    without a password lets in with any password: so must the lane, or a Store whose
    URL carries a password would ping fine and fail every snapshot write."""
    url = redis_url.replace("redis://", "redis://:unneeded@")
    async with redis.Redis.from_url(url) as client:
        assert await client.ping()
    lane = lane_for(url)
    try:
        assert await lane.command("PING") == b"PONG"
    finally:
        await lane.close()


class FakeRedis:
    """A RESP server that answers as `answer` says: (the commands received so far,
    the newest) -> the raw reply, b"" for none, or None to close the connection."""

    def __init__(self, answer: Callable[[list[list[bytes]], list[bytes]], bytes | None]):
        self.answer = answer
        self.received: list[list[bytes]] = []
        self.on_connect = b""  # sent at once to every new connection
        self.close_on_connect = False

    async def __aenter__(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parser = hiredis.Reader()
        try:
            if self.on_connect:
                writer.write(self.on_connect)
            if self.close_on_connect:
                await writer.drain()
                return
            while data := await reader.read(65536):
                parser.feed(data)
                while (cmd := parser.gets()) is not False:
                    self.received.append(cmd)
                    reply = self.answer(self.received, cmd)
                    if reply is None:
                        return
                    writer.write(reply)
        finally:
            writer.close()


async def test_a_server_before_redis_6_gets_the_password_alone() -> None:
    def answer(_: list[list[bytes]], cmd: list[bytes]) -> bytes:
        if cmd[0] == b"AUTH":
            if len(cmd) == 3:
                return b"-ERR wrong number of arguments for 'auth' command\r\n"
            return b"+OK\r\n" if cmd[1] == b"pw" else b"-ERR invalid password\r\n"
        return b"+PONG\r\n"

    fake = FakeRedis(answer)
    async with fake as port:
        lane = lane_for(f"redis://:pw@127.0.0.1:{port}/0")
        try:
            assert await lane.command("PING") == b"PONG"
            assert [c[:2] for c in fake.received] == [
                [b"AUTH", b"default"],
                [b"AUTH", b"pw"],
                [b"PING"],
            ]
        finally:
            await lane.close()


async def a_server_that_gives_up_at_once() -> None:
    fake = FakeRedis(lambda _, cmd: b"+OK\r\n")
    fake.on_connect, fake.close_on_connect = b"-ERR max number of clients reached\r\n", True
    async with fake as port:
        for url in (f"redis://127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/2"):
            lane = lane_for(url)
            for _ in range(5):  # (the error can come before or after the connect returns)
                with pytest.raises(redis.ConnectionError):
                    await lane.command("PING")
            await lane.close()


async def test_a_server_that_gives_up_on_the_connection_is_a_connection_error() -> None:
    await a_server_that_gives_up_at_once()


def test_a_server_that_gives_up_on_the_connection_is_a_connection_error_under_uvloop() -> None:
    on_uvloop(a_server_that_gives_up_at_once)


async def test_a_set_up_that_gets_no_answer_times_out_or_ends_with_close() -> None:
    async with FakeRedis(lambda _, cmd: b"") as port:  # takes commands, answers none
        lane = lane_for(f"redis://:pw@127.0.0.1:{port}/0", socket_timeout=0.2)
        with pytest.raises(redis.TimeoutError, match=r"within 0\.2 s"):
            await lane.command("PING")
        # without a deadline: close() ends the connect it interrupts
        lane = lane_for(f"redis://:pw@127.0.0.1:{port}/0", socket_timeout=None)
        waiting = asyncio.create_task(lane.command("PING"))
        await asyncio.sleep(0.1)
        assert lane._opening is not None and not waiting.done()
        await lane.close()
        with pytest.raises(redis.ConnectionError, match="closed"):
            await asyncio.wait_for(waiting, 1)


def test_the_lane_takes_redis_py_settings_and_defaults_or_steps_aside() -> None:
    for url in ("rediss://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0?decode_responses=true"):
        assert RespLane.for_pool(redis.ConnectionPool.from_url(url)) is None
    lane = lane_for("redis://127.0.0.1:6379/0?protocol=3")  # its own connection: RESP2
    assert (lane._connect_timeout_s, lane._timeout_s) == (5, 5)  # redis-py's defaults
    assert lane._keepalive  # redis-py's TCP keepalive
    unix = lane_for("unix:///tmp/r.sock?db=2", socket_timeout=1.5)
    assert (unix._path, unix._timeout_s, unix._keepalive) == ("/tmp/r.sock", 1.5, None)
    assert unix._setup == [("SELECT", 2)]


async def test_the_store_writes_snapshots_over_the_lane(redis_url: str) -> None:
    store = Store(redis_url, "resp")
    await store.connect()
    try:
        assert isinstance(store._writes, RespLane)
        await store.redis.script_flush()  # the first write gets NOSCRIPT, then EVALs
        await store.write_snapshot("w", 7, b"snap", ttl_s=5, samples=[b"s1", b"s2"])
        assert await store.redis.script_exists(_WRITE_SNAPSHOT_SHA) == [True]
        blob = (await store.read_snapshots(["w"]))["w"]
        assert blob is not None and (blob.version, blob.data) == (7, b"snap")
        assert await store.redis.lrange(keys.batch_samples("resp", "w"), 0, -1) == [b"s1", b"s2"]
    finally:
        await store.close()
