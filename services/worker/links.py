"""The worker's end of the direct links (shared/link.py): gateways dial in.

It listens on a TCP port and, on Linux unless told not to, on an abstract Unix socket
(a random name, nothing on disk: it goes with the process, however that ends), which
gateways in the same network namespace (its host, outside containers) dial instead:
the same frames, about half the cost per write to the sender (a loopback TCP write
runs the receiving side's TCP stack too). Like the TCP port on loopback, any local
process may connect; the hello is the check.

A gateway's first frame is its `LinkHello`; the worker checks the namespace and
answers with its own (instance id and start time, which the gateway checks against the
registration it routed by). After that every frame is a SubmitRequest or an
AbortRequest, handed to the service with the link it came on: the service answers
each request on that link and, when a link closes, aborts the requests it brought
(their gateway is gone or cut off, and fails them on its side).
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from collections.abc import Callable

from shared.link import ABSTRACT_UNIX, FrameLink, LinkError, join_addr
from shared.logging import get_logger
from shared.messages import encode
from shared.messages.link import LINK_HELLO_DECODER, LinkHello
from shared.messages.worker import WORKER_INBOUND_DECODER, WorkerInbound

log = get_logger(component="worker")

# A connection that has not said hello within this is closed (a port scan, a client of
# another protocol): an open socket each would otherwise stay for ever.
HELLO_TIMEOUT_S = 5.0
# How long `close` waits for the links to write what they hold (the last deltas of a
# drain) before it cuts them.
CLOSE_TIMEOUT_S = 2.0


def advertised_host(bind_host: str, advertise_host: str) -> str:
    """The host gateways dial: the configured one, else the bind address, else (bound to
    every interface) this host's own address, as a container's /etc/hosts gives it."""
    if advertise_host:
        return advertise_host
    if bind_host not in ("", "0.0.0.0", "::"):
        return bind_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()


class GatewayLinks:
    """Listens for gateways' links; `on_inbound(msg, link)` for every request frame,
    `on_lost(link)` when a link that said hello closes."""

    def __init__(
        self,
        namespace: str,
        instance_id: str,
        started_at_s: float,
        on_inbound: Callable[[WorkerInbound, FrameLink], None],
        on_lost: Callable[[FrameLink], None],
    ) -> None:
        self._namespace = namespace
        self._hello = encode(
            LinkHello(namespace=namespace, sender=instance_id, started_at_s=started_at_s)
        )
        self._on_inbound = on_inbound
        self._on_lost = on_lost
        self._server: asyncio.Server | None = None
        self._unix_server: asyncio.Server | None = None
        self.links: set[FrameLink] = set()  # said hello, still open
        self._accepted: set[FrameLink] = set()  # every connection not yet lost
        self._closing = False
        self.addr = ""  # host:port gateways dial, once started
        self.unix_name = ""  # the abstract Unix socket gateways on this host dial ("": none)
        self.hello_timeout_s = HELLO_TIMEOUT_S

    async def start(
        self, host: str, port: int, advertise_host: str = "", *, unix: bool = True
    ) -> str:
        """Listen on host:port (0: a free one) and, with `unix` (on Linux), on an
        abstract Unix socket (`unix_name`); returns the address to advertise."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accept, host, port, reuse_address=True)
        bound_port = self._server.sockets[0].getsockname()[1]
        self.addr = join_addr(advertised_host(host, advertise_host), bound_port)
        if unix and ABSTRACT_UNIX:
            await self._start_unix()
        log.info(
            "links_listening",
            bind=join_addr(host or "0.0.0.0", bound_port),
            addr=self.addr,
            unix_name=self.unix_name,
        )
        return self.addr

    async def _start_unix(self) -> None:
        name = f"baton-link-{secrets.token_hex(8)}"
        try:
            self._unix_server = await asyncio.get_running_loop().create_unix_server(
                self._accept, "\0" + name
            )
        except OSError as exc:  # gateways on other hosts never need it: TCP alone
            log.warning("link_unix_unavailable", error=repr(exc))
            return
        self.unix_name = name

    def _accept(self) -> FrameLink:
        link = FrameLink(self._on_hello, self._on_closed_early)
        self._accepted.add(link)
        asyncio.get_running_loop().call_later(self.hello_timeout_s, self._check_hello, link)
        return link

    def _check_hello(self, link: FrameLink) -> None:
        if link.is_open and link not in self.links:
            link.close(TimeoutError(f"no hello within {self.hello_timeout_s} s"))

    def _on_hello(self, link: FrameLink, frame: bytes | memoryview) -> None:
        hello = LINK_HELLO_DECODER.decode(frame)
        if self._closing:
            raise LinkError("the worker is stopping")
        if hello.namespace != self._namespace:
            raise LinkError(
                f"a gateway of namespace {hello.namespace!r} dialled this worker "
                f"(namespace {self._namespace!r})"
            )
        link.name = hello.sender
        link.on_frame = self._on_request
        link.on_lost = self._on_closed
        self.links.add(link)
        link.send(self._hello)
        log.info("gateway_linked", gateway=hello.sender)

    def _on_request(self, link: FrameLink, frame: bytes | memoryview) -> None:
        self._on_inbound(WORKER_INBOUND_DECODER.decode(frame), link)

    def _on_closed_early(self, link: FrameLink) -> None:
        """Closed before its hello: nothing was taken from it."""
        self._accepted.discard(link)

    def _on_closed(self, link: FrameLink) -> None:
        self._accepted.discard(link)
        self.links.discard(link)
        self._on_lost(link)

    async def close(self) -> None:
        """Stop listening and close every connection: what each holds is written first
        (the last deltas of a drain), for at most CLOSE_TIMEOUT_S, then it is cut."""
        self._closing = True
        for server in (self._server, self._unix_server):
            if server is not None:
                server.close()
        links = list(self._accepted)
        for link in links:
            link.close()
        if links:
            await asyncio.wait([link.closed for link in links], timeout=CLOSE_TIMEOUT_S)
        for link in links:
            if not link.closed.done():
                link.close(TimeoutError(f"its peer read nothing for {CLOSE_TIMEOUT_S} s"))
        # (no wait_closed: on 3.12+ it would wait for every connection)
        self._server = self._unix_server = None
