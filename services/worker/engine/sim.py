"""SimEngine: LLMEngine's scheduler and API with the forward replaced by a batch-time model.

    engine = SimEngine.create(SimEngineConfig(clock="virtual"), SFS_H100_QWEN3["qwen3-8b"])
    engine.add_request("r1", prompt_ids, SamplingParams(max_tokens=64), predicted_output_tokens=20)
    while engine.has_unfinished():
        for out in engine.step(): ...
    engine.now()  # virtual seconds: the sum of the modeled batch times

Every iteration runs the very same `Scheduler` as LLMEngine (one scheduler, two
uses); only step 3 differs: instead of a forward pass, the modeled
time T(batch) of the scheduled batch passes, and every chunk that samples gets a
synthetic token. So the batches, the snapshots and the batch samples are what the
real engine would produce if its forward took exactly the modeled time.

Clocks (chosen once, at construction):
  * "wall": the step sleeps until T(batch) has passed since it began (scheduling
    overhead included), so a worker serves at the modeled speed;
  * "virtual": nothing sleeps; the engine's clock jumps by T(batch) per step. For
    tests and cluster-scale experiments on one CPU; `now()` reads it and
    `advance_to(t)` moves an idle engine to the next arrival.
Snapshots and batch samples are stamped with the engine's clock.

Output length of each request (its *target*), fixed when it is added:
  * predicted_output_tokens when given (the router's guess is taken as the truth),
  * else a draw from the configured distribution (`output_len_dist`):
      "fixed"       every request emits round(output_len_mean) tokens;
      "exponential" mean output_len_mean (geometric-like, heavy right tail);
      "lognormal"   mean output_len_mean, sigma output_len_sigma of log(length)
                    (the default: response lengths spanning about a decade),
    rounded, at least 1;
  * always capped by max_tokens; ignore_eos pins it to max_tokens (as benchmarks
    expect from the real engine).
A request that reaches a target below max_tokens emits EOS as its last token and
finishes with "stop"; one that reaches max_tokens finishes with "length"; aborts
with "abort". Every other token is drawn uniformly from [first_token_id,
vocab_size) minus EOS and the request's stop_token_ids, from a per-request RNG
seeded by (seed, request_id): the same id gets the same tokens and length in every
run, whatever the arrival order. Stop strings are never matched (the text is
synthetic). Only the router's prediction, never a drawn length, reaches snapshots.

Thread safety, as LLMEngine: `add_request`, `abort_request`, `has_unfinished`,
`snapshot`, `set_batch_time_model` and `now` may be called from any thread; `step`,
`pop_batch_samples`, `advance_to` and `generate` from one thread only.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import msgspec

from services.worker.engine.frontend import (
    RequestInbox,
    StepRecords,
    generate_all,
    validate_request,
)
from services.worker.engine.outputs import FinishReason, RequestOutput
from shared.sampling import SamplingParams
from shared.scheduling.batch_time import BatchTimeModel
from shared.scheduling.request import SchedRequest
from shared.scheduling.scheduler import Scheduler, SchedulerConfig
from shared.scheduling.snapshot import WorkloadSnapshot, describe_batch, take_snapshot

if TYPE_CHECKING:
    from services.worker.engine.config import EngineConfig

ClockKind = Literal["wall", "virtual"]
OutputLenDist = Literal["fixed", "exponential", "lognormal"]


@dataclass(frozen=True, slots=True)
class SimEngineConfig:
    """Limits (as EngineConfig), clock, synthetic vocabulary and output lengths of one sim instance."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # the limits
    num_batch_samples: int = 4096  # batch samples kept until popped
    clock: ClockKind = "wall"  # wall: sleep the modeled time | virtual: only count it
    start_time_s: float = 0.0  # virtual clock at construction, seconds (ignored by "wall")
    seed: int = 0  # seeds every request's RNG (with its id): lengths and token ids
    vocab_size: int = 49152  # prompt ids must be below; SmolLM2's tokenizer by default
    eos_token_id: int = 2  # the last token of a request that stops (SmolLM2's <|im_end|>)
    first_token_id: int = 17  # synthetic ids are >= this (SmolLM2: 0..16 are special)
    output_len_dist: OutputLenDist = "lognormal"  # lengths of requests without a prediction
    output_len_mean: float = 256.0  # tokens, mean of output_len_dist
    output_len_sigma: float = 0.7  # lognormal only: standard deviation of log(length)

    def __post_init__(self) -> None:
        if self.clock not in ("wall", "virtual"):
            raise ValueError(f"clock must be 'wall' or 'virtual', got {self.clock!r}")
        if self.output_len_dist not in ("fixed", "exponential", "lognormal"):
            raise ValueError(f"unknown output_len_dist {self.output_len_dist!r}")
        if self.output_len_mean < 1 or self.output_len_sigma < 0:
            raise ValueError("output_len_mean must be >= 1 and output_len_sigma >= 0")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError("eos_token_id must be in [0, vocab_size)")
        if not 0 <= self.first_token_id < self.vocab_size - 64:
            raise ValueError("first_token_id must leave at least 64 synthetic ids below vocab_size")

    @classmethod
    def like(cls, engine: EngineConfig, **sim: object) -> SimEngineConfig:
        """The limits of a torch engine's config, plus sim settings given by keyword."""
        return cls(
            scheduler=engine.scheduler,
            num_batch_samples=engine.num_batch_samples,
            **sim,  # type: ignore[arg-type]
        )

    def draw_output_len(self, rng: random.Random) -> int:
        """One output length from output_len_dist (before the max_tokens cap)."""
        mean = self.output_len_mean
        if self.output_len_dist == "fixed":
            n = mean
        elif self.output_len_dist == "exponential":
            n = rng.expovariate(1.0 / mean)
        else:  # lognormal with E[n] = mean
            sigma = self.output_len_sigma
            n = rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)
        return max(1, round(n))


