"""Direct links (shared/link.py): framing over real sockets, the hello's checks, and the
gateway <-> worker request plane end to end (a link's loss fails its requests on both
sides and is redialled; NATS carries the requests when links are off or down)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from pathlib import Path

import httpx
import msgspec
import pytest
import uvloop

from services.gateway.links import WorkerLinks
from services.worker.links import GatewayLinks
from shared.config import parse_cluster
from shared.link import (
    ABSTRACT_UNIX,
    HEADER,
    MAX_FRAME_BYTES,
    FrameLink,
    LinkError,
    join_addr,
    split_addr,
)
from shared.messages import encode
from shared.messages.gateway import DeltaBatch
from shared.messages.link import LinkHello
from shared.messages.worker import AbortRequest, WorkerInbound
from shared.scheduling.snapshot import WorkloadSnapshot
from tests.support.stack import (
    Stack,
    hand_worker_info,
    running,
    tiny_cluster_text,
    worker_process,
)

CHAT: dict[str, object] = {
    "model": "random-tiny",
    "messages": [{"role": "user", "content": "Say hello."}],
}


class Ends:
    """A listening FrameLink and a dialling one on loopback, recording what each gets."""

    def __init__(self) -> None:
        self.got: list[bytes] = []  # frames the listening end received
        self.lost: list[FrameLink] = []
        self.server_link: FrameLink | None = None

    def _server_side(self) -> FrameLink:
        self.server_link = FrameLink(
            lambda _, frame: self.got.append(bytes(frame)), self.lost.append, name="server"
        )
        return self.server_link

    async def open(self) -> tuple[asyncio.Server, asyncio.Transport]:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(self._server_side, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
        return server, transport

    async def until(self, cond: object, timeout_s: float = 5.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not cond():  # type: ignore[operator]
                await asyncio.sleep(0.005)


async def test_frames_arrive_whole_however_the_bytes_are_cut() -> None:
    ends = Ends()
    server, raw = await ends.open()
    frames = [b"", b"x", bytes(range(256)) * 40, b"last"]
    wire = b"".join(HEADER.pack(len(f)) + f for f in frames)
    try:
        # byte by byte, then everything in one write, then cut mid-header and mid-body
        for i in range(len(wire[:300])):
            raw.write(wire[i : i + 1])
            await asyncio.sleep(0)
        raw.write(wire[300:])
        raw.write(wire)
        raw.write(wire[:2])
        await asyncio.sleep(0.01)
        raw.write(wire[2:7])
        await asyncio.sleep(0.01)
        raw.write(wire[7:])
        await ends.until(lambda: len(ends.got) == 3 * len(frames))
        assert ends.got == frames * 3
    finally:
        raw.close()
        server.close()


async def test_a_frame_over_the_limit_closes_the_link() -> None:
    ends = Ends()
    server, raw = await ends.open()
    try:
        raw.write(HEADER.pack(MAX_FRAME_BYTES + 1) + b"abc")
        await ends.until(lambda: ends.lost)
        assert ends.got == []
        assert ends.server_link is not None and not ends.server_link.is_open
        assert ends.server_link.send(b"late") is False  # a closed link sends nothing
    finally:
        raw.close()
        server.close()


def test_frames_cross_under_uvloop_too() -> None:
    """The services run on uvloop, whose transports are not asyncio's classes."""

    async def exchange() -> list[bytes]:
        ends = Ends()
        server, raw = await ends.open()
        try:
            raw.write(HEADER.pack(3) + b"abc" + HEADER.pack(1))
            raw.write(b"d")
            await ends.until(lambda: len(ends.got) == 2)
            assert ends.server_link is not None and ends.server_link.send(b"back")
            return ends.got
        finally:
            raw.close()
            server.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(exchange()) == [b"abc", b"d"]


def test_addresses_round_trip() -> None:
    assert split_addr(join_addr("127.0.0.1", 80)) == ("127.0.0.1", 80)
    assert split_addr(join_addr("::1", 8080)) == ("::1", 8080)
    for bad in ("", "host", "host:", ":80", "host:port"):
        with pytest.raises(ValueError):
            split_addr(bad)


