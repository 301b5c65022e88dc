"""Token-level routing primitives: park a request for a peer, resume it with the
peer's tokens. Two engines with their own KV exchange only token suffixes, and the
answer equals what one process computing the same routing decisions produces."""

from __future__ import annotations

from services.worker.engine.engine import LLMEngine
from services.worker.engine.outputs import StepOutputs
from shared.sampling import SamplingParams
from tests.services.worker.engine.builders import random_engine

NEW_TOKENS = 24


def greedy_next(engine: LLMEngine, seq: list[int]) -> int:
    return engine.generate([seq], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[
        0
    ][0]


def big_writes(position: int) -> bool:
    """The routing rule under test: the peer writes every third answer token."""
    return position % 3 == 2


class OriginHook:
    """On the origin: hand the token at a 'big' position to the peer to rewrite."""

    def __init__(self, engine: LLMEngine, num_prompt: int) -> None:
        self.engine, self.num_prompt = engine, num_prompt

    def __call__(self, out: StepOutputs) -> list[int]:
        dests = []
        for rid in out.request_ids:
            # index of the token just sampled (the hook runs before the step commits)
            position = self.engine.scheduler.requests[rid].num_output_tokens
            dests.append(-1 if big_writes(position) else 0)
        return dests


def back_after_one(out: StepOutputs) -> list[int]:
    """On the peer: return to the origin after every token it writes."""
    return [1] * len(out.request_ids)


def run_routed(prompts: list[list[int]], origin: LLMEngine, peer: LLMEngine) -> list[list[int]]:
    """Drive both engines and relay handoffs between them, as the relay service would."""
    origin.hook = OriginHook(origin, 0)
    peer.hook = back_after_one
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        origin.add_request(f"r{i}", p, params)
    answers: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    seen_by_peer: dict[str, int] = {}  # tokens of the sequence the peer's KV already holds
    peer_seq: dict[str, list[int]] = {}  # the peer's view of each sequence
    done: set[str] = set()
    while len(done) < len(prompts):
        for out in origin.step():
            answers[out.request_id].extend(out.new_token_ids)
            if out.finished:
                done.add(out.request_id)
        for h in origin.pop_handoffs():
            assert h.rewrites_last and h.destination == 1
            if h.request_id not in peer_seq:
                remaining = NEW_TOKENS - h.num_output_tokens
                peer.add_request(
                    h.request_id,
                    h.token_ids,
                    SamplingParams(max_tokens=remaining, temperature=0.0, ignore_eos=True),
                )
                peer_seq[h.request_id] = list(h.token_ids)
            else:
                # Only the suffix the peer has not seen travels; it prefills just that.
                peer.resume_request(h.request_id, h.token_ids[seen_by_peer[h.request_id] :])
            seen_by_peer[h.request_id] = len(h.token_ids)
        for out in peer.step():
            rid = out.request_id
            peer_seq[rid].extend(out.new_token_ids)  # resumed suffixes, then its own tokens
            if out.finished:  # finishing on the peer ends the request on the origin too
                origin.resume_request(
                    rid, peer_seq[rid][seen_by_peer[rid] :], finish_reason=out.finish_reason
                )
        for h in peer.pop_handoffs():
            assert not h.rewrites_last and h.destination == 1
            assert h.token_ids == peer_seq[h.request_id]
            written = h.token_ids[seen_by_peer[h.request_id] :]
            seen_by_peer[h.request_id] = len(h.token_ids)
            origin.resume_request(h.request_id, written)
    return [answers[f"r{i}"] for i in range(len(prompts))]


def test_routed_answer_equals_single_process_reference() -> None:
    origin, peer = random_engine(1), random_engine(2)
    prompts = [[5, 9, 14, 200], list(range(30, 70)), [7]]
    routed = run_routed(prompts, origin, peer)

    ref_small, ref_big = random_engine(1), random_engine(2)
    for prompt, answer in zip(prompts, routed, strict=True):
        seq, expected = list(prompt), []
        for pos in range(NEW_TOKENS):
            tok = greedy_next(ref_big if big_writes(pos) else ref_small, seq)
            expected.append(tok)
            seq.append(tok)
        assert answer == expected
    # Both sides freed every block once the answers ended.
    for e in (origin, peer):
        assert not e.scheduler.requests
        assert e.scheduler.blocks.num_free_blocks == 64


def test_parked_request_keeps_kv_and_is_skipped() -> None:
    engine = random_engine(3)
    engine.hook = lambda out: [2] * len(out.request_ids)
    engine.add_request(
        "a", [4, 5, 6], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    first = engine.step()
    (h,) = engine.pop_handoffs()
    assert (h.request_id, h.destination, h.rewrites_last, h.num_output_tokens) == ("a", 2, False, 1)
    assert first[0].new_token_ids == [h.token_ids[-1]]
    held = engine.scheduler.blocks.num_free_blocks
    engine.hook = None
    assert engine.step() == [] and engine.scheduler.blocks.num_free_blocks == held
    assert [c.request_id for c in engine.snapshot().pending] == ["a"]
    engine.resume_request("a", [40, 41], finish_reason=None)
    out = engine.step()
    assert out[0].new_token_ids[:2] == [40, 41]
    engine.abort_request("a")
    engine.step()
    assert engine.scheduler.blocks.num_free_blocks == 64


def handed_off_after_one_token(engine: LLMEngine, max_tokens: int) -> LLMEngine:
    """`engine` with request "a" (prompt [4, 5], greedy) parked after its first token,
    handed to peer 1."""
    engine.hook = back_after_one
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [4, 5], params)
    engine.step()
    engine.pop_handoffs()
    return engine


def test_a_request_past_the_cap_stalls_until_a_parked_one_comes_back() -> None:
    """max_num_seqs 1: while "a" is parked, "b" waits for its slot and a step computes
    nothing; `can_progress` says so until the inbox or the parked KV changes."""
    engine = handed_off_after_one_token(random_engine(6, max_num_seqs=1), max_tokens=4)
    assert not engine.can_progress()  # "a" alone, parked: nothing to compute
    engine.hook = None
    engine.add_request("b", [6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert engine.can_progress()  # "b" is queued: the next step takes it
    assert engine.step() == [] and [r.request_id for r in engine.scheduler.waiting] == ["b"]
    assert not engine.can_progress()
    engine.drop_parked_kv("a")  # frees KV, not the slot: a step may admit, so it says so
    assert engine.can_progress()
    engine.step()
    assert not engine.can_progress()
    engine.resume_request("a", [9], finish_reason="stop")
    assert engine.can_progress()
    out = {o.request_id: o for o in engine.step()}  # "a" ends, and "b" takes its slot
    assert out["a"].finished and out["b"].num_output_tokens == 1
    assert engine.can_progress()


def test_peer_finishing_ends_the_request_on_the_origin() -> None:
    engine = handed_off_after_one_token(random_engine(4), max_tokens=10)
    engine.resume_request("a", [7, 8, 9], finish_reason="stop")
    (out,) = engine.step()
    assert out.finished and out.finish_reason == "stop" and out.new_token_ids == [7, 8, 9]
    assert not engine.has_unfinished() and engine.scheduler.blocks.num_free_blocks == 64


def test_resume_never_exceeds_max_tokens() -> None:
    engine = handed_off_after_one_token(random_engine(5), max_tokens=4)
    engine.resume_request("a", [7, 8, 9, 10, 11])
    (out,) = engine.step()
    assert out.finished and out.finish_reason == "length" and out.num_output_tokens == 4
