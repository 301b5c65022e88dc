"""Latency-aware routing end to end: two sim instances (wall clock, known coefficients)
behind the real gateway, estimator, NATS and Redis.

"big" is accurate and slow (30 ms per step, one request at a time), "small" is less
accurate and fast (2 ms per step). The policies must pick as their formulas say.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import pytest
import pytest_asyncio

from services.estimator.sfs.correction import TtftCorrection
from shared.config import parse_cluster
from shared.messages.worker import CALIBRATION_DECODER
from shared.scheduling.snapshot import WorkloadSnapshot
from tests.support.chat import sse_events, streamed
from tests.support.clusters import decisions_head, instance, preset, shipped, sim_model
from tests.support.stack import Stack, running, start_stack

# name, six-term batch-time coefficients, prices (input, output per Mtok), quality:
# "big" takes 30 ms a step, "small" 2 ms
SIM_MODELS = [
    ("big", [0.03, 1e-5, 0.0, 1e-4, 0.0, 0.0], (1.0, 2.0), {"default": 0.9, "trivia": 0.2}),
    ("small", [0.002, 1e-6, 0.0, 1e-5, 0.0, 0.0], (0.1, 0.2), {"default": 0.5, "trivia": 0.6}),
]


def sim_cluster(nats_url: str, redis_url: str) -> str:
    """One instance of each SIM_MODELS model, "big" taking one request at a time."""
    limits = {"max_num_batched_tokens": 256, "num_kv_blocks": 256, "max_model_len": 1024}
    return "".join(
        [
            decisions_head(
                nats_url,
                redis_url,
                policy="sfs-constraint",
                snapshot_max_age_s=2.0,
                snapshot_refresh_s=0.01,
                fit_interval_s=0.2,
                fit_min_samples=8,
                fit_refit_every=8,
            ),
            *(
                sim_model(
                    name,
                    coefs,
                    8.0,
                    price_input_per_mtok=pin,
                    price_output_per_mtok=pout,
                    quality=quality,
                )
                for name, coefs, (pin, pout), quality in SIM_MODELS
            ),
            instance("big", {"max_num_seqs": 1, **limits}),
            instance("small", {"max_num_seqs": 8, **limits}),
            preset("constraint", ["big", "small"], policy="sfs-constraint"),
            preset("agnostic", ["big", "small"], policy="latency-agnostic"),
            preset("lagrangian", ["big", "small"], policy="sfs-lagrangian", delta=1.0),
        ]
    )


MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def sim(nats_url: str, redis_url: str) -> AsyncIterator[Stack]:
    s = await start_stack(parse_cluster(sim_cluster(nats_url, redis_url)), 2, ["big", "small"])
    yield s
    await s.stop()


async def chat(
    stack: Stack, model: str, headers: dict[str, str] | None = None, **extra: object
) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 8, **extra}
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        return await client.post("/v1/chat/completions", json=body, headers=headers or {})


def served_by(stack: Stack, resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    iid = resp.headers["x-instance-id"]
    return next(w.cfg.model for w in stack.workers if w.cfg.instance_id == iid)


@pytest.mark.asyncio(loop_scope="session")
async def test_idle_cluster_policies_and_the_slo_header(sim: Stack) -> None:
    await sim.wait_idle()
    # Idle: big answers its first token in ~30 ms, within the default 158 ms target.
    resp = await chat(sim, "constraint")
    assert served_by(sim, resp) == "big"
    baton = resp.json()["baton"]
    assert baton["model"] == "big" and baton["instance"] == resp.headers["x-instance-id"]
    assert baton["policy"] == "sfs-constraint" and baton["task"] is None
    assert baton["preset"] == "constraint" and "token_policy" not in baton
    assert baton["router_overhead_ms"] > 0
    assert 25 <= baton["predicted_ttft_ms"] <= 100  # one 30 ms prefill step
    usage = resp.json()["usage"]
    assert baton["cost"] == pytest.approx(
        (usage["prompt_tokens"] * 1.0 + usage["completion_tokens"] * 2.0) / 1e6
    )
    await sim.wait_idle()
    # x-slo-ttft-ms: 10 ms rules big out; small (~2 ms) meets it.
    resp = await chat(sim, "constraint", {"x-slo-ttft-ms": "10"})
    assert served_by(sim, resp) == "small"
    assert resp.json()["baton"]["predicted_ttft_ms"] < 10
    # x-baton-task: on trivia small is the more accurate one.
    await sim.wait_idle()
    resp = await chat(sim, "agnostic", {"x-baton-task": "trivia"})
    assert served_by(sim, resp) == "small" and resp.json()["baton"]["task"] == "trivia"
    # x-baton-policy overrides the preset's.
    await sim.wait_idle()
    resp = await chat(sim, "agnostic", {"x-baton-policy": "sfs-constraint", "x-slo-ttft-ms": "10"})
    assert served_by(sim, resp) == "small" and resp.json()["baton"]["policy"] == "sfs-constraint"
    # ... routebalance too: an idle cluster's batch is decided at once, by its balanced
    # weights (the preset names none)
    await sim.wait_idle()
    resp = await chat(sim, "agnostic", {"x-baton-policy": "routebalance"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["baton"]["policy"] == "routebalance"
    assert sim.estimator.batches.num_batches >= 1
    resp = await chat(sim, "agnostic", {"x-baton-policy": "best-route"})
    assert resp.status_code == 400


@pytest.mark.asyncio(loop_scope="session")
async def test_measured_ttft_comes_back_to_the_estimator(
    sim: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An SFS-routed request's RequestDoneEvent carries its predicted and measured TTFT,
    and the estimator's correction of that instance takes it (sfs/correction.py)."""
    correction = sim.estimator.latency.correction
    assert correction is not None
    # Which request each measurement came from: an earlier test's done event may still
    # be on its way, so counts alone cannot tell this test's from it.
    seen: dict[str, int] = {}
    observe = TtftCorrection.observe

    def spy(
        self: TtftCorrection,
        instance_id: str,
        estimated_s: float,
        measured_s: float,
        request_id: str | None = None,
    ) -> None:
        before = self.num_observed(instance_id)
        observe(self, instance_id, estimated_s, measured_s, request_id)
        if request_id is not None:
            seen[request_id] = self.num_observed(instance_id) - before

    monkeypatch.setattr(TtftCorrection, "observe", spy)  # (slotted: not per object)

    async def feedback_for(request_id: str) -> int:
        for _ in range(500):  # the done event is published after the answer
            if request_id in seen:
                return seen[request_id]
            await asyncio.sleep(0.01)
        raise TimeoutError(f"no measured TTFT came back for {request_id}")

    for _ in range(2):
        await sim.wait_idle()
        resp = await chat(sim, "constraint")  # idle: big, one 30 ms prefill step
        assert served_by(sim, resp) == "big"
        assert await feedback_for(resp.headers["x-request-id"]) == 1  # taken, not skipped
    assert correction.factor(resp.headers["x-instance-id"]) == 1.0  # not before min_samples


