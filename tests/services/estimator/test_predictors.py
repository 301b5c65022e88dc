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

import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from services.launcher.servers import free_port
from shared.config import parse_cluster
from shared.messages.estimator import RouteRequest
from tests.services.estimator.sfs.test_predictors import write_predictors
from tests.support.stack import Stack, start_stack

CLUSTER = """
namespace = "{namespace}"
nats_url = "{nats_url}"
redis_url = "{redis_url}"

[gateway]
port = {port}
registry_refresh_s = 0.2
event_timeout_s = 60.0
# these tests check the estimator's decisions: a reply slowed by a loaded machine must
# not turn one into the gateway's fallback
route_timeout_s = 10.0

[estimator]
policy = "latency-agnostic"
registry_refresh_s = 0.2
predictors = "{predictors}"
default_output_tokens = 7

[worker]
heartbeat_interval_s = 0.2
heartbeat_ttl_s = 2.0
drain_timeout_s = 3.0

{models}

[presets.agnostic]
models = ["big", "small"]
policy = "latency-agnostic"

[presets.mixed]
models = ["big", "small", "other"]
policy = "latency-agnostic"
"""

MODEL = """
[models.{name}]
engine = "sim"
tokenizer = "random-tiny"
batch_time_features = "six-term"
batch_time_coefs = [0.002, 1e-6, 0.0, 1e-5, 0.0, 0.0]
quality = {{ default = {quality} }}

[models.{name}.sim]
clock = "wall"
output_len_dist = "fixed"
output_len_mean = 3.0

[[instances]]
model = "{name}"
[instances.scheduler]
max_num_seqs = 4
max_num_batched_tokens = 512
num_kv_blocks = 256
max_model_len = 1024
"""

SHORT = "Hi."
LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 20)  # ~200 tokens


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    nats_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    predictors = write_predictors(tmp_path_factory.mktemp("predictors"))
    models = "".join(
        MODEL.format(name=n, quality=q) for n, q in (("big", 0.9), ("small", 0.5), ("other", 0.1))
    )
    text = CLUSTER.format(
        namespace=f"t{uuid.uuid4().hex[:8]}",
        nats_url=nats_url,
        redis_url=redis_url,
        port=free_port(),
        predictors=predictors,  # absolute: used as is
        models=models,
    )
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


@pytest.mark.asyncio(loop_scope="session")
async def test_falls_back_to_the_table_and_default_length(stack: Stack) -> None:
    # "other" is unknown to the predictor: quality comes from the table for every
    # candidate (one scale), so big wins; big's length is still predicted.
    assert await chat(stack, "mixed", SHORT) == ("big", 5)
    # Without prompt ids (e.g. an older gateway): the table decides, no length predicted.
    reply = await stack.estimator.route(
        RouteRequest(request_id="no-ids", model="agnostic", num_prompt_tokens=3, max_tokens=32)
    )
    assert reply.model == "big" and reply.predicted_output_tokens is None
    # With ids: small, and the reply carries the routed length (capped by max_tokens).
    reply = await stack.estimator.route(
        RouteRequest(
            request_id="ids",
            model="agnostic",
            num_prompt_tokens=3,
            max_tokens=8,
            prompt_token_ids=[1, 2, 3],
        )
    )
    assert reply.model == "small" and reply.predicted_output_tokens == 8
    # An upstream length wins over the predictor's.
    reply = await stack.estimator.route(
        RouteRequest(
            request_id="upstream",
            model="agnostic",
            num_prompt_tokens=3,
            max_tokens=32,
            prompt_token_ids=[1, 2, 3],
            predicted_output_tokens=2,
        )
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
