"""`bench_gateway.py --breakdown`'s throughput-round anatomy: a round split from batch
samples (lead, steps, gaps, tail), and the worker's samples read back from Redis where
the worker writes them (Store.write_snapshot, the bench's namespace and instance id);
the HTTP floor after a step; and a SIGTERM to the bench leaves none of the services it
started running."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from bench.gateway_anchors import http_floor_after_step_ms
from bench.gateway_samples import RoundAnatomy, RoundBreakdown
from bench.gateway_settings import Settings
from bench.gateway_ttft_split import ServerSplit
from shared import keys
from shared.scheduling.snapshot import BatchSample
from shared.store import Store
from tests.scripts import SCRIPTS
from tests.services.launcher.test_launcher import assert_no_orphans, children_of


def sample(
    start_s: float, duration_s: float, num_decodes: int = 16, prefill: int = 0
) -> BatchSample:
    return BatchSample(
        wall_time_s=start_s,
        duration_s=duration_s,
        num_prefill_tokens=prefill,
        num_decode_tokens=num_decodes,
        chunk_sizes=[prefill] if prefill else [],
        context_lens=[40] * (num_decodes + bool(prefill)),
        num_running=16,
        num_waiting=0,
    )


# a round from t0 = 100 s to 100.009 s: three 2 ms steps starting 1 ms, 3.5 ms and
# 6.5 ms in (gaps 0.5 and 1.0 ms), the client done 0.5 ms after the last one; one step
# before the round and one after it belong to other rounds
ROUND = [sample(100.0 + s, 0.002) for s in (0.001, 0.0035, 0.0065)]
OTHERS = [sample(99.99, 0.002), sample(100.02, 0.002)]


def test_a_round_splits_into_lead_steps_gaps_and_tail() -> None:
    anatomy = RoundAnatomy()
    anatomy.add(list(reversed(ROUND)) + OTHERS, 100.0, 100.009)  # any order
    got = anatomy.summary()
    assert got["steps"] == 3
    assert got["lead_ms"] == pytest.approx(1.0)
    assert got["step_ms"] == pytest.approx(2.0)
    assert got["gap_us_p50"] == pytest.approx(750.0)  # between 500 and 1000
    assert got["gaps_ms"] == pytest.approx(1.5)
    assert got["tail_ms"] == pytest.approx(0.5)
    assert got["wall_ms"] == pytest.approx(9.0)


def test_the_decode_step_is_the_median_of_the_largest_decode_only_batches() -> None:
    anatomy = RoundAnatomy()
    steps = [
        sample(100.000, 0.008, num_decodes=3, prefill=30),  # prefill: not a decode step
        sample(100.010, 0.003, num_decodes=15),  # a smaller batch
        sample(100.020, 0.004),
        sample(100.030, 0.005),
        sample(100.040, 0.009),
    ]
    anatomy.add(steps, 100.0, 100.05)
    got = anatomy.summary()
    assert got["decode_step_ms_p50"] == pytest.approx(5.0)
    assert got["step_ms"] == pytest.approx(5.8)  # every step's mean


def test_intake_runs_from_the_first_step_to_the_last_with_prompt_tokens() -> None:
    anatomy = RoundAnatomy()
    steps = [
        sample(100.001, 0.001, num_decodes=0, prefill=30),  # the first request alone
        sample(100.003, 0.002, num_decodes=1, prefill=60),  # two more came meanwhile
        sample(100.006, 0.002, num_decodes=3),
        sample(100.009, 0.002, num_decodes=3, prefill=30),  # the last one
        sample(100.012, 0.002, num_decodes=4),
    ]
    anatomy.add(steps, 100.0, 100.015)
    got = anatomy.summary()
    assert got["prefill_steps"] == 3
    assert got["intake_ms"] == pytest.approx(8.0)
    anatomy = RoundAnatomy()
    anatomy.add(ROUND, 100.0, 100.009)  # decode steps only: nothing taken in
    assert anatomy.summary()["intake_ms"] == 0.0


def test_the_summary_is_the_mean_of_the_rounds_and_empty_windows_are_skipped() -> None:
    anatomy = RoundAnatomy()
    anatomy.add(ROUND, 100.0, 100.009)
    anatomy.add([sample(200.004, 0.004)], 200.0, 200.010)  # one step: no gap
    anatomy.add(ROUND, 300.0, 300.010)  # no sample in the window: not a round
    got = anatomy.summary()
    assert got["steps"] == pytest.approx(2.0)
    assert got["lead_ms"] == pytest.approx(2.5)
    assert got["step_ms"] == pytest.approx(3.0)
    assert got["gaps_ms"] == pytest.approx(0.75)
    assert RoundAnatomy().summary() == {}


async def test_the_worker_side_reads_the_samples_the_worker_wrote(redis_url: str) -> None:
    store = Store(redis_url, "bench")
    await store.connect()
    try:
        await store.write_snapshot(
            "bench-0",
            1,
            b"\x90",
            ttl_s=10,
            samples=[msgspec.msgpack.encode(s) for s in ROUND + OTHERS],
        )
        rounds = RoundBreakdown(store, "bench-0")
        await rounds.record("gateway", None, 100.0, 100.009)
        got = rounds.summary()
        assert got["gateway"]["steps"] == 3
        assert got["gateway"]["tail_ms"] == pytest.approx(0.5)
        assert got["engine"] == {}
    finally:
        await store.redis.delete(
            keys.batch_samples("bench", "bench-0"), keys.snapshot("bench", "bench-0")
        )
        await store.close()


def test_the_gateway_ttft_splits_by_its_own_stamps() -> None:
    """What the client waited beyond the gateway's prepare, route and submit -> first
    token is HTTP and SSE; a request whose last chunk lacks a part is left out."""
    split = ServerSplit()
    assert split.summary() == {}
    for ttft_s, first in ((0.005, 3.0), (0.007, 5.0), (0.006, 4.0)):
        split.record(
            ttft_s, {"prepare_ms": 0.4, "router_overhead_ms": 0.1, "first_token_ms": first}
        )
    split.record(0.05, {"prepare_ms": 0.4, "router_overhead_ms": 0.1, "first_token_ms": None})
    split.record(0.05, None)
    parts = split.summary()
    assert parts == pytest.approx(
        {
            "http_and_sse_ms_p50": 1.5,
            "prepare_ms_p50": 0.4,
            "route_ms_p50": 0.1,
            "submit_to_first_token_ms_p50": 4.0,
        }
    )


async def test_the_floor_after_a_step_waits_for_the_step_and_takes_it_out() -> None:
    settings = Settings(client="aiohttp", idle_ms=1.0)
    after = await http_floor_after_step_ms(settings, step_ms=40.0, count=4)
    assert len(after) == 4
    # each answer came after the 40 ms step (else ~ -40 ms), and the step is taken out
    # (its median: one wake-up late on a loaded machine is not what this checks)
    assert all(ms > 0 for ms in after) and sorted(after)[len(after) // 2] < 40, after


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc")
def test_a_sigterm_stops_every_service_the_bench_started() -> None:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "bench_gateway.py"), "--rounds", "200", "--cpus", "none"],
        cwd=SCRIPTS.parent,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        # 1. Wait until its NATS, Redis and three services run (5 children at least),
        #    while it waits for them to be ready.
        started: set[int] = set()
        deadline = time.monotonic() + 120
        while len(started) < 5 and proc.poll() is None and time.monotonic() < deadline:
            started = children_of(proc.pid)
            time.sleep(0.2)
        assert len(started) >= 5, f"the bench started {len(started)} processes"
        # 2. Stop it as a CI timeout would.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert_no_orphans(started, timeout_s=10)
    finally:
        for pid in started | children_of(proc.pid):  # (left only when the test failed)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
