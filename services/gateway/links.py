"""The gateway's direct links (shared/link.py): one to every live worker that offers one.

`sync` follows the registry (each refresh): a worker that appears with a `link_addr`
gets a keeper task that dials it (its abstract Unix socket `link_unix_name` first: it
answers in the worker's network namespace, so on its host; else, or when that fails,
its TCP address), says hello, checks the answer against the
registration (the same instance id and start time: an address a restarted worker took
over is another worker) and holds the link up; when the link drops the keeper
redials with a growing pause (`RETRY_S`) for as long as the worker stays registered.
A worker that leaves the registry, or comes back restarted, has its link closed.

`get` is the submit path's question: the link to this instance, if one is up now.
Token deltas arriving on a link go to `on_batch` as they complete; `on_lost` hears
of every link that closes, for the gateway to fail the requests it carried.

A link that closes is redialled at once; when that is refused, the worker's process is
gone (its port closed with it): `unreachable` names it until a dial succeeds again or
the registry drops it (within its heartbeat TTL), and the gateway routes around it
meanwhile. A worker whose link never came up is never called unreachable: its
requests go over NATS (a link address this host cannot reach says nothing of the
worker).
"""

from __future__ import annotations

import asyncio
import math
import socket
import time
from collections.abc import Awaitable, Callable

from shared.link import ABSTRACT_UNIX, FrameLink, LinkError, split_addr
from shared.logging import RetryLog, get_logger
from shared.messages import encode
from shared.messages.gateway import DELTA_BATCH_DECODER, DeltaBatch
from shared.messages.link import LINK_HELLO_DECODER, LinkHello
from shared.messages.registry import WorkerInfo

log = get_logger(component="gateway")

RETRY_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)  # pauses between dials of one worker, then 2 s
# A registered worker whose link stays refused this long is worth a warning (its
# requests go over NATS meanwhile); sooner, it is most likely stopping, and the
# registry drops it within its heartbeat TTL.
WARN_AFTER_S = 5.0
# A link that closes after being up this long is redialled at once (is the worker gone,
# or only the link?); one that closes sooner waits out the pauses, so a peer that says
# hello and hangs up is not redialled in a hot loop.
STABLE_S = 1.0


