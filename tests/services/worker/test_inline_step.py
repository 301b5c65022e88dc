"""The worker runs short steps inline on its event loop, every other step in a thread:
the first step after an idle wait when its prompts are small, and any step after one
that took at most `max_inline_step_ms`.

A real worker on real NATS and Redis; the test talks to it as a gateway would
(SubmitRequest in, DeltaBatch out) and records on which thread each step ran.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from services.worker.config import WorkerServiceConfig, create_engine
from services.worker.service import WorkerService
from shared import subjects
from shared.bus import Bus
from shared.config import ConfigError, parse_cluster
from shared.messages.gateway import DELTA_BATCH_DECODER, DeltaBatch, TokenDelta
from shared.messages.worker import SubmitRequest
from shared.sampling import SamplingParams
from tests.support.stack import tiny_cluster_text

MAX_TOKENS = 4


class StepThreads:
    """An engine factory that records, per step, whether it ran on the event loop's thread."""

    def __init__(self) -> None:
        self.loop_thread = threading.get_ident()
        self.on_loop: list[bool] = []

    def __call__(self, cfg: WorkerServiceConfig) -> Any:
        engine = create_engine(cfg)
        step = engine.step

        def recorded_step() -> Any:
            self.on_loop.append(threading.get_ident() == self.loop_thread)
            return step()

        engine.step = recorded_step
        return engine

    def take(self) -> list[bool]:
        taken, self.on_loop = self.on_loop, []
        return taken


class SlowHandBack(StepThreads):
    """Also holds the event loop for `block_s` whenever a step in the thread ends, as a
    slow hand-off back would: the loop sees the step take that much longer."""

    def __init__(self, block_s: float) -> None:
        super().__init__()
        self.block_s = block_s
        self.loop = asyncio.get_running_loop()

    def __call__(self, cfg: WorkerServiceConfig) -> Any:
        engine = super().__call__(cfg)
        step = engine.step

        def step_then_block_the_loop() -> Any:
            out = step()
            if threading.get_ident() != self.loop_thread:
                # queued ahead of the thread's result: the loop runs it first
                self.loop.call_soon_threadsafe(time.sleep, self.block_s)
            return out

        engine.step = step_then_block_the_loop
        return engine


class Client:
    """Plays the gateway: submits over the bus and collects each request's deltas."""

    def __init__(self, bus: Bus, namespace: str) -> None:
        self.bus = bus
        self.inbox = subjects.gateway_inbox(namespace, f"gw{uuid.uuid4().hex[:6]}")
        self.finished: dict[str, asyncio.Event] = {}

    async def start(self) -> None:
        await self.bus.subscribe(self.inbox, DELTA_BATCH_DECODER, self._on_batch)
        await self.bus.flush()

    async def _on_batch(self, batch: DeltaBatch) -> None:
        for event in batch.events:
            assert isinstance(event, TokenDelta), event
            if event.finish_reason is not None:
                self.finished[event.request_id].set()

    def _track(self, request_id: str) -> None:
        """A request about to be submitted (subclasses keep more of it)."""
        self.finished[request_id] = asyncio.Event()

    async def submit(
        self, worker: WorkerService, num_prompt_tokens: int = 8, max_tokens: int = MAX_TOKENS
    ) -> str:
        """Send the worker a greedy request; return its id."""
        request_id = uuid.uuid4().hex
        self._track(request_id)
        msg = SubmitRequest(
            request_id=request_id,
            prompt_token_ids=list(range(1, num_prompt_tokens + 1)),
            params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            reply_to=self.inbox,
            arrival_time_s=0.0,
        )
        await self.bus.publish(worker.inbox_subject, msg)
        return request_id

    async def generate(
        self, worker: WorkerService, num_prompt_tokens: int, max_tokens: int = MAX_TOKENS
    ) -> None:
        request_id = await self.submit(worker, num_prompt_tokens, max_tokens)
        await asyncio.wait_for(self.finished[request_id].wait(), 30)


