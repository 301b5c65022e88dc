"""Token-level routing on one worker: the engine's route hook, hand-offs turned into
PeerReqs, PeerReqs turned back into engine requests. The per-request books are in
tracked.py, the delayed-batching hold in hold.py, the nets for a silent relay in
silence.py.

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

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import torch

from services.worker.engine.outputs import Handoff, RequestOutput, StepOutputs
from services.worker.routing.api import STAY, RouteBatch, TokenPolicy, target_of
from services.worker.routing.chars import CharBoundaries
from services.worker.routing.hold import hold_s
from services.worker.routing.tracked import (
    Outbox,
    PeerError,
    PresetCounters,
    Tracked,
    active_count,
    new_state,
    peer_req,
)
from shared.config import PresetConfig
from shared.logging import get_logger
from shared.messages.batcher import BatchTables
from shared.messages.peer import PeerRelease, PeerReq
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    from services.worker.engine.protocol import RoutableEngine

log = get_logger(component="token-routing")

PolicyFactory = Callable[[str, list[str], int, dict[str, float | str]], TokenPolicy]


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
            state=new_state(request_id, 0, prompt, len(cfg.models), params),
            origin_instance=self.instance_id,
            params=params,
            max_tokens=params.max_tokens,
            seq=list(prompt),
            ready_since_s=time.monotonic(),
        )

    def num_active(self, preset: str) -> int:
        return active_count(self.requests.values(), preset)

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
        self, request_id: str, tracked: Tracked, to: int, rewrites_last: bool, reason: str | None
    ) -> PeerReq:
        num_active = self.num_active(tracked.preset) if tracked.is_origin else tracked.num_active
        std_serving = self.presets[tracked.preset].mode == "std_serving"
        return peer_req(
            request_id,
            tracked,
            self.instance_id,
            std_serving,
            num_active,
            to,
            rewrites_last,
            reason,
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
        new = tracked.policy.receive(tracked.state, msg.suffix[overlap:])
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
        state = new_state(
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
        self.finish_alone(msg.request_id, tracked, time.monotonic(), engine)

    def finish_alone(
        self, rid: str, tracked: Tracked, now_s: float, engine: RoutableEngine
    ) -> None:
        """The origin gives up on its peers: routing off, and a request parked at a
        peer runs here again (later answers are dropped, see on_peer)."""
        tracked.routing_off = True
        if tracked.parked:
            tracked.parked = False
            tracked.ready_since_s = now_s
            engine.resume_request(rid, [])

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
        """None: step now. Else seconds the loop may wait for more requests first
        (hold.py has the rule; plain work is never held)."""
        if has_plain_work:
            return None
        return hold_s(self.requests, self.presets, self.tables, now_s)