# ---- clocks --------------------------------------------------------------------


class Clock(Protocol):
    """Where the modeled time of a batch goes."""

    def now(self) -> float: ...

    def elapse(self, since_s: float, duration_s: float) -> None:
        """Return once duration_s has passed since now() read since_s."""


class WallClock:
    """time.time(); a batch sleeps out whatever of its modeled time is left."""

    def now(self) -> float:
        return time.time()

    def elapse(self, since_s: float, duration_s: float) -> None:
        remaining = since_s + duration_s - time.time()
        if remaining > 0:
            time.sleep(remaining)


class VirtualClock:
    """A counter of modeled seconds; nothing sleeps."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = start_s

    def now(self) -> float:
        return self._now

    def elapse(self, since_s: float, duration_s: float) -> None:
        self._now = max(self._now, since_s + duration_s)

    def advance_to(self, t_s: float) -> None:
        """Let idle time pass up to t_s (never backwards)."""
        self._now = max(self._now, t_s)


# ---- the engine ----------------------------------------------------------------


@dataclass(slots=True, eq=False)
class SimSequence:
    """Engine-side state of one simulated request: counters, target length and its RNG."""

    sched: SchedRequest
    params: SamplingParams
    target: int  # output tokens this request emits in all
    finish_reason: str  # at the target: STOP (EOS emitted) or LENGTH (max_tokens)
    rng: random.Random
    excluded_ids: frozenset[int]  # never drawn: EOS and the request's stop tokens
    output_ids: list[int] = field(default_factory=list)
    emitted: int = 0  # output tokens already handed out in a RequestOutput


@dataclass(slots=True)
class SimStats:
    """Modeled against measured time over every non-empty step (modeled = what samples say)."""

    num_steps: int = 0
    modeled_s: float = 0.0  # sum of modeled batch times, seconds
    measured_s: float = 0.0  # wall time those steps took, seconds (virtual: overhead only)
    max_overrun_s: float = 0.0  # worst measured - modeled of one step (wall: sleep lag)


class SimEngine(StepRecords):
    """LLMEngine's public API over the real Scheduler, timed by a BatchTimeModel."""

    def __init__(self, config: SimEngineConfig, model: BatchTimeModel) -> None:
        self.config = config
        self.scheduler = Scheduler(config.scheduler)
        self.clock: Clock = (
            VirtualClock(config.start_time_s) if config.clock == "virtual" else WallClock()
        )
        self.vocab_size = config.vocab_size
        self.eos_ids = frozenset({config.eos_token_id})
        self.stats = SimStats()
        self._model = model
        self._seqs: dict[str, SimSequence] = {}
        self._inbox = RequestInbox[SimSequence]()
        self._snapshot_version = 0
        StepRecords.__init__(self, self._take_snapshot(), config.num_batch_samples)

    @classmethod
    def create(cls, config: SimEngineConfig, model: BatchTimeModel) -> SimEngine:
        """Build the engine (nothing to load: the model is the batch-time model)."""
        return cls(config, model)

    # ---- requests (any thread) -------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        predicted_output_tokens: int | None = None,
    ) -> None:
        """Validate and queue a request (as LLMEngine); RequestError says what is wrong.

        predicted_output_tokens, when given, is the request's output length (capped by
        max_tokens) and travels into snapshots; else a length is drawn (module doc).
        """
        validate_request(
            prompt_token_ids, params, self.config.scheduler.max_model_len, self.vocab_size
        )
        n = len(prompt_token_ids)
        seq = self._new_sequence(request_id, n, params, predicted_output_tokens)
        self._inbox.submit(request_id, seq)

    def _new_sequence(
        self, request_id: str, num_prompt_tokens: int, params: SamplingParams, predicted: int | None
    ) -> SimSequence:
        rng = random.Random(f"{self.config.seed}/{request_id}")  # str seeds are stable across runs
        if params.ignore_eos:
            target = params.max_tokens
        else:
            wanted = predicted if predicted is not None else self.config.draw_output_len(rng)
            target = min(max(wanted, 1), params.max_tokens)
        reason = FinishReason.LENGTH if target >= params.max_tokens else FinishReason.STOP
        sched = SchedRequest(request_id, num_prompt_tokens, params.max_tokens, arrival_seq=-1)
        sched.predicted_output_tokens = predicted
        excluded = self.eos_ids | frozenset(params.stop_token_ids)
        return SimSequence(sched, params, target, reason, rng, excluded)

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its KV is freed at the start of the next step."""
        self._inbox.abort(request_id)

    def has_unfinished(self) -> bool:
        return self._inbox.has_live

    def can_progress(self) -> bool:
        """Always: nothing here parks a request (no token-level routing), so every
        unfinished request is scheduled in turn (LLMEngine.can_progress)."""
        return True

    def set_batch_time_model(self, model: BatchTimeModel) -> None:
        """Price the following steps with model (e.g. freshly fitted coefficients)."""
        self._model = model  # one reference swap: the next step reads it once

    @property
    def batch_time_model(self) -> BatchTimeModel:
        return self._model

    # ---- the loop (one thread) ---------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: take inbox, schedule, let the modeled time pass, emit, publish."""
        started_s, t0 = self.clock.now(), time.perf_counter()
        # 1. Take the inbox: new requests join the queue, aborts free their KV now.
        outputs = self._take_inbox()
        # 2. Schedule under the token budget, running cap and KV capacity.
        batch = self.scheduler.schedule()
        if len(batch) > 0:
            # 3. "Forward": the modeled time of this batch passes (slept or counted).
            duration_s = max(0.0, self._model.predict(batch))
            self.clock.elapse(started_s, duration_s)
            # 4. Advance counters; every sampling chunk gets its next synthetic token.
            self.scheduler.commit(batch)
            for chunk in batch:
                if chunk.samples:
                    seq = self._seqs[chunk.request.request_id]
                    outputs.append(self._emit(seq, self._append_token(seq)))
            self._samples.append(describe_batch(batch, self.scheduler, started_s, duration_s))
            self._count(duration_s, time.perf_counter() - t0)
        # 5. Publish the state this iteration left behind.
        self._snapshot_version += 1
        self._snapshot = self._take_snapshot()
        return outputs

    def _take_inbox(self) -> list[RequestOutput]:
        taken = self._inbox.take()
        for seq in taken.new:
            old = seq.sched
            seq.sched = self.scheduler.add(
                old.request_id, old.num_prompt_tokens, old.max_tokens, old.predicted_output_tokens
            )
            self._seqs[old.request_id] = seq
        outputs = []
        for rid in taken.aborts:
            aborted = self._seqs.get(rid)
            if aborted is not None:
                outputs.append(self._emit(aborted, FinishReason.ABORT))
        return outputs

    def _append_token(self, seq: SimSequence) -> str | None:
        """Append the token sampled in this step; the finish reason if it was the last."""
        n = seq.sched.num_output_tokens  # already counts this token (after commit)
        if n >= seq.target:
            last = seq.finish_reason == FinishReason.STOP
            seq.output_ids.append(self.config.eos_token_id if last else self._draw(seq))
            return seq.finish_reason
        seq.output_ids.append(self._draw(seq))
        return None

    def _draw(self, seq: SimSequence) -> int:
        while True:  # rejection: the excluded ids are a handful out of tens of thousands
            token = seq.rng.randrange(self.config.first_token_id, self.vocab_size)
            if token not in seq.excluded_ids:
                return token

    def _emit(self, seq: SimSequence, finish_reason: str | None) -> RequestOutput:
        """Hand out the tokens not yet emitted; finish the request if a reason is given."""
        output = RequestOutput(
            request_id=seq.sched.request_id,
            new_token_ids=seq.output_ids[seq.emitted :],
            new_logprobs=None,  # no distribution to report: the tokens are synthetic
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            num_prompt_tokens=seq.sched.num_prompt_tokens,
            num_output_tokens=len(seq.output_ids),
        )
        seq.emitted = len(seq.output_ids)
        if finish_reason is not None:
            self.scheduler.finish(seq.sched, completed=finish_reason != FinishReason.ABORT)
            del self._seqs[seq.sched.request_id]
            self._inbox.release(seq.sched.request_id)
        return output

    def _count(self, modeled_s: float, measured_s: float) -> None:
        s = self.stats
        s.num_steps += 1
        s.modeled_s += modeled_s
        s.measured_s += measured_s
        s.max_overrun_s = max(s.max_overrun_s, measured_s - modeled_s)

    def _take_snapshot(self) -> WorkloadSnapshot:
        snap = take_snapshot(self.scheduler, self._snapshot_version, self.clock.now())
        return msgspec.structs.replace(
            snap,
            batch_time_features=self._model.feature_set,
            batch_time_coefs=list(self._model.coefs),
        )

    # ---- clock -----------------------------------------------------------------

    def now(self) -> float:
        """The engine's clock, seconds: time.time() ("wall") or modeled time ("virtual")."""
        return self.clock.now()

    def advance_to(self, t_s: float) -> None:
        """Virtual clock only: let idle time pass up to t_s (no-op if already later)."""
        if not isinstance(self.clock, VirtualClock):
            raise RuntimeError("advance_to needs clock='virtual'")
        self.clock.advance_to(t_s)

    # ---- offline use -------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion; returns each prompt's (synthetic) output token ids."""
        return generate_all(self, prompts, params)
