"""How often a worker writes a gateway its requests' tokens: the stream interval.

After every step the worker has a batch of token deltas per owning gateway. Each batch
written is a syscall and a wake-up of the gateway, which then writes one SSE chunk per
stream: with random-tiny's ~2.4 ms decode steps at 16 streams, ~50 us of the worker's
core per step and most of the gateway's. No reader follows a
stream at hundreds of tokens per second, so a step's batch for a gateway waits for the
next step while that one is expected to end within `interval_s` of the oldest token
held, and goes with the next step's in one write (the gateway merges the deltas it
finds queued into one SSE chunk per stream).

As vLLM's `stream_interval` (counted in tokens there), with three differences: it
counts time, so a model whose step takes longer than the interval is never held; no
token waits longer than the interval, unless the step after it runs longer than the
one before; and what a client waits on is never held: a request's first tokens (its
TTFT), its last (its end) and failures, which take what was held for their gateway
with them, in order.

Policy only: `Answers.publish` (answers.py) writes what `take` returns.
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Iterable
from typing import Generic, TypeVar

from shared.messages.gateway import GatewayEvent, TokenDelta

D = TypeVar("D", bound=Hashable)  # a destination: a gateway's link or NATS inbox


def is_urgent(event: GatewayEvent) -> bool:
    """Never held: a request's first tokens, its end, and failures."""
    if not isinstance(event, TokenDelta):
        return True
    return event.position == 0 or event.finish_reason is not None


def group(events: Iterable[tuple[D, GatewayEvent]]) -> tuple[dict[D, list[GatewayEvent]], set[D]]:
    """Events by destination, in the order they came, and the destinations that have
    an urgent one (`is_urgent`): what `StreamPacer.take` takes."""
    by_dest: dict[D, list[GatewayEvent]] = {}
    urgent: set[D] = set()
    for dest, event in events:
        by_dest.setdefault(dest, []).append(event)
        if is_urgent(event):
            urgent.add(dest)
    return by_dest, urgent


class StreamPacer(Generic[D]):
    """Holds each destination's deltas back for as long as a step's tokens may wait."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        # destination -> (its held events in order, monotonic time the oldest was held)
        self._held: dict[D, tuple[list[GatewayEvent], float]] = {}

    def __bool__(self) -> bool:
        """Whether anything is held."""
        return bool(self._held)

    def take(
        self,
        by_dest: dict[D, list[GatewayEvent]],
        urgent: Container[D],
        now_s: float,
        next_step_s: float | None,
    ) -> dict[D, list[GatewayEvent]]:
        """The batches to write now, by destination, each in the order its events came
        (held ones first), and any other destination's held batch that would wait too
        long. `by_dest`: a step's new events by destination (`group`), `urgent`: the
        destinations among them with an urgent event.
        `next_step_s` is how long the next step is expected to take; None: send
        everything now (no step follows soon)."""
        # Hold while the oldest token would still be sent within the interval by the
        # next step's write (now - held since < limit), and none that a client waits on
        # is here.
        limit_s = -1.0 if next_step_s is None else self.interval_s - next_step_s
        send: dict[D, list[GatewayEvent]] = {}
        held_for = self._held
        for dest, batch in by_dest.items():
            held = held_for.pop(dest, None)
            if held is None:
                since_s = now_s
            else:  # (never urgent: it was held)
                held[0].extend(batch)
                batch, since_s = held
            if now_s - since_s < limit_s and dest not in urgent:
                held_for[dest] = (batch, since_s)
            else:
                send[dest] = batch
        # A destination with nothing new (its requests preempted, or parked at a peer)
        # still gets what it holds in time.
        for dest, (batch, since_s) in list(held_for.items()):
            if now_s - since_s >= limit_s and dest not in by_dest:
                del held_for[dest]
                send[dest] = batch
        return send

    def take_all(self) -> dict[D, list[GatewayEvent]]:
        """Everything held (before the worker waits: no step would send it)."""
        send = {dest: batch for dest, (batch, _) in self._held.items()}
        self._held.clear()
        return send

    def forget(self, dest: D) -> None:
        """A destination gone for good (a closed link): drop what it had."""
        self._held.pop(dest, None)
