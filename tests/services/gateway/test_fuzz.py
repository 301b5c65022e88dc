"""Seeded random requests against the real stack: whatever a client sends, the answer is
a 2xx or a 4xx in OpenAI's error format, never a 5xx, and nothing is left behind.

Bodies are valid requests with one or two fields replaced by values of the wrong type,
out of range, at the edges of float32, or malformed JSON; some streams are left early.
Such fuzzing found two bugs: a `top_p` of 1e-320 failed the worker's step (and with
it the worker), and JSON nested 5,000 deep answered 500. A failure prints the body.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx

from tests.services.gateway.test_e2e import snapshot_of
from tests.support.stack import Stack

SEED = 20261202
NUM_REQUESTS = 240
CONCURRENCY = 8

ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2, 7, 2**63, -(2**63) - 1, 2**64, 10**30, 1e308, -1e308,
    1e-320, 1e-45, 0.5, -0.0, "", "x", "é😀", "\u0000", "<|im_end|>", [], [1], [None],
    ["a", 1], {}, {"a": 1}, "9" * 300,
]  # fmt: skip
CHAT_FIELDS = [
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "n", "stream", "stream_options", "stop", "seed", "logprobs", "top_logprobs", "user",
    "presence_penalty", "frequency_penalty", "logit_bias", "response_format", "tools",
    "ignore_eos",
]  # fmt: skip
COMPLETION_FIELDS = [
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream",
    "stream_options", "stop", "seed", "logprobs", "echo", "suffix", "best_of",
]  # fmt: skip
# in range or at its edges, some below float32's smallest value
EDGE_FLOATS = [1e-320, 1e-50, 1e-45, 1e-38, 5e-6, 1e-5, 1.1e-5, 0.999999, 1.0, 2.0, -2.0]
FLOAT_FIELDS = {"temperature", "top_p", "presence_penalty", "frequency_penalty"}
ODD_MESSAGES: list[Any] = [
    {"role": "system", "content": "Be brief."},
    {"role": "assistant", "content": None},
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
    {"role": "bogus", "content": "x"},
    {"role": "user"},
    {"content": "x"},
    "text",
    None,
]
ODD_PROMPTS: list[Any] = [[1, 2, 3], [[1, 2], [3]], ["a", "b"], [], [-1], [10**9], "x" * 2000]
MALFORMED: list[bytes] = [
    b"",
    b"{",
    b"[]",
    b"null",
    b"\xff\xfe",
    b'{"model": "random-tiny", "prompt": "\xff"}',
    b'{"model": "random-tiny", "prompt": "hi", "max_tokens": 1e400}',
    b'{"model": "random-tiny", "prompt": "hi", "temperature": NaN}',
    b'{"a":' * 5000 + b"1" + b"}" * 5000,
]


def random_body(rng: random.Random) -> tuple[str, bytes]:
    """(path, body): mostly a valid request with a field or two made odd."""
    is_chat = rng.random() < 0.5
    path = "/v1/chat/completions" if is_chat else "/v1/completions"
    if rng.random() < 0.08:
        return path, rng.choice(MALFORMED)
    body: dict[str, Any] = {
        "model": rng.choice(["random-tiny", "random-tiny", "no-such-model"]),
        "max_tokens": rng.randint(1, 12),
        "stream": rng.random() < 0.5,
    }
    if is_chat:
        body["messages"] = [{"role": "user", "content": rng.choice(["hi", "é😀" * 20, ""])}]
    else:
        body["prompt"] = rng.choice(["hi", "Once upon a time"])
    fields = CHAT_FIELDS if is_chat else COMPLETION_FIELDS
    for _ in range(rng.choice([0, 1, 1, 2])):
        field = rng.choice(fields)
        if field == "messages" and rng.random() < 0.7:
            body[field] = [rng.choice(ODD_MESSAGES) for _ in range(rng.randint(0, 3))]
        elif field == "prompt" and rng.random() < 0.7:
            body[field] = rng.choice(ODD_PROMPTS)
        elif field in FLOAT_FIELDS and rng.random() < 0.6:
            body[field] = rng.choice(EDGE_FLOATS)
        else:
            body[field] = rng.choice(ODD_VALUES)
    return path, json.dumps(body).encode()


async def send(client: httpx.AsyncClient, rng: random.Random, path: str, raw: bytes) -> None:
    """One request; asserts the answer's shape (a stream may be left early)."""
    leave_after = rng.randint(1, 4) if rng.random() < 0.15 else None
    headers = {"content-type": "application/json"}
    async with client.stream("POST", path, content=raw, headers=headers) as resp:
        lines = []
        async for line in resp.aiter_lines():
            lines.append(line)
            if leave_after is not None and len(lines) >= leave_after:
                break  # leave mid-answer: closing the response drops the connection
        text = "\n".join(lines)
    where = f"{path} {raw[:300]!r} -> {resp.status_code} {text[:300]}"
    assert resp.status_code < 500, where
    if resp.status_code >= 400:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str) and error["message"], where
        assert error["type"] == "invalid_request_error", where
    elif leave_after is None and resp.headers["content-type"].startswith("text/event-stream"):
        assert "data: [DONE]" in lines[-2:], where
        assert '"error"' not in text, where


async def test_random_requests_get_2xx_or_4xx_and_leave_nothing_behind(stack: Stack) -> None:
    rng = random.Random(SEED)
    bodies = [random_body(rng) for _ in range(NUM_REQUESTS)]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        for i in range(0, NUM_REQUESTS, CONCURRENCY):
            batch = bodies[i : i + CONCURRENCY]
            await asyncio.gather(*(send(client, rng, path, raw) for path, raw in batch))
        ok = await client.post(
            "/v1/chat/completions",
            json={"model": "random-tiny", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert ok.status_code == 200, ok.text
    # Every stream closed, every worker's KV back in its pool.
    ids = [w.cfg.instance_id for w in stack.workers]
    for _ in range(200):
        snaps = [await snapshot_of(stack, iid) for iid in ids]
        if (
            stack.gateway.num_in_flight == 0
            and len(stack.gateway.streams) == 0
            and all(
                not s.request_ids and s.num_free_blocks == s.scheduler.num_kv_blocks for s in snaps
            )
        ):
            break
        await asyncio.sleep(0.05)
    assert stack.gateway.num_in_flight == 0 and len(stack.gateway.streams) == 0
    for iid, snap in zip(ids, snaps, strict=True):
        assert snap.request_ids == [] and snap.num_free_blocks == snap.scheduler.num_kv_blocks, iid
    assert all(w.num_failed_steps == 0 for w in stack.workers)
