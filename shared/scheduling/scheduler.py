"""The scheduling policy: which requests run in the next iteration, and how many tokens each.

One uniform token budget covers prefill and decode (as in vLLM v1): a request is
scheduled for as many of its uncomputed tokens as the budget allows, so a long
prompt is split across iterations (chunked prefill) and mixed with decodes.

Deterministic and pure (no tensors, no clocks, no I/O): the engine runs it for
real, the estimator replays it on a snapshot, the sim engine runs it on a modeled
clock, and all three see the same batches.

Policy, in order, every iteration:
  1. running requests, oldest first, each takes min(uncomputed, budget left) tokens;
     if its KV cannot grow, the newest running request is preempted (its blocks
     freed, its progress dropped, recomputed later) until it can;
  2. if nothing was preempted, waiting requests in FIFO order (preempted ones at
     the front) are admitted while the running cap, the budget and the KV allow:
     a request is admitted only when blocks for all its tokens are free. The head
     of the queue is never skipped, so no request starves.

Priority requests (`SchedRequest.is_priority`: a token-routing peer's copy of another
worker's request, whose origin waits on every token it writes) go first: they wait
ahead of plain requests, are admitted before step 1 (while a slot and KV for all
their tokens are free), and stand ahead of the plain ones in `running`, so they take
the budget first and plain requests are preempted first. While any priority request
is here (waiting, running or parked between its visits), the plain requests' prefill
chunks take at most `max_chunk_beside_guests` tokens of a step between them (their
decodes are not counted): a visit waits out the step in flight and then its own, and
on a CPU a 512-token chunk made each ~1 s against ~0.15 s at 64
(docs/token-routing.md). Without them the policy is exactly the one above. The
estimator's replay (`services.estimator.sfs.kernel`) follows a snapshot's queues in
their order, so it schedules running priority requests first too; it admits waiting
ones FIFO (peer copies are few and short) and does not model the cap.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec

from shared.scheduling.blocks import BlockManager, blocks_for
from shared.scheduling.lengths import LengthRatios
from shared.scheduling.request import RequestStatus, SchedRequest


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Limits of one engine instance, defined once: the cluster file's
    `[instances.scheduler]`, EngineConfig, SimEngineConfig and every WorkloadSnapshot
    embed this struct, so a replica of the scheduler runs under the very same limits.
    Unknown fields are skipped on decode (a newer worker's snapshot still reads); the
    cluster file's table is checked for them when it is read."""

    max_num_seqs: int = 16  # running requests at most
    max_num_batched_tokens: int = 512  # tokens per iteration (prefill + decode)
    # tokens per KV block. 64 on CPU: decode attention multiplies per cache block, and
    # at 16 the many tiny matmuls cost ~30% more (16 requests, 128-256 tokens of context)
    block_size: int = 64
    num_kv_blocks: int = 128  # KV capacity in blocks (x block_size tokens)
    max_model_len: int = 2048  # prompt + output tokens of one request
    # plain prefill tokens per step while priority requests (token-routing guests) are
    # here, 0: no cap. The guest's origin waits on each of those steps.
    max_chunk_beside_guests: int = 64

    def __post_init__(self) -> None:
        limits = {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "max_model_len": self.max_model_len,
        }
        if bad := [f"{name}={value}" for name, value in limits.items() if value < 1]:
            raise ValueError(f"scheduler limits must be positive, got {', '.join(bad)}")
        if self.max_chunk_beside_guests < 0:
            raise ValueError("max_chunk_beside_guests must be >= 0 (0: no cap)")
        if blocks_for(self.max_model_len, self.block_size) > self.num_kv_blocks:
            raise ValueError(
                f"max_model_len={self.max_model_len} needs more KV than num_kv_blocks="
                f"{self.num_kv_blocks} x block_size={self.block_size} holds"
            )


