"""The estimator prices with the predictors end to end: gateway -> estimator -> sim workers
on real NATS and Redis.

A tiny real predictor (tests/services/estimator/sfs/test_predictors.py) knows "big" and "small":
small is the better one on short prompts, big on long ones, and big answers in 5 tokens,
small in 11. The cluster file's quality table says the opposite of the short-prompt rule
(big 0.9, small 0.5), so every pick shows which source priced it. Sim workers take the
routed length as the answer's length, so `usage.completion_tokens` shows the prediction
travelled to the worker.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from shared.config import parse_cluster
from shared.messages.estimator import RouteReply, RouteRequest
from tests.services.estimator.sfs.test_predictors import write_predictors
from tests.support.clusters import decisions_head, instance, preset, sim_model
from tests.support.stack import Stack, start_stack


def predictors_cluster(nats_url: str, redis_url: str, predictors: str) -> str:
    """big, small and other (quality 0.9, 0.5, 0.1 in the table), one instance each."""
    limits = {
        "max_num_seqs": 4,
        "max_num_batched_tokens": 512,
        "num_kv_blocks": 256,
        "max_model_len": 1024,
    }
    return "".join(
        [
            decisions_head(
                nats_url,
                redis_url,
                policy="latency-agnostic",
                predictors=predictors,  # absolute: used as is
                default_output_tokens=7,
            ),
            *(
                sim_model(name, [0.002, 1e-6, 0.0, 1e-5, 0.0, 0.0], 3.0, quality={"default": q})
                + instance(name, limits)
                for name, q in (("big", 0.9), ("small", 0.5), ("other", 0.1))
            ),
            preset("agnostic", ["big", "small"], policy="latency-agnostic"),
            preset("mixed", ["big", "small", "other"], policy="latency-agnostic"),
        ]
    )


SHORT = "Hi."
LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 20)  # ~200 tokens


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    nats_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    predictors = write_predictors(tmp_path_factory.mktemp("predictors"))
    text = predictors_cluster(nats_url, redis_url, str(predictors))
    s = await start_stack(parse_cluster(text), 3, models=["big", "small", "other"])
    yield s
    await s.stop()


async def chat(stack: Stack, model: str, content: str) -> tuple[str, int]:
    """(model that served, completion tokens)."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 32}
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    iid = resp.headers["x-instance-id"]
    served = next(w.cfg.model for w in stack.workers if w.cfg.instance_id == iid)
    return served, resp.json()["usage"]["completion_tokens"]


@pytest.mark.asyncio(loop_scope="session")
async def test_predicted_quality_picks_and_predicted_length_reaches_the_worker(
    stack: Stack,
) -> None:
    assert stack.estimator.predictors is not None
    # Short prompt: the predictor says small (0.9 vs 0.1); the table would say big.
    assert await chat(stack, "agnostic", SHORT) == ("small", 11)
    # Long prompt: big (0.9 vs 0.1), and big's predicted length.
    assert await chat(stack, "agnostic", LONG) == ("big", 5)


async def route(stack: Stack, request_id: str, max_tokens: int, **extra: Any) -> RouteReply:
    """The estimator's pick for a 3-token prompt to preset "agnostic" (nothing submitted)."""
    req = RouteRequest(
        request_id=request_id, model="agnostic", num_prompt_tokens=3, max_tokens=max_tokens, **extra
    )
    return await stack.estimator.route(req)


@pytest.mark.asyncio(loop_scope="session")
async def test_falls_back_to_the_table_and_default_length(stack: Stack) -> None:
    # "other" is unknown to the predictor: quality comes from the table for every
    # candidate (one scale), so big wins; big's length is still predicted.
    assert await chat(stack, "mixed", SHORT) == ("big", 5)
    # Without prompt ids (e.g. an older gateway): the table decides, no length predicted.
    reply = await route(stack, "no-ids", 32)
    assert reply.model == "big" and reply.predicted_output_tokens is None
    # With ids: small, and the reply carries the routed length (capped by max_tokens).
    reply = await route(stack, "ids", 8, prompt_token_ids=[1, 2, 3])
    assert reply.model == "small" and reply.predicted_output_tokens == 8
    # An upstream length wins over the predictor's.
    reply = await route(
        stack, "upstream", 32, prompt_token_ids=[1, 2, 3], predicted_output_tokens=2
    )
    assert reply.predicted_output_tokens == 2
    ledger = stack.estimator.ledger
    entries = [e for i in stack.estimator.instances for e in ledger.pending(i)]
    assert [e.predicted_output_tokens for e in entries if e.request_id == "upstream"] == [2]
    for rid in ("no-ids", "ids", "upstream"):  # nothing was submitted: clear the ledger
        stack.estimator.ledger.remove(rid)


def test_estimator_config_predictors_switch() -> None:
    cfg = parse_cluster('[estimator]\npredictors = ""\n')
    assert cfg.estimator.predictors == ""
    assert parse_cluster("").estimator.predictors == "models/predictors"
