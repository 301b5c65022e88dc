"""The stream interval: a fast model's tokens go to their gateway every few steps, what
a client waits on goes at once (services/worker/pacing.py).

The policy alone here; a real worker writing its batches through it in
test_worker_stream_pacing.py.
"""

from __future__ import annotations

from services.worker.pacing import StreamPacer, group, is_urgent
from shared.messages.gateway import GatewayEvent, RequestFailed, TokenDelta

STEP_S = 0.002


def delta(rid: str, position: int, finish: str | None = None) -> TokenDelta:
    return TokenDelta(rid, position, [100 + position], None, finish, 8)


def take(
    pacer: StreamPacer[str],
    events: list[tuple[str, GatewayEvent]],
    now_s: float,
    step_s: float | None,
) -> dict[str, list[GatewayEvent]]:
    """What the worker does after a step: group its events, hand them to the pacer."""
    return pacer.take(*group(events), now_s, step_s)


def test_group_keeps_order_by_destination_and_marks_the_urgent_ones() -> None:
    events: list[tuple[str, GatewayEvent]] = [
        ("gw1", delta("a", 3)),
        ("gw2", delta("b", 0)),
        ("gw1", delta("c", 5)),
        ("gw3", delta("d", 2, "stop")),
    ]
    by_dest, urgent = group(events)
    assert {d: positions(b) for d, b in by_dest.items()} == {
        "gw1": [("a", 3), ("c", 5)],
        "gw2": [("b", 0)],
        "gw3": [("d", 2)],
    }
    assert urgent == {"gw2", "gw3"}


def positions(batch: list[GatewayEvent]) -> list[tuple[str, int]]:
    return [(e.request_id, e.position) for e in batch if isinstance(e, TokenDelta)]


def test_what_a_client_waits_on_is_urgent() -> None:
    assert is_urgent(delta("a", 0))  # the first tokens: TTFT
    assert is_urgent(delta("a", 7, "length"))  # the end of the answer
    assert is_urgent(RequestFailed("a", 500, "boom"))
    assert not is_urgent(delta("a", 3))


def test_steps_are_held_while_the_oldest_token_would_still_go_within_the_interval() -> None:
    pacer: StreamPacer[str] = StreamPacer(0.005)
    t = 10.0
    # The first tokens go at once, whatever the interval.
    assert take(pacer, [("gw", delta("a", 0))], t, STEP_S) == {"gw": [delta("a", 0)]}
    # +2 ms: the next step would end 2 ms after this one's tokens: held; +4 ms: it
    # would end 4 ms after the oldest held one: held too.
    for _ in range(2):
        t += STEP_S
        assert take(pacer, [("gw", delta("a", round((t - 10.0) / STEP_S)))], t, STEP_S) == {}
        assert pacer
    # +6 ms: one more step would end 6 ms after the oldest held token: all go now.
    t += STEP_S
    sent = take(pacer, [("gw", delta("a", 3))], t, STEP_S)
    assert {d: positions(b) for d, b in sent.items()} == {"gw": [("a", 1), ("a", 2), ("a", 3)]}
    assert not pacer


def test_an_urgent_event_takes_what_was_held_before_it_in_order() -> None:
    pacer: StreamPacer[str] = StreamPacer(1.0)
    assert take(pacer, [("gw", delta("a", 1)), ("gw", delta("b", 4))], 0.0, STEP_S) == {}
    assert take(pacer, [("gw", delta("a", 2)), ("gw", delta("b", 5))], 0.002, STEP_S) == {}
    # b ends: everything held for its gateway goes with it, a's tokens first as they came
    sent = take(pacer, [("gw", delta("a", 3)), ("gw", delta("b", 6, "stop"))], 0.004, STEP_S)
    assert positions(sent["gw"]) == [("a", 1), ("b", 4), ("a", 2), ("b", 5), ("a", 3), ("b", 6)]
    # a new request's first token, a failure: the same
    assert take(pacer, [("gw", delta("a", 4))], 0.006, STEP_S) == {}
    sent = take(pacer, [("gw", delta("c", 0))], 0.008, STEP_S)
    assert positions(sent["gw"]) == [("a", 4), ("c", 0)]
    assert take(pacer, [("gw", delta("a", 5))], 0.010, STEP_S) == {}
    failure = RequestFailed("a", 500, "the model failed")
    assert take(pacer, [("gw", failure)], 0.012, STEP_S) == {"gw": [delta("a", 5), failure]}


def test_each_destination_is_paced_on_its_own() -> None:
    pacer: StreamPacer[str] = StreamPacer(1.0)
    assert take(pacer, [("gw1", delta("a", 1))], 0.0, STEP_S) == {}
    sent = take(pacer, [("gw1", delta("a", 2)), ("gw2", delta("b", 0))], 0.002, STEP_S)
    assert sent == {"gw2": [delta("b", 0)]}  # gw1's tokens still held
    assert pacer.take_all() == {"gw1": [delta("a", 1), delta("a", 2)]}
    assert not pacer and pacer.take_all() == {}


def test_no_step_to_follow_a_step_longer_than_the_interval_or_interval_zero_sends_now() -> None:
    events = [("gw", delta("a", 3))]
    assert take(StreamPacer[str](0.005), events, 0.0, None) == {"gw": [delta("a", 3)]}
    assert take(StreamPacer[str](0.005), events, 0.0, 0.006) == {"gw": [delta("a", 3)]}
    assert take(StreamPacer[str](0.0), events, 0.0, 0.0) == {"gw": [delta("a", 3)]}


def test_a_forgotten_destination_loses_what_was_held_for_it() -> None:
    pacer: StreamPacer[str] = StreamPacer(1.0)
    assert take(pacer, [("gone", delta("a", 1)), ("gw", delta("b", 1))], 0.0, STEP_S) == {}
    pacer.forget("gone")
    assert pacer.take_all() == {"gw": [delta("b", 1)]}


def test_a_destination_with_nothing_new_still_gets_its_tokens_in_time() -> None:
    # gw1's request was preempted (or parked at a peer): its later steps bring nothing.
    pacer: StreamPacer[str] = StreamPacer(0.005)
    assert take(pacer, [("gw1", delta("a", 1)), ("gw2", delta("b", 1))], 0.0, STEP_S) == {}
    assert take(pacer, [("gw2", delta("b", 2))], 0.002, STEP_S) == {}
    sent = take(pacer, [("gw2", delta("b", 3))], 0.004, STEP_S)
    assert {d: positions(b) for d, b in sent.items()} == {
        "gw1": [("a", 1)],
        "gw2": [("b", 1), ("b", 2), ("b", 3)],
    }
    # No step to follow: everything held goes, whoever it is for.
    assert take(pacer, [("gw2", delta("b", 4))], 0.006, STEP_S) == {}
    assert take(pacer, [("gw1", delta("a", 9, "abort"))], 0.007, None) == {
        "gw1": [delta("a", 9, "abort")],
        "gw2": [delta("b", 4)],
    }
