"""Who each of a worker's requests answers to, and the writing of their events there.

A request is answered on the gateway link it came on (shared/link.py), else over NATS
on its gateway's inbox. The transport is bound once per destination (`LinkReply`,
`NatsReply`, one object per link or inbox, kept while it has requests), so sending
has no per-message branch. A step's outputs become one `DeltaBatch` per destination;
a fast model's may wait for the next step's (pacing.py).
"""

from __future__ import annotations

import time
from collections.abc import Container, Iterable
from typing import TYPE_CHECKING, NamedTuple

from services.worker.pacing import StreamPacer, is_urgent
from shared.messages import encode
from shared.messages.gateway import DeltaBatch, GatewayEvent, RequestFailed, TokenDelta
from shared.subjects import is_token

if TYPE_CHECKING:
    from services.worker.engine.outputs import RequestOutput
    from shared.bus import Bus
    from shared.link import FrameLink


class LinkReply:
    """A gateway's direct link: events are written to it at once (a closed link's are
    dropped: its requests are being aborted)."""

    __slots__ = ("link",)

    def __init__(self, link: FrameLink) -> None:
        self.link = link

    async def send(self, batch: DeltaBatch) -> None:
        self.link.send(encode(batch))


class NatsReply:
    """A gateway's inbox subject over NATS."""

    __slots__ = ("_bus", "subject")

    def __init__(self, bus: Bus, subject: str) -> None:
        self._bus = bus
        self.subject = subject

    async def send(self, batch: DeltaBatch) -> None:
        await self._bus.publish(self.subject, batch)


Dest = LinkReply | NatsReply


class Owner(NamedTuple):
    """Who a running request answers to."""

    gateway: str  # its liveness token (SubmitRequest.owner, checked by OrphanWatch); "": none
    link: FrameLink | None  # the direct link it came on
    dest: Dest  # where its events go


class Answers:
    """The owners of a worker's requests and the pacer holding their events."""

    def __init__(self, instance_id: str, bus: Bus, stream_interval_s: float) -> None:
        self._instance_id = instance_id
        self._bus = bus
        self.owners: dict[str, Owner] = {}  # request id -> its owning gateway
        self.pacer: StreamPacer[Dest] = StreamPacer(stream_interval_s)
        self._links: dict[FrameLink, LinkReply] = {}
        self._inboxes: dict[str, NatsReply] = {}

    def dest(self, reply_to: str, link: FrameLink | None) -> Dest:
        """Where a request's events go: the link it came on, else its gateway's inbox."""
        if link is not None:
            reply = self._links.get(link)
            if reply is None:
                reply = self._links[link] = LinkReply(link)
            return reply
        inbox = self._inboxes.get(reply_to)
        if inbox is None:
            inbox = self._inboxes[reply_to] = NatsReply(self._bus, reply_to)
        return inbox

    def add(self, request_id: str, reply_to: str, gateway: str, link: FrameLink | None) -> None:
        """An admitted request (an owner that is not a valid key part is never checked)."""
        owner = Owner(gateway if is_token(gateway) else "", link, self.dest(reply_to, link))
        self.owners[request_id] = owner

    def deltas(
        self, outputs: list[RequestOutput], final_counts: dict[str, dict[str, int]] | None
    ) -> tuple[dict[Dest, list[GatewayEvent]], set[Dest]]:
        """A step's outputs as token deltas by destination (pacing.group's form, built in
        one pass: this runs after every step, with the caches cold from it). A finished
        request's owner is dropped; `final_counts` (token-level routing) gives its
        tokens per model."""
        by_dest: dict[Dest, list[GatewayEvent]] = {}
        urgent: set[Dest] = set()
        owners = self.owners
        for out in outputs:
            owner = owners.get(out.request_id)
            if owner is None:
                continue
            dest = owner.dest
            counts = None
            if out.finished:
                del owners[out.request_id]
                if final_counts is not None:
                    counts = final_counts.pop(out.request_id, None)
            new = out.new_token_ids  # (the engine's own lists, made for this output)
            top = out.new_top_logprobs
            delta = TokenDelta(
                out.request_id,
                out.num_output_tokens - len(new),
                new,
                out.new_logprobs,
                out.finish_reason if out.finished else None,
                out.num_prompt_tokens,
                counts,
                top if top and top[0] else None,
            )
            batch = by_dest.get(dest)
            if batch is None:
                by_dest[dest] = [delta]
            else:
                batch.append(delta)
            if is_urgent(delta):
                urgent.add(dest)
        return by_dest, urgent

    def fail_all(self, status: int, reason: str) -> list[tuple[Dest, GatewayEvent]]:
        """Forget every owner; return a failure event for each request."""
        failures: list[tuple[Dest, GatewayEvent]] = [
            (owner.dest, RequestFailed(rid, status, reason)) for rid, owner in self.owners.items()
        ]
        self.owners.clear()
        return failures

    def requests_of(self, link: FrameLink) -> list[str]:
        return [rid for rid, owner in self.owners.items() if owner.link is link]

    def forget_link(self, link: FrameLink) -> None:
        """A closed link: what was held for it is dropped (its requests are aborted)."""
        reply = self._links.pop(link, None)
        if reply is not None:
            self.pacer.forget(reply)

    async def publish(
        self,
        by_dest: dict[Dest, list[GatewayEvent]],
        urgent: Container[Dest],
        step: int,
        next_step_s: float | None = None,
    ) -> None:
        """One DeltaBatch per destination, with what was held for it before. With
        `next_step_s` (a step expected to follow in that long) the pacer may hold a
        destination's batch for the next step's; never one in `urgent`."""
        held = self.pacer.take(by_dest, urgent, time.monotonic(), next_step_s)
        await self.send(held.items(), step)

    async def flush(self, step: int) -> None:
        """Write everything the pacer holds: before the loop waits (no step would), a
        step longer than the last, a drain, and in close."""
        if self.pacer:
            await self.send(self.pacer.take_all().items(), step)

    async def send(self, batches: Iterable[tuple[Dest, list[GatewayEvent]]], step: int) -> None:
        for dest, events in batches:
            await dest.send(DeltaBatch(instance_id=self._instance_id, step=step, events=events))