class WorkerLinks:
    """Direct links to workers, kept up while they are registered."""

    def __init__(
        self,
        namespace: str,
        owner_token: str,
        on_batch: Callable[[DeltaBatch], None],
        on_lost: Callable[[FrameLink], None],
        connect_timeout_s: float = 2.0,
    ) -> None:
        self._namespace = namespace
        self._hello = encode(LinkHello(namespace=namespace, sender=owner_token))
        self._on_batch = on_batch
        self._on_lost = on_lost
        self._connect_timeout_s = connect_timeout_s
        self._up: dict[str, FrameLink] = {}  # instance id -> its link, said hello
        # instance id -> (the registration it keeps a link to, its keeper task)
        self._keepers: dict[str, tuple[WorkerInfo, asyncio.Task[None]]] = {}
        self.unreachable: set[str] = set()  # instances whose link died and now refuses
        self._closing = False

    def get(self, instance_id: str) -> FrameLink | None:
        """The open link to this instance, or None (then the request goes over NATS)."""
        link = self._up.get(instance_id)
        return link if link is not None and link.is_open else None

    @property
    def num_up(self) -> int:
        return sum(link.is_open for link in self._up.values())

    def sync(self, workers: dict[str, WorkerInfo]) -> None:
        """Keep a link to every live worker offering one; drop the rest."""
        for iid, (info, task) in list(self._keepers.items()):
            now = workers.get(iid)
            if (
                now is None
                or (now.link_addr, now.link_unix_name) != (info.link_addr, info.link_unix_name)
                or now.started_at_s != info.started_at_s
            ):
                del self._keepers[iid]
                self.unreachable.discard(iid)
                task.cancel()
                link = self._up.pop(iid, None)
                if link is not None:
                    link.close()
        if self._closing:
            return
        for iid, info in workers.items():
            if info.link_addr and iid not in self._keepers:
                task = asyncio.create_task(self._keep(info), name=f"link-{iid}")
                self._keepers[iid] = (info, task)

    async def close(self) -> None:
        self._closing = True
        tasks = [task for _, task in self._keepers.values()]
        self._keepers.clear()
        for task in tasks:
            task.cancel()
        for link in self._up.values():
            link.close()
        self._up.clear()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)

    # -- one worker's keeper -------------------------------------------------------

    async def _keep(self, info: WorkerInfo) -> None:
        iid = info.instance_id
        failures = RetryLog(log, "link_dial_failed", recovered="worker_linked_again")
        attempt = 0
        failing_since: float | None = None
        was_up = False  # a link to it has been up: a refusal now means it is gone
        was_unix = False  # ... over its Unix socket: that socket's refusal says so alone
        logged_up_at = -math.inf  # (a link that keeps dropping is logged once per 10 s)
        while not self._closing:
            try:
                link = await self.dial(info, was_unix=was_unix)
            except (OSError, TimeoutError, LinkError, ValueError) as exc:
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                if (
                    was_up
                    and isinstance(exc, ConnectionRefusedError)
                    and iid not in self.unreachable
                ):
                    self.unreachable.add(iid)
                    log.warning(
                        "worker_unreachable",
                        instance_id=iid,
                        addr=info.link_addr,
                        note="its link closed and its address refuses connections: routed "
                        "around until it answers again or leaves the registry",
                    )
                if now - failing_since >= WARN_AFTER_S:
                    failures.failed(
                        instance_id=iid,
                        addr=info.link_addr,
                        error=repr(exc),
                        hint="its requests go over NATS; can this host reach the address? "
                        "([worker] link_host, link_advertise_host)",
                    )
            else:
                failures.ok()
                failing_since, was_up, was_unix = None, True, link.is_unix
                self.unreachable.discard(iid)
                self._up[iid] = link
                t_up = time.monotonic()
                if t_up - logged_up_at >= 10.0:
                    log.info("worker_linked", instance_id=iid, addr=_dialled(info, link))
                    logged_up_at = t_up
                try:
                    await asyncio.shield(link.closed)
                finally:
                    if self._up.get(iid) is link:
                        del self._up[iid]
                    link.close()  # cancelled (the worker left the registry): close it
                if time.monotonic() - t_up >= STABLE_S:
                    attempt = 0
                    continue  # redial at once: is the worker gone, or only the link?
            await asyncio.sleep(RETRY_S[min(attempt, len(RETRY_S) - 1)])
            attempt += 1

    async def dial(self, info: WorkerInfo, *, was_unix: bool = False) -> FrameLink:
        """Connect, say hello, check the worker's answer; the link, up. Over the
        worker's Unix socket when it answers here (a worker on another host, or in
        another container, has none in this network namespace: refused at once), else
        over TCP.

        Not over TCP after all when the Unix socket is the worker's but says nothing:
        it refuses though a link `was_unix` (a process keeps its namespace: the worker
        is gone, even if its TCP address is one this host cannot reach and would only
        time out), or takes the connection and sends no hello in time (its process is
        stalled; TCP would wait as long again)."""
        loop = asyncio.get_running_loop()
        if info.link_unix_name and ABSTRACT_UNIX:
            name = "\0" + info.link_unix_name
            try:
                return await self._handshake(info, lambda new: _connect_unix(new, name))
            except TimeoutError:
                raise
            except ConnectionRefusedError:
                if was_unix:
                    raise
            except (OSError, LinkError) as exc:
                log.debug("link_unix_failed", instance_id=info.instance_id, error=repr(exc))
        host, port = split_addr(info.link_addr)
        return await self._handshake(info, lambda new: loop.create_connection(new, host, port))

    async def _handshake(
        self,
        info: WorkerInfo,
        connect: Callable[[Callable[[], FrameLink]], Awaitable[tuple[object, FrameLink]]],
    ) -> FrameLink:
        """`connect(protocol_factory)` opens the connection; then the hellos."""
        loop = asyncio.get_running_loop()
        hello: asyncio.Future[LinkHello] = loop.create_future()

        def on_hello(link: FrameLink, frame: bytes | memoryview) -> None:
            if not hello.done():
                hello.set_result(LINK_HELLO_DECODER.decode(frame))
            link.on_frame = self.on_frame_from

        def on_lost(link: FrameLink) -> None:
            if not hello.done():
                hello.set_exception(ConnectionError("the worker closed the link at hello"))
                hello.exception()  # retrieved here: the dial may have timed out already
            else:  # it was up (or refused after its hello): its requests are lost
                self._on_lost(link)

        async with asyncio.timeout(self._connect_timeout_s):
            _, link = await connect(lambda: FrameLink(on_hello, on_lost, name=info.instance_id))
            try:  # (asyncio and uvloop set TCP_NODELAY on every TCP transport already)
                link.send(self._hello)
                theirs = await hello
            except BaseException:
                link.close()
                raise
        if theirs.namespace != self._namespace or (theirs.sender, theirs.started_at_s) != (
            info.instance_id,
            info.started_at_s,
        ):
            link.close()
            raise LinkError(
                f"{_dialled(info, link)} is {theirs.sender!r} (namespace {theirs.namespace!r}, "
                f"started {theirs.started_at_s}), not the registered {info.instance_id!r}"
            )
        return link

    def on_frame_from(self, link: FrameLink, frame: bytes | memoryview) -> None:
        self._on_batch(DELTA_BATCH_DECODER.decode(frame))


def _dialled(info: WorkerInfo, link: FrameLink) -> str:
    """The address the link went to: "@name" for the Unix socket, else host:port."""
    return "@" + info.link_unix_name if link.is_unix else info.link_addr


async def _connect_unix(
    protocol_factory: Callable[[], FrameLink], name: str
) -> tuple[object, FrameLink]:
    """`loop.create_unix_connection` to an abstract name (uvloop's refuses the NUL)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, name)
    except BaseException:
        sock.close()
        raise
    return await loop.create_unix_connection(protocol_factory, sock=sock)
