"""A real worker on real NATS and Redis, and the test playing its gateway: submits
over the bus and collects each request's deltas."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from services.worker.config import WorkerServiceConfig
from services.worker.service import WorkerService
from shared import subjects
from shared.bus import Bus
from shared.messages.gateway import DELTA_BATCH_DECODER, DeltaBatch, TokenDelta
from shared.messages.worker import SubmitRequest
from shared.sampling import SamplingParams

MAX_TOKENS = 4


class Client:
    """Plays the gateway: submits over the bus and collects each request's deltas."""

    def __init__(self, bus: Bus, namespace: str) -> None:
        self.bus = bus
        self.inbox = subjects.gateway_inbox(namespace, f"gw{uuid.uuid4().hex[:6]}")
        self.finished: dict[str, asyncio.Event] = {}

    async def start(self) -> None:
        await self.bus.subscribe(self.inbox, DELTA_BATCH_DECODER, self.on_batch)
        await self.bus.flush()

    async def on_batch(self, batch: DeltaBatch) -> None:
        for event in batch.events:
            assert isinstance(event, TokenDelta), event
            if event.finish_reason is not None:
                self.finished[event.request_id].set()

    def track(self, request_id: str) -> None:
        """A request about to be submitted (subclasses keep more of it)."""
        self.finished[request_id] = asyncio.Event()

    async def submit(
        self, worker: WorkerService, num_prompt_tokens: int = 8, max_tokens: int = MAX_TOKENS
    ) -> str:
        """Send the worker a greedy request; return its id."""
        request_id = uuid.uuid4().hex
        self.track(request_id)
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


C = TypeVar("C", bound=Client)


@asynccontextmanager
async def serving(
    nats_url: str,
    cfg: WorkerServiceConfig,
    engine_factory: Callable[[WorkerServiceConfig], Any],
    client_type: Callable[[Bus, str], C],
) -> AsyncIterator[tuple[WorkerService, asyncio.Task[None], C]]:
    """The worker `cfg` describes, running until the block ends (stopped then, unless
    its run() already ended), and a started client of `client_type` on the bus."""
    worker = WorkerService(cfg, engine_factory=engine_factory)
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(worker.ready.wait(), 120)
    bus = Bus(nats_url, name="test-gateway")
    await bus.connect()
    client = client_type(bus, cfg.namespace)
    await client.start()
    try:
        yield worker, task, client
    finally:
        await bus.close()
        if not task.done():
            worker.request_stop()
            await asyncio.wait_for(task, 10)
