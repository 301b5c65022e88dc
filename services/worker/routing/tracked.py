"""One worker's books on a token-level request: what it knows of the sequence, which
prefix each other model holds, who holds the pen, and the PeerReq built from them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.worker.routing.api import RouteState, TokenPolicy
from shared.messages.peer import PeerRelease, PeerReq
from shared.sampling import SamplingParams


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


def new_state(
    request_id: str, index: int, prompt: list[int], num_models: int, params: SamplingParams
) -> RouteState:
    """The route state of a request that model `index` of `num_models` starts."""
    return RouteState(
        request_id=request_id,
        model_index=index,
        num_prompt_tokens=len(prompt),
        tokens_by_model=[0] * num_models,
        temperature=params.temperature,
        draw_key=draw_key(request_id, prompt, params),
    )


def active_count(requests: Iterable[Tracked], preset: str) -> int:
    """N for the B* tables: the preset's live requests whose origin is here, or the
    latest count an origin reported for guests."""
    group = [t for t in requests if t.preset == preset]
    origin = sum(1 for t in group if t.is_origin)
    if origin:
        return origin
    return max((t.num_active for t in group), default=0)


def peer_req(
    request_id: str,
    tracked: Tracked,
    sender_instance: str,
    std_serving: bool,
    num_active: int,
    to: int,
    rewrites_last: bool,
    finish_reason: str | None,
) -> PeerReq:
    """The PeerReq that hands `tracked` to model `to` (or ends it there): it carries
    only the suffix `to` lacks, except in std_serving mode (the whole sequence)."""
    loc = 0 if std_serving else tracked.seen.get(to, 0)
    suffix = tracked.policy.send(tracked.state, tracked.seq[loc:])
    tracked.seen[to] = loc + len(suffix)
    tracked.seq_no += 1
    return PeerReq(
        request_id=request_id,
        preset=tracked.preset,
        origin_instance=tracked.origin_instance,
        sender_instance=sender_instance,
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
        num_active=num_active,
        tokens_by_model=list(tracked.state.tokens_by_model),
    )