async def test_hello_checks_the_namespace_and_the_workers_identity() -> None:
    """A worker refuses a gateway of another namespace; a gateway refuses a worker that is
    not the registered one (an address a restarted worker took over)."""
    got: list[WorkerInbound] = []
    worker = GatewayLinks("ns-a", "w0", 123.0, lambda m, _: got.append(m), lambda _: None)
    await worker.start("127.0.0.1", 0)
    info = msgspec.structs.replace(
        hand_worker_info("ns-a", "w0"), started_at_s=123.0, link_addr=worker.addr
    )
    lost: list[FrameLink] = []
    try:
        ours = WorkerLinks("ns-a", "gw", lambda _: None, lost.append)
        link = await ours.dial(info)
        assert link.is_open and link.name == "w0"
        assert link.send(encode(AbortRequest(request_id="r1")))
        for _ in range(200):
            if got:
                break
            await asyncio.sleep(0.005)
        assert got == [AbortRequest(request_id="r1")]
        link.close()
        await link.closed
        await ours.close()

        with pytest.raises(LinkError, match="not the registered"):
            await WorkerLinks("ns-a", "gw", lambda _: None, lost.append).dial(
                msgspec.structs.replace(info, started_at_s=124.0)
            )
        with pytest.raises(ConnectionError):  # the worker closes on the wrong namespace
            await WorkerLinks("ns-b", "gw", lambda _: None, lost.append).dial(info)
        assert len(worker.links) == 0  # nothing stays open
    finally:
        await worker.close()


LINUX_ONLY = pytest.mark.skipif(not ABSTRACT_UNIX, reason="abstract Unix sockets: Linux")


async def unix_dials() -> None:
    """A worker listens on TCP and on an abstract Unix socket; a gateway dials the
    socket, and falls back to TCP when the name is not the registered worker's
    (another worker's socket) or nobody answers it (a worker on another host, a dead
    one)."""
    worker = GatewayLinks("ns", "w0", 1.0, lambda *_: None, lambda _: None)
    other = GatewayLinks("ns", "w1", 2.0, lambda *_: None, lambda _: None)
    await worker.start("127.0.0.1", 0)
    await other.start("127.0.0.1", 0)
    name = worker.unix_name
    info = msgspec.structs.replace(
        hand_worker_info("ns", "w0"), started_at_s=1.0, link_addr=worker.addr, link_unix_name=name
    )
    links = WorkerLinks("ns", "gw", lambda _: None, lambda _: None)
    dialled: list[FrameLink] = []
    try:
        assert name and name != other.unix_name
        dialled.append(await links.dial(info))
        assert dialled[-1].is_unix and dialled[-1].is_open
        dialled.append(await links.dial(msgspec.structs.replace(info, link_unix_name="")))
        assert not dialled[-1].is_unix and dialled[-1].is_open
        # the name is another worker's: its hello says so, and TCP reaches ours
        dialled.append(
            await links.dial(msgspec.structs.replace(info, link_unix_name=other.unix_name))
        )
        assert not dialled[-1].is_unix and dialled[-1].is_open
        dialled.append(
            await links.dial(msgspec.structs.replace(info, link_unix_name=name + "-gone"))
        )
        assert not dialled[-1].is_unix and dialled[-1].is_open
    finally:
        for link in dialled:
            link.close()
        await links.close()
        await worker.close()
        await other.close()
    sock = socket.socket(socket.AF_UNIX)
    with pytest.raises(ConnectionRefusedError), sock:  # closing the worker frees the name
        sock.connect("\0" + name)

    plain = GatewayLinks("ns", "w2", 1.0, lambda *_: None, lambda _: None)
    await plain.start("127.0.0.1", 0, unix=False)
    assert plain.unix_name == ""
    await plain.close()


@LINUX_ONLY
async def test_a_gateway_on_the_workers_host_dials_its_unix_socket() -> None:
    await unix_dials()


