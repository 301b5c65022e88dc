"""LLMEngine: continuous batching over one model.

    engine = LLMEngine.create(EngineConfig(model="smollm2-135m"))
    engine.add_request("r1", prompt_ids, SamplingParams(max_tokens=64))
    while engine.has_unfinished():
        for out in engine.step(): ...

`add_request` and `abort_request` may be called from another thread than `step`:
they only validate and queue; each `step` begins by taking that inbox, so the
scheduler is touched by one thread alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.frontend import (
    RequestInbox,
    StepRecords,
    generate_all,
    validate_request,
)
from services.worker.engine.loader import load_model
from services.worker.engine.model import CausalLM
from services.worker.engine.outputs import (
    FinishReason,
    Handoff,
    RequestError,
    RequestOutput,
    Resume,
    StepHook,
    StepOutputs,
)
from services.worker.engine.runner import ModelRunner
from services.worker.engine.sampler import SamplingState, sample
from shared.sampling import SamplingParams
from shared.scheduling.request import SchedRequest
from shared.scheduling.scheduler import Scheduler
from shared.scheduling.snapshot import describe_batch, take_snapshot

if TYPE_CHECKING:
    from shared.model_store import Tokenizer


@dataclass(slots=True, eq=False)
class Sequence:
    """Engine-side state of one request: the scheduler's counters plus tokens."""

    sched: SchedRequest
    token_ids: list[int]
    sampling: SamplingState
    stop_ids: frozenset[int]
    emitted: int = 0  # output tokens already handed out in a RequestOutput
    num_handoffs: int = 0  # times the route hook sent this request to a peer
    new_logprobs: list[float] = field(default_factory=list)
    new_top: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def params(self) -> SamplingParams:
        return self.sampling.params

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.sched.num_prompt_tokens :]


__all__ = ["LLMEngine", "RequestError"]


