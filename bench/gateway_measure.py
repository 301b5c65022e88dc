"""The gateway benchmark's measurement: the in-process engine and the service path
alternated request by request (TTFT) and round by round (throughput), so a change in
background load hits both alike; and a run's figures from what it measured."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from bench.gateway_anchors import Anchors
from bench.gateway_client import Client, gateway_streams, stream_one
from bench.gateway_engine import EngineSide
from bench.gateway_samples import RoundBreakdown, worker_first_steps
from bench.gateway_settings import Settings
from bench.gateway_stack import NAMESPACE, Stack
from bench.gateway_stats import intervals
from bench.gateway_ttft_split import PathObserver, ServerSplit
from bench.stats import percentile

Side = dict[str, Any]  # one side's figures and raw samples


async def measure(
    settings: Settings,
    engine: EngineSide,
    base_url: str,
    observer: PathObserver | None,
    rounds: RoundBreakdown | None = None,
) -> dict[str, Side]:
    """{"engine": ..., "gateway": ...}: each side's TTFT after an idle gap and back to
    back, its token rate, and the raw samples (for the intervals and --pool)."""
    ttft: dict[str, list[float]] = {"engine": [], "gateway": []}
    # the same requests back to back (no idle gap): warm processes, as under steady load
    warm: dict[str, list[float]] = {"engine": [], "gateway": []}
    tokens = {"engine": 0, "gateway": 0}
    wall = {"engine": 0.0, "gateway": 0.0}
    # per throughput round, in order: its tokens and its wall time, s
    round_tokens: dict[str, list[int]] = {"engine": [], "gateway": []}
    round_wall: dict[str, list[float]] = {"engine": [], "gateway": []}
    splits = {"after_idle": ServerSplit(), "back_to_back": ServerSplit()}
    engine_steps: list[float] = []  # each TTFT request's first step in process, s
    ttft_at: list[float] = []  # each gateway TTFT request's start, wall clock
    idle_s = settings.idle_ms / 1e3
    async with Client(settings.client, base_url, settings.streams + 4) as client:
        for i in range(3):  # warm-up both
            engine.ttft_s(i, settings.ttft_tokens)
            await stream_one(client, i, settings.ttft_tokens)
        # and one short round of all the streams each: the client opens its pool's
        # connections here (a client streaming at load keeps them open), not in round 1
        engine.streams(settings.streams, 8)
        await gateway_streams(client, settings.streams, 8)
        per_round = max(1, settings.ttft_requests // settings.rounds)
        for r in range(settings.rounds):
            for i in range(per_round):
                # Both sides start from the same idle gap: a process that has slept
                # runs its first step on cold caches (measured: a random-tiny step
                # takes 1.7 ms back to back, 4.0 ms after 50 ms idle). Without the gap
                # the in-process engine would run hot and the worker cold.
                await asyncio.sleep(idle_s)
                ttft["engine"].append(engine.ttft_s(i, settings.ttft_tokens))
                engine_steps.append(engine.first_steps_s[-1])
                await asyncio.sleep(idle_s)
                split = splits["after_idle"]
                ttft_at.append(time.time())  # (the worker's batch samples' clock)
                t, _ = await stream_one(client, i, settings.ttft_tokens, observer, split)
                ttft["gateway"].append(t)
            for i in range(per_round):
                warm["engine"].append(engine.ttft_s(i, settings.ttft_tokens))
                split = splits["back_to_back"]
                t, _ = await stream_one(client, i, settings.ttft_tokens, None, split)
                warm["gateway"].append(t)
            for side in ("engine", "gateway") if r % 2 == 0 else ("gateway", "engine"):
                t_start = time.time()  # the batch samples' clock
                if side == "engine":
                    n, w = engine.streams(settings.streams, settings.new_tokens)
                else:
                    n, w = await gateway_streams(client, settings.streams, settings.new_tokens)
                if rounds is not None:
                    await rounds.record(side, engine, t_start, time.time())
                tokens[side] += n
                wall[side] += w
                round_tokens[side].append(n)
                round_wall[side].append(w)
            print(f"  round {r + 1}/{settings.rounds} done", flush=True)
    out: dict[str, Side] = {
        side: {
            "ttft_ms_p50": 1e3 * percentile(ttft[side], 50),
            "ttft_ms_p50_back_to_back": 1e3 * percentile(warm[side], 50),
            "ttft_ms_p99_back_to_back": 1e3 * percentile(warm[side], 99),
            "ttft_ms_p99": 1e3 * percentile(ttft[side], 99),
            "tok_s": tokens[side] / wall[side],
            "round_tok_s": [
                n / w for n, w in zip(round_tokens[side], round_wall[side], strict=True)
            ],
            # the raw samples, for the confidence intervals and --pool
            "ttft_ms": [1e3 * t for t in ttft[side]],
            "round_tokens": round_tokens[side],
            "round_wall_s": round_wall[side],
            "num_tokens": tokens[side],
            "wall_s": wall[side],
        }
        for side in ("engine", "gateway")
    }
    out["gateway"]["ttft_split"] = {k: v.summary() for k, v in splits.items()}
    out["engine"]["first_step_ms"] = [1e3 * t for t in engine_steps]
    out["gateway"]["ttft_at_wall_s"] = ttft_at  # (worker_first_steps matches the steps)
    return out


async def run_measure(
    settings: Settings, engine: EngineSide, stack: Stack
) -> tuple[dict[str, Side], dict[str, Any] | None]:
    """The measurements, with the worker's first steps; and with settings.breakdown
    their split: {"ttft": PathObserver's, "rounds": RoundBreakdown's means,
    "rounds_each": each side's rounds}."""
    from shared.store import Store

    store = Store(stack.redis_url, NAMESPACE)  # the worker's batch samples
    await store.connect()
    try:
        if not settings.breakdown:
            measured = await measure(settings, engine, stack.base_url, None)
            await worker_first_steps(store, stack.worker_id, measured["gateway"])
            return measured, None
        observer, rounds = PathObserver(NAMESPACE), RoundBreakdown(store, stack.worker_id)
        await observer.start(stack.nats_url)
        try:
            measured = await measure(settings, engine, stack.base_url, observer, rounds)
            await worker_first_steps(store, stack.worker_id, measured["gateway"])
        finally:
            await observer.close()
    finally:
        await store.close()
    return measured, {
        "ttft": observer.summary() if observer.rows else {},
        "rounds": rounds.summary(),
        "rounds_each": rounds.each(),
    }


def run_result(
    settings: Settings,
    layout: str,
    measured: dict[str, Side],
    breakdown: dict[str, Any] | None,
    anchors: Anchors,
) -> dict[str, Any]:
    """A run's JSON: the settings, each side's figures and samples, the added TTFT and
    the tok/s ratio with their intervals, the anchors (and the breakdown)."""
    engine, gateway = measured["engine"], measured["gateway"]
    result = {
        "model": settings.model,
        "dtype": settings.dtype,
        "client": settings.client,
        "streams": settings.streams,
        "worker_settings": list(settings.worker),
        "cpus": layout,
        "new_tokens": settings.new_tokens,
        "idle_ms_before_ttft_request": settings.idle_ms,
        "engine": engine,
        "gateway": gateway,
        "added_ttft_ms_p50": gateway["ttft_ms_p50"] - engine["ttft_ms_p50"],
        "added_ttft_ms_p99": gateway["ttft_ms_p99"] - engine["ttft_ms_p99"],
        "stream_tok_s_ratio": gateway["tok_s"] / engine["tok_s"],
        # each gateway round against the engine round next to it (they alternate): a
        # slow phase of the host that hits one side's rounds shows as a spread here
        "stream_tok_s_ratio_by_round": [
            g / e for g, e in zip(gateway["round_tok_s"], engine["round_tok_s"], strict=True)
        ],
        "added_ttft_ms_p50_back_to_back": gateway["ttft_ms_p50_back_to_back"]
        - engine["ttft_ms_p50_back_to_back"],
        "added_ttft_ms_p99_back_to_back": gateway["ttft_ms_p99_back_to_back"]
        - engine["ttft_ms_p99_back_to_back"],
        **anchors.figures(settings.client),
        "load_average_1m": os.getloadavg()[0],
        # the gateway TTFT taken apart by the gateway's own stamps (ServerSplit)
        "gateway_ttft_split": gateway["ttft_split"],
        **intervals(engine, gateway),
    }
    if breakdown is not None:
        result["gateway_ttft_breakdown"] = breakdown["ttft"]
        result["round_breakdown"] = breakdown["rounds"]
        result["round_breakdown_each"] = breakdown["rounds_each"]  # per round, in order
    return result
