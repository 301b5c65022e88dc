"""Safety nets for a relay that is itself gone.

The relay bounds every hand-off with its peer timeout, but a relay that died or
restarted answers nothing. The worker asks it (PeerQuery) about origin requests
away longer than `origin_wait_s` and settles them with its answer; peer copies no
visit touched for `guest_idle_s` are dropped. Pure functions over the books: the
routing driver does the asking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.logging import get_logger
from shared.messages.peer import PeerRelease

if TYPE_CHECKING:
    from services.worker.engine.protocol import RoutableEngine
    from services.worker.routing.runtime import TokenRouting
    from services.worker.routing.tracked import Outbox

log = get_logger(component="token-routing")


def overdue_origins(routing: TokenRouting, now_s: float, origin_wait_s: float) -> dict[str, float]:
    """Origin requests away at a peer for longer than `origin_wait_s`, each with the
    time its hand-off left (which names the hand-off asked about)."""
    return {
        rid: t.parked_at_s
        for rid, t in routing.requests.items()
        if t.parked and t.is_origin and now_s - t.parked_at_s > origin_wait_s
    }


def settle_overdue(
    routing: TokenRouting,
    asked: dict[str, float],
    pending: set[str],
    now_s: float,
    engine: RoutableEngine,
    outbox: Outbox,
) -> None:
    """Apply the relay's answer about overdue requests (`asked`: overdue_origins at the
    time of asking; `pending`: those the relay is still timing, an empty set when it
    did not answer). A pending one waits another origin_wait_s; any other one still
    away on the same hand-off comes back: the origin finishes it alone, as after a
    failed hand-back, and releases the peers' copies (if a relay carries the release).
    Requests that came back meanwhile, or left again on a newer hand-off, are left
    alone."""
    for rid, left_at_s in asked.items():
        tracked = routing.requests.get(rid)
        if tracked is None or not tracked.parked or not tracked.is_origin:
            continue
        if tracked.parked_at_s != left_at_s:  # back and away again since we asked
            continue
        if rid in pending:
            tracked.parked_at_s = now_s
            continue
        log.warning("peer_silent", request_id=rid, waited_s=round(now_s - tracked.parked_at_s, 1))
        routing.num_peer_failures += 1
        routing.finish_alone(rid, tracked, now_s, engine)
        outbox.peer.append(
            PeerRelease(request_id=rid, preset=tracked.preset, origin_instance=routing.instance_id)
        )


def expire_guests(
    routing: TokenRouting, now_s: float, guest_idle_s: float, engine: RoutableEngine
) -> None:
    """Drop peer copies no visit has touched for `guest_idle_s` (their origin's release
    may have been lost with the relay): the KV is freed, and a later visit for such a
    copy fails back to the origin (unknown request with an anchor > 0), which then
    finishes alone."""
    for rid, tracked in list(routing.requests.items()):
        idle_s = now_s - tracked.parked_at_s
        if tracked.parked and not tracked.is_origin and idle_s > guest_idle_s:
            log.info("guest_copy_expired", request_id=rid, idle_s=round(idle_s, 1))
            engine.abort_request(rid)
            del routing.requests[rid]
