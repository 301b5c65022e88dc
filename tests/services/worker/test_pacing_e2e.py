"""A real worker (random-tiny, real NATS and Redis) writes its gateway a request's
tokens through the stream interval: the first token alone and at once, the tokens of
the steps after it held and sent with the answer's end, nothing lost or reordered; with
the interval 0, one batch per step."""

from __future__ import annotations

import asyncio

import pytest

from services.worker.config import WorkerServiceConfig
from shared.bus import Bus
from shared.config import ConfigError, parse_cluster
from shared.messages.gateway import DeltaBatch, TokenDelta
from tests.services.worker.hand_gateway import Client
from tests.services.worker.test_inline_step import running_worker
from tests.support.stack import tiny_cluster_text

MAX_TOKENS = 6


class BatchRecorder(Client):
    """The test's gateway: keeps every DeltaBatch as it came."""

    def __init__(self, bus: Bus, namespace: str) -> None:
        super().__init__(bus, namespace)
        self.batches: list[DeltaBatch] = []

    async def on_batch(self, batch: DeltaBatch) -> None:
        self.batches.append(batch)
        await super().on_batch(batch)


async def run_requests(
    nats_url: str, redis_url: str, interval_s: float, max_tokens: list[int]
) -> tuple[list[DeltaBatch], list[str]]:
    """Submit requests of these lengths together; return the batches and their ids."""
    async with running_worker(nats_url, redis_url, 16, 3.6e6, stream_interval_s=interval_s) as (
        worker,
        _,
        client,
    ):
        recorder = BatchRecorder(client.bus, worker.cfg.namespace)
        await recorder.start()
        ids = [await recorder.submit(worker, max_tokens=n) for n in max_tokens]
        for rid in ids:
            await asyncio.wait_for(recorder.finished[rid].wait(), 30)
        return recorder.batches, ids


def deltas_of(batches: list[DeltaBatch], request_id: str) -> list[list[TokenDelta]]:
    """Per batch that holds any, the request's deltas in it."""
    per_batch = [
        [e for e in b.events if isinstance(e, TokenDelta) and e.request_id == request_id]
        for b in batches
    ]
    return [d for d in per_batch if d]


def tokens_in_order(deltas: list[list[TokenDelta]]) -> list[int]:
    flat = [d for batch in deltas for d in batch]
    assert [d.position for d in flat] == list(range(len(flat)))  # nothing lost or reordered
    return [t for d in flat for t in d.token_ids]


async def test_held_tokens_go_with_the_answers_end(nats_url: str, redis_url: str) -> None:
    # A second-long interval: only what a client waits on sends anything.
    batches, [rid] = await run_requests(nats_url, redis_url, 1.0, [MAX_TOKENS])
    paced = deltas_of(batches, rid)
    assert [[d.position for d in b] for b in paced] == [[0], list(range(1, MAX_TOKENS))]
    assert paced[-1][-1].finish_reason == "length"
    # Interval 0: a batch per step, the same tokens.
    batches, [rid] = await run_requests(nats_url, redis_url, 0.0, [MAX_TOKENS])
    each = deltas_of(batches, rid)
    assert [[d.position for d in b] for b in each] == [[p] for p in range(MAX_TOKENS)]
    assert tokens_in_order(paced) == tokens_in_order(each)


async def test_a_request_ending_sends_the_others_held_tokens(nats_url: str, redis_url: str) -> None:
    batches, (short, long) = await run_requests(nats_url, redis_url, 1.0, [3, MAX_TOKENS])
    for rid, n in ((short, 3), (long, MAX_TOKENS)):
        assert len(tokens_in_order(deltas_of(batches, rid))) == n
    # The long answer went in three batches: its first token, what was held of it when
    # the short one ended (in that batch), its end.
    groups = deltas_of(batches, long)
    assert len(groups) == 3, [[d.position for d in g] for g in groups]
    end = next(i for i, b in enumerate(batches) for e in b.events if e.finish_reason)
    assert deltas_of(batches[end : end + 1], long) == [groups[1]]
    assert groups[1][-1].finish_reason is None


def test_the_cluster_file_sets_the_stream_interval() -> None:
    text = tiny_cluster_text("nats://127.0.0.1:1", "redis://127.0.0.1:1/0")

    def cluster(value: str) -> str:
        return text.replace("[worker]\n", f"[worker]\nstream_interval_ms = {value}\n", 1)

    default = WorkerServiceConfig.from_cluster(parse_cluster(text), "random-tiny", "w")
    assert default.stream_interval_s == 0.005
    cfg = WorkerServiceConfig.from_cluster(parse_cluster(cluster("0")), "random-tiny", "w")
    assert cfg.stream_interval_s == 0.0
    for bad in ("-1", "5000"):
        with pytest.raises(ConfigError, match="stream_interval_ms"):
            parse_cluster(cluster(bad))
    # never as long as the gateway waits for a stream's next event before failing it
    short_wait = cluster("600").replace("event_timeout_s = 60.0", "event_timeout_s = 0.5", 1)
    assert short_wait != cluster("600")
    with pytest.raises(ConfigError, match="event_timeout_s"):
        parse_cluster(short_wait)