@pytest.mark.asyncio(loop_scope="session")
async def test_loaded_instance_sfs_routes_away_agnostic_does_not(sim: Stack) -> None:
    await sim.wait_idle()
    # Load big directly (one instance serves "big": the gateway routes it locally):
    # 4 requests of 40 tokens, one at a time, ~1.2 s each.
    load = [asyncio.create_task(chat(sim, "big", max_tokens=40, ignore_eos=True)) for _ in range(4)]
    big = next(s for s in sim.estimator.instances.values() if s.info.model == "big")
    for _ in range(200):
        if big.snapshot is not None and big.snapshot.num_requests >= 3:
            break
        await asyncio.sleep(0.02)
    else:
        raise TimeoutError("big never showed its load")
    constraint, lagrangian, agnostic = await asyncio.gather(
        chat(sim, "constraint"), chat(sim, "lagrangian"), chat(sim, "agnostic")
    )
    assert served_by(sim, constraint) == "small"  # big's predicted TTFT is seconds
    assert served_by(sim, lagrangian) == "small"  # 0.9 - 1/s * seconds < 0.5 - 1/s * ms
    assert served_by(sim, agnostic) == "big"  # blind to load
    assert constraint.json()["baton"]["predicted_ttft_ms"] < 158
    assert agnostic.json()["baton"]["predicted_ttft_ms"] is None  # it predicts no TTFT
    for r in await asyncio.gather(*load):
        assert r.status_code == 200
    await sim.wait_idle()  # every ledger entry left: done events and snapshots agree