@LINUX_ONLY
def test_a_gateway_on_the_workers_host_dials_its_unix_socket_under_uvloop() -> None:
    """uvloop refuses an abstract name in create_unix_connection: the gateway connects
    the socket itself (gateway/links.py `_connect_unix`); the services run on uvloop."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(unix_dials())


@LINUX_ONLY
async def test_a_unix_socket_that_refuses_or_stalls_is_not_dialled_past() -> None:
    """The TCP address is not tried when the Unix socket already told: it refuses after
    a link was up on it (the worker is gone; its TCP address may be one this host
    cannot reach, here one that never answers), or it takes the connection and sends no
    hello (the worker is stalled)."""
    loop = asyncio.get_running_loop()
    silent = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)  # no hello, ever
    worker = GatewayLinks("ns", "w0", 1.0, lambda *_: None, lambda _: None)
    await worker.start("127.0.0.1", 0)
    name = worker.unix_name
    info = msgspec.structs.replace(
        hand_worker_info("ns", "w0"),
        started_at_s=1.0,
        link_addr=join_addr("127.0.0.1", silent.sockets[0].getsockname()[1]),
        link_unix_name=name,
    )
    links = WorkerLinks("ns", "gw", lambda _: None, lambda _: None, connect_timeout_s=0.3)
    stalled = await loop.create_unix_server(asyncio.Protocol, "\0" + name + "-stalled")
    try:
        link = await links.dial(info)
        assert link.is_unix
        link.close()
        await worker.close()  # the worker is gone: its name refuses
        with pytest.raises(ConnectionRefusedError):
            await links.dial(info, was_unix=True)
        with pytest.raises(TimeoutError):  # (without a link before: TCP, which times out)
            await links.dial(info)
        with pytest.raises(TimeoutError):
            await links.dial(msgspec.structs.replace(info, link_unix_name=name + "-stalled"))
    finally:
        await links.close()
        await worker.close()
        silent.close()
        stalled.close()


async def snapshot_of(stack: Stack, instance_id: str) -> WorkloadSnapshot:
    blob = (await stack.gateway.store.read_snapshots([instance_id]))[instance_id]
    assert blob is not None
    return msgspec.msgpack.decode(blob.data, type=WorkloadSnapshot)


async def until_linked(stack: Stack, num: int) -> None:
    for _ in range(400):
        if stack.gateway.links.num_up == num:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{stack.gateway.links.num_up} links up, expected {num}")


async def test_requests_and_tokens_cross_the_link(stack: Stack) -> None:
    await until_linked(stack, 2)
    for worker in stack.workers:  # on one host: over the workers' Unix sockets (Linux)
        link = stack.gateway.links.get(worker.cfg.instance_id)
        assert link is not None
        assert link.is_unix == ABSTRACT_UNIX, worker.registration.info()
    before = sum(w.admission.num_link_requests for w in stack.workers)
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 5
    assert sum(w.admission.num_link_requests for w in stack.workers) == before + 1
    for _ in range(200):  # set at each registry refresh
        if stack.metric("baton_worker_links") == 2:
            break
        await asyncio.sleep(0.02)
    assert stack.metric("baton_worker_links") == 2


async def test_a_lost_link_fails_its_stream_frees_the_kv_and_is_redialled(
    nats_url: str, redis_url: str
) -> None:
    cluster = parse_cluster(tiny_cluster_text(nats_url, redis_url))
    async with running(cluster, num_workers=1) as stack:
        await until_linked(stack, 1)
        body = {**CHAT, "stream": True, "max_tokens": 200, "ignore_eos": True}
        events: list[dict[str, object]] = []
        async with (
            httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as resp,
        ):
            request_id = resp.headers["x-request-id"]
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[6:]))
                if len(events) == 3:  # mid-stream: cut the link under it
                    link = stack.gateway.links.get("w0")
                    assert link is not None
                    link.close()
        assert "error" in events[-1], events[-1]  # reported in band, then the stream ends
        assert "lost the connection to worker w0" in str(events[-1]["error"])
        snap = await snapshot_of(stack, "w0")
        for _ in range(200):  # the worker aborted it: its KV back in the pool
            snap = await snapshot_of(stack, "w0")
            if (
                request_id not in snap.request_ids
                and snap.num_free_blocks == snap.scheduler.num_kv_blocks
            ):
                break
            await asyncio.sleep(0.02)
        assert request_id not in snap.request_ids
        assert snap.num_free_blocks == snap.scheduler.num_kv_blocks
        await until_linked(stack, 1)  # the keeper dialled again
        before = stack.workers[0].admission.num_link_requests
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        assert stack.workers[0].admission.num_link_requests == before + 1


async def test_with_links_off_requests_go_over_nats(nats_url: str, redis_url: str) -> None:
    text = tiny_cluster_text(nats_url, redis_url).replace("[worker]\n", "[worker]\nlink = false\n")
    async with running(parse_cluster(text), num_workers=1) as stack:
        assert (
            stack.workers[0].registration.info().link_addr,
            stack.workers[0].registration.info().link_unix_name,
        ) == (
            "",
            "",
        )
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            body = {**CHAT, "stream": True, "max_tokens": 6}
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in "".join(lines)  # all 6 tokens came
        assert stack.gateway.links.num_up == 0
        assert stack.workers[0].admission.num_link_requests == 0


async def test_a_delta_batch_frame_reaches_the_stream() -> None:
    """The gateway's frame reader decodes DeltaBatch frames into its dispatcher."""
    batches: list[DeltaBatch] = []
    links = WorkerLinks("ns", "gw", batches.append, lambda _: None)
    batch = DeltaBatch(instance_id="w0", step=3, events=[])
    links.on_frame_from(FrameLink(lambda *_: None, lambda _: None), encode(batch))
    assert batches == [batch]


def test_link_settings_in_the_cluster_file_and_the_environment() -> None:
    from services.worker.links import advertised_host
    from shared.config import ConfigError

    cfg = parse_cluster("", environ={"BATON_LINK_HOST": "0.0.0.0"})
    assert (cfg.worker.link, cfg.worker.link_host, cfg.worker.link_port) == (True, "0.0.0.0", 0)
    assert cfg.worker.link_unix is True
    assert parse_cluster("[worker]\nlink_unix = false\n").worker.link_unix is False
    with pytest.raises(ConfigError, match="link_port out of range"):
        parse_cluster("[worker]\nlink_port = 70000\n")
    assert advertised_host("127.0.0.1", "") == "127.0.0.1"
    assert advertised_host("0.0.0.0", "worker-3.internal") == "worker-3.internal"
    assert advertised_host("0.0.0.0", "") not in ("", "0.0.0.0")  # this host's address


