"""A step that raises fails the worker's requests with a 500, not the worker: it frees
their KV and serves on; only an engine failing step after step ends the process.

A real worker (random-tiny) on real NATS and Redis, whose engine's step is made to
raise on the calls a test picks; the test talks to it as a gateway would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any

import pytest

from services.worker.config import WorkerServiceConfig, create_engine
from services.worker.service import MAX_CONSECUTIVE_STEP_FAILURES
from shared.bus import Bus
from shared.config import parse_cluster
from shared.messages.gateway import DeltaBatch, RequestFailed, TokenDelta
from tests.services.worker.hand_gateway import Client, serving
from tests.support.stack import tiny_cluster_text


class FailingSteps:
    """An engine factory whose engine's step raises while `failures_left` > 0: after
    the real step ran (`broken` False: a fault in one batch) or instead of it (`broken`
    True: an engine that cannot step at all)."""

    def __init__(self) -> None:
        self.failures_left = 0
        self.broken = False
        self.engine: Any = None

    def __call__(self, cfg: WorkerServiceConfig) -> Any:
        engine = create_engine(cfg)
        step = engine.step

        def failing_step() -> Any:
            if self.failures_left > 0:
                self.failures_left -= 1
                if self.broken:
                    raise RuntimeError("injected failure: the engine is broken")
                out = step()  # the step ran (state advanced), then something broke
                raise RuntimeError(f"injected failure after a step of {len(out)} outputs")
            return step()

        engine.step = failing_step
        self.engine = engine
        return engine


class Gateway(Client):
    """Plays the gateway: submits over the bus and collects each request's events,
    failures included."""

    def __init__(self, bus: Bus, namespace: str) -> None:
        super().__init__(bus, namespace)
        self.events: dict[str, list[TokenDelta | RequestFailed]] = {}
        self.done: dict[str, asyncio.Event] = {}

    async def on_batch(self, batch: DeltaBatch) -> None:
        for event in batch.events:
            assert isinstance(event, TokenDelta | RequestFailed), event
            self.events[event.request_id].append(event)
            if isinstance(event, RequestFailed) or event.finish_reason is not None:
                self.done[event.request_id].set()

    def track(self, request_id: str) -> None:
        self.events[request_id], self.done[request_id] = [], asyncio.Event()

    async def outcome(self, request_id: str) -> TokenDelta | RequestFailed:
        await asyncio.wait_for(self.done[request_id].wait(), 30)
        return self.events[request_id][-1]


@pytest.fixture
async def failing_worker(nats_url: str, redis_url: str):  # type: ignore[no-untyped-def]
    cluster = parse_cluster(tiny_cluster_text(nats_url, redis_url))
    cfg = WorkerServiceConfig.from_cluster(cluster, "random-tiny", f"fail{uuid.uuid4().hex[:4]}")
    # every step in the thread but the first after an idle wait (as by default)
    cfg = dataclasses.replace(cfg, max_inline_step_ms=0.0)
    steps = FailingSteps()
    async with serving(nats_url, cfg, steps, Gateway) as (worker, task, gateway):
        yield worker, task, steps, gateway


async def test_a_failed_step_fails_its_requests_with_500_and_serving_goes_on(
    failing_worker: Any,
) -> None:
    worker, task, steps, gateway = failing_worker
    # Two requests in flight, then one step raises (mid-answer: both have tokens).
    first = [await gateway.submit(worker, max_tokens=200) for _ in range(2)]
    for rid in first:
        for _ in range(300):
            if gateway.events[rid]:
                break
            await asyncio.sleep(0.01)
    steps.failures_left = 1
    for rid in first:
        failed = await gateway.outcome(rid)
        assert isinstance(failed, RequestFailed), failed
        assert failed.status == 500 and "RuntimeError: injected failure" in failed.message
    assert worker.num_failed_steps == 1 and not task.done()
    # Their KV is freed and the next request is served whole.
    rid = await gateway.submit(worker)
    done = await gateway.outcome(rid)
    assert isinstance(done, TokenDelta) and done.finish_reason == "length"
    for _ in range(200):
        snap = steps.engine.snapshot()
        if not snap.request_ids:
            break
        await asyncio.sleep(0.01)
    assert snap.request_ids == [] and snap.num_free_blocks == snap.scheduler.num_kv_blocks
    assert not task.done()


async def test_an_engine_that_fails_every_step_ends_the_worker(failing_worker: Any) -> None:
    worker, task, steps, gateway = failing_worker
    steps.failures_left, steps.broken = 10**6, True
    rid = await gateway.submit(worker)
    failed = await gateway.outcome(rid)
    assert isinstance(failed, RequestFailed) and failed.status == 500
    # The aborts' steps fail too: past the limit the error ends run() (the process).
    with pytest.raises(RuntimeError, match="steps in a row failed"):
        await asyncio.wait_for(task, 30)
    assert worker.num_failed_steps == MAX_CONSECUTIVE_STEP_FAILURES


@pytest.mark.parametrize(
    ("status", "kind"),
    [(400, "invalid_request_error"), (500, "server_error"), (503, "service_unavailable")],
)
def test_the_gateway_answers_a_worker_failure_in_openai_terms(status: int, kind: str) -> None:
    from services.gateway.generation import failure

    err = failure(RequestFailed("r", status, "why"))
    assert (err.status, err.type, err.message) == (status, kind, "why")