@pytest.mark.asyncio(loop_scope="session")
async def test_streamed_usage_chunk_carries_baton(sim: Stack) -> None:
    body = {
        "model": "constraint",
        "messages": MESSAGES,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp, lines = await streamed(sim.base_url, body)
    final = [e for e in sse_events(lines) if isinstance(e, dict)][-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] >= 1
    assert final["baton"]["instance"] == resp.headers["x-instance-id"]
    assert final["baton"]["router_overhead_ms"] > 0


@pytest.mark.asyncio(loop_scope="session")
async def test_batch_time_fit_is_published_and_carried_by_snapshots(sim: Stack) -> None:
    for _ in range(3):  # enough iterations on both instances for a fit
        await asyncio.gather(
            chat(sim, "big", max_tokens=8, ignore_eos=True),
            chat(sim, "small", max_tokens=16, ignore_eos=True),
        )
    store = sim.estimator.store
    ids = [w.cfg.instance_id for w in sim.workers]
    for _ in range(200):
        blobs = await store.read_calibrations(ids)
        if all(b is not None for b in blobs.values()) and all(
            w.calibration is not None for w in sim.workers
        ):
            break
        await asyncio.sleep(0.05)
    else:
        raise TimeoutError("no calibration published or read")
    for w in sim.workers:
        cal = CALIBRATION_DECODER.decode(blobs[w.cfg.instance_id] or b"")
        assert cal.feature_set == "six-term"
        assert cal.mape < 0.05  # the sim's batch times are exactly its six-term model
        # The worker's next snapshot carries what the estimator fitted (the fit as
        # stored now: the estimator may refit from the last round's samples meanwhile).
        snap = None
        for _ in range(100):
            iid = w.cfg.instance_id
            blob = (await store.read_snapshots([iid]))[iid]
            assert blob is not None
            snap = msgspec.msgpack.decode(blob.data, type=WorkloadSnapshot)
            cal = CALIBRATION_DECODER.decode((await store.read_calibrations([iid]))[iid] or b"")
            if snap.batch_time_coefs == cal.coefs:
                break
            await asyncio.sleep(0.05)
        assert snap is not None and snap.batch_time_coefs == cal.coefs
    async with httpx.AsyncClient(base_url=sim.base_url) as client:
        metrics = (await client.get("/metrics")).text
    assert re.search(r'baton_batch_time_fit_mape\{feature_set="six-term",instance="w0"\}', metrics)


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize(
    ("name", "most_accurate"),
    [("sim-sfs.toml", "qwen3-32b"), ("sim-routebalance.toml", "qwen2.5-72b")],
)
async def test_sim_cluster_files_start_and_serve(
    nats_url: str, redis_url: str, repo_root: Path, name: str, most_accurate: str
) -> None:
    """The papers' testbeds as shipped: every replica starts and every preset serves."""
    text = (repo_root / "configs" / name).read_text()
    cluster = parse_cluster(shipped(text, nats_url, redis_url))
    models = [i.model for i in cluster.instances for _ in range(i.replicas)]
    async with running(cluster, len(models), models=models) as stack:
        for preset in cluster.presets:
            resp = await chat(stack, preset, max_tokens=4)
            assert resp.status_code == 200, (preset, resp.text)
            assert resp.json()["baton"]["model"] in models
        # latency-agnostic with lambda 0 takes the most accurate model
        resp = await chat(stack, "latency-agnostic", max_tokens=4)
        assert resp.json()["baton"]["model"] == most_accurate
