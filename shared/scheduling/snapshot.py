"""Workload snapshots and batch-time samples: what an engine publishes about itself.

A snapshot is everything the scheduler knows, as counters (a column each, a row per
request: `WorkloadSnapshot` says why), so that the estimator can rebuild the same
scheduler state (`restore_scheduler`) and replay it forward.
Batch samples are (composition, measured wall time) pairs for fitting the
batch-time model (shared/scheduling/batch_time.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from shared.scheduling.request import RequestStatus, SchedRequest
from shared.scheduling.scheduler import ScheduledBatch, Scheduler, SchedulerConfig


class RequestCounters(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One request as the scheduler sees it: a row of a `WorkloadSnapshot`.

    Not on the wire (the snapshot travels as columns); the row view for readers
    off the decision path and for tests (`WorkloadSnapshot.running` etc., `from_rows`).
    gc=False: only str, int and None fields, so never part of a reference cycle."""

    request_id: str
    arrival_seq: int  # admission/fairness order
    num_prompt_tokens: int  # tokens
    num_output_tokens: int  # tokens sampled so far
    num_computed_tokens: int  # tokens with KV in the cache
    max_tokens: int  # new tokens allowed
    predicted_output_tokens: int | None = None  # estimator hint, tokens
    # KV blocks held; always set in rows read from a snapshot. None in a row given to
    # `WorkloadSnapshot.from_rows`: what the scheduler's allocation holds (see there)
    num_blocks: int | None = None
    is_priority: bool = False  # a token-routing guest (SchedRequest.is_priority)


_COLUMNS = (
    "request_ids",
    "arrival_seqs",
    "prompt_tokens",
    "output_tokens",
    "computed_tokens",
    "max_tokens",
    "predicted_output_tokens",
    "num_blocks",
    "priority",
)


class WorkloadSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """The scheduler state of one instance after an iteration.

    Requests are columns, one row a request, rows in the replay's slot order: the
    `num_running` running ones (admission order, oldest first), then the
    `num_pending` pending ones (parked while a peer writes), then the waiting ones
    (queue order, head first). Columns, not a list of per-request structs, because
    the estimator parses every new snapshot into the same columns (`replay.kernel_state`,
    13 instances per decision in the worst case): reading ~65 structs' attributes
    cost ~8 us per snapshot even compiled, the columns are a few list copies. Rows
    for everything else: `running`, `pending`, `waiting` and `from_rows`.

    Older writers (per-request rows in `running` / `waiting` / `pending` lists) do not
    decode into this struct (no `num_running`, a required field for that reason:
    msgspec skips unknown fields, and with a default such a snapshot would read as an
    idle instance); readers treat an undecodable snapshot as missing. Column lengths
    and counts are checked on construction and decode (`msgspec.ValidationError`).
    """

    version: int  # monotonic per instance
    wall_time_s: float  # time.time() when taken
    scheduler: SchedulerConfig  # the limits the publisher's scheduler runs under
    num_free_blocks: int
    num_running: int  # rows [0, num_running)
    num_pending: int  # rows [num_running, num_running + num_pending); waiting: the rest
    request_ids: list[str] = []
    arrival_seqs: list[int] = []  # admission/fairness order
    prompt_tokens: list[int] = []  # tokens
    output_tokens: list[int] = []  # tokens sampled so far
    computed_tokens: list[int] = []  # tokens with KV in the cache
    max_tokens: list[int] = []  # new tokens allowed
    predicted_output_tokens: list[int] = []  # estimator hint, tokens; -1: none
    num_blocks: list[int] = []  # KV blocks held; 0 for waiting rows
    priority: list[bool] = []  # token-routing guests (scheduled first; the chunk cap)
    batch_time_features: str = ""  # name of the feature set of batch_time_coefs
    batch_time_coefs: list[float] = []  # seconds per feature unit, publisher's calibration
    # measured / modeled time of the latest iterations under batch_time_coefs (an EWMA,
    # shared/scheduling/speed.py); the estimator scales an SFS TTFT estimate T by
    # this ** exp(-T / speed_horizon_s)
    batch_time_speed: float = 1.0
    # quantiles of actual / predicted output length of requests finished here lately
    # (shared.scheduling.lengths), of those predicted below their max_tokens; [] until
    # enough of them had a prediction
    output_length_ratios: list[float] = []
    # the same for requests predicted at or past their max_tokens (the prediction
    # clamped to it)
    output_length_ratios_capped: list[float] = []

    @property
    def carries_calibration(self) -> bool:
        """Whether the publisher priced its batches with a model it names here (the
        batch_time_* fields; batch_time_speed is measured against it)."""
        return bool(self.batch_time_features and self.batch_time_coefs)

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        if not (
            len(self.arrival_seqs)
            == len(self.prompt_tokens)
            == len(self.output_tokens)
            == len(self.computed_tokens)
            == len(self.max_tokens)
            == len(self.predicted_output_tokens)
            == len(self.num_blocks)
            == len(self.priority)
            == n
        ):
            lengths = ", ".join(f"{name} {len(getattr(self, name))}" for name in _COLUMNS)
            raise ValueError(f"snapshot columns of unequal length: {lengths}")
        if self.num_running < 0 or self.num_pending < 0 or self.num_running + self.num_pending > n:
            raise ValueError(
                f"snapshot counts num_running={self.num_running}, "
                f"num_pending={self.num_pending} do not fit its {n} rows"
            )

    @classmethod
    def from_rows(
        cls,
        *,
        running: Iterable[RequestCounters] = (),
        waiting: Iterable[RequestCounters] = (),
        pending: Iterable[RequestCounters] = (),
        **fields: Any,
    ) -> WorkloadSnapshot:
        """A snapshot from per-request rows (tests, tools); `fields` are the others.

        A running or pending row without `num_blocks` gets the blocks the scheduler's
        allocation holds for it: every token of the sequence while it prefills, else
        the computed ones (needs `scheduler`); a waiting row without them holds none.
        """
        run, pend, wait = list(running), list(pending), list(waiting)
        scheduler: SchedulerConfig | None = fields.get("scheduler")
        block_size = scheduler.block_size if scheduler is not None else None
        rows = [*run, *pend, *wait]
        num_held = len(run) + len(pend)
        blocks: list[int] = []
        for i, c in enumerate(rows):
            b = c.num_blocks
            if b is None and i < num_held:
                if block_size is None:
                    raise TypeError("from_rows needs scheduler for a row without num_blocks")
                p, o = c.num_prompt_tokens, c.num_output_tokens
                prefilling = p + o - c.num_computed_tokens > 1 or o == 0
                b = -(-(p + o if prefilling else c.num_computed_tokens) // block_size)
            blocks.append(0 if b is None else b)
        return cls(
            num_running=len(run),
            num_pending=len(pend),
            **_request_columns(rows),
            num_blocks=blocks,
            **fields,
        )

    def _rows(self, start: int, stop: int) -> list[RequestCounters]:
        return [
            RequestCounters(
                self.request_ids[i],
                self.arrival_seqs[i],
                self.prompt_tokens[i],
                self.output_tokens[i],
                self.computed_tokens[i],
                self.max_tokens[i],
                None if (p := self.predicted_output_tokens[i]) < 0 else p,
                self.num_blocks[i],
                self.priority[i],
            )
            for i in range(start, stop)
        ]

    @property
    def running(self) -> list[RequestCounters]:
        """Running rows, admission order (built on each call: not for hot paths)."""
        return self._rows(0, self.num_running)

    @property
    def pending(self) -> list[RequestCounters]:
        """Pending rows (built on each call)."""
        return self._rows(self.num_running, self.num_running + self.num_pending)

    @property
    def waiting(self) -> list[RequestCounters]:
        """Waiting rows, queue order (built on each call)."""
        return self._rows(self.num_running + self.num_pending, len(self.request_ids))

    @property
    def num_waiting(self) -> int:
        return len(self.request_ids) - self.num_running - self.num_pending

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)


class BatchSample(msgspec.Struct, array_like=True, frozen=True):
    """Composition and measured duration of one engine iteration."""

    wall_time_s: float  # time.time() at the start of the iteration
    duration_s: float  # wall time of schedule + forward + sample, seconds
    num_prefill_tokens: int
    num_decode_tokens: int
    chunk_sizes: list[int]  # per scheduled prefill chunk, tokens
    context_lens: list[int]  # per scheduled request, tokens of context after the step
    num_running: int  # running requests after scheduling
    num_waiting: int  # waiting requests after scheduling
    prefill_context_lens: list[
        int
    ] = []  # per prefill chunk (as chunk_sizes), context after the step


