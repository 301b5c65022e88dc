"""The gateway's HTTP server (services/gateway/server.py): the cluster file's keep-alive
closes idle client connections, and `python -m services.gateway` fails with uvicorn's
startup status when it cannot serve; /health tells a hung NATS server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from msgspec import structs

from services.gateway.app import create_app
from services.gateway.config import GatewayServiceConfig
from services.gateway.server import server_config
from services.launcher.servers import start_nats
from shared.config import ClusterConfig, ConfigError, parse_cluster
from tests.support.stack import run_service_process, tiny_cluster_text

HEALTH = b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n"


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """One HTTP/1.1 response with a Content-Length body: its status line."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)
    return head.split(b"\r\n", 1)[0]


@contextlib.asynccontextmanager
async def serving_gateway(cluster: ClusterConfig, gateway_id: str) -> AsyncIterator[None]:
    """A gateway (no worker behind it) served by uvicorn as `python -m services.gateway`
    configures it, on the cluster's port, until the block ends."""
    app = create_app(GatewayServiceConfig.from_cluster(cluster, gateway_id))
    server = uvicorn.Server(server_config(app, cluster.gateway))
    serving = asyncio.create_task(server.serve())
    try:
        for _ in range(200):
            if server.started:
                break
            await asyncio.sleep(0.05)
        assert server.started
        yield
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, timeout=30)


async def test_an_idle_connection_is_kept_for_keep_alive_s_then_closed(
    nats_url: str, redis_url: str
) -> None:
    cluster = parse_cluster(tiny_cluster_text(nats_url, redis_url))
    cluster = structs.replace(cluster, gateway=structs.replace(cluster.gateway, keep_alive_s=2))
    async with serving_gateway(cluster, "gw-keepalive"):
        reader, writer = await asyncio.open_connection("127.0.0.1", cluster.gateway.port)
        # no worker: /health answers 503, on a connection that stays open
        writer.write(HEALTH)
        assert b" 503 " in await read_response(reader)
        await asyncio.sleep(0.4)  # idle for well under keep_alive_s: reused
        writer.write(HEALTH)
        assert b" 503 " in await read_response(reader)
        idle_from = time.monotonic()
        # the server closed it: after keep_alive_s, well before uvicorn's default 5 s
        assert await asyncio.wait_for(reader.read(1), timeout=4.0) == b""
        idle_s = time.monotonic() - idle_from
        assert idle_s >= 1.6, f"closed after {idle_s:.2f} s idle, before keep_alive_s = 2"
        writer.close()


def test_a_gateway_that_cannot_bind_exits_with_uvicorns_startup_status(
    nats_url: str, redis_url: str, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cluster_file = tmp_path / "cluster.toml"
        cluster_file.write_text(tiny_cluster_text(nats_url, redis_url, port=port))
        proc = run_service_process("gateway", cluster_file)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "address already in use" in proc.stderr.lower(), proc.stderr[-2000:]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("max_in_flight = 32", "keep_alive_s = 0"),
        ("event_timeout_s = 60.0", "event_timeout_s = 0.0"),
    ],
)
def test_a_gateway_timeout_of_zero_is_refused(old: str, new: str) -> None:
    text = tiny_cluster_text("nats://127.0.0.1:4222", "redis://127.0.0.1:6379/0")
    assert old in text
    with pytest.raises(ConfigError, match=new.split()[0]):
        parse_cluster(text.replace(old, f"{old}\n{new}" if "keep" in new else new, 1))


async def test_the_framework_routes_see_a_proxys_forwarded_scheme(
    nats_url: str, redis_url: str
) -> None:
    """uvicorn's proxy-headers middleware is off (server_config); the app applies it to
    every route but the completion ones, so FastAPI's redirects behind a TLS proxy
    still point at https."""
    cluster = parse_cluster(tiny_cluster_text(nats_url, redis_url))
    async with serving_gateway(cluster, "gw-proxy"):
        reader, writer = await asyncio.open_connection("127.0.0.1", cluster.gateway.port)
        writer.write(
            b"GET /v1/models/ HTTP/1.1\r\nHost: baton.example\r\n"
            b"X-Forwarded-Proto: https\r\nX-Forwarded-For: 203.0.113.7\r\n\r\n"
        )
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 307 "), head
        location = next(
            line.split(b":", 1)[1].strip()
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"location:")
        )
        assert location == b"https://baton.example/v1/models"
        writer.close()


async def test_health_says_when_nats_hangs(redis_url: str, tmp_path: Path) -> None:
    """A NATS server that hangs (stopped, not gone) keeps its connections open, so the
    gateway still counts as connected: /health reports the bus "unresponsive" once its
    pings go unanswered, and "ok" again once the server answers."""
    server = start_nats("127.0.0.1", None, tmp_path / "nats")
    cluster = parse_cluster(tiny_cluster_text(server.url, redis_url))
    url = f"http://127.0.0.1:{cluster.gateway.port}/health"

    async def bus_reads(want: str) -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            for _ in range(100):  # the watch pings every bus_watch.CHECK_S (2 s)
                if (await client.get(url)).json()["bus"] == want:
                    return
                await asyncio.sleep(0.1)
        raise AssertionError(f"/health never said bus {want!r}")

    try:
        async with serving_gateway(cluster, "gw-bus"):
            await bus_reads("ok")
            os.kill(server.process.pid, signal.SIGSTOP)
            try:
                await bus_reads("unresponsive")
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            await bus_reads("ok")
    finally:
        server.stop()
