"""The worker-side token-routing books (services/worker/routing/runtime.py) driving two
real engines in one process, messages passed as the relay would pass them.

The answer must equal, token for token, what one process applying the same routing
rule produces (greedy), both engines must free every KV block, and only suffixes
travel."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import msgspec
import pytest
import torch

from services.worker.engine.engine import LLMEngine
from services.worker.engine.outputs import StepOutputs
from services.worker.routing.api import STAY, RouteBatch, TokenPolicy, hand_after, hand_rewrite
from services.worker.routing.chars import CharBoundaries
from services.worker.routing.hold import BARRIER_RECHECK_S
from services.worker.routing.runtime import TokenRouting
from services.worker.routing.silence import expire_guests, overdue_origins, settle_overdue
from services.worker.routing.tracked import Outbox, draw_key
from shared.config import PresetConfig, TokenMode
from shared.messages.peer import PeerRelease, PeerReq
from shared.sampling import SamplingParams
from tests.services.worker.engine.builders import random_engine

NEW_TOKENS = 20
BLOCKS = 64


def big_writes(position: int) -> bool:
    """The rule under test: the large model writes output positions 2, 5, 8, ..."""
    return position % 3 == 2


# request id -> (model index, draw key) of every state a policy routed it under
SEEN_KEYS: dict[str, set[tuple[int, str]]] = {}


class EveryThird(TokenPolicy):
    """Small: hand position 2 mod 3 to the large model to rewrite; large: hand back."""

    name = "every-third"

    def route(self, batch: RouteBatch) -> list[int]:
        for s in batch.states:
            SEEN_KEYS.setdefault(s.request_id, set()).add((self.model_index, s.draw_key))
        if self.model_index == 1:
            return [hand_after(0)] * len(batch.states)
        # num_output_tokens counts the token just sampled: its position is that - 1.
        return [
            hand_rewrite(1) if big_writes(s.num_output_tokens - 1) else STAY for s in batch.states
        ]


def make_policy(
    name: str, models: list[str], index: int, args: Mapping[str, float | str]
) -> TokenPolicy:
    assert name == "every-third"
    return EveryThird(models, index, args, Path("."))


def tiny_engine(seed: int) -> LLMEngine:
    return random_engine(seed, num_kv_blocks=BLOCKS)


def presets(mode: TokenMode) -> dict[str, PresetConfig]:
    return {"pair": PresetConfig(models=["small", "large"], token_policy="every-third", mode=mode)}


class Pair:
    """Two workers' engines and books, and an in-process relay between them."""

    def __init__(self, mode: TokenMode) -> None:
        self.engines = {"w-small": tiny_engine(1), "w-large": tiny_engine(2)}
        self.books = {
            "w-small": TokenRouting("w-small", "small", presets(mode), make_policy),
            "w-large": TokenRouting("w-large", "large", presets(mode), make_policy),
        }
        for iid, engine in self.engines.items():
            engine.hook = self.books[iid].hook
        self.client: dict[str, list[int]] = {}
        self.finished: dict[str, str | None] = {}
        self.suffix_tokens = 0  # tokens carried by PeerReqs

    def submit(
        self,
        rid: str,
        prompt: list[int],
        max_tokens: int = NEW_TOKENS,
        params: SamplingParams | None = None,
    ) -> None:
        if params is None:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engines["w-small"].add_request(rid, prompt, params)
        self.books["w-small"].add_origin(rid, "pair", prompt, params)
        self.client[rid] = []

    def deliver(self, msg: PeerReq | PeerRelease) -> None:
        if isinstance(msg, PeerRelease):
            for iid in self.books:
                if iid != msg.origin_instance:
                    self.books[iid].on_release(msg, self.engines[iid])
            return
        self.suffix_tokens += len(msg.suffix)
        to = "w-small" if msg.to_model == 0 else "w-large"
        self.books[to].on_peer(msg, self.engines[to], Outbox())

    def step_all(self) -> None:
        for iid, engine in self.engines.items():
            books, outbox = self.books[iid], Outbox()
            outputs = engine.step()
            for out in books.on_outputs(outputs, outbox):
                if iid == "w-small":
                    self.client[out.request_id].extend(out.new_token_ids)
                    if out.finished:
                        self.finished[out.request_id] = out.finish_reason
            books.on_handoffs(engine.pop_handoffs(), engine, outbox)
            for msg in outbox.peer:
                self.deliver(msg)

    def step_origin(self) -> Outbox:
        """One step of the small (origin) worker alone; what it would send (not delivered)."""
        books, engine, outbox = self.books["w-small"], self.engines["w-small"], Outbox()
        for out in books.on_outputs(engine.step(), outbox):
            self.client[out.request_id].extend(out.new_token_ids)
        books.on_handoffs(engine.pop_handoffs(), engine, outbox)
        return outbox

    def origin_until_handoff(self) -> PeerReq:
        for _ in range(10):
            if (outbox := self.step_origin()).peer:
                (sent,) = outbox.peer
                assert isinstance(sent, PeerReq)
                return sent
        raise AssertionError("no hand-off in 10 steps")

    def run(self, rids: list[str]) -> None:
        for _ in range(2000):
            if all(r in self.finished for r in rids) and not any(
                e.has_unfinished() for e in self.engines.values()
            ):
                return
            self.step_all()
        raise AssertionError("the routed requests did not finish")


