"""Token-level routing on one worker: the engine's route hook, hand-offs turned into
PeerReqs, PeerReqs turned back into engine requests, and the delayed-batching hold.

Pure mechanism (no I/O): the worker service feeds it the engine's outputs and the
messages the relay delivers, and publishes what it returns. The policies decide;
this module only keeps the books.

Per request this worker tracks the sequence it knows (`seq`), which prefix of it
each other model is known to hold (`seen`: what we sent it or it sent us), and
the tokens written per model. Invariants:
  * only the worker holding the pen writes; every other copy is parked in its
    engine (KV kept, skipped by the scheduler) or, in std_serving mode, freed;
  * a PeerReq carries seq[seen[to]:], so the receiver prefills only what it lacks;
  * the origin (the preset's models[0]) alone streams to the client: the tokens a
    peer wrote reach the client when the origin resumes with them, in order;
  * the request ends on both sides when it ends on either: a peer that finishes
    sends a finished PeerReq, an origin that finishes sends a PeerRelease.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import torch

from services.worker.engine.outputs import Handoff, RequestOutput, StepOutputs
from services.worker.routing.api import STAY, RouteBatch, RouteState, TokenPolicy, target_of
from services.worker.routing.chars import CharBoundaries
from shared.config import PresetConfig
from shared.hold import may_step, wait_left_s
from shared.logging import get_logger
from shared.messages.batcher import BatchTables
from shared.messages.peer import PeerRelease, PeerReq
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    from services.worker.engine.protocol import RoutableEngine

log = get_logger(component="token-routing")

# How long a barrier-held loop sleeps before it looks again when nothing wakes it
# (a peer's answer wakes it at once; this only bounds a missed wake-up).
BARRIER_RECHECK_S = 0.05

PolicyFactory = Callable[[str, list[str], int, dict[str, float | str]], TokenPolicy]


def draw_key(request_id: str, prompt: list[int], params: SamplingParams) -> str:
    """What a policy's seeded draws (ME's writer) are keyed on, the same on every worker
    the request visits: its `seed` when it has one (the same seed, the same draws, as
    for sampling); its prompt when it samples greedily (temperature 0, top_p 0 or top_k
    1: the same prompt, the same answer, as from a single model); else its id (every
    request draws anew)."""
    if params.seed is not None:
        return f"seed:{params.seed}"
    if params.is_greedy:
        digest = hashlib.blake2b(array("q", prompt).tobytes(), digest_size=16).hexdigest()
        return f"prompt:{digest}"
    return request_id


class PeerError(ValueError):
    """A PeerReq this worker cannot apply (unknown request, a gap before its anchor)."""


@dataclass(slots=True)
class Tracked:
    """One request of a token-level preset, as this worker knows it."""

    preset: str
    policy: TokenPolicy
    state: RouteState
    origin_instance: str
    params: SamplingParams
    max_tokens: int  # output tokens at most, whole answer
    seq: list[int]  # the sequence this worker knows: prompt, then output
    seen: dict[int, int] = field(default_factory=dict)  # model index -> tokens of seq it holds
    seq_no: int = 0  # highest PeerReq seq_no sent or received
    echo: int = 0  # tokens resumed into the engine that its next outputs will repeat
    parked: bool = False  # the pen is elsewhere
    parked_at_s: float = 0.0  # monotonic time the pen last left (meaningful while parked)
    ready_since_s: float = 0.0  # monotonic time the request last became ready here
    routing_off: bool = False  # a peer failed: finish alone, never hand off again
    num_active: int = 0  # N the origin last reported (guests) for the B* tables

    @property
    def is_origin(self) -> bool:
        return self.state.model_index == 0

    @property
    def num_output(self) -> int:
        return len(self.seq) - self.state.num_prompt_tokens


@dataclass(slots=True)
class PresetCounters:
    """What this worker saw of one preset since its last RoutingStats report."""

    num_tokens: int = 0  # tokens sampled for the preset's requests (taken-back ones too)
    num_handoffs: int = 0  # hand-offs sent to a peer
    num_taken_back: int = 0  # hand-offs whose sampled token the peer rewrites
    step_batch_sizes: list[int] = field(default_factory=list)  # rows of each step with its requests
    step_seconds: list[float] = field(default_factory=list)  # seconds each of those steps took


@dataclass(slots=True)
class Outbox:
    """What the service must publish after a call."""

    peer: list[PeerReq | PeerRelease] = field(default_factory=list)


class TokenRouting:
    """The routing books of one worker (one engine) across its token-level presets."""

    def __init__(
        self,
        instance_id: str,
        model: str,
        presets: dict[str, PresetConfig],
        make_policy: PolicyFactory,
        chars: CharBoundaries | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.model = model
        self.presets = presets
        # The vocabulary's character boundaries: a hand-off that would split a
        # character waits for its end (chars.py); None: never deferred.
        self.chars = chars
        self.num_deferred = 0  # hand-offs deferred to a character's end
        # One policy object per preset this model takes part in, built up front so a
        # bad preset fails the worker at start, not at the first request.
        self.policies: dict[str, TokenPolicy] = {}
        # Presets whose policy cannot run here (e.g. a router trained on another build
        # of the model): the worker serves everything else and answers these with the
        # reason instead of dying.
        self.unavailable: dict[str, str] = {}
        for name, preset in presets.items():
            if model in preset.models and preset.token_policy is not None:
                index = preset.models.index(model)
                try:
                    self.policies[name] = make_policy(
                        preset.token_policy, list(preset.models), index, dict(preset.args)
                    )
                except (ValueError, OSError) as exc:
                    self.unavailable[name] = str(exc)
                    log.error("token_preset_unavailable", preset=name, error=str(exc))
        self.requests: dict[str, Tracked] = {}
        self.tables: dict[str, BatchTables] = {}
        self.num_handoffs = 0
        self.num_peer_failures = 0
        self.counters: dict[str, PresetCounters] = {n: PresetCounters() for n in self.policies}
        self.step_presets: set[str] = set()  # presets with rows in the last forward
        self.step_rows = 0  # rows of the last forward
        # Output tokens per real model of origin requests that ended, for the final delta.
        self.final_counts: dict[str, dict[str, int]] = {}

    # -- requests entering at this worker (the origin) ------------------------------

    def check_origin(self, preset: str) -> str | None:
        """None if requests of `preset` may enter here, else the reason they may not."""
        cfg = self.presets.get(preset)
        if cfg is None or cfg.token_policy is None:
            return f"unknown token-level preset {preset!r}"
        if preset in self.unavailable:
            return f"preset {preset!r} is unavailable: {self.unavailable[preset]}"
        if cfg.models[0] != self.model:
            return f"preset {preset!r} enters on {cfg.models[0]!r}, not on {self.model!r}"
        if preset not in self.policies:
            return f"preset {preset!r} has no policy on this worker"
        return None

    def add_origin(
        self, request_id: str, preset: str, prompt: list[int], params: SamplingParams
    ) -> None:
        """A client request of `preset` entered here (after the engine accepted it)."""
        cfg = self.presets[preset]
        self.requests[request_id] = Tracked(
            preset=preset,
            policy=self.policies[preset],
            state=self._state(request_id, 0, prompt, len(cfg.models), params),
            origin_instance=self.instance_id,
            params=params,
            max_tokens=params.max_tokens,
            seq=list(prompt),
            ready_since_s=time.monotonic(),
        )

    def _state(
        self,
        request_id: str,
        index: int,
        prompt: list[int],
        num_models: int,
        params: SamplingParams,
    ) -> RouteState:
        return RouteState(
            request_id=request_id,
            model_index=index,
            num_prompt_tokens=len(prompt),
            tokens_by_model=[0] * num_models,
            temperature=params.temperature,
            draw_key=draw_key(request_id, prompt, params),
        )

    def num_active(self, preset: str) -> int:
        """N for the tables: the preset's live requests whose origin is here, or the
        latest count an origin reported for guests."""
        origin = sum(1 for t in self.requests.values() if t.preset == preset and t.is_origin)
        if origin:
            return origin
        return max((t.num_active for t in self.requests.values() if t.preset == preset), default=0)

    # -- the engine hook ----------------------------------------------------------

    def hook(self, outputs: StepOutputs) -> list[int] | None:
        """Called by the engine after every forward that sampled: one destination per row."""
        out = outputs
        groups: dict[str, list[int]] = {}
        for row, rid in enumerate(out.request_ids):
            tracked = self.requests.get(rid)
            if tracked is not None:
                groups.setdefault(tracked.preset, []).append(row)
        self.step_presets, self.step_rows = set(groups), len(out.request_ids)
        if not groups:
            return None
        dests = [STAY] * len(out.request_ids)
        for preset, rows in groups.items():
            policy = self.policies[preset]
            counters = self.counters[preset]
            counters.num_tokens += len(rows)
            states = []
            for row in rows:
                t = self.requests[out.request_ids[row]]
                t.state.num_output_tokens = t.num_output + 1  # the token sampled now
                t.state.run_length += 1
                t.state.tokens_by_model[t.state.model_index] += 1
                states.append(t.state)
            index = torch.tensor(rows, dtype=torch.long, device=out.logits.device)
            batch = RouteBatch(
                states,
                torch.tensor([out.token_ids[r] for r in rows], dtype=torch.long),
                out.logits.index_select(0, index),
                out.hidden.index_select(0, index),
            )
            chosen = policy.route(batch)
            num_models = len(self.presets[preset].models)
            for row, state, dest in zip(rows, states, chosen, strict=True):
                tracked = self.requests[state.request_id]
                if dest != STAY and not tracked.routing_off:
                    target, rewrites = target_of(dest)
                    if 0 <= target < num_models and target != state.model_index:
                        if self.chars is not None and self.chars.splits_char(
                            tracked.seq, out.token_ids[row], bool(rewrites)
                        ):
                            self.num_deferred += 1  # the policy asks again next token
                            continue
                        dests[row] = dest
                        counters.num_handoffs += 1
                        counters.num_taken_back += rewrites
                        if rewrites:  # the token is taken back: it was not written here
                            state.tokens_by_model[state.model_index] -= 1
                            state.num_output_tokens -= 1
                            state.run_length -= 1
        return dests

    # -- after a step --------------------------------------------------------------

    def on_outputs(self, outputs: list[RequestOutput], outbox: Outbox) -> list[RequestOutput]:
        """Update the books from the engine's outputs; returns the outputs the client sees
        (the origin's; a guest's outputs go back to the origin instead)."""
        client: list[RequestOutput] = []
        for out in outputs:
            tracked = self.requests.get(out.request_id)
            if tracked is None:
                client.append(out)
                continue
            new = out.new_token_ids
            skip = min(tracked.echo, len(new))  # resumed tokens the engine repeats
            tracked.echo -= skip
            tracked.seq.extend(new[skip:])
            if tracked.is_origin:
                client.append(out)
            if out.finished:
                self._finish(out.request_id, tracked, out.finish_reason, outbox)
        return client

    def _finish(
        self, request_id: str, tracked: Tracked, reason: str | None, outbox: Outbox
    ) -> None:
        del self.requests[request_id]
        log.debug(
            "routed_request_ended", request_id=request_id, reason=reason, origin=tracked.is_origin
        )
        if tracked.is_origin:
            models = self.presets[tracked.preset].models
            self.final_counts[request_id] = {
                m: n for m, n in zip(models, tracked.state.tokens_by_model, strict=True)
            }
            if tracked.seen:  # some peer holds a copy: free it
                outbox.peer.append(
                    PeerRelease(
                        request_id=request_id,
                        preset=tracked.preset,
                        origin_instance=tracked.origin_instance,
                    )
                )
        elif reason in ("stop", "length"):
            # The answer ended while this peer held the pen: the origin ends it too.
            outbox.peer.append(self._peer_req(request_id, tracked, 0, False, reason))

    def on_handoffs(self, handoffs: list[Handoff], engine: RoutableEngine, outbox: Outbox) -> None:
        """Turn the requests the hook parked into PeerReqs (between steps)."""
        for h in handoffs:
            tracked = self.requests.get(h.request_id)
            if tracked is None:  # not ours (cannot happen: the hook only routes tracked rows)
                continue
            tracked.seq = list(h.token_ids)
            tracked.echo = 0
            tracked.parked = True
            tracked.parked_at_s = time.monotonic()
            tracked.state.run_length = 0
            self.num_handoffs += 1
            if self.presets[tracked.preset].mode == "std_serving":
                # No pending resume: the parked copy keeps no KV and recomputes its
                # whole sequence when the pen comes back, like a new request.
                engine.drop_parked_kv(h.request_id)
            outbox.peer.append(
                self._peer_req(h.request_id, tracked, h.destination - 1, h.rewrites_last, None)
            )

    def _peer_req(
        self,
        request_id: str,
        tracked: Tracked,
        to: int,
        rewrites_last: bool,
        finish_reason: str | None,
    ) -> PeerReq:
        mode = self.presets[tracked.preset].mode
        loc = 0 if mode == "std_serving" else tracked.seen.get(to, 0)
        suffix = tracked.policy.send(tracked.state, tracked.seq[loc:])
        tracked.seen[to] = loc + len(suffix)
        tracked.seq_no += 1
        return PeerReq(
            request_id=request_id,
            preset=tracked.preset,
            origin_instance=tracked.origin_instance,
            sender_instance=self.instance_id,
            from_model=tracked.state.model_index,
            to_model=to,
            loc=loc,
            suffix=suffix,
            num_prompt_tokens=tracked.state.num_prompt_tokens,
            max_tokens=tracked.max_tokens,
            params=tracked.params,
            seq_no=tracked.seq_no,
            rewrites_last=rewrites_last,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            num_active=self.num_active(tracked.preset) if tracked.is_origin else tracked.num_active,
            tokens_by_model=list(tracked.state.tokens_by_model),
        )

    # -- messages from the relay -----------------------------------------------------

    def on_peer(self, msg: PeerReq, engine: RoutableEngine, outbox: Outbox) -> None:
        """Apply a PeerReq: start or resume this worker's copy, or finish the origin's.

        Raises PeerError when the message cannot be applied; the caller answers
        the sender with a failed hand-back.
        """
        tracked = self.requests.get(msg.request_id)
        if msg.failed is not None:
            self._on_failed(msg, tracked, engine)
            return
        if tracked is None:
            if msg.origin_instance == self.instance_id:
                # A peer's late answer for a request that already ended here (the
                # client went away): its copy was released with the request.
                log.debug("late_peer_answer", request_id=msg.request_id)
                return
            self._start_guest(msg, engine)
            return
        if tracked.is_origin and tracked.routing_off and not tracked.parked:
            # The origin gave up on its peers (a failed hand-back, or no answer within
            # origin_wait_s) and writes alone: a late answer must not splice in.
            log.info("late_peer_answer_dropped", request_id=msg.request_id)
            return
        if msg.seq_no <= tracked.seq_no:
            raise PeerError(f"stale PeerReq seq_no {msg.seq_no} <= {tracked.seq_no}")
        tracked.seq_no = msg.seq_no
        known = len(tracked.seq)
        if msg.loc > known:
            raise PeerError(f"anchor {msg.loc} beyond the {known} tokens held here")
        overlap = known - msg.loc
        if tracked.seq[msg.loc :] != msg.suffix[:overlap]:
            raise PeerError("the suffix disagrees with the tokens held here")
        new = self._accepted(tracked, msg.suffix[overlap:])
        tracked.seq.extend(new)
        tracked.seen[msg.from_model] = len(tracked.seq)
        tracked.state.tokens_by_model = list(msg.tokens_by_model) or tracked.state.tokens_by_model
        tracked.num_active = msg.num_active
        tracked.parked = False
        tracked.ready_since_s = time.monotonic()
        if msg.finished:
            # Ends here: the engine streams `new` and finishes (the origin releases peers).
            tracked.echo += len(new)
            engine.resume_request(msg.request_id, new, finish_reason=msg.finish_reason)
            return
        tracked.echo += len(new)
        engine.resume_request(msg.request_id, new)

    def _accepted(self, tracked: Tracked, tokens: list[int]) -> list[int]:
        return tracked.policy.receive(tracked.state, tokens)

    def _start_guest(self, msg: PeerReq, engine: RoutableEngine) -> None:
        """First visit of a request to this worker: its whole sequence is the prompt."""
        if msg.loc != 0:
            raise PeerError(f"unknown request {msg.request_id} with anchor {msg.loc} > 0")
        if msg.finished:
            raise PeerError(f"finished PeerReq for unknown request {msg.request_id}")
        cfg = self.presets.get(msg.preset)
        policy = self.policies.get(msg.preset)
        if cfg is None or policy is None or msg.to_model >= len(cfg.models):
            raise PeerError(f"preset {msg.preset!r} has no policy on this worker")
        if cfg.models[msg.to_model] != self.model:
            raise PeerError(f"PeerReq for model {msg.to_model} reached {self.model!r}")
        seq = list(msg.suffix)
        num_output = len(seq) - msg.num_prompt_tokens
        room = msg.max_tokens - num_output
        if room < 1:
            raise PeerError(f"request {msg.request_id} has no output tokens left")
        state = self._state(
            msg.request_id, msg.to_model, seq[: msg.num_prompt_tokens], len(cfg.models), msg.params
        )
        state.tokens_by_model = list(msg.tokens_by_model) or state.tokens_by_model
        state.num_output_tokens = num_output
        # The guest's engine request sees the whole sequence as its prompt and may
        # write what is left of the client's budget. It goes before this worker's
        # plain requests: its origin waits on every token it writes, and behind long
        # prompts it would wait out the relay's peer timeout (then the origin writes
        # alone).
        params = msgspec.structs.replace(msg.params, max_tokens=room)
        engine.add_request(msg.request_id, seq, params, priority=True)
        self.requests[msg.request_id] = Tracked(
            preset=msg.preset,
            policy=policy,
            state=state,
            origin_instance=msg.origin_instance,
            params=msg.params,
            max_tokens=msg.max_tokens,
            seq=seq,
            seen={msg.from_model: len(seq)},
            seq_no=msg.seq_no,
            ready_since_s=time.monotonic(),
            num_active=msg.num_active,
        )

    def _on_failed(self, msg: PeerReq, tracked: Tracked | None, engine: RoutableEngine) -> None:
        """The relay says the peer is gone: the origin finishes alone; a guest gives up."""
        self.num_peer_failures += 1
        if tracked is None:
            return
        log.warning("peer_failed", request_id=msg.request_id, reason=msg.failed)
        if not tracked.is_origin:
            engine.abort_request(msg.request_id)
            del self.requests[msg.request_id]
            return
        self._finish_alone(msg.request_id, tracked, time.monotonic(), engine)

    def _finish_alone(self, rid: str, tracked: Tracked, now_s: float, engine: RoutableEngine) -> None:
        """The origin gives up on its peers: routing off, and a request parked at a
        peer runs here again (later answers are dropped, see on_peer)."""
        tracked.routing_off = True
        if tracked.parked:
            tracked.parked = False
            tracked.ready_since_s = now_s
            engine.resume_request(rid, [])

    # -- safety nets for a relay that is itself gone ----------------------------------
    # The relay bounds every hand-off with its peer timeout, but a relay that died or
    # restarted answers nothing. The worker service asks it (PeerQuery) about origin
    # requests away longer than `origin_wait_s` and settles them with its answer.

    def overdue_origins(self, now_s: float, origin_wait_s: float) -> dict[str, float]:
        """Origin requests away at a peer for longer than `origin_wait_s`, each with the
        time its hand-off left (which names the hand-off asked about)."""
        return {
            rid: t.parked_at_s
            for rid, t in self.requests.items()
            if t.parked and t.is_origin and now_s - t.parked_at_s > origin_wait_s
        }

    def settle_overdue(
        self,
        asked: dict[str, float],
        pending: set[str],
        now_s: float,
        engine: RoutableEngine,
        outbox: Outbox,
    ) -> None:
        """Apply the relay's answer about overdue requests (`asked`: overdue_origins at
        the time of asking; `pending`: those the relay is still timing, an empty set
        when it did not answer). A pending one waits another origin_wait_s; any other
        one still away on the same hand-off comes back: the origin finishes it alone,
        as after a failed hand-back, and releases the peers' copies (if a relay carries
        the release). Requests that came back meanwhile, or left again on a newer
        hand-off, are left alone."""
        for rid, left_at_s in asked.items():
            tracked = self.requests.get(rid)
            if tracked is None or not tracked.parked or not tracked.is_origin:
                continue
            if tracked.parked_at_s != left_at_s:  # back and away again since we asked
                continue
            if rid in pending:
                tracked.parked_at_s = now_s
                continue
            log.warning(
                "peer_silent", request_id=rid, waited_s=round(now_s - tracked.parked_at_s, 1)
            )
            self.num_peer_failures += 1
            self._finish_alone(rid, tracked, now_s, engine)
            outbox.peer.append(
                PeerRelease(request_id=rid, preset=tracked.preset, origin_instance=self.instance_id)
            )

    def expire_guests(self, now_s: float, guest_idle_s: float, engine: RoutableEngine) -> None:
        """Drop peer copies no visit has touched for `guest_idle_s` (their origin's release
        may have been lost with the relay): the KV is freed, and a later visit for
        such a copy fails back to the origin (unknown request with an anchor > 0),
        which then finishes alone."""
        for rid, tracked in list(self.requests.items()):
            if (
                tracked.parked
                and not tracked.is_origin
                and now_s - tracked.parked_at_s > guest_idle_s
            ):
                log.info(
                    "guest_copy_expired",
                    request_id=rid,
                    idle_s=round(now_s - tracked.parked_at_s, 1),
                )
                engine.abort_request(rid)
                del self.requests[rid]

    def on_release(self, msg: PeerRelease, engine: RoutableEngine) -> None:
        """The origin ended the request: free this worker's copy."""
        if self.requests.pop(msg.request_id, None) is not None:
            engine.abort_request(msg.request_id)

    def forget(self, request_id: str, outbox: Outbox) -> None:
        """The request was aborted or failed here (client gone): release the peers."""
        tracked = self.requests.pop(request_id, None)
        if tracked is not None and tracked.is_origin and tracked.seen:
            outbox.peer.append(
                PeerRelease(
                    request_id=request_id, preset=tracked.preset, origin_instance=self.instance_id
                )
            )

    def record_step(self, seconds: float) -> None:
        """The last forward took `seconds`: a step sample for each preset it served."""
        for preset in self.step_presets:
            counters = self.counters[preset]
            counters.step_batch_sizes.append(self.step_rows)
            counters.step_seconds.append(seconds)
        self.step_presets = set()

    def pop_counters(self, preset: str) -> PresetCounters:
        counters, self.counters[preset] = self.counters[preset], PresetCounters()
        return counters

    # -- delayed batching ------------------------------------------------------------

    def hold_s(self, now_s: float, has_plain_work: bool) -> float | None:
        """None: step now. Else seconds the loop may wait for more requests first.

        Holds only when every request ready here belongs to a preset that holds:
        `baton` whose B*(N) is not reached (shared/hold.py has the rule),
        or `barrier` with one of its requests away at a peer. Plain requests are
        never held (a step they force carries the held presets' ready rows too).
        """
        if has_plain_work:
            return None
        ready: dict[str, list[Tracked]] = {}
        away: set[str] = set()  # barrier presets with an origin request at a peer
        for t in self.requests.values():
            if not t.parked:
                ready.setdefault(t.preset, []).append(t)
            elif t.is_origin:
                away.add(t.preset)
        wait: float | None = None
        for preset, group in ready.items():
            mode = self.presets[preset].mode
            if mode == "barrier" and group[0].is_origin:
                if preset not in away:
                    return None
                # Step barrier: the entry model waits for every request it sent
                # away, as one lockstep batch would; the peer's answer (or the
                # relay's failed hand-back) wakes the loop. No timeout of our own:
                # the relay's peer timeout bounds the wait.
                wait = BARRIER_RECHECK_S if wait is None else min(wait, BARRIER_RECHECK_S)
                continue
            tables = self.tables.get(preset)
            if tables is None or mode != "baton":
                return None
            index = group[0].state.model_index
            num_active = self.num_active(preset)
            hold = tables.b_for(index, num_active)
            timeout_s = tables.hold_timeout_ms / 1000.0
            oldest = now_s - min(t.ready_since_s for t in group)
            if may_step(len(group), num_active, hold, oldest, timeout_s):
                return None
            left = wait_left_s(len(group), oldest, timeout_s)
            if left is not None:
                wait = left if wait is None else min(wait, left)
        return wait
