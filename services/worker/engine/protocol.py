"""What the worker asks of an engine: the torch `LLMEngine` and the `SimEngine` both
implement `Engine`; token-level routing also needs `RoutableEngine`'s hand-off surface,
which only `LLMEngine` has."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from services.worker.engine.outputs import Handoff, RequestOutput, StepHook
    from shared.model_store import Tokenizer
    from shared.sampling import SamplingParams
    from shared.scheduling.scheduler import Scheduler
    from shared.scheduling.snapshot import BatchSample, WorkloadSnapshot


@runtime_checkable
class Engine(Protocol):
    """One model instance's continuous batching: requests in, one step at a time.

    `add_request` and `abort_request` may be called from any thread; `step` from one
    thread only (the worker's loop, or its step thread)."""

    scheduler: Scheduler

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        predicted_output_tokens: int | None = None,
    ) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def can_progress(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def snapshot(self) -> WorkloadSnapshot: ...

    def pop_batch_samples(self) -> list[BatchSample]: ...


@runtime_checkable
class RoutableEngine(Engine, Protocol):
    """An engine whose requests can be handed to a peer model mid-answer and back."""

    hook: StepHook | None

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        predicted_output_tokens: int | None = None,
        *,
        priority: bool = False,
    ) -> None: ...

    def resume_request(
        self, request_id: str, new_token_ids: list[int], *, finish_reason: str | None = None
    ) -> None: ...

    def drop_parked_kv(self, request_id: str) -> None: ...

    def pop_handoffs(self) -> list[Handoff]: ...

    def tokenizer(self) -> Tokenizer: ...
