"""The HTTP floor's server: `python -m bench.http_floor_server PORT STEP_US CPUS`.

It answers any POST on 127.0.0.1:PORT with a two-chunk chat stream (a role chunk, a
content chunk, [DONE]), with uvloop and no framework, so that a client's TTFT against it
is what HTTP alone costs. STEP_US > 0: each answer waits until a forked process, pinned
to CPUS ("1,2"; empty: any), has spun that long (a worker's step, and one hop to its
CPU and back). gateway_anchors.floor_server starts and stops it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from collections import deque
from typing import cast

import uvloop

CHUNKS = (
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n',
    b"data: [DONE]\n\n",
)
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def answer(transport: asyncio.WriteTransport) -> None:
    """Headers, role chunk and content chunk as separate writes, as the gateway sends them."""
    transport.write(HEAD)
    for c in CHUNKS:
        transport.write(b"%x\r\n" % len(c) + c + b"\r\n")
    transport.write(b"0\r\n\r\n")


def spin_on_request(there: socket.socket, step_us: int, cpus: list[int]) -> None:
    """The forked step process: for each byte received, spin `step_us`, answer a byte;
    exits at EOF (the server is gone)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    while there.recv(1):
        end = time.perf_counter() + step_us / 1e6
        while time.perf_counter() < end:
            pass
        there.send(b"k")
    os._exit(0)


class StepDone(asyncio.Protocol):
    """The step process's side: each byte from it answers the oldest waiting request."""

    def __init__(self, waiting: deque[asyncio.WriteTransport]) -> None:
        self.waiting = waiting

    def data_received(self, data: bytes) -> None:
        for _ in data:
            answer(self.waiting.popleft())


class Answer(asyncio.Protocol):
    """One client connection: answers each complete request (head and body) at once,
    or, with a step process (`step`), once it has spun."""

    def __init__(
        self, step: asyncio.WriteTransport | None, waiting: deque[asyncio.WriteTransport]
    ) -> None:
        self.step, self.waiting, self.buf = step, waiting, b""
        self.transport: asyncio.WriteTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (a stream server's transport writes; uvloop's are not asyncio's classes)
        self.transport = cast(asyncio.WriteTransport, transport)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, _, rest = self.buf.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(rest) < length:
                return
            self.buf = rest[length:]
            if self.step is not None:
                self.waiting.append(self.transport)
                self.step.write(b"s")
            else:
                answer(self.transport)


async def serve(port: int, here: socket.socket | None) -> None:
    loop = asyncio.get_running_loop()
    waiting: deque[asyncio.WriteTransport] = deque()  # answers that wait for a step, in order
    step: asyncio.WriteTransport | None = None
    if here is not None:
        step, _ = await loop.create_connection(lambda: StepDone(waiting), sock=here)
    server = await loop.create_server(lambda: Answer(step, waiting), "127.0.0.1", port)
    await server.serve_forever()


def main() -> None:
    port, step_us = int(sys.argv[1]), int(sys.argv[2])
    cpus = [int(c) for c in sys.argv[3].split(",") if c]
    here: socket.socket | None = None
    if step_us:  # before the loop starts: the child only spins
        here, there = socket.socketpair()
        if os.fork() == 0:
            here.close()
            spin_on_request(there, step_us, cpus)
        there.close()
    uvloop.run(serve(port, here))


if __name__ == "__main__":
    main()
