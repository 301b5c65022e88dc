"""What every engine (real or simulated) does the same way at its front door:
validate a request, queue it thread-safely for the loop, publish each step's snapshot
and batch samples, run prompts offline."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from services.worker.engine.outputs import RequestError, RequestOutput, Resume
from shared.sampling import SamplingParams
from shared.scheduling.snapshot import BatchSample, WorkloadSnapshot

T = TypeVar("T")


def validate_request(
    prompt_token_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int
) -> None:
    """Raise RequestError with a message for the client if the request cannot run."""
    try:
        params.validate()
    except ValueError as e:
        raise RequestError(str(e)) from None
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestError("the prompt is empty")
    if n + params.max_tokens > max_model_len:
        raise RequestError(
            f"this model's maximum context length is {max_model_len} tokens; the request asks "
            f"for {n + params.max_tokens} ({n} in the prompt, {params.max_tokens} for the answer)"
        )
    if any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise RequestError(f"prompt token ids must be in [0, {vocab_size})")


@dataclass(slots=True)
class InboxBatch(Generic[T]):
    """Everything queued since the previous step."""

    new: list[T] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    resumes: list[Resume] = field(default_factory=list)


class RequestInbox(Generic[T]):
    """Thread-safe queue between callers (any thread) and the engine loop (one thread).

    Invariant: an id is live from submit until release, so a duplicate can never
    reach the scheduler, whatever the interleaving with the loop.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self._queued = InboxBatch[T]()

    def submit(self, request_id: str, item: T) -> None:
        with self._lock:
            if request_id in self._live:
                raise RequestError(f"duplicate request id {request_id!r}")
            self._live.add(request_id)
            self._queued.new.append(item)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._queued.aborts.append(request_id)

    def resume(self, resume: Resume) -> None:
        with self._lock:
            self._queued.resumes.append(resume)

    def take(self) -> InboxBatch[T]:
        with self._lock:
            taken, self._queued = self._queued, InboxBatch[T]()
        return taken

    def release(self, request_id: str) -> None:
        """The request finished: its id may be used again."""
        with self._lock:
            self._live.discard(request_id)

    @property
    def has_queued(self) -> bool:
        """New requests, aborts or resumes the next step will take."""
        with self._lock:
            q = self._queued
            return bool(q.new or q.aborts or q.resumes)

    @property
    def has_live(self) -> bool:
        """Requests queued or not yet finished, or control messages waiting."""
        with self._lock:
            q = self._queued
            return bool(self._live or q.aborts or q.resumes)


class StepRecords:
    """What an engine publishes of its steps: the snapshot after the latest one (read
    from any thread: the object is replaced, never changed) and the batch samples since
    the last pop (at most `num_samples`, the newest)."""

    def __init__(self, snapshot: WorkloadSnapshot, num_samples: int) -> None:
        self._snapshot = snapshot
        self._samples: deque[BatchSample] = deque(maxlen=num_samples)

    def snapshot(self) -> WorkloadSnapshot:
        """The scheduler state after the latest step (the sim engine's carries its
        batch-time calibration)."""
        return self._snapshot

    def pop_batch_samples(self) -> list[BatchSample]:
        """Samples since the last call (the sim engine's duration_s is modeled time)."""
        samples = list(self._samples)
        self._samples.clear()
        return samples


class SteppedEngine(Protocol):
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None: ...

    def step(self) -> list[RequestOutput]: ...


def generate_all(
    engine: SteppedEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[list[int]]:
    """Run prompts to completion on engine; each prompt's output token ids."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, plist, strict=True):
        engine.add_request(rid, prompt, p)
    results: dict[str, list[int]] = {rid: [] for rid in ids}
    pending = set(ids)
    while pending:
        for out in engine.step():
            if out.request_id in results:
                results[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    pending.discard(out.request_id)
    return [results[rid] for rid in ids]
