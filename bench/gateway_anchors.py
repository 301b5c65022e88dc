"""The gateway benchmark's anchors, measured in the same run: one bare NATS round trip
between two processes, and the HTTP floor (the benchmark's clients against a server
that answers at once, or once another process has computed for a step)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import uvloop

from bench.gateway_client import CLIENT_ERRORS, CLIENTS, Client, stream_one
from bench.gateway_nats_echo import SUBJECT
from bench.gateway_settings import Settings
from bench.stats import percentile
from services.launcher.servers import free_port, stop_process_group

REPO = Path(__file__).resolve().parent.parent


def _start_module(module: str, *args: str) -> subprocess.Popen[bytes]:
    """`python -m <module> <args>` from the repository, in a process group of its own."""
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, start_new_session=True)


@contextlib.asynccontextmanager
async def floor_server(step_ms: float = 0.0, cpus: Sequence[int] = ()) -> AsyncIterator[str]:
    """bench/http_floor_server.py on a free port: it answers a chat stream at once, or
    with `step_ms` once a process on `cpus` has computed that long (a worker's step,
    and its hop there and back). Yields its base URL."""
    port = free_port()
    server = _start_module(
        "bench.http_floor_server", str(port), str(round(step_ms * 1e3)), ",".join(map(str, cpus))
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process_group(server, 5)


async def _first_answer(client: Client) -> None:
    """Wait until the server started by floor_server answers."""
    for _ in range(100):
        try:
            await stream_one(client, 0, 1)
            return
        except CLIENT_ERRORS:
            await asyncio.sleep(0.05)


async def http_floor_ms(idle_ms: float, count: int = 100) -> dict[str, list[float]]:
    """TTFT of each client (CLIENTS) against a server that answers at once (no work):
    the part of the added TTFT that HTTP alone costs here. The clients alternate
    request by request, each after the TTFT runs' idle gap."""
    async with contextlib.AsyncExitStack() as stack:
        base = await stack.enter_async_context(floor_server())
        clients = {kind: await stack.enter_async_context(Client(kind, base)) for kind in CLIENTS}
        await _first_answer(clients["aiohttp"])
        ttfts: dict[str, list[float]] = {kind: [] for kind in clients}
        for i in range(count):
            for kind, client in clients.items():
                await asyncio.sleep(idle_ms / 1e3)
                ttfts[kind].append(1e3 * (await stream_one(client, i, 1))[0])
        return ttfts


async def http_floor_after_step_ms(
    settings: Settings, step_ms: float, count: int = 60
) -> list[float]:
    """settings.client's TTFT, less `step_ms`, against a server that answers once a
    process on the worker's CPUs has computed for `step_ms` (floor_server): what one
    request's HTTP and a hop to that CPU and back cost when the answer takes a step that
    long. A wait idles the other CPUs, and waking from a longer idle costs more on a VM
    (a halted vCPU, caches taken by other guests): the floor that the added TTFT
    outside the 1st step compares with."""
    async with (
        floor_server(step_ms, settings.worker_cpus) as base,
        Client(settings.client, base) as client,
    ):
        await _first_answer(client)
        ttfts: list[float] = []
        for i in range(count):
            await asyncio.sleep(settings.idle_ms / 1e3)  # the TTFT runs' idle gap
            ttfts.append(1e3 * (await stream_one(client, i, 1))[0] - step_ms)
        return ttfts


async def nats_rtt_ms(nats_url: str, count: int = 200) -> list[float]:
    """Round trips to an echo process (bench/gateway_nats_echo.py): the price of one
    process hop on this machine now."""
    import nats

    echo = _start_module("bench.gateway_nats_echo", nats_url)
    nc = await nats.connect(nats_url)
    try:
        for _ in range(100):
            try:
                await nc.request(SUBJECT, b"x", timeout=0.2)
                break
            except Exception:
                await asyncio.sleep(0.05)
        rtts = []
        for _ in range(count):
            t0 = time.perf_counter()
            await nc.request(SUBJECT, b"x", timeout=2)
            rtts.append(1e3 * (time.perf_counter() - t0))
            await asyncio.sleep(0.002)
        return rtts
    finally:
        await nc.close()
        stop_process_group(echo, 5)


class Anchors(NamedTuple):
    """A run's anchors, each sample in ms."""

    nats_rtt_ms: list[float]
    http_floor_ms: dict[str, list[float]]  # by client
    step_ms: float  # the step that the floor after a step waited for
    http_floor_after_step_ms: list[float]  # less the step

    def figures(self, client: str) -> dict[str, Any]:
        """The run's JSON fields of the anchors; `client`: the one the run measured with."""
        floor = self.http_floor_ms[client]
        return {
            # one bare NATS request/reply between two processes
            "nats_rtt_ms_p50": percentile(self.nats_rtt_ms, 50),
            "nats_rtt_ms_p99": percentile(self.nats_rtt_ms, 99),
            # the same HTTP client against a server that answers at once
            "http_floor_ttft_ms_p50": percentile(floor, 50),
            "http_floor_ttft_ms_p99": percentile(floor, 99),
            "http_floor_ttft_ms_p50_by_client": {
                k: percentile(v, 50) for k, v in self.http_floor_ms.items()
            },
            # the same, answered once a process on the worker's CPUs computed as long as
            # the in-process engine's 1st step p50, less that step
            "http_floor_step_ms": self.step_ms,
            "http_floor_after_step_ms_p50": percentile(self.http_floor_after_step_ms, 50),
            "http_floor_after_step_ms_p99": percentile(self.http_floor_after_step_ms, 99),
        }


def measure_anchors(settings: Settings, nats_url: str, step_ms: float) -> Anchors:
    """Every anchor, one after the other (the floor after a step of `step_ms`), each on
    an event loop of its own."""
    return Anchors(
        uvloop.run(nats_rtt_ms(nats_url)),
        uvloop.run(http_floor_ms(settings.idle_ms)),
        step_ms,
        uvloop.run(http_floor_after_step_ms(settings, step_ms)),
    )
