"""Direct links: msgspec messages framed over one connection, gateway <-> worker.

The request plane beside NATS. A gateway keeps one link to every worker that offers
one (`WorkerInfo.link_addr`); a request submitted over a link gets its token deltas
back on it, and its abort goes the same way, so one request's messages never race
each other across two transports. Everything else (routing, the estimator's events,
peer requests, calibration) stays on NATS, and a request goes over NATS when no link
to its worker is up.

Why: over NATS every request and every engine iteration crosses the NATS server
twice, and on a 2-vCPU VM (guest halt-polling off) a NATS request/reply between two
processes takes 0.20 ms back to back and 1.1 ms after 50 ms idle (the Go server's
threads are woken on idle vCPUs), against 0.08 / 0.30 ms for the same round trip over
a plain TCP connection. A link also
drops the per-message work of nats-py on both ends (a flusher task and a futures
queue per publish, a task hop per delivery), and makes a peer's death visible at
once: the connection closes.

The connection is TCP, or an abstract Unix socket when the gateway runs on the
worker's host (`WorkerInfo.link_unix_name`): after an engine step (caches cold), one
600-byte write takes the sender ~71 us over loopback TCP and ~38 over a Unix socket,
the receiver idle on the other vCPU (the TCP write runs the receiving side's stack
too, on the sender's core); at 16 streams the worker's gap between engine steps is
35-63 us shorter.

Frame: a 4-byte big-endian length, then that many bytes of one msgpack message. The
payloads are the NATS messages' own (SubmitRequest / AbortRequest one way, DeltaBatch
the other), after one `LinkHello` each way (shared/messages/link.py).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
from collections.abc import Callable
from typing import cast

from shared.logging import get_logger

log = get_logger(component="link")

HEADER = struct.Struct(">I")
# Abstract Unix socket names (a leading NUL: nothing on disk, scoped to the network
# namespace) are Linux's; elsewhere a worker offers TCP alone.
ABSTRACT_UNIX = sys.platform.startswith("linux")
# A frame this long is a peer speaking another protocol (a DeltaBatch of 256 requests
# with top logprobs is well under 1 MiB): the link is closed rather than buffered.
MAX_FRAME_BYTES = 64 << 20
# A peer that leaves this much unread is stuck: the link is closed, its requests fail
# on both sides, rather than the writer holding its output in memory without bound.
MAX_WRITE_BUFFER_BYTES = 64 << 20

OnFrame = Callable[["FrameLink", bytes | memoryview], None]
OnLost = Callable[["FrameLink"], None]


class LinkError(Exception):
    """The peer broke the framing or the handshake."""


class FrameLink(asyncio.Protocol):
    """One direct link: whole frames in (`on_frame`, called on the event loop as they
    complete), whole frames out (`send`, written at once: no flusher, no queue).

    `on_frame` and `on_lost` are set by the side that owns the link and may be
    replaced after the hello; `on_lost` runs once, when the connection ends for any
    reason (either side closed it, the peer died, the framing broke)."""

    def __init__(self, on_frame: OnFrame, on_lost: OnLost, name: str = "") -> None:
        self.on_frame = on_frame
        self.on_lost = on_lost
        self.name = name  # the peer, for logs: an instance id or a gateway's owner token
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def is_unix(self) -> bool:
        """Over a Unix socket (a peer on this host), not TCP."""
        sock = None if self.transport is None else self.transport.get_extra_info("socket")
        return sock is not None and sock.family == socket.AF_UNIX

    @property
    def is_open(self) -> bool:
        """Connected and not closing (a closing link takes no more frames either way)."""
        transport = self.transport
        return transport is not None and not self.closed.done() and not transport.is_closing()

    # -- asyncio.Protocol --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's TCP transport is not an asyncio.Transport subclass: no isinstance)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        # Fast path: the whole chunk is exactly one frame (one DeltaBatch per iteration,
        # one submit per request): no copy into the buffer.
        if not self._buf and len(data) >= HEADER.size:
            (size,) = HEADER.unpack_from(data)
            if len(data) == HEADER.size + size:
                self._deliver(memoryview(data)[HEADER.size :])
                return
        self._buf += data
        while len(self._buf) >= HEADER.size and self.is_open:  # (a handler may close it)
            (size,) = HEADER.unpack_from(self._buf)
            if size > MAX_FRAME_BYTES:
                self.close(LinkError(f"frame of {size} bytes (at most {MAX_FRAME_BYTES})"))
                return
            end = HEADER.size + size
            if len(self._buf) < end:
                return
            frame = bytes(self._buf[HEADER.size : end])
            del self._buf[:end]
            self._deliver(frame)

    def _deliver(self, frame: bytes | memoryview) -> None:
        try:
            self.on_frame(self, frame)
        except Exception as exc:  # a frame its reader cannot take: the peer is broken
            log.warning("link_frame_refused", peer=self.name, error=repr(exc))
            self.close(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        self._buf.clear()
        self.on_lost(self)

    # -- the owner's side --------------------------------------------------------

    def send(self, payload: bytes) -> bool:
        """Write one frame now; False (and nothing written) when the link is closed."""
        if not self.is_open:
            return False
        transport = cast(asyncio.Transport, self.transport)
        transport.write(HEADER.pack(len(payload)) + payload)
        if transport.get_write_buffer_size() > MAX_WRITE_BUFFER_BYTES:
            self.close(LinkError(f"the peer left {MAX_WRITE_BUFFER_BYTES} bytes unread"))
        return True

    def close(self, reason: Exception | None = None) -> None:
        """Close the link; `on_lost` follows. Without a reason, gracefully: what is
        buffered is written first. With one (the peer broke the protocol, stopped
        reading, never said hello), at once: a graceful close would wait for a peer
        that does not read, and `on_lost` would never come."""
        transport = self.transport
        if transport is None:
            return
        if reason is not None:
            log.warning("link_closed", peer=self.name, reason=str(reason))
            transport.abort()
        elif not transport.is_closing():
            transport.close()


def split_addr(addr: str) -> tuple[str, int]:
    """ "host:port" (an IPv6 host in brackets) -> (host, port); ValueError if malformed."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not a host:port address: {addr!r}")
    return host.strip("[]"), int(port)


def join_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