async def test_a_connection_that_never_says_hello_is_closed() -> None:
    worker = GatewayLinks("ns", "w0", 1.0, lambda *_: None, lambda _: None)
    worker.hello_timeout_s = 0.05
    await worker.start("127.0.0.1", 0)
    try:
        host, port = split_addr(worker.addr)
        reader, writer = await asyncio.open_connection(host, port)
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # closed by the worker, nothing sent
        writer.close()
    finally:
        await worker.close()


async def test_a_killed_worker_is_routed_around_before_the_registry_notices(
    nats_url: str, redis_url: str, tmp_path: Path
) -> None:
    """Its link closes and its port refuses: the gateway stops routing there at once,
    though its registration lives on for its TTL (10 s here)."""
    text = tiny_cluster_text(nats_url, redis_url).replace(
        "heartbeat_ttl_s = 2.0", "heartbeat_ttl_s = 10.0"
    )
    (tmp_path / "cluster.toml").write_text(text)
    with worker_process(tmp_path / "cluster.toml", "victim") as victim:
        async with running(parse_cluster(text), num_workers=1) as stack:
            for _ in range(1200):  # the victim loads, registers, and both are linked
                if stack.gateway.links.num_up == 2 and "victim" in stack.estimator.workers:
                    break
                await asyncio.sleep(0.05)
            assert stack.gateway.links.num_up == 2
            victim_link = stack.gateway.links.get("victim")
            assert victim_link is not None
            assert victim_link.is_unix == ABSTRACT_UNIX  # (that refusal, too)
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
            for _ in range(200):
                if "victim" in stack.gateway.links.unreachable:
                    break
                await asyncio.sleep(0.01)
            assert "victim" in stack.gateway.links.unreachable
            assert "victim" in stack.gateway.workers  # the registry still lists it
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
                health = (await client.get("/health")).json()
                assert health["workers"] == ["w0"]
                for _ in range(4):  # shortest-queue would pick the idle victim half the time
                    resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3})
                    assert resp.status_code == 200, resp.text
                    assert resp.headers["x-instance-id"] == "w0"


async def test_a_peer_that_stops_reading_is_cut_and_reported_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past the write-buffer limit the link is aborted, not closed gracefully (which
    would wait for the peer to read): `on_lost` runs, its requests can be failed."""
    import shared.link

    monkeypatch.setattr(shared.link, "MAX_WRITE_BUFFER_BYTES", 256 << 10)
    ends = Ends()
    server, raw = await ends.open()
    raw.pause_reading()  # the dialling end reads nothing from now on
    try:
        await ends.until(lambda: ends.server_link is not None and ends.server_link.is_open)
        link = ends.server_link
        assert link is not None
        for _ in range(4096):  # 64 KiB frames until the kernel's buffers and ours fill
            if not link.send(b"x" * (64 << 10)):
                break
            await asyncio.sleep(0)
        await ends.until(lambda: ends.lost)
        assert not link.is_open and link.send(b"late") is False
    finally:
        raw.close()
        server.close()


async def test_a_worker_that_hangs_up_after_hello_is_not_redialled_in_a_hot_loop() -> None:
    """A peer that says hello and closes at once: the keeper backs off between dials."""
    dials: list[float] = []

    def hang_up(link: FrameLink, frame: bytes | memoryview) -> None:
        dials.append(asyncio.get_running_loop().time())
        link.send(encode(LinkHello(namespace="ns", sender="w0", started_at_s=1.0)))
        link.close()

    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: FrameLink(hang_up, lambda _: None), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    info = msgspec.structs.replace(
        hand_worker_info("ns", "w0"), started_at_s=1.0, link_addr=join_addr("127.0.0.1", port)
    )
    links = WorkerLinks("ns", "gw", lambda _: None, lambda _: None)
    try:
        links.sync({"w0": info})
        await asyncio.sleep(1.0)
        assert 2 <= len(dials) <= 10, len(dials)  # (a hot loop: thousands)
    finally:
        await links.close()
        server.close()


async def test_closing_the_worker_end_closes_connections_that_have_not_said_hello() -> None:
    worker = GatewayLinks("ns", "w0", 1.0, lambda *_: None, lambda _: None)
    await worker.start("127.0.0.1", 0)
    host, port = split_addr(worker.addr)
    reader, writer = await asyncio.open_connection(host, port)
    await asyncio.sleep(0.05)  # accepted
    await worker.close()
    async with asyncio.timeout(1):  # well before the 5 s hello timeout
        assert await reader.read() == b""
    writer.close()
