"""Token-level routing end to end: gateway, estimator, two workers (a small and a large
random model sharing the vocabulary) and the relay, on real NATS and Redis.

The routing rule is a test policy registered in the policy table (the workers run
in this process): the large model rewrites output positions 2, 5, 8, ... so the
expected answer is computable by one process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import httpx
import pytest
import pytest_asyncio

from services.relay.service import RelayService
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.routing.chars import CharBoundaries
from services.worker.routing.policies import register_token_policy, unregister_token_policy
from shared.config import parse_cluster
from shared.health import check
from shared.model_store import load_tokenizer
from shared.sampling import SamplingParams
from shared.scheduling.scheduler import SchedulerConfig
from tests.services.worker.routing.test_runtime import EveryThird, big_writes
from tests.support.clusters import instance, preset, table
from tests.support.stack import Stack, kill, start_stack, tiny_cluster_text

pytestmark = pytest.mark.asyncio(loop_scope="module")

PAIR_MODELS = ["random-tiny", "random-tiny-big"]
PAIR = "".join(
    [
        table("models.random-tiny-big", dtype="float32"),
        instance(
            "random-tiny-big",
            {
                "max_num_seqs": 8,
                "max_num_batched_tokens": 256,
                "num_kv_blocks": 64,
                "max_model_len": 256,
            },
            replicas=1,
            seed=7,
        ),
        preset("pair", PAIR_MODELS, token_policy="every-third"),
        preset("pair-barrier", PAIR_MODELS, token_policy="every-third", mode="barrier"),
        table("relay", peer_timeout_s=2.0, registry_refresh_s=0.2),
    ]
)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def routed(nats_url: str, redis_url: str) -> AsyncIterator[tuple[Stack, RelayService]]:
    register_token_policy(EveryThird)
    text = tiny_cluster_text(nats_url, redis_url).replace("replicas = 2", "replicas = 1")
    cluster = parse_cluster(text + PAIR)
    relay = RelayService(cluster)
    relay_task = asyncio.create_task(relay.run())
    stack = await start_stack(cluster, 2, ["random-tiny", "random-tiny-big"])
    yield stack, relay
    relay.request_stop()
    await stack.stop()
    await asyncio.wait_for(relay_task, 10)
    unregister_token_policy("every-third")


HOP_DELAY_S = 0.3


class Reference(NamedTuple):
    tokens: list[int]
    tokens_by_model: dict[str, int]
    num_handoffs: int  # hand-offs each way, together


def reference(prompt: list[int], n: int) -> Reference:
    """What one process applying the same rule writes (greedy, fp32): the large model
    rewrites positions 2, 5, 8, ... and hands back after each, but, as the workers do
    (routing/chars.py), never inside a character: a rewrite waits for the text before
    it, a hand-back for the text with its token, to end one (the random models write
    lone bytes of SmolLM2's vocabulary now and then), and a rewrite that waited is
    skipped (the rule asks at its position only).

    Call it through `asyncio.to_thread`: it builds two engines and decodes token by
    token (about a second on a slow core); on the event loop it would stall the
    in-process workers' heartbeats, the relay and the gateway for that long, close to
    the suite's 2 s registration TTL."""
    small, big = (
        LLMEngine.create(
            EngineConfig(
                model=m,
                dtype="float32",
                seed=seed,
                scheduler=SchedulerConfig(num_kv_blocks=64, max_model_len=256),
            )
        )
        for m, seed in (("random-tiny", 0), ("random-tiny-big", 7))
    )
    chars = CharBoundaries(load_tokenizer("random-tiny").token_bytes)
    seq, out = list(prompt), []
    counts = {"random-tiny": 0, "random-tiny-big": 0}
    hops, big_writing = 0, False
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for pos in range(n):
        tok = (big if big_writing else small).generate([seq], one)[0][0]
        if not big_writing and big_writes(pos) and not chars.splits_char(seq, tok, True):
            big_writing, hops = True, hops + 1  # the large model rewrites it
            tok = big.generate([seq], one)[0][0]
        counts["random-tiny-big" if big_writing else "random-tiny"] += 1
        if big_writing and not chars.splits_char(seq, tok, False):
            big_writing, hops = False, hops + 1  # and hands back after it
        out.append(tok)
        seq.append(tok)
    return Reference(out, counts, hops)


def blocks_in_use(stack: Stack) -> list[int]:
    out = []
    for w in stack.workers:
        sched = w.engine.scheduler
        out.append(sched.config.num_kv_blocks - sched.blocks.num_free_blocks)
    return out


async def post_pair(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> httpx.Response:
    """A greedy completion of exactly max_tokens tokens on the `pair` preset."""
    body = {
        "model": "pair",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return await client.post("/v1/completions", json=body)


async def wait_idle(stack: Stack, relay: RelayService) -> None:
    for _ in range(200):
        if blocks_in_use(stack) == [0, 0] and not relay.books.routes:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(
        f"KV still held: {blocks_in_use(stack)}, relay routes {len(relay.books.routes)}"
    )


async def greedy_completion(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int
) -> dict[str, Any]:
    """A greedy, fixed-length completion; asserts it succeeded and returns the body."""
    resp = await client.post(
        "/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


async def test_routed_completion_equals_single_process(routed: tuple[Stack, RelayService]) -> None:
    stack, relay = routed
    tok = load_tokenizer("random-tiny")
    prompt = "Token routing passes the pen"
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        body = await greedy_completion(client, "pair", prompt, 16)
    expected = await asyncio.to_thread(reference, tok.encode(prompt), 16)
    assert body["choices"][0]["text"] == tok.decode(expected.tokens)
    usage = body["usage"]
    assert usage["completion_tokens"] == 16
    # Positions 2, 5, 8, 11, 14 are the large model's (unless inside a character).
    assert usage["tokens_by_model"] == expected.tokens_by_model
    assert expected.tokens_by_model["random-tiny-big"] >= 3  # the rule ran
    assert relay.books.counters.forwarded == expected.num_handoffs
    baton = body["baton"]  # the preset and its token policy are named
    assert baton["preset"] == "pair" and baton["token_policy"] == "every-third"
    assert baton["cost"] == float(f"{baton['cost']:.10g}")
    await wait_idle(stack, relay)


async def test_barrier_mode_answers_concurrent_requests_exactly(
    routed: tuple[Stack, RelayService],
) -> None:
    """Step barriers: the entry model waits out every hand-off; answers stay exact."""
    stack, relay = routed
    tok = load_tokenizer("random-tiny")
    prompts = ["Barrier one", "A second, longer barrier prompt", "three"]

    async def one(client: httpx.AsyncClient, prompt: str) -> dict[str, Any]:
        return await greedy_completion(client, "pair-barrier", prompt, 12)

    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        bodies = await asyncio.gather(*(one(client, p) for p in prompts))
    for prompt, body in zip(prompts, bodies, strict=True):
        expected = await asyncio.to_thread(reference, tok.encode(prompt), 12)
        assert body["choices"][0]["text"] == tok.decode(expected.tokens)
        assert body["usage"]["tokens_by_model"] == expected.tokens_by_model
    await wait_idle(stack, relay)


async def test_streamed_routed_answers_and_aborts_leave_no_kv(
    routed: tuple[Stack, RelayService],
) -> None:
    stack, relay = routed

    async def one(i: int, client: httpx.AsyncClient) -> None:
        body = {
            "model": "pair",
            "prompt": f"request {i} " * (1 + i % 5),
            "max_tokens": 12,
            "temperature": 0.8 if i % 2 else 0,
            "seed": i,
            "stream": True,
            "ignore_eos": True,
        }
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            chunks = 0
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    chunks += 1
                    if i % 4 == 0 and chunks == 3:
                        return  # the client goes away mid-answer: abort
            assert chunks > 2

    gate = asyncio.Semaphore(16)  # under the gateway's max_in_flight (32)

    async def limited(i: int, client: httpx.AsyncClient) -> None:
        async with gate:
            await one(i, client)

    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        await asyncio.gather(*(limited(i, client) for i in range(40)))
    await wait_idle(stack, relay)


async def test_tokens_held_when_a_request_parks_at_a_peer_go_out_while_it_waits(
    routed: tuple[Stack, RelayService],
) -> None:
    """The origin's pacer holds a step's tokens for the next step's write; a request
    handed to the peer leaves the origin with no step to come, so the loop sends what
    it holds before it waits (WorkerService._idle), not when the request comes back."""
    stack, relay = routed
    origin = stack.workers[0]  # random-tiny: the pair preset's entry model
    relayed = relay.send

    async def slow_relay(sends: Any) -> None:  # each hop of a hand-off takes 0.3 s more
        await asyncio.sleep(HOP_DELAY_S)
        await relayed(sends)

    sent: list[tuple[float, int]] = []  # (when, position) of the origin's token deltas
    send = origin.answers.send

    async def recording_send(batches: Any, step: int) -> None:
        batches = list(batches)
        for _, events in batches:
            sent.extend((time.monotonic(), e.position) for e in events if hasattr(e, "position"))
        await send(batches, step)

    interval_s = origin.answers.pacer.interval_s
    relay.send, origin.answers.send = slow_relay, recording_send  # type: ignore[method-assign]
    origin.answers.pacer.interval_s = 30.0  # hold whatever may be held
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            resp = await post_pair(client, "parked at the peer", 4)
    finally:
        relay.send, origin.answers.send = relayed, send  # type: ignore[method-assign]
        origin.answers.pacer.interval_s = interval_s
    assert resp.status_code == 200, resp.text
    when = {position: t for t, position in sent}
    assert sorted(when) == [0, 1, 2, 3]
    # Position 1 (held: neither the first token nor the end) went out when the request
    # parked for position 2, two slowed relay hops before position 2 came back.
    assert when[2] - when[1] >= 1.5 * HOP_DELAY_S
    await wait_idle(stack, relay)


async def test_requests_past_the_running_cap_wait_without_empty_steps(
    routed: tuple[Stack, RelayService],
) -> None:
    """More requests than the origin's `max_num_seqs` (8): while the admitted ones are
    parked at the peer, the others wait for a slot that no step can free, and the origin
    waits for a message instead of stepping, not running empty steps back to back until
    a request comes back."""
    stack, relay = routed
    origin = stack.workers[0]
    relayed = relay.send

    async def slow_relay(sends: Any) -> None:  # parked requests stay parked longer
        await asyncio.sleep(HOP_DELAY_S)
        await relayed(sends)

    n, max_tokens = 12, 6  # the peer rewrites positions 2 and 5 of each
    steps = origin.num_steps
    relay.send = slow_relay  # type: ignore[method-assign]
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            resps = await asyncio.gather(
                *(post_pair(client, f"past the cap {i}", max_tokens) for i in range(n))
            )
    finally:
        relay.send = relayed  # type: ignore[method-assign]
    for resp in resps:
        assert resp.status_code == 200, resp.text
    # Each step that ran computed something: a prefill, or a token of a request (two
    # hand-backs of each re-enter through a step too). Far fewer than the empty steps
    # of several 0.3 s waits.
    assert origin.num_steps - steps <= 4 * n * max_tokens
    await wait_idle(stack, relay)


async def test_dead_peer_never_loses_a_request(routed: tuple[Stack, RelayService]) -> None:
    """The large worker dies while requests are in flight: every request still
    completes, finished by the small model alone once the relay gives the hand-off back."""
    stack, relay = routed
    failovers = relay.books.counters.failovers

    async def post(i: int, client: httpx.AsyncClient) -> httpx.Response:
        return await post_pair(client, f"dead {i}", 24)

    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        pending = [asyncio.create_task(post(i, client)) for i in range(4)]
        await asyncio.sleep(0.3)  # hand-offs are under way
        big_task = stack.worker_tasks[1]  # the large worker's loop: crash it
        await kill(big_task)
        resps = await asyncio.gather(*pending)
        late = await post(99, client)  # no large worker at all: served by the small one
    for resp in [*resps, late]:
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 24
    assert relay.books.counters.failovers > failovers
    assert blocks_in_use(stack)[0] == 0


async def test_models_list_names_a_presets_token_policy(
    routed: tuple[Stack, RelayService],
) -> None:
    stack, _ = routed
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert cards["pair"]["token_policy"] == "every-third"
    assert cards["pair"]["models"] == ["random-tiny", "random-tiny-big"]
    assert cards["auto"]["token_policy"] is None  # whole answers, routed per request


async def test_relay_answers_its_health_probe(routed: tuple[Stack, RelayService]) -> None:
    stack, _ = routed
    assert await check("relay", stack.cluster)
    assert not await check("batcher", stack.cluster)  # none runs in this stack


async def test_logprobs_on_a_token_preset_are_a_clear_400(
    routed: tuple[Stack, RelayService],
) -> None:
    stack, _ = routed
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        resp = await client.post(
            "/v1/completions",
            json={"model": "pair", "prompt": "hi", "max_tokens": 4, "logprobs": 1},
        )
    assert resp.status_code == 400
    assert "logprobs" in resp.json()["error"]["message"]
