"""Part 4 of the SFS benchmark (scripts/bench_sfs.py): what one routing decision costs,
the snapshot reads from a real Redis included.

For each instance count, every decision first has every instance write a new snapshot
version (untimed), then reads them all in one pipelined read, decodes and reconciles
them, and lets sfs-constraint choose (timed, and its parts: the read, the choice, one
candidate's TTFT alone). Once with the replay kernel that runs (its compiled build
where there is one), once with the plain-Python kernel.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
from tqdm import tqdm

from bench.cluster_sim import build_views
from bench.stats import percentile
from services.estimator.instances import InstanceState, LatencyEstimator, create_instance_state
from services.estimator.ledger import Ledger, LedgerEntry
from services.estimator.policies import create_policy
from services.estimator.sfs import kernel, native, replay
from services.estimator.sfs.replay import Probe
from shared.config import ClusterConfig, EstimatorConfig, ModelConfig
from shared.messages.estimator import RouteRequest
from shared.messages.registry import WorkerInfo
from shared.scheduling.batch_time import SFS_H100_QWEN3
from shared.scheduling.snapshot import WorkloadSnapshot
from shared.store import Store

TARGET_DECISION_P50_US_13 = 1000.0
# Result key (with _p50 / _p99 appended) -> what is timed (`_decision_runs`).
HEADLINES = {
    "decision_us": "with_reads",  # read + decode + reconcile + choice
    "service_path_us": "service_path",  # the choice alone
    "service_path_cpu_us": "service_path_cpu",  # ... its thread's CPU time
    "redis_read_us": "read_only",
    "every_ttft_decision_us": "every_ttft",  # with_reads, every candidate's TTFT computed
    "ttft_us_per_instance": "per_instance_ttft",  # one candidate's TTFT alone
}


async def decision_cost(
    args: argparse.Namespace, url: str, live_snapshot: Callable[..., WorkloadSnapshot]
) -> dict[str, Any]:
    """Part 4 against the Redis at `url` (scripts/bench_sfs.py's part 4 options);
    `live_snapshot(rng, version, num_running)` makes the snapshots the instances write."""
    store = Store(url, f"bench-sfs-{os.getpid()}")
    await store.connect()
    enc = msgspec.msgpack.Encoder()
    rng = random.Random(args.seed)
    try:
        pool = [
            enc.encode(live_snapshot(rng, v, rng.randint(20, 50)))
            for v in tqdm(range(32), desc="[4] building snapshots", unit="snap")
        ]
        # The kernel that runs (its mypyc build where one exists), then the plain
        # module side by side, swapped in where the replay instantiates it.
        impls = [("native", native.IMPL)] if native.NATIVE else []
        impls.append(("plain", kernel))
        runs: dict[str, dict[str, Any]] = {}
        try:
            for name, impl in impls:
                replay.kernel_impl = impl
                runs[name] = await _decision_runs(args, store, pool, random.Random(args.seed), name)
        finally:
            replay.kernel_impl = native.IMPL
    finally:
        await store.close()
    out = runs[impls[0][0]]
    plain = runs["plain"]
    return {
        "sfs_kernel": native.IMPL_NOTE,
        **{
            f"{key}_{q}": out[regime][q]
            for key, regime in HEADLINES.items()
            for q in ("p50", "p99")
        },
        "ttfts_per_decision_mean": out["ttfts_per_decision"],
        "all_ttfts_share": out["all_ttfts_share"],
        "plain_kernel_decision_us_p50": plain["with_reads"]["p50"],
        "plain_kernel_service_path_us_p50": plain["service_path"]["p50"],
        "target_p50_us_13": TARGET_DECISION_P50_US_13,
        "note": "on uvloop, as the estimator runs; "
        "with_reads: one pipelined Redis read of every instance's snapshot (all new "
        "versions), msgpack decode, ledger reconcile and the sfs-constraint choice, which "
        "parses and replays only the candidates whose TTFT can change its pick (best "
        "utility first until one meets the target: ttfts_per_decision_mean, all_ttfts_share "
        "how often it needed all); every_ttft: the same computing every candidate's TTFT; "
        "ttft_us_per_instance: one candidate's TTFT timed alone (its decoded snapshot parsed, "
        "the replay to the request's first token; timed on the candidates the choice did not "
        "read, so lower-utility ones; null when it read every one); "
        "service_path: the choice alone (the estimator reads and parses snapshots in its "
        "background refresh loop; here the parse of the replayed ones is in it); snapshots of 20-50 "
        "running requests from a live scheduler (bench_sfs_decision.live_snapshot); the ledger "
        f"holds the last {args.ledger_depth} dispatches; plain_kernel_*: the same with the "
        "replay kernel as plain Python (the headline figures use the kernel named in sfs_kernel)",
    }


async def _decision_runs(
    args: argparse.Namespace, store: Store, pool: list[bytes], rng: random.Random, label: str
) -> dict[str, Any]:
    """Timed decisions for each instance count with the kernel currently installed."""
    dec = msgspec.msgpack.Decoder(WorkloadSnapshot)
    models = list(SFS_H100_QWEN3.items())
    out: dict[str, Any] = {}
    for regime in HEADLINES.values():
        out[regime] = {"p50": {}, "p99": {}}
    out["ttfts_per_decision"], out["all_ttfts_share"] = {}, {}
    for n in args.decision_instances:
        est = EstimatorConfig(snapshot_max_age_s=60.0)
        cluster = ClusterConfig(
            estimator=est,
            models={
                name: ModelConfig(
                    engine="sim",
                    batch_time_features=m.feature_set,
                    batch_time_coefs=list(m.coefs),
                    quality={"default": 0.3 + 0.3 * k},
                    price_input_per_mtok=0.05 * (k + 1),
                    price_output_per_mtok=0.2 * (k + 1),
                )
                for k, (name, m) in enumerate(models)
            },
        )
        states: list[InstanceState] = []
        for j in range(n):
            name = models[j % len(models)][0]
            info = WorkerInfo(
                instance_id=f"i{j}",
                model=name,
                inbox="x",
                max_model_len=8192,
                max_num_seqs=64,
                started_at_s=0.0,
                heartbeat_at_s=0.0,
            )
            states.append(create_instance_state(info, cluster.models[name], est))
        latency = LatencyEstimator(est)
        ledger = Ledger(60.0)
        policy = create_policy("sfs-constraint", 200.0, 0.0)
        ids = [s.instance_id for s in states]
        gc.collect()
        gc.freeze()  # long-lived snapshots and states: keep full collections out of timing
        in_flight: deque[str] = deque()
        service_cpu: list[float] = []
        with_reads: list[float] = []
        service: list[float] = []
        reads: list[float] = []
        replays: list[int] = []  # TTFTs the policy read (the others were never computed)
        every: list[float] = []  # with_reads plus computing the TTFTs it did not read
        per_instance: list[float] = []  # one candidate's TTFT alone (the ones not read)
        version = 0
        for d in tqdm(range(args.decisions), desc=f"[4] {label}, {n} instances", unit="decision"):
            # untimed: every worker writes a new snapshot version (worst case: all new)
            for j, iid in enumerate(ids):
                version += 1
                await store.write_snapshot(iid, version, pool[(d + j) % len(pool)], ttl_s=60.0)
            request = RouteRequest(
                request_id=f"r{d}",
                model="auto",
                num_prompt_tokens=rng.randint(20, 3000),
                max_tokens=1024,
                task=None,
                predicted_output_tokens=rng.randint(50, 500),
            )
            probe = Probe(request.num_prompt_tokens, request.predicted_output_tokens or 1, 1024)
            # timed A: read + decode + reconcile, then the choice: it parses and
            # replays the snapshots of the candidates whose TTFT it reads (the service
            # parses every new one in its refresh loop, `LatencyEstimator.prepare`)
            t0 = time.perf_counter()
            blobs = await store.read_snapshots(ids)
            t_read = time.perf_counter()
            for state in states:
                blob = blobs[state.instance_id]
                assert blob is not None
                snap = dec.decode(blob.data)
                state.take_snapshot(snap, (blob.version, blob.wall_time_s))
                ledger.reconcile(state.instance_id, state.visible)
            t_parsed, c_parsed = time.perf_counter(), time.thread_time()
            views = build_views(
                cluster,
                policy,
                latency,
                ledger,
                states,
                request,
                probe,
                time.time(),
                time.monotonic(),
            )
            chosen = policy.choose(request, views)
            t1 = time.perf_counter()
            service_cpu.append((time.thread_time() - c_parsed) * 1e6)
            replays.append(sum(1 for v in views if v.scores is not None and v.scores.ttft_known))
            # untimed by the headline: the TTFTs the choice did not need, so that the
            # cost of a decision that computes every one is reported next to it
            # Each timed alone too: one candidate's TTFT (its snapshot parsed, the
            # replay to the request's first token) is the per-instance cost.
            t_rest = time.perf_counter()
            for v in views:
                if v.scores is not None and not v.scores.ttft_known:
                    t_one = time.perf_counter()
                    v.scores.ttft_s  # noqa: B018 (computes it)
                    per_instance.append((time.perf_counter() - t_one) * 1e6)
            every.append((t1 - t0 + time.perf_counter() - t_rest) * 1e6)
            ledger.add(
                LedgerEntry(
                    request.request_id,
                    chosen.instance_id,
                    request.num_prompt_tokens,
                    1024,
                    time.monotonic(),
                    request.predicted_output_tokens,
                )
            )
            # The service's ledger holds dispatches until a snapshot shows them (one
            # refresh, ~20 ms): keep the last `ledger_depth` in flight, as a steady
            # state at a few hundred decisions per second would.
            in_flight.append(request.request_id)
            if len(in_flight) > args.ledger_depth:
                ledger.remove(in_flight.popleft())
            with_reads.append((t1 - t0) * 1e6)
            reads.append((t_read - t0) * 1e6)
            service.append((t1 - t_parsed) * 1e6)
        for regime, xs in (
            ("with_reads", with_reads),
            ("service_path", service),
            ("service_path_cpu", service_cpu),
            ("read_only", reads),
            ("every_ttft", every),
            ("per_instance_ttft", per_instance),
        ):
            # None: nothing to time (per_instance_ttft when every decision read every TTFT)
            out[regime]["p50"][str(n)] = percentile(xs, 50) if xs else None
            out[regime]["p99"][str(n)] = percentile(xs, 99) if xs else None
        out["ttfts_per_decision"][str(n)] = statistics.fmean(replays)
        out["all_ttfts_share"][str(n)] = sum(1 for r in replays if r == n) / len(replays)
    return out