def reference(prompt: list[int], n: int) -> list[int]:
    small, large = tiny_engine(1), tiny_engine(2)
    seq, out = list(prompt), []
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for pos in range(n):
        tok = (large if big_writes(pos) else small).generate([seq], params)[0][0]
        out.append(tok)
        seq.append(tok)
    return out


@pytest.mark.parametrize("mode", ["baton", "barrier", "std_serving"])
def test_routed_answer_equals_single_process_and_frees_kv(mode: TokenMode) -> None:
    pair = Pair(mode)
    prompts = {"a": [5, 9, 14, 200], "b": list(range(30, 70)), "c": [7]}
    for rid, prompt in prompts.items():
        pair.submit(rid, prompt)
    pair.run(list(prompts))
    for rid, prompt in prompts.items():
        assert pair.client[rid] == reference(prompt, NEW_TOKENS), rid
        assert pair.finished[rid] == "length"
    for engine in pair.engines.values():
        assert not engine.scheduler.requests
        assert engine.scheduler.blocks.num_free_blocks == BLOCKS
    for books in pair.books.values():
        assert not books.requests
    if mode == "baton":
        # Only unseen suffixes travel: far fewer tokens than whole sequences.
        whole = sum((len(p) + NEW_TOKENS) * (NEW_TOKENS // 3) * 2 for p in prompts.values())
        assert pair.suffix_tokens < whole / 3


def test_a_request_is_drawn_by_one_key_on_every_worker() -> None:
    """Seeded draws (ME's writer) are keyed on RouteState.draw_key: the guest's copy
    gets the origin's key, and that key is the request's seed when it has one, its
    prompt when it is greedy, else its id, so that `seed` or temperature 0 repeat."""
    SEEN_KEYS.clear()
    pair = Pair("baton")
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=7, ignore_eos=True)
    sampled = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True)
    requests = {
        "a": ([5, 9, 14], greedy),
        "b": ([5, 9, 14], greedy),  # the same prompt
        "c": ([6, 9, 14], greedy),
        "d": ([5, 9, 14], seeded),
        "e": ([6, 9, 14], seeded),  # the same seed
        "f": ([5, 9, 14], sampled),
    }
    for rid, (prompt, params) in requests.items():
        pair.submit(rid, prompt, params=params)
    pair.run(list(requests))
    keys = {}
    for rid in requests:
        (key,) = {k for _, k in SEEN_KEYS[rid]}  # one key on both workers...
        assert {i for i, _ in SEEN_KEYS[rid]} == {0, 1}  # ... which both routed
        keys[rid] = key
    assert keys["a"] == keys["b"] != keys["c"]
    assert keys["d"] == keys["e"] == "seed:7"
    assert keys["f"] == "f"
    assert draw_key("x", [5, 9, 14], greedy) == keys["a"]


class Always(TokenPolicy):
    """Asks for the same destination after every token."""

    name = "always"

    def configure(self) -> None:  # takes its destination as an argument
        pass

    def route(self, batch: RouteBatch) -> list[int]:
        return [int(self.args["dest"])] * len(batch.states)


