"""The gateway benchmark's run (bench/gateway_*.py): its flags and settings, its cluster
file, the JSON of a run, the anchors, the NATS observer, and its stack started by the
launcher."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import msgspec
import nats
import pytest
import uvloop

from bench.gateway_anchors import Anchors, http_floor_ms, nats_rtt_ms
from bench.gateway_client import CLIENTS, Client, stream_one
from bench.gateway_measure import run_result
from bench.gateway_settings import Settings
from bench.gateway_stack import SERVICE_ENV, cluster_text, launched_stack
from bench.gateway_ttft_split import PathObserver
from shared.config import parse_cluster
from shared.messages.gateway import DeltaBatch, TokenDelta
from shared.messages.worker import SubmitRequest
from shared.sampling import SamplingParams
from tests.scripts import load_script
from tests.services.launcher.test_launcher import assert_no_orphans, children_of

script = load_script("bench_gateway")


def test_the_flags_default_to_the_settings_defaults() -> None:
    args = script.parser().parse_args([])
    for flag, _ in script.FIELD_OPTIONS:
        name = script.field_name(flag)
        assert getattr(args, name) == getattr(Settings(), name), flag
    assert args.client == Settings().client


def test_the_cluster_file_pins_the_worker_apart_and_takes_the_worker_settings() -> None:
    settings = Settings(
        model="random-tiny", streams=24, worker=("link = false",), worker_cpus=[1], rest_cpus=[0]
    )
    cluster = parse_cluster(cluster_text(settings, port=18123))
    assert cluster.gateway.port == 18123
    assert cluster.server_cpus == [0]
    assert cluster.service_cpus("gateway") == [0]
    (inst,) = cluster.instances
    assert inst.cpus == [1] and inst.replicas == 1
    assert inst.scheduler.max_num_seqs == 24  # every stream of a round in one batch
    assert cluster.presets["bench-model"].models == ["random-tiny"]
    assert cluster.worker.link is False


def measured_side(ttft_ms: list[float], tok_s: float) -> dict[str, object]:
    return {
        "ttft_ms_p50": ttft_ms[1],
        "ttft_ms_p99": ttft_ms[-1],
        "ttft_ms_p50_back_to_back": ttft_ms[0],
        "ttft_ms_p99_back_to_back": ttft_ms[-1],
        "tok_s": tok_s,
        "round_tok_s": [tok_s, tok_s],
        "ttft_ms": ttft_ms,
        "round_tokens": [1024, 1024],
        "round_wall_s": [1024 / tok_s] * 2,
        "first_step_ms": [1.0, 1.0, 1.0],
    }


def test_a_runs_json_holds_the_figures_their_intervals_and_the_anchors() -> None:
    engine, gateway = measured_side([3.0, 4.0, 5.0], 1000.0), measured_side([5.0, 6.0, 7.0], 900.0)
    gateway["ttft_split"] = {"after_idle": {}, "back_to_back": {}}
    anchors = Anchors(
        nats_rtt_ms=[0.1, 0.2, 0.3],
        http_floor_ms={"aiohttp": [1.0, 2.0, 3.0], "httpx": [2.0, 3.0, 4.0]},
        step_ms=1.5,
        http_floor_after_step_ms=[0.5, 0.6, 0.7],
    )
    got = run_result(
        Settings(worker=("link = false",)),
        "not pinned",
        {"engine": engine, "gateway": gateway},
        None,
        anchors,
    )
    assert got["added_ttft_ms_p50"] == pytest.approx(2.0)
    assert got["stream_tok_s_ratio"] == pytest.approx(0.9)
    assert got["stream_tok_s_ratio_by_round"] == pytest.approx([0.9, 0.9])
    assert got["worker_settings"] == ["link = false"]
    assert got["http_floor_ttft_ms_p50"] == 2.0  # the run's client's (aiohttp)
    assert got["http_floor_ttft_ms_p50_by_client"] == {"aiohttp": 2.0, "httpx": 3.0}
    assert got["http_floor_step_ms"] == 1.5 and got["nats_rtt_ms_p99"] == pytest.approx(0.298)
    assert got["outside_first_step"]["added_ttft_ms_p50"] == pytest.approx(2.0)
    for key in ("added_ttft_ms_p50_ci95", "stream_tok_s_ratio_ci95", "load_average_1m"):
        assert key in got
    assert "round_breakdown" not in got  # (only with --breakdown)


async def test_the_http_floor_answers_each_client() -> None:
    got = await http_floor_ms(idle_ms=1.0, count=3)
    assert set(got) == set(CLIENTS)
    assert all(len(v) == 3 and all(ms > 0 for ms in v) for v in got.values()), got


async def test_the_nats_anchor_times_round_trips_to_an_echo_process(nats_url: str) -> None:
    rtts = await nats_rtt_ms(nats_url, count=5)
    assert len(rtts) == 5 and all(0 < ms < 2000 for ms in rtts)


async def test_the_observer_splits_a_request_at_its_two_bus_crossings(nats_url: str) -> None:
    observer = PathObserver("obs")
    await observer.start(nats_url)
    nc = await nats.connect(nats_url)
    try:
        t0 = time.perf_counter()
        submit = SubmitRequest(
            request_id="r1",
            prompt_token_ids=[1, 2],
            params=SamplingParams(max_tokens=2),
            reply_to="obs.gateway.g.in",
            arrival_time_s=time.time(),
        )
        await nc.publish("obs.worker.w-0.in", msgspec.msgpack.encode(submit))
        delta = TokenDelta("r1", 0, [7], None, None, 2)
        batch = DeltaBatch(instance_id="w-0", step=1, events=[delta])
        await nc.publish("obs.gateway.g.in", msgspec.msgpack.encode(batch))
        await nc.flush()
        deadline = time.monotonic() + 5
        while "r1" not in observer.first_delta_at and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        observer.record("r1", t0, time.perf_counter())
        (row,) = observer.rows
        assert all(ms >= 0 for ms in row)
        assert set(observer.summary()) == {
            "http_to_submit_ms_p50",
            "worker_ms_p50",
            "delta_to_sse_ms_p50",
        }
        observer.record("r2", t0, time.perf_counter())  # never seen on the bus: no row
        assert len(observer.rows) == 1
    finally:
        await nc.close()
        await observer.close()


def test_the_launcher_starts_the_stack_that_streams_and_stops_it(tmp_path: Path) -> None:
    """In this process (its children): it serves the benchmark's client; at the end
    nothing it started runs, and this process's environment and signals are as before."""
    before = children_of(os.getpid())
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    env = {k: os.environ.get(k) for k in SERVICE_ENV}
    with launched_stack(Settings(streams=2), tmp_path) as stack:
        started = children_of(os.getpid()) - before
        assert len(started) == 5  # nats, redis, estimator, worker, gateway
        assert stack.worker_id == "random-tiny-0"

        async def one() -> tuple[float, int]:
            async with Client("aiohttp", stack.base_url) as client:
                return await stream_one(client, 0, 3)

        ttft_s, tokens = uvloop.run(one())
        assert tokens == 3 and 0 < ttft_s < 30
    assert_no_orphans(started, timeout_s=15)
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    assert {k: os.environ.get(k) for k in SERVICE_ENV} == env
