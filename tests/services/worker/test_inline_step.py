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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from services.worker.config import WorkerServiceConfig, create_engine
from services.worker.service import WorkerService
from shared.config import ConfigError, parse_cluster
from tests.services.worker.hand_gateway import MAX_TOKENS, Client, serving
from tests.support.stack import tiny_cluster_text


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
    async with serving(nats_url, cfg, threads, Client) as (worker, task, client):
        yield worker, threads, client
    task.result()  # a run() that failed fails the test


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
