"""NATS client wrapper: typed publish, subscribe and request/reply over msgpack Structs.

The codec is chosen per call site once (a decoder built at import in
`shared.messages.*`), so service code never touches raw bytes or nats-py
callbacks. A handler that raises is logged and the subscription goes on: one
bad message must not stop a service.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.logging import RetryLog, get_logger
from shared.messages import encode

T = TypeVar("T")
R = TypeVar("R")
log = get_logger(component="bus")

# Generous buffers: a gateway inbox receives one message per worker iteration
# per worker; a slow consumer must be visible in logs, not silently dropped early.
_PENDING_MSGS = 1_000_000
_PENDING_BYTES = 1 << 30


class Bus:
    """One NATS connection for one service process."""

    def __init__(self, url: str, name: str) -> None:
        self.url = url
        self.name = name
        self._nc: Client | None = None
        self._later: set[asyncio.Task[None]] = set()  # replies waiting on a future (serve)

    @property
    def nc(self) -> Client:
        assert self._nc is not None, "Bus.connect() not called"
        return self._nc

    @property
    def is_connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def connect(self, *, connect_timeout_s: float = 5.0) -> None:
        # a reconnect loop's errors (twice a second while NATS is down): a few lines
        failures = RetryLog(log, "nats_error", recovered="nats_reconnected")

        async def on_error(exc: Exception) -> None:
            failures.failed(error=str(exc))

        async def on_reconnected() -> None:
            failures.ok()

        self._nc = await nats.connect(
            self.url,
            name=self.name,
            connect_timeout=connect_timeout_s,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            error_cb=on_error,
            reconnected_cb=on_reconnected,
            pending_size=64 * 1024 * 1024,
        )

    async def publish(self, subject: str, message: msgspec.Struct) -> None:
        await self.nc.publish(subject, encode(message))

    async def subscribe(
        self,
        subject: str,
        decoder: msgspec.msgpack.Decoder[T],
        handler: Callable[[T], Awaitable[None]],
        *,
        queue: str = "",
    ) -> Subscription:
        """Call `handler(decoded)` for every message; decode errors are logged and dropped."""

        async def on_msg(msg: Msg) -> None:
            await self._decode_and_call(subject, decoder, handler, msg)

        return await self._subscribe_cb(subject, queue, on_msg)

    async def _decode_and_call(
        self,
        subject: str,
        decoder: msgspec.msgpack.Decoder[T],
        handler: Callable[[T], Awaitable[R]],
        msg: Msg,
    ) -> R | None:
        """Decode msg and run handler on it; a bad message or a failing handler is
        logged and yields None, so one poison message never stops a subscription."""
        try:
            decoded = decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("bad_message", subject=subject, error=str(exc))
            return None
        try:
            return await handler(decoded)
        except Exception:
            log.exception("handler_failed", subject=subject)
            return None

    async def _subscribe_cb(
        self, subject: str, queue: str, cb: Callable[[Msg], Awaitable[None]]
    ) -> Subscription:
        return await self.nc.subscribe(
            subject,
            queue=queue,
            cb=cb,
            pending_msgs_limit=_PENDING_MSGS,
            pending_bytes_limit=_PENDING_BYTES,
        )

    async def serve(
        self,
        subject: str,
        decoder: msgspec.msgpack.Decoder[T],
        handler: Callable[[T], Awaitable[msgspec.Struct | asyncio.Future[Any]]],
        *,
        queue: str = "",
    ) -> Subscription:
        """Answer requests on `subject` with `handler`'s reply (decoding and errors as in
        `subscribe`: a bad message or a failing handler gets no reply).

        A handler that cannot answer at once returns a future instead: the reply goes out
        when it resolves, and meanwhile the subscription takes the next request (nats-py
        runs one subscription's callbacks one at a time)."""

        async def on_msg(msg: Msg) -> None:
            reply = await self._decode_and_call(subject, decoder, handler, msg)
            if isinstance(reply, asyncio.Future):
                task = asyncio.create_task(self._reply_later(subject, msg, reply))
                self._later.add(task)
                task.add_done_callback(self._later.discard)
            elif reply is not None and msg.reply:
                await self.nc.publish(msg.reply, encode(reply))

        return await self._subscribe_cb(subject, queue, on_msg)

    async def _reply_later(
        self, subject: str, msg: Msg, reply: asyncio.Future[Any]
    ) -> None:
        try:
            answer = await reply
        except Exception:
            log.exception("handler_failed", subject=subject)
            return
        if msg.reply and self._nc is not None:
            await self._nc.publish(msg.reply, encode(answer))

    async def request(
        self,
        subject: str,
        message: msgspec.Struct,
        decoder: msgspec.msgpack.Decoder[T],
        *,
        timeout_s: float,
    ) -> T:
        """Send `message` and wait for one reply; raises TimeoutError or nats NoRespondersError."""
        try:
            msg = await self.nc.request(subject, encode(message), timeout=timeout_s)
        except nats.errors.TimeoutError:
            raise TimeoutError(f"no reply on {subject} within {timeout_s} s") from None
        return decoder.decode(msg.data)

    async def flush(self, timeout_s: int = 5) -> None:
        await self.nc.flush(timeout=timeout_s)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Drain (deliver what is pending, stop subscriptions), then close; bounded. Idempotent."""
        nc, self._nc = self._nc, None
        if nc is None or nc.is_closed:
            return
        try:
            await asyncio.wait_for(nc.drain(), timeout_s)
        except Exception as exc:  # a dead or slow server must not block shutdown
            log.warning("nats_drain_failed", error=repr(exc))
            await nc.close()


def is_no_responders(exc: BaseException) -> bool:
    return isinstance(exc, nats.errors.NoRespondersError)


__all__ = ["Bus", "is_no_responders"]
