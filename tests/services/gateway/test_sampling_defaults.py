"""Sampling defaults from the cluster file: `[models.X] default_temperature / default_top_p`
fill what a request leaves out (for a preset, those of the model routing picks), and a
real stack serves a request without a temperature with the model's."""

from __future__ import annotations

import httpx
import pytest

from services.gateway.protocol import CHAT_DECODER
from services.gateway.request_checks import sampling_params
from shared.config import ConfigError, parse_cluster
from tests.support.stack import running, tiny_cluster_text

MODELS = """
[models.a]
default_temperature = 0.2
default_top_p = 0.9

[models.b]
default_temperature = 0.2
default_top_p = 0.9

[models.c]
default_temperature = 0.7

[models.d]

[[instances]]
model = "a"

[[instances]]
model = "b"

[[instances]]
model = "c"

[[instances]]
model = "d"

[presets.same]
models = ["a", "b"]

[presets.mixed]
models = ["a", "c"]
"""


async def answered(
    client: httpx.AsyncClient, model: str, extra: dict[str, float]
) -> tuple[str, list[float]]:
    """(the model that answered, its 12 tokens' logprobs, rounded) for a fixed prompt."""
    body = {
        "model": model,
        "prompt": "the quick brown fox",
        "max_tokens": 12,
        "ignore_eos": True,
        "logprobs": 0,
        **extra,
    }
    resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    return out["model"], [round(lp, 4) for lp in out["choices"][0]["logprobs"]["token_logprobs"]]


def test_a_model_gives_its_defaults_and_a_preset_its_first_models() -> None:
    cluster = parse_cluster(MODELS)
    assert cluster.sampling_defaults("a") == (0.2, 0.9)
    assert cluster.sampling_defaults("c") == (0.7, 1.0)  # top_p unset: OpenAI's 1.0
    assert cluster.sampling_defaults("d") == (1.0, 1.0)
    # a preset: its first model's, until routing picks the one that answers (below)
    assert cluster.sampling_defaults("same") == (0.2, 0.9)
    assert cluster.sampling_defaults("mixed") == (0.2, 0.9)


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("default_temperature = -0.1", "default_temperature"),
        ("default_temperature = 2.5", "default_temperature"),
        ("default_top_p = -0.1", "default_top_p"),
        ("default_top_p = 1.5", "default_top_p"),
    ],
)
def test_out_of_range_defaults_are_refused_naming_the_field(line: str, field: str) -> None:
    text = MODELS.replace("[models.d]\n", f"[models.d]\n{line}\n", 1)
    with pytest.raises(ConfigError, match=field):
        parse_cluster(text)


def test_what_the_request_sends_wins_over_the_defaults() -> None:
    def params(extra: str) -> tuple[float, float]:
        raw = f'{{"model": "a", "messages": [{{"role": "user", "content": "hi"}}]{extra}}}'
        p = sampling_params(CHAT_DECODER.decode(raw.encode()), 8, (0.2, 0.9))
        return p.temperature, p.top_p

    assert params("") == (0.2, 0.9)
    assert params(', "temperature": 1.0') == (1.0, 0.9)
    assert params(', "temperature": 0, "top_p": 1.0') == (0.0, 1.0)  # 0 is sent, not absent


async def test_a_request_without_temperature_samples_at_the_models_default(
    nats_url: str, redis_url: str
) -> None:
    # default 0: greedy, so every answer without a temperature is the greedy answer
    text = tiny_cluster_text(nats_url, redis_url).replace(
        '[models.random-tiny]\ndtype = "float32"\n',
        '[models.random-tiny]\ndtype = "float32"\ndefault_temperature = 0.0\n',
        1,
    )
    cluster = parse_cluster(text)
    assert cluster.sampling_defaults("random-tiny") == (0.0, 1.0)
    async with (
        running(cluster, num_workers=1) as stack,
        httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client,
    ):

        async def answer(extra: dict[str, float]) -> list[float]:
            return (await answered(client, "random-tiny", extra))[1]

        greedy = await answer({"temperature": 0.0})
        assert await answer({}) == greedy
        assert await answer({}) == greedy
        # at 1.0 a random-tiny model (a near-uniform distribution) leaves the greedy path
        sampled = [await answer({"temperature": 1.0, "seed": s}) for s in range(3)]
        assert any(s != greedy for s in sampled)


async def test_a_preset_request_samples_at_the_routed_models_defaults(
    nats_url: str, redis_url: str
) -> None:
    """The preset's models disagree (unset, so 1.0, vs greedy 0.0): a request that sends
    no temperature samples at the one of the model routing picked, whichever comes first
    in the preset (the values the request is checked with before routing)."""
    text = tiny_cluster_text(nats_url, redis_url).replace(
        '[models.random-tiny]\ndtype = "float32"\n',
        '[models.random-tiny]\ndtype = "float32"\ndefault_temperature = 0.0\n'
        '[models.random-tiny-b]\ndtype = "float32"\n'
        '[[instances]]\nmodel = "random-tiny-b"\n[instances.scheduler]\nmax_num_seqs = 8\nnum_kv_blocks = 64\n'
        "max_model_len = 256\n",
        1,
    )
    text += '[presets.mixed]\nmodels = ["random-tiny-b", "random-tiny"]\npolicy = "round-robin"\n'
    cluster = parse_cluster(text)
    assert cluster.sampling_defaults("mixed") == (1.0, 1.0)  # before routing: the first's
    async with (
        running(cluster, num_workers=2, models=["random-tiny", "random-tiny-b"]) as stack,
        httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client,
    ):
        greedy = {
            m: (await answered(client, m, {"temperature": 0.0}))[1]
            for m in ("random-tiny", "random-tiny-b")
        }
        answers = [await answered(client, "mixed", {"seed": s}) for s in range(6)]
        by_tiny = [lps for model, lps in answers if model == "random-tiny"]
        by_b = [lps for model, lps in answers if model == "random-tiny-b"]
        assert len(by_tiny) == len(by_b) == 3  # round-robin: every other request
        # random-tiny's default 0: greedy (at the placeholder 1.0 it would leave the
        # greedy path, a near-uniform distribution); random-tiny-b's 1.0 samples
        assert all(lps == greedy["random-tiny"] for lps in by_tiny)
        assert any(lps != greedy["random-tiny-b"] for lps in by_b)
