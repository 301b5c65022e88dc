"""Delayed batching on one worker: whether the loop steps now or waits for more
requests of its token-level presets first.

Holds only when every request ready here belongs to a preset that holds: `baton`
whose B*(N) is not reached (shared/hold.py has the rule), or `barrier` with one of
its requests away at a peer. Plain requests are never held (a step they force
carries the held presets' ready rows too).
"""

from __future__ import annotations

from collections.abc import Mapping

from services.worker.routing.tracked import Tracked, active_count
from shared.config import PresetConfig
from shared.hold import may_step, wait_left_s
from shared.messages.batcher import BatchTables

# How long a barrier-held loop sleeps before it looks again when nothing wakes it
# (a peer's answer wakes it at once; this only bounds a missed wake-up).
BARRIER_RECHECK_S = 0.05


def hold_s(
    requests: Mapping[str, Tracked],
    presets: Mapping[str, PresetConfig],
    tables: Mapping[str, BatchTables],
    now_s: float,
) -> float | None:
    """None: step now. Else seconds the loop may wait for more requests first
    (the caller has checked that no plain request is ready)."""
    ready: dict[str, list[Tracked]] = {}
    away: set[str] = set()  # barrier presets with an origin request at a peer
    for t in requests.values():
        if not t.parked:
            ready.setdefault(t.preset, []).append(t)
        elif t.is_origin:
            away.add(t.preset)
    wait: float | None = None
    for preset, group in ready.items():
        mode = presets[preset].mode
        if mode == "barrier" and group[0].is_origin:
            if preset not in away:
                return None
            # Step barrier: the entry model waits for every request it sent away, as
            # one lockstep batch would; the peer's answer (or the relay's failed
            # hand-back) wakes the loop. No timeout of our own: the relay's peer
            # timeout bounds the wait.
            wait = BARRIER_RECHECK_S if wait is None else min(wait, BARRIER_RECHECK_S)
            continue
        preset_tables = tables.get(preset)
        if preset_tables is None or mode != "baton":
            return None
        index = group[0].state.model_index
        num_active = active_count(requests.values(), preset)
        hold = preset_tables.b_for(index, num_active)
        timeout_s = preset_tables.hold_timeout_ms / 1000.0
        oldest = now_s - min(t.ready_since_s for t in group)
        if may_step(len(group), num_active, hold, oldest, timeout_s):
            return None
        left = wait_left_s(len(group), oldest, timeout_s)
        if left is not None:
            wait = left if wait is None else min(wait, left)
    return wait