def _request_columns(rows: Sequence[SchedRequest | RequestCounters]) -> dict[str, Any]:
    """Every column but `num_blocks` from requests or rows (the same attribute names).

    -1 stands for no prediction, so a (never expected) negative one is stored as 0:
    to OutputPolicy.target and the kernel alike both mean an end at the first token."""
    return {
        "request_ids": [r.request_id for r in rows],
        "arrival_seqs": [r.arrival_seq for r in rows],
        "prompt_tokens": [r.num_prompt_tokens for r in rows],
        "output_tokens": [r.num_output_tokens for r in rows],
        "computed_tokens": [r.num_computed_tokens for r in rows],
        "max_tokens": [r.max_tokens for r in rows],
        "predicted_output_tokens": [
            -1 if (p := r.predicted_output_tokens) is None else max(p, 0) for r in rows
        ],
        "priority": [r.is_priority for r in rows],
    }


def take_snapshot(scheduler: Scheduler, version: int, wall_time_s: float) -> WorkloadSnapshot:
    reqs = [*scheduler.running, *scheduler.pending.values(), *scheduler.waiting]
    return WorkloadSnapshot(
        version=version,
        wall_time_s=wall_time_s,
        scheduler=scheduler.config,
        num_free_blocks=scheduler.blocks.num_free_blocks,
        num_running=len(scheduler.running),
        num_pending=len(scheduler.pending),
        **_request_columns(reqs),
        num_blocks=[len(r.block_ids) for r in reqs],
        output_length_ratios=scheduler.length_ratios.quantiles(),
        output_length_ratios_capped=scheduler.length_ratios.capped_quantiles(),
    )


def with_calibration(
    snapshot: WorkloadSnapshot, feature_set: str, coefs: Sequence[float], speed: float
) -> WorkloadSnapshot:
    """`snapshot` as a worker publishes it under a batch-time calibration: the model it
    is read under (`carries_calibration`) and how fast the latest iterations ran against
    that model (`batch_time_speed`, shared/scheduling/speed.py)."""
    return msgspec.structs.replace(
        snapshot,
        batch_time_features=feature_set,
        batch_time_coefs=list(coefs),
        batch_time_speed=speed,
    )


def describe_batch(
    batch: ScheduledBatch,
    scheduler: Scheduler,
    wall_time_s: float,
    duration_s: float,
    queue_lens: tuple[int, int] | None = None,
) -> BatchSample:
    """queue_lens: (running, waiting) right after scheduling; defaults to the current ones."""
    num_running, num_waiting = queue_lens or (len(scheduler.running), len(scheduler.waiting))
    return BatchSample(
        wall_time_s=wall_time_s,
        duration_s=duration_s,
        num_prefill_tokens=batch.num_prefill_tokens,
        num_decode_tokens=batch.num_decode_tokens,
        chunk_sizes=[c.num_new_tokens for c in batch.chunks if not c.is_decode],
        context_lens=[c.end for c in batch.chunks],
        num_running=num_running,
        num_waiting=num_waiting,
        prefill_context_lens=[c.end for c in batch.chunks if not c.is_decode],
    )


def restore_scheduler(snapshot: WorkloadSnapshot) -> Scheduler:
    """Rebuild a scheduler equal, for scheduling purposes, to the one that was snapshotted.

    Block ids are re-issued (lowest first): the policy depends on block counts only.
    """
    scheduler = Scheduler(snapshot.scheduler)
    s = snapshot
    num_running, num_held = s.num_running, s.num_running + s.num_pending
    for i, rid in enumerate(s.request_ids):
        if i < num_running:
            status = RequestStatus.RUNNING
        elif i < num_held:
            status = RequestStatus.PENDING
        else:
            status = RequestStatus.WAITING
        predicted = s.predicted_output_tokens[i]
        req = SchedRequest(
            rid,
            s.prompt_tokens[i],
            s.max_tokens[i],
            s.arrival_seqs[i],
            num_output_tokens=s.output_tokens[i],
            num_computed_tokens=s.computed_tokens[i],
            status=status,
            predicted_output_tokens=None if predicted < 0 else predicted,
            is_priority=s.priority[i],
        )
        scheduler.requests[rid] = req
        if status is RequestStatus.WAITING:
            scheduler.waiting.append(req)
            continue
        scheduler.blocks.grow(req, s.num_blocks[i] * s.scheduler.block_size)
        if status is RequestStatus.RUNNING:
            scheduler.running.append(req)
        else:
            scheduler.pending[rid] = req
    scheduler._next_arrival = max(s.arrival_seqs, default=-1) + 1
    scheduler._num_priority = sum(s.priority)
    return scheduler
