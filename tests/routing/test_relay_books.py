"""The relay's answer to an origin asking about requests away for long (PeerQuery):
only hand-offs it is timing count as pending."""

from __future__ import annotations

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