@pytest.mark.parametrize("rewrites", [False, True])
def test_a_hand_off_waits_for_the_end_of_a_character(rewrites: bool) -> None:
    """Token 7 is a 2-byte character's lead byte, 8 its continuation, the rest ASCII: a
    hand-off that would leave the next writer inside the character waits for its end."""
    vocab = {7: "é".encode()[:1], 8: "é".encode()[1:]}
    dest = hand_rewrite(1) if rewrites else hand_after(1)

    def small_books(prompt: list[int], chars: CharBoundaries | None) -> TokenRouting:
        """The small model's books, its policy asking for `dest` after every token."""
        books = TokenRouting(
            "w-small",
            "small",
            {
                "pair": PresetConfig(
                    models=["small", "large"], token_policy="always", args={"dest": dest}
                )
            },
            lambda name, models, index, args: Always(models, index, args, Path(".")),
            chars,
        )
        books.add_origin("a", "pair", prompt, SamplingParams(max_tokens=8, temperature=0.0))
        return books

    books = small_books([1, 2, 3], CharBoundaries(lambda t: vocab.get(t, b"a")))

    def route(sampled: int) -> int:
        out = StepOutputs(["a"], [sampled], torch.zeros(1, 16), torch.zeros(1, 4))
        (got,) = books.hook(out)  # type: ignore[misc]
        if got == STAY:  # the token stands and is this worker's: the books append it
            books.requests["a"].seq.append(sampled)
        return got

    if rewrites:  # rewriting token t: the text before t must end a character
        assert route(7) == dest  # (7 is taken back: the text before it was whole)
        books.requests["a"].seq.append(7)  # had 7 stood instead, ...
        assert route(8) == STAY  # ... rewriting 8 would split the character
        assert route(4) == dest
    else:  # continuing after t: the text with t must end a character
        assert route(7) == STAY  # the next writer would start inside "é"
        assert route(8) == dest
    assert books.num_deferred == 1
    without = small_books([1, 2, 3, 7], None)
    out = StepOutputs(["a"], [7 if not rewrites else 8], torch.zeros(1, 16), torch.zeros(1, 4))
    assert without.hook(out) == [dest]  # no vocabulary given: never deferred


def test_tokens_by_model_are_counted() -> None:
    pair = Pair("baton")
    pair.submit("a", [3, 4, 5])
    pair.run(["a"])
    # Positions 2, 5, ..., 17 are the large model's: 6 of 20.
    small = pair.books["w-small"]
    assert small.num_handoffs == 6
    assert pair.books["w-large"].num_handoffs == 6


def test_a_peer_copy_is_scheduled_as_priority_work() -> None:
    """The large worker's copy of a routed request goes before the requests clients
    sent it directly (shared.scheduling.scheduler: priority); the origin's own request
    is plain."""
    pair = Pair("baton")
    large = pair.engines["w-large"]
    large.add_request("direct", [7] * 40, SamplingParams(max_tokens=4, temperature=0.0))
    pair.submit("a", [3, 4, 5])
    pair.deliver(pair.origin_until_handoff())  # queued on the large worker after "direct"
    large.step()
    assert large.scheduler.requests["a"].is_priority
    assert not large.scheduler.requests["direct"].is_priority
    assert not pair.engines["w-small"].scheduler.requests["a"].is_priority


def test_peer_finishing_ends_the_answer_at_the_origin() -> None:
    pair = Pair("baton")
    # max_tokens 3: the large model writes position 2, the last one; it finishes there.
    pair.submit("a", [3, 4, 5], max_tokens=3)
    pair.run(["a"])
    assert pair.client["a"] == reference([3, 4, 5], 3)
    assert pair.finished["a"] == "length"
    for engine in pair.engines.values():
        assert engine.scheduler.blocks.num_free_blocks == BLOCKS


def test_failed_hand_back_lets_the_origin_finish_alone() -> None:
    pair = Pair("baton")
    pair.submit("a", [3, 4, 5])
    small, engine = pair.books["w-small"], pair.engines["w-small"]
    sent = pair.origin_until_handoff()
    assert sent.rewrites_last
    # The relay answers: the peer is gone. The origin writes the rest alone.
    failed = msgspec.structs.replace(
        sent, failed="peer timed out", suffix=[], seq_no=sent.seq_no + 1
    )
    small.on_peer(failed, engine, Outbox())
    while engine.has_unfinished():
        assert not any(isinstance(m, PeerReq) for m in pair.step_origin().peer)
    assert len(pair.client["a"]) == NEW_TOKENS
    assert engine.scheduler.blocks.num_free_blocks == BLOCKS


