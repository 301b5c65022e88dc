"""The relay's answer to an origin asking about requests away for long (PeerQuery):
only hand-offs it is timing count as pending."""

from __future__ import annotations

import msgspec

from services.relay.books import RelayBooks
from shared.messages.peer import PeerReq
from shared.sampling import SamplingParams


def hand_off(seq_no: int, sender: str, from_model: int, to_model: int) -> PeerReq:
    return PeerReq(
        request_id="a",
        preset="pair",
        origin_instance="w-small",
        sender_instance=sender,
        from_model=from_model,
        to_model=to_model,
        loc=0,
        suffix=[1, 2, 3],
        num_prompt_tokens=3,
        max_tokens=16,
        params=SamplingParams(max_tokens=16),
        seq_no=seq_no,
    )


def test_pending_lists_only_hand_offs_the_relay_is_timing() -> None:
    books = RelayBooks(10.0, lambda preset, index, rid: "w-large", lambda iid: True)
    assert books.pending(["a", "b"]) == []  # never seen (e.g. a restarted relay)
    books.on_peer(hand_off(1, "w-small", 0, 1), 0.0)  # to the peer: timed
    assert books.pending(["a", "b"]) == ["a"]
    books.on_peer(hand_off(2, "w-large", 1, 0), 1.0)  # back at the origin: not timed
    assert books.pending(["a"]) == []
    books.on_peer(hand_off(3, "w-small", 0, 1), 2.0)
    books.check(20.0)  # the peer missed its deadline: given back, forgotten
    assert books.pending(["a"]) == []


def test_a_later_hand_off_from_its_origin_that_no_route_knows_is_given_back_at_once() -> None:
    """A relay that started mid-answer: the origin's next hand-off (seq 5) names a route
    only the predecessor knew. The origin sent it after the start notice, so it would
    not ask about it: the relay gives it back at once (one more seq), and the peer's
    late answer for the old hand-off is dropped with its copy released."""
    books = RelayBooks(10.0, lambda preset, index, rid: "w-large", lambda iid: True)
    sends = books.on_peer(hand_off(5, "w-small", 0, 1), 0.0)
    assert len(sends) == 1
    target, back = sends[0]
    assert target == "w-small" and isinstance(back, PeerReq)
    assert (back.to_model, back.seq_no, back.suffix) == (0, 6, [])
    assert back.failed == "the relay restarted"
    assert books.counters.failovers == 1 and books.pending(["a"]) == []
    # the peer answers the hand-off the predecessor forwarded: dropped, its copy freed
    late = books.on_peer(hand_off(4, "w-large", 1, 0), 0.5)
    assert [(i, type(m).__name__) for i, m in late] == [("w-large", "PeerRelease")]
    assert books.counters.dropped_unknown == 1 and books.counters.forwarded == 0
    # the first hand-off of a new request is still routed
    fresh = msgspec.structs.replace(hand_off(1, "w-small", 0, 1), request_id="b")
    assert books.on_peer(fresh, 1.0) == [("w-large", fresh)]


def test_a_peers_hand_off_that_no_route_knows_is_dropped_and_its_copy_freed() -> None:
    books = RelayBooks(10.0, lambda preset, index, rid: "w-large", lambda iid: True)
    sends = books.on_peer(hand_off(3, "w-large", 1, 0), 0.0)
    assert [(i, type(m).__name__) for i, m in sends] == [("w-large", "PeerRelease")]
    assert books.counters.dropped_unknown == 1 and books.counters.failovers == 0