@asynccontextmanager
async def running_worker(
    nats_url: str,
    redis_url: str,
    max_inline_step_tokens: int,
    max_inline_step_ms: float = 0.0,
    threads: StepThreads | None = None,
    **settings: Any,
) -> AsyncIterator[tuple[WorkerService, StepThreads, Client]]:
    """A real worker (random-tiny) with the given caps (and other WorkerServiceConfig
    `settings`), and a client on the bus. max_inline_step_ms 0 (the default here): only
    first steps after an idle wait."""
    cluster = parse_cluster(tiny_cluster_text(nats_url, redis_url))
    cfg = dataclasses.replace(
        WorkerServiceConfig.from_cluster(cluster, "random-tiny", "inline"),
        max_inline_step_tokens=max_inline_step_tokens,
        max_inline_step_ms=max_inline_step_ms,
        **settings,
    )
    threads = StepThreads() if threads is None else threads
    worker = WorkerService(cfg, engine_factory=threads)
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(worker.ready.wait(), 120)
    bus = Bus(nats_url, name="test-client")
    await bus.connect()
    client = Client(bus, cluster.namespace)
    await client.start()
    try:
        yield worker, threads, client
    finally:
        await client.bus.close()
        worker.request_stop()
        await asyncio.wait_for(task, 10)


async def test_first_step_after_idle_runs_inline_the_rest_in_a_thread(
    nats_url: str, redis_url: str
) -> None:
    async with running_worker(nats_url, redis_url, 16) as (worker, threads, client):
        # A small prompt on an idle worker: its prefill runs on the loop, its decodes
        # (a busy batch) in the thread.
        await client.generate(worker, 8)
        assert threads.take() == [True] + [False] * (MAX_TOKENS - 1)
        # A prompt over max_inline_step_tokens: every step in the thread.
        await client.generate(worker, 32)
        assert threads.take() == [False] * MAX_TOKENS
        # Idle again: the next small prompt runs its first step inline again.
        await client.generate(worker, 16)
        assert threads.take() == [True] + [False] * (MAX_TOKENS - 1)
        assert worker.num_inline_steps == 2


async def test_steps_after_a_short_step_run_inline(nats_url: str, redis_url: str) -> None:
    # Every step of random-tiny takes under an hour: each one after a step runs inline.
    async with running_worker(nats_url, redis_url, 16, 3.6e6) as (worker, threads, client):
        await client.generate(worker, 8)
        assert threads.take() == [True] * MAX_TOKENS
        # A prompt over max_inline_step_tokens: its prefill in the thread, then the
        # decodes (short steps, no new prompt tokens) inline.
        await client.generate(worker, 32)
        assert threads.take() == [False] + [True] * (MAX_TOKENS - 1)
        assert worker.num_inline_steps == 2 * MAX_TOKENS - 1


async def test_a_slow_hand_back_does_not_count_as_the_steps_time(
    nats_url: str, redis_url: str
) -> None:
    # Each thread step's hand-back holds the loop 300 ms; random-tiny computes a step
    # in a few ms, under the 150 ms cap: after the thread prefill, the decodes run
    # inline (timed with the hand-back, every step would stay in the thread).
    slow = SlowHandBack(0.3)
    async with running_worker(nats_url, redis_url, 16, 150.0, slow) as (worker, threads, client):
        await client.generate(worker, 32)  # prompt over max_inline_step_tokens: a thread
        assert threads.take() == [False] + [True] * (MAX_TOKENS - 1)


async def test_zero_max_inline_step_tokens_runs_every_step_in_a_thread(
    nats_url: str, redis_url: str
) -> None:
    async with running_worker(nats_url, redis_url, 0, 3.6e6) as (worker, threads, client):
        await client.generate(worker, 8)
        assert threads.take() == [False] * MAX_TOKENS
        assert worker.num_inline_steps == 0


def test_the_cluster_file_sets_the_inline_step_caps() -> None:
    text = tiny_cluster_text("nats://127.0.0.1:1", "redis://127.0.0.1:1/0")

    def with_cap(cap: int) -> str:
        return text.replace("[worker]\n", f"[worker]\nmax_inline_step_tokens = {cap}\n", 1)

    cfg = WorkerServiceConfig.from_cluster(parse_cluster(with_cap(0)), "random-tiny", "w")
    assert cfg.max_inline_step_tokens == 0
    with pytest.raises(ConfigError, match="max_inline_step_tokens"):
        parse_cluster(with_cap(-1))
    with_ms = text.replace("[worker]\n", "[worker]\nmax_inline_step_ms = 0.5\n", 1)
    cfg = WorkerServiceConfig.from_cluster(parse_cluster(with_ms), "random-tiny", "w")
    assert cfg.max_inline_step_ms == 0.5
    with pytest.raises(ConfigError, match="max_inline_step_ms"):
        parse_cluster(text.replace("[worker]\n", "[worker]\nmax_inline_step_ms = -1\n", 1))