def test_a_silent_relay_never_strands_a_request_or_a_copy() -> None:
    """The relay itself is gone: nothing answers a hand-off. A request away longer
    than origin_wait_s is overdue; while the relay says it still times it, it waits
    on; once the relay does not (or cannot) say so, the origin takes it back and
    finishes alone; the peer's late answer is dropped, not spliced in; the peer's
    idle copy is dropped after guest_idle_s; every KV block ends free."""
    pair = Pair("baton")
    pair.submit("a", [3, 4, 5])
    small, small_engine = pair.books["w-small"], pair.engines["w-small"]
    large, large_engine = pair.books["w-large"], pair.engines["w-large"]
    sent = pair.origin_until_handoff()
    t0 = small.requests["a"].parked_at_s
    assert overdue_origins(small, t0 + 29.0, 30.0) == {}
    assert overdue_origins(small, t0 + 31.0, 30.0) == {"a": t0}
    # The relay answers that it still times the hand-off: wait another origin_wait_s.
    outbox = Outbox()
    settle_overdue(small, {"a": t0}, {"a"}, t0 + 31.0, small_engine, outbox)
    assert small.requests["a"].parked and not outbox.peer
    assert overdue_origins(small, t0 + 60.0, 30.0) == {}
    # An answer about an older hand-off of the request changes nothing.
    settle_overdue(small, {"a": t0 - 5.0}, set(), t0 + 62.0, small_engine, outbox)
    assert small.requests["a"].parked and not outbox.peer
    # The hand-off did reach the peer before the relay died: it writes and hands
    # back into the void.
    large.on_peer(sent, large_engine, Outbox())
    back = Outbox()
    while not back.peer:
        large.on_outputs(large_engine.step(), back)
        large.on_handoffs(large_engine.pop_handoffs(), large_engine, back)
    (answer,) = back.peer
    assert isinstance(answer, PeerReq) and answer.to_model == 0
    # Overdue again and the relay silent: the origin resumes alone and
    # releases the peers.
    assert overdue_origins(small, t0 + 62.0, 30.0) == {"a": t0 + 31.0}
    outbox = Outbox()
    settle_overdue(small, {"a": t0 + 31.0}, set(), t0 + 62.0, small_engine, outbox)
    assert [type(m) for m in outbox.peer] == [PeerRelease]
    assert small.num_peer_failures == 1 and not small.requests["a"].parked
    late_delivered = False
    while small_engine.has_unfinished():
        if len(pair.client["a"]) >= 12 and not late_delivered:  # the late answer, mid-way
            small.on_peer(answer, small_engine, Outbox())
            late_delivered = True
        assert not any(isinstance(m, PeerReq) for m in pair.step_origin().peer)
    assert late_delivered and len(pair.client["a"]) == NEW_TOKENS
    assert small_engine.scheduler.blocks.num_free_blocks == BLOCKS
    # The peer's copy (its release was lost with the relay) expires on its own.
    t_guest = large.requests["a"].parked_at_s
    expire_guests(large, t_guest + 299.0, 300.0, large_engine)
    assert "a" in large.requests
    expire_guests(large, t_guest + 301.0, 300.0, large_engine)
    assert "a" not in large.requests
    large_engine.step()  # the abort applies at the next iteration
    assert large_engine.scheduler.blocks.num_free_blocks == BLOCKS
    assert not large_engine.has_unfinished()


def test_no_kv_leak_after_500_mixed_requests_with_aborts() -> None:
    """500 requests of mixed lengths through both engines, a fifth aborted by the
    client at a random moment (some while the large model holds the pen): at the end
    no request, block or book entry is left on either side."""
    import random

    rng = random.Random(0)
    pair = Pair("baton")
    small = pair.engines["w-small"]
    rids = [f"m{i}" for i in range(500)]
    to_abort = {rid for rid in rids if rng.random() < 0.2}
    queue = list(rids)
    live: set[str] = set()
    for _ in range(20000):
        # 1. Keep up to 12 requests in flight.
        while queue and len(live) < 12:
            rid = queue.pop()
            prompt = [rng.randrange(5, 40000) for _ in range(rng.randrange(1, 40))]
            pair.submit(rid, prompt, max_tokens=rng.randrange(1, 10))
            live.add(rid)
        # 2. Clients going away.
        for rid in list(live):
            if rid in to_abort and rng.random() < 0.3:
                small.abort_request(rid)
                to_abort.discard(rid)
        pair.step_all()
        live -= set(pair.finished)
        if not queue and not live and not any(e.has_unfinished() for e in pair.engines.values()):
            break
    else:
        raise AssertionError("requests did not drain")
    assert len(pair.finished) == 500
    assert "abort" in pair.finished.values()
    for engine in pair.engines.values():
        assert not engine.scheduler.requests
        assert engine.scheduler.blocks.num_free_blocks == BLOCKS
    for books in pair.books.values():
        assert not books.requests


