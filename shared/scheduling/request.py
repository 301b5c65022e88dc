"""Per-request scheduling state: raw counters, a status, and the KV blocks held.

The scheduler sees only this: no token ids, no tensors. The engine keeps the tokens
next to it; the estimator rebuilds these counters from a snapshot to replay the
schedule: one scheduler, two uses.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted (holds no KV)
    RUNNING = "running"  # admitted: holds KV blocks, scheduled every step
    PENDING = "pending"  # token-level routing: a peer writes; KV kept, not scheduled
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class SchedRequest:
    """Counters of one request.

    Invariants: 0 <= num_computed_tokens <= num_tokens; a RUNNING request holds
    enough blocks for num_computed_tokens; a WAITING one holds none.
    """

    request_id: str
    num_prompt_tokens: int
    max_tokens: int  # new tokens allowed (already capped by the context limit)
    arrival_seq: int  # order of arrival; fairness and preemption use it
    num_output_tokens: int = 0
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    predicted_output_tokens: int | None = None  # estimator hint; the engine ignores it
    # Peer work (a token-routing peer's copy of another worker's request): scheduled
    # before plain requests, since its origin waits on every token it writes.
    is_priority: bool = False

    @property
    def num_tokens(self) -> int:
        """Prompt plus every token sampled so far."""
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while more than the last sampled token is missing from the cache."""
        return self.num_uncomputed_tokens > 1 or self.num_output_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
