"""shared/resp_lane.py against real Redis servers: replies in order, error replies,
lost connections, deadlines, cancellation, the connection's set-up, and the Store
taking it for its snapshot writes."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as redis
import uvloop
from redis.exceptions import NoScriptError

from services.launcher.servers import find_redis_server, free_port, is_reachable
from shared import keys
from shared.resp_lane import RespLane
from shared.store import Store


def lane_for(url: str, **kwargs: object) -> RespLane:
    lane = RespLane.for_pool(redis.ConnectionPool.from_url(url, **kwargs))  # type: ignore[arg-type]
    assert lane is not None
    return lane


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
    finally:
        await lane.close()


async def test_replies_reach_their_commands(redis_url: str) -> None:
    await replies_in_order(redis_url)


def test_replies_reach_their_commands_under_uvloop(redis_url: str) -> None:
    """The worker runs on uvloop, whose transports are not asyncio's classes."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(replies_in_order(redis_url))


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
    redis_url: str,
) -> None:
    lane = lane_for(redis_url)
    admin = redis.Redis.from_url(redis_url)
    try:
        await lane.command("CLIENT", "SETNAME", "resp-victim")
        waiting = asyncio.create_task(lane.command("BLPOP", "resp:never", 5))
        await asyncio.sleep(0.1)
        assert await admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        with pytest.raises(redis.ConnectionError):
            await asyncio.wait_for(waiting, 2)
        assert await lane.command("PING") == b"PONG"  # a new connection
    finally:
        await lane.close()
        await admin.aclose()


async def test_a_reply_past_the_deadline_fails_and_drops_the_connection(redis_url: str) -> None:
    lane = lane_for(redis_url, socket_timeout=0.1)
    admin = redis.Redis.from_url(redis_url)
    try:
        await lane.command("SET", "resp:d", b"before")
        first = lane._protocol
        await admin.execute_command("CLIENT", "PAUSE", "400", "ALL")
        with pytest.raises(redis.TimeoutError, match=r"no reply from Redis within 0\.1 s"):
            await lane.command("GET", "resp:d")
        assert first is not None and first.is_lost
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
            find_redis_server(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--unixsocket",
            str(sock),
            "--requirepass",
            "s3cret",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(500):
            if is_reachable("127.0.0.1", port, 0.2) and sock.exists():
                break
            assert proc.poll() is None, "redis-server exited"
            asyncio.run(asyncio.sleep(0.02))
        yield port, sock
    finally:
        proc.terminate()
        proc.wait(5)


async def test_the_set_up_authenticates_selects_and_names_over_tcp_and_unix(
    secured_redis: tuple[int, Path],
) -> None:
    port, sock = secured_redis
    for url in (
        f"redis://:s3cret@127.0.0.1:{port}/3?client_name=baton-w",
        f"redis://default:s3cret@127.0.0.1:{port}/3?client_name=baton-w",
        f"unix://:s3cret@{sock}?db=3&client_name=baton-w",
    ):
        lane = lane_for(url)
        reader = redis.Redis.from_url(url)
        try:
            assert await lane.command("CLIENT", "GETNAME") == b"baton-w"
            await lane.command("SET", "resp:db", url)
            assert await reader.get("resp:db") == url.encode()  # db 3, as the URL says
            assert await reader.execute_command("SELECT", 0) and await reader.get("resp:db") is None
        finally:
            await lane.close()
            await reader.aclose()
    wrong = lane_for(f"redis://:nope@127.0.0.1:{port}/0")
    with pytest.raises(redis.AuthenticationError):
        await wrong.command("PING")
    missing = lane_for(f"redis://127.0.0.1:{port}/0")
    with pytest.raises(redis.AuthenticationError, match="NOAUTH"):
        await missing.command("PING")  # no password: the command's own error
    await missing.close()


def test_urls_the_lane_does_not_speak_keep_redis_py() -> None:
    for url in ("rediss://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0?protocol=3"):
        assert RespLane.for_pool(redis.ConnectionPool.from_url(url)) is None
    assert RespLane.for_pool(redis.ConnectionPool.from_url("unix:///tmp/r.sock")) is not None


async def test_the_store_writes_snapshots_over_the_lane(redis_url: str) -> None:
    store = Store(redis_url, "resp")
    await store.connect()
    try:
        assert isinstance(store._writes, RespLane)
        await store.write_snapshot("w", 7, b"snap", ttl_s=5, samples=[b"s1", b"s2"])
        blob = (await store.read_snapshots(["w"]))["w"]
        assert blob is not None and (blob.version, blob.data) == (7, b"snap")
        assert await store.redis.lrange(keys.batch_samples("resp", "w"), 0, -1) == [b"s1", b"s2"]
    finally:
        await store.close()