@dataclass(slots=True)
class ScheduledChunk:
    """num_new_tokens of one request, starting at position start.

    samples and is_decode are fixed when scheduled: the request's counters move on
    at commit, the description of what this iteration computed must not.
    """

    request: SchedRequest
    start: int
    num_new_tokens: int
    samples: bool = False  # reaches the end of the sequence: a token is sampled
    is_decode: bool = False  # one new token after the request already sampled

    @classmethod
    def plan(cls, req: SchedRequest, num_new_tokens: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        return cls(
            req,
            start,
            num_new_tokens,
            samples=start + num_new_tokens == req.num_tokens,
            is_decode=num_new_tokens == 1 and req.num_output_tokens > 0,
        )

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass(slots=True)
class ScheduledBatch:
    """What one iteration computes."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[SchedRequest] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.chunks)

    def __iter__(self) -> Iterator[ScheduledChunk]:
        return iter(self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for c in self.chunks if c.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens


class Scheduler:
    """Owns the waiting queue, the running list and the KV block manager."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.blocks = BlockManager(config.num_kv_blocks, config.block_size)
        self.waiting: deque[SchedRequest] = deque()
        # priority requests first, each kind oldest first (admission order): scheduling
        # walks it from the front, preemption takes from the back
        self.running: list[SchedRequest] = []
        self.pending: dict[str, SchedRequest] = {}
        self.requests: dict[str, SchedRequest] = {}
        self.length_ratios = LengthRatios()  # actual / predicted output, finished requests
        self._next_arrival = 0
        self._num_priority = 0  # priority requests in `requests`

    # ---- lifecycle -------------------------------------------------------------

    def add(
        self,
        request_id: str,
        num_prompt_tokens: int,
        max_tokens: int,
        predicted_output_tokens: int | None = None,
        *,
        priority: bool = False,
    ) -> SchedRequest:
        """Queue a new request; caller validated lengths against max_model_len.

        predicted_output_tokens is the router's guess, carried into snapshots for
        the estimator's replay; the policy itself never reads it. `priority`: peer
        work, queued behind earlier priority requests only (see the module docstring).
        """
        assert request_id not in self.requests, f"duplicate request id {request_id}"
        assert num_prompt_tokens >= 1 and max_tokens >= 1
        assert num_prompt_tokens + max_tokens <= self.config.max_model_len
        req = SchedRequest(request_id, num_prompt_tokens, max_tokens, self._next_arrival)
        req.predicted_output_tokens = predicted_output_tokens
        req.is_priority = priority
        self._next_arrival += 1
        self.requests[request_id] = req
        if priority:
            self._num_priority += 1
            self.waiting.insert(self._num_priority_waiting(), req)
        else:
            self.waiting.append(req)
        return req

    def finish(self, req: SchedRequest, *, completed: bool = False) -> None:
        """Drop req from every queue and free its KV. Idempotent.

        completed: it ended by itself (a stop or its length, not an abort), so its
        output length is recorded against its prediction (`length_ratios`).
        """
        if req.status is RequestStatus.FINISHED:
            return
        if completed:
            self.length_ratios.record(
                req.predicted_output_tokens, req.num_output_tokens, req.max_tokens
            )
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            del self.pending[req.request_id]
        self.blocks.free(req)
        req.status = RequestStatus.FINISHED
        del self.requests[req.request_id]
        self._num_priority -= req.is_priority

    def abort(self, request_id: str) -> SchedRequest | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req)
        return req

    def set_pending(self, request_id: str) -> None:
        """Park a running request while a peer writes; it keeps its KV."""
        req = self.requests[request_id]
        assert req.status is RequestStatus.RUNNING
        self.running.remove(req)
        req.status = RequestStatus.PENDING
        self.pending[request_id] = req

    def resume(self, request_id: str) -> None:
        """Return a pending request to the running list (tokens appended by the caller)."""
        req = self.pending.pop(request_id)
        req.status = RequestStatus.RUNNING
        self._insert_running(req)

    def drop_pending_kv(self, request_id: str) -> None:
        """Free a pending request's KV; on resume it prefills its whole sequence again
        (token routing without pending resume: the std_serving baseline)."""
        req = self.pending[request_id]
        self.blocks.free(req)
        req.num_computed_tokens = 0

    @property
    def num_admitted(self) -> int:
        """Requests holding KV: running plus pending."""
        return len(self.running) + len(self.pending)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- policy ----------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Build the next batch. Mutates KV allocation and queues, not token counters."""
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        # What plain prefill chunks may take of this step (no priority work here: all).
        cap = self.config.max_chunk_beside_guests if self._num_priority else 0
        plain_prefill = cap or budget

        # 0. Priority requests join the running ones first (step 1 plans their chunks).
        while (
            self.waiting
            and self.waiting[0].is_priority
            and self.num_admitted < self.config.max_num_seqs
            and self.blocks.can_grow(self.waiting[0], self.waiting[0].num_tokens)
        ):
            req = self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self._insert_running(req)

        # 1. Running requests in order (priority first, oldest first); preempt the last
        #    when KV runs out (a plain request before any priority one).
        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            is_plain_prefill = not req.is_priority and req.num_uncomputed_tokens > 1
            num_new = min(req.num_uncomputed_tokens, budget)
            if is_plain_prefill:
                num_new = min(num_new, plain_prefill)
            if num_new <= 0:  # fully computed (waits on a pending peer reply), or capped
                idx += 1
                continue
            target = req.num_computed_tokens + num_new
            while not self.blocks.can_grow(req, target):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req preempted itself: nothing newer is left to run
            self.blocks.grow(req, target)
            batch.chunks.append(ScheduledChunk.plan(req, num_new))
            budget -= num_new
            if is_plain_prefill:
                plain_prefill -= num_new
            idx += 1

        # 2. Admit waiting requests, FIFO, unless this step is already under KV pressure.
        if batch.preempted:
            return batch
        # Pending requests hold KV and come back to running: they count against the cap.
        while self.waiting and budget > 0 and self.num_admitted < self.config.max_num_seqs:
            req = self.waiting[0]
            is_plain_prefill = not req.is_priority and req.num_uncomputed_tokens > 1
            if is_plain_prefill and plain_prefill <= 0:
                break  # capped beside priority work: it waits, at the head
            if not self.blocks.can_grow(req, req.num_tokens):
                break  # head-of-line waits for KV: later arrivals never overtake it
            self.waiting.popleft()
            self.blocks.grow(req, req.num_tokens)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_new = min(req.num_uncomputed_tokens, budget)
            if is_plain_prefill:
                num_new = min(num_new, plain_prefill)
                plain_prefill -= num_new
            batch.chunks.append(ScheduledChunk.plan(req, num_new))
            budget -= num_new
        return batch

    def commit(self, batch: ScheduledBatch) -> None:
        """Advance counters after the batch ran: KV computed, one token per sampling chunk.

        The caller then finishes requests that hit a stop condition.
        """
        for chunk in batch.chunks:
            req = chunk.request
            if req.status is not RequestStatus.RUNNING:
                continue  # parked or finished by the caller between schedule and commit
            req.num_computed_tokens = chunk.end
            if chunk.samples:
                req.num_output_tokens += 1

    def _preempt(self, req: SchedRequest) -> None:
        """Recompute-style preemption: drop KV and progress, requeue at the front (a
        plain request behind the waiting priority ones)."""
        self.running.remove(req)
        self.blocks.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        if req.is_priority:
            self.waiting.appendleft(req)
        else:
            self.waiting.insert(self._num_priority_waiting(), req)

    def _insert_running(self, req: SchedRequest) -> None:
        """Into `running` at its place: after the priority requests when it is plain
        (a plain one is admitted newest: appended), among them by arrival when it is one
        (a resumed request, too, by arrival among its kind)."""
        key = (not req.is_priority, req.arrival_seq)
        idx = next(
            (i for i, r in enumerate(self.running) if (not r.is_priority, r.arrival_seq) > key),
            len(self.running),
        )
        self.running.insert(idx, req)

    def _num_priority_waiting(self) -> int:
        """How many waiting requests are priority ones (they are the queue's head)."""
        n = 0
        for r in self.waiting:
            if not r.is_priority:
                break
            n += 1
        return n
