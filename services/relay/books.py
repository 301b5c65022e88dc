"""The relay's books (pure): where each request's copies live, which hand-off is still
out, and what to send for every message, failure and timeout.

Per request: the last sequence number seen (older or repeated messages are
dropped), the worker instance holding each model's copy (later hand-offs to that
model go to the same instance, whose KV already holds the prefix), and the hand-off
the relay waits on. A hand-off not answered within `peer_timeout_s`, or whose
holder leaves the registry, is given back to the origin with `failed` set, and the
origin finishes the request alone. When an origin leaves, every copy it left on
peers is released.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from shared.messages.peer import PeerMessage, PeerRelease, PeerReq

Send = tuple[str, PeerMessage]  # (instance id, message)


@dataclass(slots=True)
class Route:
    """One request's state at the relay."""

    origin: str  # instance that owns the request
    preset: str
    last_seq: int = 0  # highest seq_no forwarded
    holders: dict[int, str] = field(default_factory=dict)  # model index -> instance
    waiting_on: str | None = None  # instance holding the pen, if not the origin
    deadline_s: float = 0.0  # monotonic time the holder must answer by
    last: PeerReq | None = None  # the hand-off that is out


@dataclass(slots=True)
class RelayCounters:
    forwarded: int = 0
    dropped_stale: int = 0  # out-of-order or duplicate sequence numbers
    dropped_unknown: int = 0  # for requests already given back or released
    failovers: int = 0  # hand-offs given back to their origin (peer dead, timed out, none live)
    released: int = 0


class RelayBooks:
    def __init__(
        self,
        peer_timeout_s: float,
        pick: Callable[[str, int, str], str | None],
        alive: Callable[[str], bool],
    ) -> None:
        """pick(preset, model_index, request_id) -> the least loaded live instance of that
        model (None if none); alive(instance) -> whether it is registered."""
        self.peer_timeout_s = peer_timeout_s
        self._pick, self._alive = pick, alive
        self.routes: dict[str, Route] = {}
        self.given_back: set[str] = set()  # request ids handed back to their origin
        self.counters = RelayCounters()

    def on_peer(self, msg: PeerReq, now_s: float) -> list[Send]:
        """A worker sent a hand-off: where does it go?"""
        route = self.routes.get(msg.request_id)
        if route is None:
            is_origin = msg.sender_instance == msg.origin_instance
            if msg.request_id in self.given_back or (msg.seq_no != 1 and not is_origin):
                self.counters.dropped_unknown += 1
                return self._release_sender(msg)
            route = self.routes[msg.request_id] = Route(msg.origin_instance, msg.preset)
            if msg.seq_no != 1:
                # The origin's later hand-off, and this relay routed none before it (it
                # started since): where the peer's copy is, and how current, only a
                # predecessor knew. Sent after this relay's start notice, it is one the
                # origin would not ask about (it would wait `origin_wait_s`): given
                # back at once, the request goes on alone.
                route.last_seq, route.last = msg.seq_no, msg
                return self._give_back(msg.request_id, route, "the relay restarted")
        if msg.seq_no <= route.last_seq:
            self.counters.dropped_stale += 1
            return []
        route.last_seq = msg.seq_no
        route.holders[msg.from_model] = msg.sender_instance
        route.waiting_on, route.last = None, None
        # 1. The origin holds model 0; other models keep the instance that has their copy.
        if msg.to_model == 0:
            target: str | None = route.origin
        else:
            target = route.holders.get(msg.to_model)
            if target is None or not self._alive(target):
                target = self._pick(msg.preset, msg.to_model, msg.request_id)
        if target is None:
            route.last = msg
            return self._give_back(msg.request_id, route, "no live worker serves the peer model")
        route.holders[msg.to_model] = target
        # 2. Wait on a peer; the origin itself is never timed out (its client is).
        if target != route.origin:
            route.waiting_on, route.deadline_s, route.last = (
                target,
                now_s + self.peer_timeout_s,
                msg,
            )
        self.counters.forwarded += 1
        return [(target, msg)]

    def pending(self, request_ids: list[str]) -> list[str]:
        """The ids among `request_ids` with a hand-off out (timed by peer_timeout_s)."""
        out = []
        for rid in request_ids:
            route = self.routes.get(rid)
            if route is not None and route.waiting_on is not None:
                out.append(rid)
        return out

    def on_release(self, msg: PeerRelease) -> list[Send]:
        """The origin ended the request: free every copy it left on peers."""
        route = self.routes.pop(msg.request_id, None)
        self.given_back.discard(msg.request_id)
        if route is None:
            return []
        self.counters.released += 1
        return [(i, msg) for i in set(route.holders.values()) if i != route.origin]

    def check(self, now_s: float) -> list[Send]:
        """Timeouts and departures: give hand-offs back, release orphaned copies."""
        sends: list[Send] = []
        for rid, route in list(self.routes.items()):
            if not self._alive(route.origin):
                # The client's request died with its origin: free the peers' copies.
                del self.routes[rid]
                release = PeerRelease(
                    request_id=rid, preset=route.preset, origin_instance=route.origin
                )
                sends += [(i, release) for i in set(route.holders.values()) if i != route.origin]
                continue
            if route.waiting_on is None:
                continue
            if not self._alive(route.waiting_on):
                sends += self._give_back(rid, route, f"peer {route.waiting_on} left")
            elif now_s >= route.deadline_s:
                sends += self._give_back(
                    rid,
                    route,
                    f"peer {route.waiting_on} did not answer in {self.peer_timeout_s:g} s",
                )
        return sends

    def _give_back(self, rid: str, route: Route, reason: str) -> list[Send]:
        self.counters.failovers += 1
        del self.routes[rid]
        self.given_back.add(rid)
        sends: list[Send] = []
        last = route.last
        if last is not None:
            back = msgspec.structs.replace(
                last,
                to_model=0,
                suffix=[],
                seq_no=route.last_seq + 1,
                failed=reason,
            )
            sends.append((route.origin, back))
        release = PeerRelease(request_id=rid, preset=route.preset, origin_instance=route.origin)
        sends += [
            (i, release)
            for i in set(route.holders.values())
            if i != route.origin and self._alive(i)
        ]
        return sends

    def _release_sender(self, msg: PeerReq) -> list[Send]:
        """A late message for a request given back: the sender's copy is not needed."""
        if msg.sender_instance == msg.origin_instance:
            return []
        release = PeerRelease(
            request_id=msg.request_id, preset=msg.preset, origin_instance=msg.origin_instance
        )
        return [(msg.sender_instance, release)]