def test_hold_obeys_the_batch_tables() -> None:
    """The large model holds its step until B_L(N) requests are ready there, every
    active request is there, or the oldest waited the hold timeout."""
    from shared.messages.batcher import BatchTables

    pair = Pair("baton")
    pair.submit("a", [3, 4, 5])
    pair.step_all()  # "a" is one token ahead of the others
    for rid in ("b", "c"):
        pair.submit(rid, [3, 4, 5])
    large = pair.books["w-large"]
    tables = BatchTables(
        preset="pair",
        version=1,
        models=["small", "large"],
        b=[[1, 1, 1], [1, 2, 2]],
        hold_timeout_ms=50.0,
        is_estimated=True,
        published_at_s=0.0,
    )
    large.tables["pair"] = tables
    # Step the small engine alone until one request waits at the large model.
    small, big = pair.engines["w-small"], pair.engines["w-large"]
    for _ in range(10):
        outbox = Outbox()
        pair.books["w-small"].on_outputs(small.step(), outbox)
        pair.books["w-small"].on_handoffs(small.pop_handoffs(), small, outbox)
        for msg in outbox.peer:
            pair.deliver(msg)
        if large.requests:
            break
    ready = [t for t in large.requests.values() if not t.parked]
    assert len(ready) == 1
    t0 = ready[0].ready_since_s
    assert large.num_active("pair") == 3  # reported by the origin
    # One ready, B_L(3) = 2: hold, for what is left of the 50 ms timeout.
    wait = large.hold_s(t0 + 0.01, has_plain_work=False)
    assert wait is not None and abs(wait - 0.04) < 1e-6
    assert large.hold_s(t0 + 0.06, has_plain_work=False) is None  # timed out: step
    assert large.hold_s(t0 + 0.01, has_plain_work=True) is None  # plain work never waits
    del large.tables["pair"]
    assert large.hold_s(t0 + 0.01, has_plain_work=False) is None  # no tables: eager
    assert big.has_unfinished()


def test_a_preset_whose_policy_cannot_load_is_refused_not_fatal() -> None:
    def broken(
        name: str, models: list[str], index: int, args: Mapping[str, float | str]
    ) -> TokenPolicy:
        raise ValueError("the router was trained on another build: run `just routers`")

    books = TokenRouting("w-small", "small", presets("baton"), broken)
    assert books.policies == {}
    reason = books.check_origin("pair")
    assert reason is not None and "just routers" in reason


def test_barrier_holds_the_entry_model_while_a_request_is_away() -> None:
    pair = Pair("barrier")
    pair.submit("a", [3, 4, 5])
    small, engine = pair.books["w-small"], pair.engines["w-small"]
    large = pair.books["w-large"]
    assert small.hold_s(0.0, has_plain_work=False) is None  # nothing away: step
    # Step the entry model alone until it sends `a` away (output position 2).
    sent: list[PeerReq] = []
    while not sent:
        outbox = Outbox()
        for out in small.on_outputs(engine.step(), outbox):
            pair.client[out.request_id].extend(out.new_token_ids)
        small.on_handoffs(engine.pop_handoffs(), engine, outbox)
        sent = [m for m in outbox.peer if isinstance(m, PeerReq)]
    # `b` arrives while `a` is away: it waits for the barrier like the rest of the batch.
    pair.submit("b", list(range(10, 30)))
    assert small.hold_s(0.0, has_plain_work=False) == BARRIER_RECHECK_S
    assert small.hold_s(0.0, has_plain_work=True) is None  # plain work is never held
    # The peer is never held by the barrier; once every request is back, the entry
    # model steps again.
    for msg in sent:
        pair.deliver(msg)
    assert large.hold_s(0.0, has_plain_work=False) is None
    while any(t.parked for t in small.requests.values()):
        pair.step_all()
    assert small.hold_s(0.0, has_plain_work=False) is None
    pair.run(["a", "b"])
    for rid, prompt in {"a": [3, 4, 5], "b": list(range(10, 30))}.items():
        assert pair.client[rid] == reference(prompt, NEW_TOKENS)