class LLMEngine(StepRecords):
    def __init__(self, config: EngineConfig, model: CausalLM) -> None:
        self.config = config
        self.model = model
        self.scheduler = Scheduler(config.scheduler)
        self.runner = ModelRunner(
            model, config.scheduler.num_kv_blocks, config.scheduler.block_size
        )
        self.eos_ids = frozenset(model.config.eos_token_ids)
        self.vocab_size = model.config.vocab_size
        self.hook: StepHook | None = None
        self._seqs: dict[str, Sequence] = {}
        self._inbox = RequestInbox[Sequence]()
        self._handoffs: list[Handoff] = []
        # The last step scheduled nothing, and nothing has happened since that could
        # change the next schedule (`can_progress`).
        self._stalled = False
        self._snapshot_version = 0
        StepRecords.__init__(
            self, take_snapshot(self.scheduler, 0, time.time()), config.num_batch_samples
        )
        self._tokenizer: Tokenizer | None = None  # loaded on first use (`tokenizer`)
        self.device = next(model.parameters()).device

    @classmethod
    def create(cls, config: EngineConfig) -> LLMEngine:
        """Load the model named in config (see shared.model_store) and build the engine."""
        torch.set_num_threads(config.threads)
        return cls(config, load_model(config))

    # ---- requests (any thread) -------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        predicted_output_tokens: int | None = None,
        *,
        priority: bool = False,
    ) -> None:
        """Validate and queue a request; RequestError says what is wrong.

        predicted_output_tokens (the router's guess) only travels into snapshots.
        `priority`: scheduled before plain requests (a token-routing peer's copy of
        another worker's request; shared.scheduling.scheduler).
        """
        validate_request(
            prompt_token_ids, params, self.config.scheduler.max_model_len, self.vocab_size
        )
        n = len(prompt_token_ids)
        sched = SchedRequest(request_id, n, params.max_tokens, arrival_seq=-1)
        sched.predicted_output_tokens = predicted_output_tokens
        sched.is_priority = priority
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_ids
        )
        seq = Sequence(
            sched, list(prompt_token_ids), SamplingState.create(params, self.device), stop_ids
        )
        if params.stop:
            self.tokenizer()  # here, not inside a step: keeps steps free of spikes
        self._inbox.submit(request_id, seq)

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its KV is freed at the start of the next step."""
        self._inbox.abort(request_id)

    def resume_request(
        self, request_id: str, new_token_ids: list[int], *, finish_reason: str | None = None
    ) -> None:
        """Bring back a parked request with the tokens a peer wrote (any thread).

        Applied at the start of the next step: the new tokens are appended and
        streamed as this request's output, then the request runs again, prefilling
        only those tokens into its kept KV, unless finish_reason (or a stop condition
        met by the new tokens) ends it.
        """
        self._inbox.resume(Resume(request_id, list(new_token_ids), finish_reason))

    def drop_parked_kv(self, request_id: str) -> None:
        """Free the KV of a parked request (between steps, loop thread only): when it is
        resumed it recomputes its whole sequence, as a brand-new request would."""
        if request_id in self.scheduler.pending:
            self.scheduler.drop_pending_kv(request_id)
            self._stalled = False  # the freed KV may admit a waiting request

    def pop_handoffs(self) -> list[Handoff]:
        """Requests parked by the route hook since the last call."""
        handoffs, self._handoffs = self._handoffs, []
        return handoffs

    def has_unfinished(self) -> bool:
        return self._inbox.has_live

    def can_progress(self) -> bool:
        """Whether a step now could compute anything: a request, abort or resume is
        queued, or some request is running or waiting, unless the last step scheduled
        none of them (every admitted request parked at a peer, the rest waiting for a
        slot or for KV that only those free) and no parked KV was dropped since. False:
        stepping would run empty steps back to back until a peer answers."""
        if self._inbox.has_queued:
            return True
        sched = self.scheduler
        return not self._stalled and bool(sched.running or sched.waiting)

    # ---- the loop (one thread) ---------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: take inbox, schedule, forward, sample, update, publish."""
        t0, wall0 = time.perf_counter(), time.time()
        # 1. Take the inbox: new requests join the queue, aborts free their KV now.
        outputs = self._take_inbox()
        # 2. Schedule under the token budget, running cap and KV capacity.
        batch = self.scheduler.schedule()
        queue_lens = (len(self.scheduler.running), len(self.scheduler.waiting))
        # (a preemption requeues a request the next schedule may admit: not stalled)
        self._stalled = len(batch) == 0 and not batch.preempted
        if len(batch) > 0:
            # 3. Forward and sample the chunks that reach the end of their sequence.
            seqs = {c.request.request_id: self._seqs[c.request.request_id] for c in batch}
            result = self.runner.execute(batch, {rid: s.token_ids for rid, s in seqs.items()})
            states = [seqs[rid].sampling for rid in result.request_ids]
            sampled = sample(result.logits, states)
            destinations = None
            if self.hook is not None and result.request_ids:
                destinations = self.hook(
                    StepOutputs(result.request_ids, sampled.token_ids, result.logits, result.hidden)
                )
            # 4. Append tokens, advance counters, stop what is done.
            for i, rid in enumerate(result.request_ids):
                seq = seqs[rid]
                seq.token_ids.append(sampled.token_ids[i])
                if sampled.logprobs is not None:
                    seq.new_logprobs.append(sampled.logprobs[i])
                    assert sampled.top_logprobs is not None
                    seq.new_top.append(sampled.top_logprobs[i])
            self.scheduler.commit(batch)
            for i, rid in enumerate(result.request_ids):
                seq = seqs[rid]
                dest = destinations[i] if destinations else 0
                if dest < 0:  # the peer rewrites this token: take it back unseen
                    self._unsample(seq)
                    self._park(seq, -dest, rewrites_last=True)
                    continue
                reason = self._stop_reason(seq)
                outputs.append(self._emit(seq, reason))
                if reason is None and dest > 0:
                    self._park(seq, dest, rewrites_last=False)
            self._samples.append(
                describe_batch(batch, self.scheduler, wall0, time.perf_counter() - t0, queue_lens)
            )
        # 5. Publish the state this iteration left behind.
        self._snapshot_version += 1
        self._snapshot = take_snapshot(self.scheduler, self._snapshot_version, time.time())
        return outputs

    def _take_inbox(self) -> list[RequestOutput]:
        taken = self._inbox.take()
        for seq in taken.new:
            rid = seq.sched.request_id
            old = seq.sched
            seq.sched = self.scheduler.add(
                rid,
                old.num_prompt_tokens,
                old.max_tokens,
                old.predicted_output_tokens,
                priority=old.is_priority,
            )
            self._seqs[rid] = seq
        outputs = [out for r in taken.resumes if (out := self._apply_resume(r)) is not None]
        for rid in taken.aborts:
            aborted = self._seqs.get(rid)
            if aborted is not None:
                outputs.append(self._emit(aborted, FinishReason.ABORT))
        return outputs

    def _park(self, seq: Sequence, destination: int, *, rewrites_last: bool) -> None:
        """The hook sent seq to a peer: keep its KV, skip it until it is resumed."""
        self.scheduler.set_pending(seq.sched.request_id)
        seq.num_handoffs += 1
        self._handoffs.append(
            Handoff(
                seq.sched.request_id,
                destination,
                list(seq.token_ids),
                seq.sched.num_prompt_tokens,
                seq.sched.num_output_tokens,
                rewrites_last,
                seq.num_handoffs,
            )
        )

    def _unsample(self, seq: Sequence) -> None:
        """Take back the token sampled this step (never computed, never emitted)."""
        tok = seq.token_ids.pop()
        seq.sched.num_output_tokens -= 1
        counts = seq.sampling.output_counts
        if tok in counts:
            counts[tok] -= 1
            if not counts[tok]:
                del counts[tok]
        if seq.params.logprobs is not None:
            seq.new_logprobs.pop()
            seq.new_top.pop()

    def _apply_resume(self, resume: Resume) -> RequestOutput | None:
        seq = self._seqs.get(resume.request_id)
        if seq is None or seq.sched.request_id not in self.scheduler.pending:
            return None  # finished or aborted meanwhile, or never parked: nothing to resume
        sched = seq.sched
        room = sched.max_tokens - sched.num_output_tokens
        new = resume.new_token_ids[: max(0, room)]
        for tok in new:
            seq.token_ids.append(tok)
            seq.sampling.record(tok)
        sched.num_output_tokens += len(new)
        reason = resume.finish_reason
        if reason is None and new:
            reason = self._stop_reason(seq)
        if reason is None and sched.num_output_tokens >= sched.max_tokens:
            reason = FinishReason.LENGTH
        if reason is None and sched.num_uncomputed_tokens == 0:
            # Resumed with nothing new after handing its last token to a peer to
            # rewrite (the peer failed): recompute the last position to sample again.
            # Its KV slot is rewritten with the same values.
            sched.num_computed_tokens -= 1
        self.scheduler.resume(sched.request_id)
        return self._emit(seq, reason) if new or reason else None

    def _stop_reason(self, seq: Sequence) -> str | None:
        last = seq.token_ids[-1]
        if last in seq.stop_ids:
            return FinishReason.STOP
        if seq.params.stop and self._hits_stop_string(seq):
            return FinishReason.STOP
        if seq.sched.num_output_tokens >= seq.params.max_tokens:
            return FinishReason.LENGTH
        return None

    def _hits_stop_string(self, seq: Sequence) -> bool:
        """Does the text ending in the newest token contain a stop string?

        A match must involve the newest token (older ones were checked before), so a
        window of a few tokens per stop-string character suffices.
        """
        # Byte-level BPE may spend a token per byte, plus a few for merges at the edge.
        window = max(len(s.encode()) for s in seq.params.stop) + 4
        # (no piece of a character at either end: its U+FFFD would match "\ufffd")
        text = self.tokenizer().decode_window(seq.output_ids[-window:])
        return any(s in text for s in seq.params.stop)

    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer, loaded on first use (stop strings, the token-routing
        character guard): one per engine."""
        if self._tokenizer is None:
            from shared.model_store import load_tokenizer

            self._tokenizer = load_tokenizer(self.config.model)
        return self._tokenizer

    def _emit(self, seq: Sequence, finish_reason: str | None) -> RequestOutput:
        """Hand out the tokens not yet emitted; finish the request if a reason is given."""
        out_ids = seq.output_ids
        want_logprobs = seq.params.logprobs is not None
        output = RequestOutput(
            request_id=seq.sched.request_id,
            new_token_ids=out_ids[seq.emitted :],
            new_logprobs=seq.new_logprobs if want_logprobs else None,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            num_prompt_tokens=seq.sched.num_prompt_tokens,
            num_output_tokens=len(out_ids),
            new_top_logprobs=seq.new_top if want_logprobs else None,
        )
        seq.emitted = len(out_ids)
        seq.new_logprobs, seq.new_top = [], []
        if finish_reason is not None:
            self.scheduler.finish(seq.sched, completed=finish_reason != FinishReason.ABORT)
            del self._seqs[seq.sched.request_id]
            self._inbox.release(seq.sched.request_id)
        return output

    # ---- offline use -------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion; returns each prompt's output token ids."""
        return generate_all(self, prompts, params)
