"""SFS benchmark: TTFT prediction error on a real CPU engine, OnTimeUtility vs
arrival rate on the simulated SFS testbed, the delta frontier, the routing decision
cost, and the fidelity of the simulated engine. Every part side by side in one run:

  1. TTFT prediction error. A real LLMEngine (SmolLM2 family, bf16, 1 thread) runs in
     its own process, as a worker does (no NATS hop, no Redis: the engine sends its
     snapshot over a pipe after every step); the Azure conversation trace is replayed open loop, time-scaled
     so that the modeled mean TTFT is `--ttft-inflation` times the idle one (queues form),
     lengths scaled and capped to the engine's max_model_len, prompts cut from alpaca
     text. At each arrival the new request's TTFT is predicted from the engine's
     snapshot plus the requests submitted but not yet in it: SFS (in-flight aware, see
     bench/sfs_evaluation.py), SFS as the estimator service computes it
     (from the snapshot's time), and the throughput estimator. Actual TTFT = add_request
     to the step that returns the request's first token. Batch-time model: fitted on a
     warm-up of request bursts, refitted online as the estimator does; the throughput
     baseline's profile is re-measured on the same window at every refit.
  2. OnTimeUtility vs arrival rate on configs/sim-sfs.toml (Qwen3 0.6B/8B/32B, H100
     coefficients) in a discrete-event simulation (bench/cluster_sim.py):
     SimEngines on one virtual clock, the estimator's policies and LatencyEstimator
     deciding; Poisson and MMPP-2 (ratios 3, 6) arrivals; the paper's four tasks.
  3. sfs-lagrangian over delta at one rate: the utility-latency frontier (PNG).
  4. Decision cost for 3 and 13 instances including the snapshot reads from a real
     Redis started here on a free port.
  5. Fidelity of the simulated engine: the same arrivals on a SimEngine priced by the
     batch-time model fitted on the real engine; TTFT distributions compared.

    python scripts/bench_sfs.py [--parts 1 2 3 4 5] [--out results/bench_sfs.json]

Writes JSON to --out, PNGs next to it (and to --docs-img when given).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import json
import math
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import uvloop  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench.cluster_sim import (  # noqa: E402
    Arrival,
    ClusterRun,
    build_views,
    make_requests,
    simulate_cluster,
    simulate_single,
)
from bench.sfs_evaluation import (  # noqa: E402
    auc_ratio,
    estimate_from_now,
    ks_distance,
    mape,
    signed_relative_errors,
)
from bench.stats import percentile  # noqa: E402
from loadgen.arrivals import arrival_offsets, constant_profile, mmpp_profile  # noqa: E402
from loadgen.data import data_dir, how_to_get  # noqa: E402
from loadgen.tokens import WordCounter  # noqa: E402
from loadgen.traces import read_trace  # noqa: E402
from loadgen.workloads import PROMPT_SET_FILES, load_prompt_set  # noqa: E402
from services.estimator.instances import (  # noqa: E402
    InstanceState,
    LatencyEstimator,
    create_instance_state,
)
from services.estimator.ledger import Ledger, LedgerEntry  # noqa: E402
from services.estimator.policies import create_policy  # noqa: E402
from services.estimator.sfs import kernel, native, replay  # noqa: E402
from services.estimator.sfs.baselines import profile_throughput, throughput_ttft_s  # noqa: E402
from services.estimator.sfs.fit import OnlineBatchTimeFitter, fit_batch_time  # noqa: E402
from services.estimator.sfs.replay import (  # noqa: E402
    OutputPolicy,
    PendingRequest,
    Probe,
    SfsReplayer,
)
from services.estimator.sfs.utility import default_ttft_target_s  # noqa: E402
from shared.config import ClusterConfig, EstimatorConfig, ModelConfig, load_cluster  # noqa: E402
from shared.messages.estimator import RouteRequest  # noqa: E402
from shared.messages.registry import WorkerInfo  # noqa: E402
from shared.scheduling.batch_time import FEATURE_SETS, SFS_H100_QWEN3, BatchTimeModel  # noqa: E402
from shared.scheduling.scheduler import SchedulerConfig  # noqa: E402
from shared.scheduling.snapshot import BatchSample, WorkloadSnapshot  # noqa: E402
from shared.scheduling.speed import RecentSpeed  # noqa: E402

TASKS = ("alpaca", "hotpotqa", "govreport", "writingprompts")
BASELINES = ("round-robin", "shortest-queue", "latency-agnostic")
SFS_POLICIES = ("sfs-constraint", "sfs-lagrangian")
TARGET_MAPE = 0.10
TARGET_AUC_RATIO = 1.25
PAPER_AUC_RATIO = 1.33
PAPER_MAPE_SFS, PAPER_MAPE_THROUGHPUT = 0.05, 0.85
TARGET_DECISION_P50_US_13 = 1000.0
PAPER_DECISION_US = 100.0


def pct(xs: Sequence[float], q: float) -> float:
    return percentile(list(xs), q)


# =============================================================================
# Parts 1 and 5: a real engine under a replayed trace
# =============================================================================


@dataclass(slots=True)
class Measured:
    """One request of the real-engine replay."""

    request_id: str
    offset_s: float  # planned arrival, seconds from the replay's origin
    add_s: float  # actual add_request time, seconds from the origin
    num_prompt_tokens: int
    num_output_tokens: int
    predicted_output_tokens: int
    queue_at_arrival: int  # requests the engine held or was about to (snapshot + unseen)
    pred_sfs_s: float  # the estimator service's SFS (LatencyEstimator.ttft), from now
    pred_sfs_eval_s: float  # sfs_evaluation.estimate_from_now (the same estimate, cross-check)
    pred_sfs_snapshot_s: float  # SfsReplayer.estimate: counted from the snapshot's time (not in flight)
    pred_throughput_s: float
    pred_sfs_point_s: float  # as pred_sfs_eval_s, running requests end at bare predictions
    pred_sfs_flat_s: float  # as pred_sfs_s, the snapshot's batch_time_speed left at 1
    pred_sfs_alt_s: float  # as pred_sfs_s, the compared estimator's (--compare-*; nan: none)
    first_token_s: float = math.nan  # seconds from the origin
    ttft_s: float = math.nan  # first token - add_request
    # diagnostics: the snapshot's age at the decision, the bare replay's iterations to
    # the first token (in flight included), the time from the decision to add_request
    snapshot_age_s: float = math.nan
    pred_steps: int = 0
    decide_to_add_s: float = math.nan
    # the bare replay's end of the iteration in flight, seconds from the snapshot (0: idle)
    pred_in_flight_s: float = math.nan
    decide_wall_s: float = math.nan  # time.time() at the decision (batch samples' clock)


def _engine_process_main(
    ecfg: Any, t_origin: float, commands: Connection, results: Connection
) -> None:
    """The engine's own process (as a worker runs it): take submissions, step while
    there is work, and after every step send the snapshot, the first-token times, the
    ids that finished and the batch samples."""
    import torch

    from services.worker.engine.engine import LLMEngine

    torch.set_num_threads(1)
    engine = LLMEngine.create(ecfg)
    results.send((engine.snapshot(), [], [], []))  # ready
    seen_first: set[str] = set()
    while True:
        # 1. submissions (block briefly while idle, never while there is work)
        ready = commands.poll(0 if engine.has_unfinished() else 0.05)
        while ready:
            cmd = commands.recv()
            if cmd is None:
                return
            rid, ids, params, predicted = cmd
            engine.add_request(rid, ids, params, predicted_output_tokens=predicted)
            ready = commands.poll(0)
        if not engine.has_unfinished():
            continue
        # 2. one step, then what a reader needs, on the shared monotonic clock
        outputs = engine.step()
        t = time.perf_counter() - t_origin
        firsts = []
        for out in outputs:
            if out.new_token_ids and out.request_id not in seen_first:
                seen_first.add(out.request_id)
                firsts.append((out.request_id, t))
        done = [out.request_id for out in outputs if out.finished]
        seen_first.difference_update(done)
        results.send((engine.snapshot(), firsts, done, engine.pop_batch_samples()))


def calibrated(
    snap: WorkloadSnapshot, model: BatchTimeModel, speed: RecentSpeed
) -> WorkloadSnapshot:
    """The snapshot as a worker calibrated with `model` publishes it: the model's
    coefficients and the recent speed against it."""
    return msgspec.structs.replace(
        snap,
        batch_time_features=model.feature_set,
        batch_time_coefs=list(model.coefs),
        batch_time_speed=speed.factor(snap.wall_time_s),
    )


class ComparedFit:
    """--compare-feature-set / --compare-speed-horizon-s: a second online fit of the same
    iterations feeding its own LatencyEstimator (its own recent speed and measured-TTFT
    correction, its own estimator settings), so two feature sets or two speed horizons
    are scored on the same decisions of one run."""

    def __init__(
        self,
        feature_set: str,
        args: argparse.Namespace,
        warm: list[BatchSample],
        est_cfg: EstimatorConfig,
        info: WorkerInfo,
    ) -> None:
        self.fitter = OnlineBatchTimeFitter(
            feature_set, refit_every=args.refit_every, window=args.fit_window, min_samples=32
        )
        self.fitter.add(warm)
        self.model = self.fitter.refit().model
        self.online = args.fit == "online"
        self.speed = RecentSpeed()
        self.latency = LatencyEstimator(est_cfg)
        self.state = create_instance_state(info, None, est_cfg)

    def add(self, new: list[BatchSample]) -> None:
        """Iterations that ended: refit (as the primary fit does), track the speed."""
        if new and self.fitter.add(new) is not None and self.online:
            self.model = self.fitter.model or self.model
        self.speed.observe(self.model, new)

    def estimate(
        self,
        snap: WorkloadSnapshot,
        probe: Probe,
        ledger: list[LedgerEntry],
        now_wall: float,
        now: float,
        request_id: str,
    ) -> float:
        """The service's TTFT for `probe` with this fit on the snapshot; the decision's
        correction factor is noted for its feedback."""
        self.state.snapshot = calibrated(snap, self.model, self.speed)
        self.state.config_model = self.model
        self.state.snapshot_wall_time_s = snap.wall_time_s
        ttft_s = self.latency.ttft(self.state, probe, ledger, now_wall, now).ttft_s
        if self.latency.correction is not None:
            self.latency.correction.note(request_id, "real")
        return ttft_s

    def feedback(self, estimated_s: float, measured_s: float, request_id: str) -> None:
        if self.latency.correction is not None:
            self.latency.correction.observe("real", estimated_s, measured_s, request_id)


class EngineProcess:
    """Steps a real engine in its own process, as a worker does, so that the
    benchmark's decisions and refits never take the GIL from the engine's steps (in
    one process they stretched the replay's steps against the warm-up's).

    A reader thread applies each step's report under one lock: the snapshot, the
    first-token times and the ids that finished, so a reader never sees a finished
    request as merely unseen. perf_counter is CLOCK_MONOTONIC, shared by both
    processes, so first-token times are on the benchmark's clock.
    """

    def __init__(self, ecfg: Any, t_origin: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._cmd_recv, self._cmd_send = ctx.Pipe(duplex=False)
        self._res_recv, self._res_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_engine_process_main,
            args=(ecfg, t_origin, self._cmd_recv, self._res_send),
            name="engine",
            daemon=True,
        )
        self.lock = threading.Lock()
        self.first: dict[str, float] = {}
        self.done: set[str] = set()
        self.submitted: set[str] = set()
        self.samples: list[BatchSample] = []
        self.snapshot: WorkloadSnapshot | None = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name="engine-reader", daemon=True)

    def start(self) -> None:
        self._proc.start()
        self._reader.start()
        if not self._ready.wait(600):
            raise RuntimeError("the engine process did not start")

    def _read_loop(self) -> None:
        while True:
            try:
                snap, firsts, done, samples = self._res_recv.recv()
            except (EOFError, OSError):
                return
            with self.lock:
                self.snapshot = snap
                self.first.update(firsts)
                self.done.update(done)
                self.samples.extend(samples)
            self._ready.set()

    def submit(
        self, rid: str, ids: list[int], params: Any, predicted_output_tokens: int | None = None
    ) -> None:
        with self.lock:
            self.submitted.add(rid)
        self._cmd_send.send((rid, ids, params, predicted_output_tokens))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._cmd_send.send(None)
        self._proc.join(timeout=60)
        if self._proc.exitcode not in (0, None):
            raise RuntimeError(f"engine process failed (exit code {self._proc.exitcode})")

    def read(self) -> tuple[WorkloadSnapshot, set[str]]:
        with self.lock:
            assert self.snapshot is not None
            return self.snapshot, set(self.done)

    def take_samples(self) -> list[BatchSample]:
        with self.lock:
            s, self.samples = self.samples, []
        return s

    def wait_idle(self, timeout_s: float) -> None:
        """Until every submitted request has finished (or the timeout)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if self.submitted <= self.done:
                    return
            time.sleep(0.01)


def alpaca_token_ids(model: str, limit_chars: int = 2_000_000) -> list[int]:
    """Alpaca instructions, inputs and outputs as one run of our tokenizer's ids."""
    from shared.model_store import load_tokenizer

    tok = load_tokenizer(model)
    prompts = load_prompt_set("alpaca", data_dir())
    text = "\n\n".join(p.text + "\n" + p.reference for p in prompts)[:limit_chars]
    return tok.encode(text)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    offset_s: float  # trace time, seconds (unscaled)
    num_prompt_tokens: int
    num_output_tokens: int


def trace_requests(args: argparse.Namespace) -> tuple[list[TraceRequest], list[TraceRequest]]:
    """(warm-up rows, measured rows) of the trace, lengths scaled and capped."""
    rows = read_trace(args.trace, "azure")

    def mapped(r: Any, origin: float) -> TraceRequest:
        p = min(args.max_input, max(4, round(r.input_tokens * args.input_scale)))
        o = min(args.max_output, max(2, round(r.output_tokens * args.output_scale)))
        return TraceRequest(r.offset_s - origin, p, o)

    measured = [r for r in rows if r.offset_s >= args.trace_start_s]
    if not measured:
        raise SystemExit(f"--trace-start-s {args.trace_start_s} is past the trace's end")
    origin = measured[0].offset_s
    warm = [mapped(r, 0.0) for r in rows[: args.warmup_requests]]
    return warm, [mapped(r, origin) for r in measured]


def mean_sim_ttft(
    cfg: Any, model: BatchTimeModel, reqs: list[TraceRequest], scale: float, duration_s: float
) -> float:
    """Mean TTFT (s) of the requests arriving in the first `duration_s` at time scale
    `scale` (< 1 compresses the trace) on a SimEngine priced by `model`."""
    arrivals = [
        Arrival(f"c{i}", r.offset_s * scale, r.num_prompt_tokens, r.num_output_tokens)
        for i, r in enumerate(reqs)
        if r.offset_s * scale < duration_s
    ]
    run = simulate_single(cfg, model, arrivals, until_first_tokens=True)
    return statistics.fmean(run.ttft_s.values())


def calibrate_scale(
    cfg: Any, model: BatchTimeModel, reqs: list[TraceRequest], inflation: float, duration_s: float
) -> tuple[float, float]:
    """Time scale whose window has a modeled mean TTFT `inflation` times the same
    requests' mean TTFT on an idle instance (queues form, the instance keeps up).

    Bisection on log scale (TTFT falls as the scale grows). Returns (scale, idle mean).
    """
    lo, hi = 1e-2, 100.0
    window = [r for r in reqs if r.offset_s * hi < duration_s]
    spaced = [
        TraceRequest(1e6 * i, r.num_prompt_tokens, r.num_output_tokens)
        for i, r in enumerate(window)
    ]
    idle = mean_sim_ttft(cfg, model, spaced, 1.0, math.inf)
    for _ in range(16):
        mid = math.sqrt(lo * hi)
        if mean_sim_ttft(cfg, model, reqs, mid, duration_s) > inflation * idle:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi), idle


def run_real(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from services.worker.engine.config import EngineConfig
    from services.worker.engine.sim import SimEngineConfig
    from shared.sampling import SamplingParams

    torch.set_num_threads(1)
    ecfg = EngineConfig(
        model=args.model,
        dtype="auto",  # as workers run it: bf16 where the CPU computes it natively
        # of the engine's default block size, as workers run
        threads=1,
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_kv_blocks=args.num_kv_blocks,
            max_model_len=args.max_model_len,
        ),
    ).with_env(os.environ)  # BATON_DTYPE / BATON_WEIGHT_DTYPE, as for workers
    if args.max_input + args.max_output > ecfg.scheduler.max_model_len:
        raise SystemExit("--max-input + --max-output must fit --max-model-len")
    print(
        f"[1] loading {args.model} ({ecfg.resolved_dtype}, weights {ecfg.resolved_weight_dtype}, "
        "1 thread, its own process) ...",
        flush=True,
    )
    corpus = alpaca_token_ids(args.model)
    rng = random.Random(args.seed)

    def prompt_ids(n: int) -> list[int]:
        start = rng.randrange(len(corpus) - n)
        return corpus[start : start + n]

    warm, measured_rows = trace_requests(args)
    t_origin = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t_origin

    runner = EngineProcess(ecfg, t_origin)
    runner.start()

    # 1. Warm-up: bursts of 1..max_num_seqs trace requests, run to completion, so the
    #    fit sees prefill chunks, mixed and decode-only batches of every size.
    sizes = [k for k in (1, 2, 4, 8, 12, 16, 24, 32) if k <= args.max_num_seqs]
    sizes = sizes * args.warmup_rounds
    warm_it = iter(warm * (1 + sum(sizes) // max(1, len(warm))))
    n = 0
    for k in tqdm(sizes, desc="[1] warm-up bursts", unit="burst"):
        for _ in range(k):
            r = next(warm_it)
            out = min(r.num_output_tokens, args.warmup_max_output)
            params = SamplingParams(max_tokens=out, ignore_eos=True, temperature=0)
            runner.submit(f"w{n}", prompt_ids(r.num_prompt_tokens), params)
            n += 1
        time.sleep(0.05)
        runner.wait_idle(600)
    warm_samples = runner.take_samples()
    fitter = OnlineBatchTimeFitter(
        args.feature_set, refit_every=args.refit_every, window=args.fit_window, min_samples=32
    )
    fitter.add(warm_samples)
    warm_fit = fitter.refit()
    model = warm_fit.model
    profile = warm_profile = profile_throughput(warm_samples)
    print(
        f"[1] warm-up fit ({len(warm_samples)} batches, {args.feature_set}): MAPE "
        f"{warm_fit.mape_inliers:.1%} inliers, {warm_fit.mape_all:.1%} all, "
        f"{warm_fit.num_stalls} stalls; throughput profile {profile.prefill_tps:.0f} prefill "
        f"tok/s, decode step {profile.mean_decode_step_s * 1e3:.1f} ms",
        flush=True,
    )

    # 2. Time scale: the simulated instance (same limits, the fitted model) is busy
    #    `load` of the window.
    sim_cfg = SimEngineConfig.like(ecfg, clock="virtual")
    scale, idle_ttft = calibrate_scale(
        sim_cfg, model, measured_rows, args.ttft_inflation, args.duration_s
    )
    plan = [r for r in measured_rows if r.offset_s * scale < args.duration_s]
    rate = len(plan) / args.duration_s
    print(
        f"[1] replay: {len(plan)} requests in {args.duration_s:.0f} s ({rate:.2f} req/s, trace "
        f"time x{scale:.3f}): modeled mean TTFT {args.ttft_inflation:g}x the idle {idle_ttft * 1e3:.0f} ms",
        flush=True,
    )

    # 3. Open-loop replay: predict at each arrival, then submit. The snapshot carries
    #    the current fit and the recent speed under it, as a worker's does (the worker
    #    holds the estimator's calibration and observes its own iterations); side by
    #    side, the same estimator with the speed left at 1 (`flat`, its own correction).
    est_cfg = EstimatorConfig(default_output_tokens=args.max_output, snapshot_max_age_s=math.inf)
    latency = LatencyEstimator(est_cfg)
    latency_flat = LatencyEstimator(est_cfg)
    speed = RecentSpeed()
    info = WorkerInfo(
        instance_id="real",
        model=args.model,
        inbox="",
        max_model_len=ecfg.scheduler.max_model_len,
        max_num_seqs=ecfg.scheduler.max_num_seqs,
        started_at_s=0.0,
        heartbeat_at_s=0.0,
    )
    state = create_instance_state(info, None, est_cfg)
    state_flat = create_instance_state(info, None, est_cfg)
    compared = None
    if args.compare_feature_set is not None or args.compare_speed_horizon_s is not None:
        compared = ComparedFit(
            args.compare_feature_set or args.feature_set,
            args,
            warm_samples,
            est_cfg
            if args.compare_speed_horizon_s is None
            else msgspec.structs.replace(est_cfg, speed_horizon_s=args.compare_speed_horizon_s),
            info,
        )
    replayer = SfsReplayer(OutputPolicy(args.max_output))
    policy = OutputPolicy(args.max_output)  # measured length ratios from the snapshots
    point_policy = OutputPolicy(args.max_output, use_measured_ratios=False)
    num_lps = 0
    submitted: dict[str, tuple[float, PendingRequest]] = {}  # id -> (add time, entry)
    rows: list[Measured] = []
    unfed: dict[str, Measured] = {}  # submitted, first token not yet fed back
    runner.take_samples()
    t_replay = clock()
    lrng = random.Random(args.seed + 1)
    bar = tqdm(total=len(plan), desc="[1] replay", unit="req")
    refits = 0
    replay_samples: list[BatchSample] = []
    recent: deque[BatchSample] = deque(warm_samples, maxlen=args.fit_window)
    held_at: float | None = None  # when the snapshot in use (and `done`) was read
    for i, r in enumerate(plan):
        due = t_replay + r.offset_s * scale
        delay = due - clock()
        if delay > 0:
            time.sleep(delay)
        # online refit, as the estimator's fit loop does (between decisions here)
        new = runner.take_samples()
        replay_samples.extend(new)
        recent.extend(new)
        if new and fitter.add(new) is not None and args.fit == "online":
            model = fitter.model or model
            # the baseline is re-profiled on the same window: both track the machine alike
            with contextlib.suppress(ValueError):
                profile = profile_throughput(list(recent))
            refits += 1
        speed.observe(model, new)  # the worker's side: its iterations against its calibration
        if compared is not None:
            compared.add(new)
        # measured TTFTs so far go back to the estimator, as RequestDoneEvent does
        for rid2, m in list(unfed.items()):
            first = runner.first.get(rid2)
            if first is not None:
                measured = first - t_replay - m.add_s
                if latency.correction is not None:
                    latency.correction.observe("real", m.pred_sfs_s, measured, rid2)
                if latency_flat.correction is not None:
                    latency_flat.correction.observe("real", m.pred_sfs_flat_s, measured, rid2)
                if compared is not None:
                    compared.feedback(m.pred_sfs_alt_s, measured, rid2)
                del unfed[rid2]
        rid = f"m{i}"
        pred_out = max(
            1,
            round(r.num_output_tokens * (1 + lrng.uniform(-args.length_error, args.length_error))),
        )
        probe = Probe(r.num_prompt_tokens, pred_out, r.num_output_tokens)
        # the newest snapshot, or with --snapshot-period-ms the one held since the last
        # refresh (as the estimator's refresh loop reads them; `done` as of that read)
        if held_at is None or clock() - held_at >= args.snapshot_period_ms / 1e3:
            (snap, done), held_at = runner.read(), clock()
        now = clock()
        now_wall = time.time()
        age = now_wall - snap.wall_time_s
        visible = set(snap.request_ids)
        unseen = [
            (t_add, e)
            for rid2, (t_add, e) in submitted.items()
            if rid2 not in visible and rid2 not in done
        ]
        # unseen requests at their submit times from the snapshot's (before it, < 0:
        # they are in its first iteration)
        snap_clock = now - age  # the snapshot's time on our clock
        pending = [e for _, e in unseen]
        offsets = [t_add - snap_clock for t_add, _ in unseen]
        sfs_eval, sfs_point = (
            estimate_from_now(snap, model, probe, pending, age, pending_offsets_s=offsets, policy=p)
            for p in (policy, point_policy)
        )
        state.snapshot = calibrated(snap, model, speed)
        state_flat.snapshot = msgspec.structs.replace(state.snapshot, batch_time_speed=1.0)
        for st_ in (state, state_flat):
            st_.config_model = model
            st_.snapshot_wall_time_s = snap.wall_time_s
        ledger = [  # dispatch times on the wall clock, as the service's ledger has them
            LedgerEntry(
                e.request_id,
                "real",
                e.num_prompt_tokens,
                e.max_tokens,
                now_wall - (now - t_add),
                e.predicted_output_tokens,
            )
            for t_add, e in unseen
        ]
        sfs = latency.ttft(state, probe, ledger, now_wall, now)
        sfs_flat = latency_flat.ttft(state_flat, probe, ledger, now_wall, now)
        for lat in (latency, latency_flat):  # as the service notes its decision's factor
            if lat.correction is not None:
                lat.correction.note(rid, "real")
        old = replayer.estimate("real", snap, probe, ledger, model=model)
        num_lps += sfs.source != "sfs"  # not replayable: the service's queue model
        tp = throughput_ttft_s(
            snap,
            r.num_prompt_tokens,
            profile.prefill_tps,
            profile.mean_decode_step_s,
            [e for _, e in unseen],
        )
        params = SamplingParams(max_tokens=r.num_output_tokens, ignore_eos=True, temperature=0)
        ids = prompt_ids(r.num_prompt_tokens)
        t_add = clock()
        runner.submit(rid, ids, params, predicted_output_tokens=pred_out)
        # the compared estimate (--compare-*) after the submit: its inputs are fixed by
        # now, and the decision-to-submit gap stays what a plain run has
        sfs_alt_s = (
            math.nan
            if compared is None
            else compared.estimate(snap, probe, ledger, now_wall, now, rid)
        )
        submitted[rid] = (
            t_add,
            PendingRequest(rid, r.num_prompt_tokens, r.num_output_tokens, pred_out),
        )
        rows.append(
            Measured(
                rid,
                r.offset_s * scale,
                t_add - t_replay,
                r.num_prompt_tokens,
                r.num_output_tokens,
                pred_out,
                snap.num_requests + len(unseen),
                sfs.ttft_s,
                sfs_eval.ttft_s,
                old.ttft_s,
                tp,
                sfs_point.ttft_s,
                sfs_flat.ttft_s,
                sfs_alt_s,
                snapshot_age_s=age,
                pred_steps=sfs_eval.num_steps,
                decide_to_add_s=t_add - now,
                pred_in_flight_s=sfs_eval.in_flight_s,
                decide_wall_s=now_wall,
            )
        )
        unfed[rid] = rows[-1]
        for rid2 in [x for x in submitted if x in done]:
            del submitted[rid2]
        bar.update(1)
    bar.close()
    runner.wait_idle(args.drain_s)
    runner.close()
    replay_samples.extend(runner.take_samples())
    measure_samples = replay_samples
    for m in rows:
        t = runner.first.get(m.request_id)
        if t is not None:
            m.first_token_s = t - t_replay
            m.ttft_s = m.first_token_s - m.add_s
    done_rows = [m for m in rows if not math.isnan(m.ttft_s)]
    actual = [m.ttft_s for m in done_rows]
    final_fit = fit_batch_time(list(warm_samples) + measure_samples, args.feature_set)

    def err(preds: list[float]) -> dict[str, float]:
        rel = signed_relative_errors(preds, actual)
        return {
            "mape": mape(preds, actual),
            "median_ape": statistics.median(abs(x) for x in rel),
            "p90_ape": pct([abs(x) for x in rel], 90),
            "mean_signed": statistics.fmean(rel),
        }

    errors = {
        "sfs": err([m.pred_sfs_s for m in done_rows]),
        "sfs_evaluation": err([m.pred_sfs_eval_s for m in done_rows]),
        "sfs_point_lengths": err([m.pred_sfs_point_s for m in done_rows]),
        "sfs_without_speed": err([m.pred_sfs_flat_s for m in done_rows]),
        "sfs_from_snapshot": err([m.pred_sfs_snapshot_s for m in done_rows]),
        "throughput": err([m.pred_throughput_s for m in done_rows]),
    }
    if compared is not None:
        errors["sfs_compared"] = err([m.pred_sfs_alt_s for m in done_rows])
    queued = [m for m in done_rows if m.queue_at_arrival > 0]
    oos = _model_mape(warm_fit.model, measure_samples)
    result: dict[str, Any] = {
        "mape_sfs": errors["sfs"]["mape"],
        "mape_throughput": errors["throughput"]["mape"],
        "mape_sfs_evaluation": errors["sfs_evaluation"]["mape"],
        "mape_sfs_from_snapshot": errors["sfs_from_snapshot"]["mape"],
        "mape_sfs_point_lengths": errors["sfs_point_lengths"]["mape"],
        "mape_sfs_without_speed": errors["sfs_without_speed"]["mape"],
        "mape_sfs_compared": errors.get("sfs_compared", {}).get("mape"),
        "compared_feature_set": None if compared is None else compared.fitter.feature_set,
        "compared_speed_horizon_s": None
        if compared is None
        else compared.latency.settings.speed_horizon_s,
        "num_sfs_fell_back_to_lps": num_lps,
        "max_abs_diff_sfs_vs_evaluation_s": max(
            (abs(m.pred_sfs_s - m.pred_sfs_eval_s) for m in done_rows), default=math.nan
        ),
        "errors": errors,
        "mape_sfs_queued": mape([m.pred_sfs_s for m in queued], [m.ttft_s for m in queued]),
        "mape_throughput_queued": mape(
            [m.pred_throughput_s for m in queued], [m.ttft_s for m in queued]
        ),
        "num_requests": len(rows),
        "num_measured": len(done_rows),
        "num_queued_at_arrival": len(queued),
        "rate_rps": rate,
        "time_scale": scale,
        "actual_ttft_s": {q: pct(actual, q) for q in (50, 90, 99)},
        "batch_time_fit": {
            "feature_set": args.feature_set,
            "warmup_samples": len(warm_samples),
            "warmup_mape_inliers": warm_fit.mape_inliers,
            "warmup_mape_all": warm_fit.mape_all,
            "warmup_model_mape_on_replay": oos,
            "warmup_model_sum_ratio_on_replay": _model_sum_ratio(warm_fit.model, measure_samples),
            "final_model_sum_ratio_on_replay": _model_sum_ratio(final_fit.model, measure_samples),
            # the batches a queued probe waits through to its first token are prefill-heavy
            "final_model_sum_ratio_prefill_batches": _model_sum_ratio(
                final_fit.model, [x for x in measure_samples if x.num_prefill_tokens > 0]
            ),
            "final_model_sum_ratio_decode_batches": _model_sum_ratio(
                final_fit.model, [x for x in measure_samples if x.num_prefill_tokens == 0]
            ),
            "step_gap_share": _step_gap_share(measure_samples),
            "replay_samples": len(measure_samples),
            "final_mape_inliers": final_fit.mape_inliers,
            "final_mape_all": final_fit.mape_all,
            "online_refits": refits,
            "warmup_coefs": list(warm_fit.model.coefs),
            "final_coefs": list(final_fit.model.coefs),
        },
        "throughput_profile_warmup": {
            "prefill_tps": warm_profile.prefill_tps,
            "mean_decode_step_s": warm_profile.mean_decode_step_s,
        },
        "throughput_profile": {
            "prefill_tps": profile.prefill_tps,
            "mean_decode_step_s": profile.mean_decode_step_s,
        },
        "setup": {
            "model": args.model,
            "in_process": False,
            "note": "engine stepped in its own process, snapshot sent over a pipe after "
            "every step (no NATS hop, no Redis read)",
            "engine": {
                "dtype": ecfg.resolved_dtype,
                "weight_dtype": ecfg.resolved_weight_dtype,
                "max_num_seqs": ecfg.scheduler.max_num_seqs,
                "max_num_batched_tokens": ecfg.scheduler.max_num_batched_tokens,
                "num_kv_blocks": ecfg.scheduler.num_kv_blocks,
                "max_model_len": ecfg.scheduler.max_model_len,
            },
            "trace": str(args.trace),
            "trace_start_s": args.trace_start_s,
            "input_scale": args.input_scale,
            "output_scale": args.output_scale,
            "max_input": args.max_input,
            "max_output": args.max_output,
            "length_error": args.length_error,
            "snapshot_period_ms": args.snapshot_period_ms,
            "ttft_inflation": args.ttft_inflation,
            "idle_mean_ttft_s": idle_ttft,
            "fit": args.fit,
            "refit_every": args.refit_every,
            "fit_window": args.fit_window,
            "feature_set": args.feature_set,
            "speed_horizon_s": est_cfg.speed_horizon_s,
        },
    }
    # Part 5 needs the same arrivals on a SimEngine.
    arrivals = [
        Arrival(m.request_id, m.add_s, m.num_prompt_tokens, m.num_output_tokens) for m in rows
    ]
    result["_fidelity_inputs"] = (sim_cfg, warm_fit.model, final_fit.model, arrivals, done_rows)
    result["_rows"] = rows
    result["_batches"] = {"warmup": warm_samples, "replay": measure_samples}
    return result


def _model_mape(model: BatchTimeModel, samples: list[BatchSample]) -> float:
    if not samples:
        return math.nan
    return mape([model.predict(s) for s in samples], [s.duration_s for s in samples])


def _model_sum_ratio(model: BatchTimeModel, samples: list[BatchSample]) -> float:
    """Sum of predicted over sum of measured batch times: a TTFT is a sum of batches,
    so this (not the MAPE) is the batch model's bias as the replay feels it."""
    total = sum(s.duration_s for s in samples)
    return sum(model.predict(s) for s in samples) / total if total > 0 else math.nan


def _step_gap_share(samples: list[BatchSample], back_to_back_s: float = 0.005) -> float:
    """Wall time between one recorded iteration's end and the next one's start, over
    the iterations' own time, where the engine stepped back to back (a gap under
    `back_to_back_s`): time that passes for a queued request but is in no sample."""
    gaps = busy = 0.0
    for a, b in itertools.pairwise(sorted(samples, key=lambda s: s.wall_time_s)):
        gap = b.wall_time_s - (a.wall_time_s + a.duration_s)
        if 0.0 <= gap < back_to_back_s:
            gaps += gap
            busy += a.duration_s
    return gaps / busy if busy > 0 else math.nan


def fidelity(inputs: tuple[Any, ...]) -> dict[str, Any]:
    """Part 5: real TTFTs vs a SimEngine's on the same arrivals."""
    sim_cfg, warm_model, final_model, arrivals, done_rows = inputs
    real = {m.request_id: m.ttft_s for m in done_rows}
    out: dict[str, Any] = {"num_requests": len(real)}
    for name, model in (("final_fit", final_model), ("warmup_fit", warm_model)):
        run = simulate_single(sim_cfg, model, arrivals)
        sim = {rid: run.ttft_s[rid] for rid in real}
        rs, ss = list(real.values()), list(sim.values())
        out[name] = {
            "real_ttft_s": {f"p{q}": pct(rs, q) for q in (50, 90, 99)},
            "sim_ttft_s": {f"p{q}": pct(ss, q) for q in (50, 90, 99)},
            "ks_distance": ks_distance(rs, ss),
            "per_request_mape": mape(ss, rs),
            "real_mean_s": statistics.fmean(rs),
            "sim_mean_s": statistics.fmean(ss),
        }
    out["ks_distance"] = out["final_fit"]["ks_distance"]
    return out


# =============================================================================
# Parts 2 and 3: the simulated SFS testbed
# =============================================================================

_TASKS: dict[str, list[tuple[int, int]]] = {}
_CLUSTER: ClusterConfig | None = None


def paper_tasks(min_out: int, max_out: int) -> dict[str, list[tuple[int, int]]]:
    """Per task, (prompt tokens, output tokens) of every prompt of its shared set:
    prompts counted at 1.4 tokens/word; output = the reference answer's length clipped
    to [min_out, max_out] (the paper's responses span 1e2..1e3 tokens)."""
    counter = WordCounter()
    out = {}
    for task in TASKS:
        prompts = load_prompt_set(task, data_dir())
        out[task] = [
            (counter.count(p.text), min(max_out, max(min_out, counter.count(p.reference))))
            for p in prompts
        ]
    return out


def _init_worker(cluster_path: str, min_out: int, max_out: int) -> None:
    global _CLUSTER
    _CLUSTER = load_cluster(cluster_path)
    _TASKS.update(paper_tasks(min_out, max_out))
    gc.freeze()


@dataclass(frozen=True, slots=True)
class Cell:
    process: str  # "poisson" | "mmpp-r3" | ...
    rate: float
    policy: str
    delta: float
    lam: float
    num_requests: int
    length_error: float
    seed: int


def offsets_for(process: str, rate: float, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if process == "poisson":
        return arrival_offsets(constant_profile(rate), 1.0, rng, n, None)
    if process.startswith("mmpp-r"):
        ratio = float(process.removeprefix("mmpp-r"))
        # SFS public code's MMPP-2: high-state share 0.2, relaxation time 2 s.
        return arrival_offsets(mmpp_profile(rate, ratio, 0.2, 2.0, rng), 1.0, rng, n, None)
    raise ValueError(f"unknown arrival process {process!r}")


def run_cell(cell: Cell) -> dict[str, Any]:
    assert _CLUSTER is not None, "worker not initialised"
    cluster = _CLUSTER
    seed = cell.seed + int(cell.rate * 1000) + zlib.crc32(cell.process.encode()) % 1000
    offsets = offsets_for(cell.process, cell.rate, cell.num_requests, seed)
    max_len = min(i.scheduler.max_model_len for i in cluster.instances)
    reqs = make_requests(
        [float(x) for x in offsets],
        _TASKS,
        random.Random(seed),
        max_model_len=max_len,
        ttft_target_s=default_ttft_target_s,
        length_error=cell.length_error,
    )
    policy = create_policy(cell.policy, cell.lam, cell.delta, default_ttft_target_s)
    t0 = time.perf_counter()
    run: ClusterRun = simulate_cluster(cluster, policy, reqs, lam=cell.lam, seed=cell.seed)
    ttfts = run.ttfts()
    finite = [t for t in ttfts if math.isfinite(t)]
    return {
        "cell": cell,
        "ontime_utility": run.on_time_utility(),
        "mean_utility": run.mean_utility(),
        "attainment": run.attainment(),
        "mean_ttft_s": statistics.fmean(finite) if len(finite) == len(ttfts) else math.inf,
        "p50_ttft_s": pct(ttfts, 50),
        "p95_ttft_s": pct(ttfts, 95),
        "share_by_model": run.share_by_model(),
        "wall_s": time.perf_counter() - t0,
    }


def run_cells(cells: list[Cell], args: argparse.Namespace, desc: str) -> list[dict[str, Any]]:
    init = (str(args.cluster), args.min_output, args.max_output_sim)
    results: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=args.jobs, initializer=_init_worker, initargs=init) as ex:
        futures = [ex.submit(run_cell, c) for c in cells]
        for f in tqdm(futures, desc=desc, unit="cell"):
            results.append(f.result())
    return results


def cell_requests(rate: float, args: argparse.Namespace) -> int:
    return max(args.min_requests, round(rate * args.cell_seconds))


def part_ontime(args: argparse.Namespace) -> dict[str, Any]:
    policies = list(BASELINES) + list(args.sfs_policies)
    sweeps = {"poisson": args.rates}
    for r in args.mmpp_ratios:
        sweeps[f"mmpp-r{r:g}"] = args.mmpp_rates
    cells = [
        Cell(
            proc,
            rate,
            pol,
            args.delta,
            args.lam,
            cell_requests(rate, args),
            args.length_error,
            args.seed,
        )
        for proc, rates in sweeps.items()
        for rate in rates
        for pol in policies
    ]
    results = run_cells(cells, args, "[2] OnTimeUtility cells")
    by_proc: dict[str, dict[str, dict[str, float]]] = {}
    details: dict[str, dict[str, dict[str, Any]]] = {}
    for res in results:
        c: Cell = res["cell"]
        by_proc.setdefault(c.process, {}).setdefault(c.policy, {})[f"{c.rate:g}"] = res[
            "ontime_utility"
        ]
        details.setdefault(c.process, {}).setdefault(c.policy, {})[f"{c.rate:g}"] = {
            k: v for k, v in res.items() if k != "cell"
        }
    ratios: dict[str, dict[str, Any]] = {}
    for proc, curves in by_proc.items():
        numeric = {p: {float(r): v for r, v in cur.items()} for p, cur in curves.items()}
        ratios[proc] = {}
        for sfs in args.sfs_policies:
            ratio, best = auc_ratio(numeric, sfs, BASELINES)
            ratios[proc][sfs] = {"ratio": ratio, "best_baseline": best}
    return {
        "ontime_utility": by_proc["poisson"],
        "auc_ratio_vs_best_baseline": ratios["poisson"]["sfs-constraint"]["ratio"],
        "ontime_utility_by_process": by_proc,
        "auc_ratio_by_process": ratios,
        "cells": details,
        "setup": {
            "cluster": str(args.cluster),
            "lambda_per_usd": args.lam,
            "delta_per_s": args.delta,
            "length_error": args.length_error,
            "requests_per_cell": {
                f"{r:g}": cell_requests(r, args) for r in sorted({*args.rates, *args.mmpp_rates})
            },
            "output_tokens_clip": [args.min_output, args.max_output_sim],
            "mmpp": "two-state, high-state share 0.2, relaxation time 2 s",
        },
    }


def part_frontier(args: argparse.Namespace) -> dict[str, Any]:
    cells = [
        Cell(
            "poisson",
            args.frontier_rate,
            "sfs-lagrangian",
            d,
            args.lam,
            cell_requests(args.frontier_rate, args),
            args.length_error,
            args.seed,
        )
        for d in args.deltas
    ] + [
        Cell(
            "poisson",
            args.frontier_rate,
            p,
            0.0,
            args.lam,
            cell_requests(args.frontier_rate, args),
            args.length_error,
            args.seed,
        )
        for p in (*BASELINES, "sfs-constraint")
    ]
    results = run_cells(cells, args, "[3] delta frontier cells")
    points = []
    for res in results:
        c: Cell = res["cell"]
        points.append(
            {
                "policy": c.policy,
                "delta": c.delta if c.policy == "sfs-lagrangian" else None,
                "mean_utility": res["mean_utility"],
                "ontime_utility": res["ontime_utility"],
                "mean_ttft_s": res["mean_ttft_s"],
                "p95_ttft_s": res["p95_ttft_s"],
                "attainment": res["attainment"],
            }
        )
    return {"rate_rps": args.frontier_rate, "points": points}


# =============================================================================
# Part 4: decision cost with the snapshot reads from a real Redis
# =============================================================================


def part_decision(args: argparse.Namespace) -> dict[str, Any]:
    from bench_sfs_decision import live_snapshot

    from services.launcher.servers import start_redis
    from shared.store import Store

    server = start_redis("127.0.0.1", None)
    try:
        # on uvloop, as the estimator service runs (shared.runtime): the read is
        # measured on the event loop that does it there
        return uvloop.run(_decision_async(args, server.url, live_snapshot, Store))
    finally:
        server.stop()


async def _decision_async(
    args: argparse.Namespace,
    url: str,
    live_snapshot: Callable[..., WorkloadSnapshot],
    store_cls: Any,
) -> dict[str, Any]:
    store = store_cls(url, f"bench-sfs-{os.getpid()}")
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
        "decision_us_p50": out["with_reads"]["p50"],
        "decision_us_p99": out["with_reads"]["p99"],
        "service_path_us_p50": out["service_path"]["p50"],
        "service_path_us_p99": out["service_path"]["p99"],
        "service_path_cpu_us_p50": out["service_path_cpu"]["p50"],
        "service_path_cpu_us_p99": out["service_path_cpu"]["p99"],
        "redis_read_us_p50": out["read_only"]["p50"],
        "redis_read_us_p99": out["read_only"]["p99"],
        "every_ttft_decision_us_p50": out["every_ttft"]["p50"],
        "every_ttft_decision_us_p99": out["every_ttft"]["p99"],
        "ttft_us_per_instance_p50": out["per_instance_ttft"]["p50"],
        "ttft_us_per_instance_p99": out["per_instance_ttft"]["p99"],
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
    args: argparse.Namespace, store: Any, pool: list[bytes], rng: random.Random, label: str
) -> dict[str, Any]:
    """Timed decisions for each instance count with the kernel currently installed."""
    dec = msgspec.msgpack.Decoder(WorkloadSnapshot)
    models = list(SFS_H100_QWEN3.items())
    out: dict[str, Any] = {}
    for regime in (
        "with_reads",
        "service_path",
        "service_path_cpu",
        "read_only",
        "every_ttft",
        "per_instance_ttft",
    ):
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
            out[regime]["p50"][str(n)] = pct(xs, 50) if xs else None
            out[regime]["p99"][str(n)] = pct(xs, 99) if xs else None
        out["ttfts_per_decision"][str(n)] = statistics.fmean(replays)
        out["all_ttfts_share"][str(n)] = sum(1 for r in replays if r == n) / len(replays)
    return out


# =============================================================================
# Plots and printing
# =============================================================================


def plot_ontime(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    procs = list(res["ontime_utility_by_process"])
    fig, axes = plt.subplots(1, len(procs), figsize=(5 * len(procs), 4), squeeze=False)
    for ax, proc in zip(axes[0], procs, strict=True):
        for pol, cur in res["ontime_utility_by_process"][proc].items():
            xs = sorted(cur, key=float)
            ax.plot([float(x) for x in xs], [cur[x] for x in xs], marker="o", label=pol)
        r = res["auc_ratio_by_process"][proc]["sfs-constraint"]["ratio"]
        ax.set_title(f"{proc}: SFS AUC {r:.2f}x best baseline")
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel("OnTimeUtility")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Simulated SFS testbed (Qwen3 0.6B/8B/32B, H100 coefficients)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_frontier(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    lag = sorted(
        (p for p in res["points"] if p["policy"] == "sfs-lagrangian"), key=lambda p: p["delta"]
    )
    ax.plot(
        [p["mean_ttft_s"] for p in lag],
        [p["mean_utility"] for p in lag],
        marker="o",
        label="sfs-lagrangian (delta sweep)",
    )
    for p in lag:
        ax.annotate(
            f"{p['delta']:g}",
            (p["mean_ttft_s"], p["mean_utility"]),
            fontsize=7,
            xytext=(3, 3),
            textcoords="offset points",
        )
    for p in res["points"]:
        if p["policy"] != "sfs-lagrangian":
            ax.scatter(
                [p["mean_ttft_s"]], [p["mean_utility"]], marker="s", label=p["policy"], zorder=3
            )
    ax.set_xscale("log")
    ax.set_xlabel("mean TTFT (s, log)")
    ax.set_ylabel("mean utility (acc - lambda * cost)")
    ax.set_title(f"Utility-latency frontier at {res['rate_rps']:g} req/s (Poisson)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_prediction(rows: list[Measured], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [m for m in rows if not math.isnan(m.ttft_s)]
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2), sharex=True, sharey=True)
    actual = [m.ttft_s for m in done]
    for ax, (name, preds) in zip(
        axes,
        (
            ("throughput estimator", [m.pred_throughput_s for m in done]),
            ("SFS replay", [m.pred_sfs_s for m in done]),
        ),
        strict=True,
    ):
        ax.scatter(actual, preds, s=6, alpha=0.5)
        lim = max(max(actual), 1e-3)
        ax.plot([0, lim], [0, lim], color="k", lw=0.8)
        ax.set_title(f"{name}: MAPE {mape(preds, actual):.0%}")
        ax.set_xlabel("measured TTFT (s)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("predicted TTFT (s)")
    fig.suptitle("Real CPU engine (its own process) under the Azure conversation trace")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_average() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def jsonable(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    return x


def build_parser() -> argparse.ArgumentParser:
    """Every knob of the benchmark (scripts/sfs_bias.py reads part 1's defaults here)."""
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument(
        "--parts", type=int, nargs="+", default=[1, 2, 3, 4, 5], choices=[1, 2, 3, 4, 5]
    )
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench_sfs.json")
    ap.add_argument(
        "--docs-img", type=Path, default=None, help="also copy the PNGs here (e.g. docs/img)"
    )
    ap.add_argument("--seed", type=int, default=0)
    g1 = ap.add_argument_group("parts 1 and 5 (real engine)")
    g1.add_argument(
        "--model", default="smollm2-small", help="smollm2-135m | smollm2-medium | smollm2-small"
    )
    g1.add_argument("--trace", type=Path, default=data_dir() / "traces" / "azure_llm_2023_conv.csv")
    g1.add_argument(
        "--trace-start-s",
        type=float,
        default=600.0,
        help="trace offset of the replay's first row (warm-up rows come from the start)",
    )
    g1.add_argument("--warmup-requests", type=int, default=200)
    g1.add_argument(
        "--warmup-rounds", type=int, default=1, help="rounds of bursts of 1..max_num_seqs requests"
    )
    g1.add_argument(
        "--warmup-max-output", type=int, default=64, help="output cap of the warm-up requests"
    )
    g1.add_argument("--refit-every", type=int, default=64, help="new batches between online refits")
    g1.add_argument(
        "--fit-window", type=int, default=1024, help="newest batches an online refit uses"
    )
    g1.add_argument("--duration-s", type=float, default=240.0, help="arrival window of the replay")
    g1.add_argument("--drain-s", type=float, default=120.0)
    g1.add_argument(
        "--ttft-inflation",
        type=float,
        default=3.0,
        help="the time scale makes the modeled mean TTFT this many times the idle one",
    )
    g1.add_argument("--input-scale", type=float, default=0.125)
    g1.add_argument("--output-scale", type=float, default=0.5)
    g1.add_argument("--max-input", type=int, default=448)
    g1.add_argument("--max-output", type=int, default=256)
    g1.add_argument("--max-model-len", type=int, default=1024)
    g1.add_argument("--max-num-seqs", type=int, default=32)
    g1.add_argument("--max-num-batched-tokens", type=int, default=256)
    g1.add_argument("--num-kv-blocks", type=int, default=512, help="KV blocks of 64 tokens")
    g1.add_argument("--feature-set", default="eight-term", choices=list(FEATURE_SETS))
    g1.add_argument(
        "--compare-feature-set",
        choices=list(FEATURE_SETS),
        help="also estimate with this feature set's own fit, side by side (mape_sfs_compared)",
    )
    g1.add_argument(
        "--compare-speed-horizon-s",
        type=float,
        help="also estimate with the recent speed faded over this many seconds (the "
        "estimator's speed_horizon_s), side by side (mape_sfs_compared)",
    )
    g1.add_argument(
        "--fit",
        default="online",
        choices=["online", "warmup"],
        help="refit while replaying (as the estimator) or keep the warm-up fit",
    )
    g1.add_argument(
        "--length-error", type=float, default=0.3, help="predicted output = true x (1 + U(-e, e))"
    )
    g1.add_argument(
        "--snapshot-period-ms",
        type=float,
        default=0.0,
        help="estimate from a snapshot re-read only this often (0: the newest, sent after "
        "every step; the estimator service reads them every 20 ms)",
    )
    g2 = ap.add_argument_group("parts 2 and 3 (simulated SFS testbed)")
    g2.add_argument("--cluster", type=Path, default=REPO / "configs" / "sim-sfs.toml")
    g2.add_argument("--rates", type=float, nargs="+", default=[2, 4, 8, 12, 16, 24, 32, 40])
    g2.add_argument("--mmpp-rates", type=float, nargs="+", default=[4, 8, 16, 24, 32])
    g2.add_argument("--mmpp-ratios", type=float, nargs="*", default=[3, 6])
    g2.add_argument(
        "--sfs-policies", nargs="+", default=list(SFS_POLICIES), choices=list(SFS_POLICIES)
    )
    g2.add_argument("--lam", type=float, default=200.0, help="utility per USD of cost")
    g2.add_argument(
        "--delta",
        type=float,
        default=3.0,
        help="sfs-lagrangian in part 2: utility per second of TTFT",
    )
    g2.add_argument(
        "--deltas", type=float, nargs="+", default=[0.03, 0.1, 0.3, 1, 2, 3, 5, 10, 30, 100]
    )
    g2.add_argument("--frontier-rate", type=float, default=16.0)
    g2.add_argument("--cell-seconds", type=float, default=30.0, help="arrival window per cell")
    g2.add_argument("--min-requests", type=int, default=300)
    g2.add_argument("--min-output", type=int, default=100)
    g2.add_argument("--max-output-sim", type=int, default=1000)
    g2.add_argument("--jobs", type=int, default=2, help="processes for the simulation cells")
    g4 = ap.add_argument_group("part 4 (decision cost)")
    g4.add_argument("--decisions", type=int, default=400)
    g4.add_argument(
        "--ledger-depth", type=int, default=4, help="dispatches not yet in any snapshot"
    )
    g4.add_argument("--decision-instances", type=int, nargs="+", default=[3, 13])
    return ap


def data_files(parts: set[int], trace: Path) -> list[Path]:
    """The data files the asked parts read: 1 and 5 the trace they replay and alpaca
    (the length predictor's corpus), 2 and 3 every task's prompt set (their lengths)."""
    prompts = data_dir() / "prompts"
    files: list[Path] = []
    if parts & {1, 5}:
        files += [trace, prompts / PROMPT_SET_FILES["alpaca"]]
    if parts & {2, 3}:
        files += [prompts / PROMPT_SET_FILES[t] for t in TASKS]
    return list(dict.fromkeys(files))


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    if args.ttft_inflation <= 1:
        ap.error("--ttft-inflation must be > 1")
    if not 0 <= args.length_error < 1:
        ap.error("--length-error must be in [0, 1)")
    if not 0 <= args.snapshot_period_ms < math.inf:
        ap.error("--snapshot-period-ms must be a finite number >= 0")
    missing = [str(p) for p in data_files(set(args.parts), args.trace) if not p.is_file()]
    if missing:  # (before any part runs: part 2's worker pool would fail with a traceback)
        ap.error(
            "the data these parts read is not there: "
            + ", ".join(missing)
            + f" ({how_to_get()}; --parts 4 needs none)"
        )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    img_dir = args.out.parent
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "load_before": load_average(),
    }
    pngs: list[Path] = []
    summary: list[str] = []
    parts = set(args.parts)

    if parts & {1, 5}:
        real = run_real(args)
        rows = real.pop("_rows")
        fid_inputs = real.pop("_fidelity_inputs")
        batches = real.pop("_batches")
        (args.out.parent / (args.out.stem + "_batches.json")).write_text(
            json.dumps({k: [msgspec.to_builtins(b) for b in v] for k, v in batches.items()})
        )
        if 1 in parts:
            result["ttft_prediction"] = real
            png = img_dir / "sfs-ttft-prediction.png"
            plot_prediction(rows, png)
            pngs.append(png)
            (args.out.parent / (args.out.stem + "_requests.json")).write_text(
                json.dumps([jsonable(dataclasses.asdict(m)) for m in rows])
            )
            bt = real["batch_time_fit"]
            summary += [
                "1. TTFT prediction, real CPU engine in its own process (no NATS hop), "
                f"{real['setup']['model']}, {real['num_measured']} requests at {real['rate_rps']:.2f} req/s "
                f"({real['num_queued_at_arrival']} found work queued):",
                f"   MAPE SFS {real['mape_sfs']:.1%} (service's LatencyEstimator, with the measured-TTFT correction; the bare replay, sfs_evaluation.estimate_from_now, {real['mape_sfs_evaluation']:.1%}; counted from the snapshot's time {real['mape_sfs_from_snapshot']:.1%}; running requests ending at bare length predictions {real['mape_sfs_point_lengths']:.1%}; without the recent speed {real['mape_sfs_without_speed']:.1%}) vs "
                f"throughput {real['mape_throughput']:.1%} -> {real['mape_throughput'] / real['mape_sfs']:.1f}x better; "
                f"target SFS <= {TARGET_MAPE:.0%} ({'met' if real['mape_sfs'] <= TARGET_MAPE else 'NOT met'}); "
                f"paper: {PAPER_MAPE_SFS:.0%} vs {PAPER_MAPE_THROUGHPUT:.0%}",
                *(
                    [
                        f"   side by side, the same estimator on a {real['compared_feature_set']} "
                        f"fit with the speed faded over {real['compared_speed_horizon_s']} s "
                        f"(served: {real['setup']['feature_set']}, "
                        f"{real['setup']['speed_horizon_s']} s): "
                        f"MAPE SFS {real['mape_sfs_compared']:.1%}"
                    ]
                    if real["compared_feature_set"]
                    else []
                ),
                f"   batch-time model ({bt['feature_set']}): warm-up fit MAPE {bt['warmup_mape_inliers']:.1%} "
                f"(all {bt['warmup_mape_all']:.1%}), on the replay's batches {bt['warmup_model_mape_on_replay']:.1%}, "
                f"final fit {bt['final_mape_inliers']:.1%}; paper ~4%; predicted / measured "
                f"batch time summed over the replay: warm-up model "
                f"{bt['warmup_model_sum_ratio_on_replay']:.3f}, final "
                f"{bt['final_model_sum_ratio_on_replay']:.3f} (batches with prefill "
                f"{bt['final_model_sum_ratio_prefill_batches']:.3f}, decode-only "
                f"{bt['final_model_sum_ratio_decode_batches']:.3f}); time between back-to-back steps "
                f"{bt['step_gap_share']:.1%} of their own",
            ]
        if 5 in parts:
            fid = fidelity(fid_inputs)
            result["sim_fidelity"] = fid
            f = fid["final_fit"]
            summary += [
                f"5. SimEngine fidelity ({fid['num_requests']} requests): TTFT p50/p90/p99 real "
                f"{f['real_ttft_s']['p50'] * 1e3:.0f}/{f['real_ttft_s']['p90'] * 1e3:.0f}/{f['real_ttft_s']['p99'] * 1e3:.0f} ms "
                f"vs sim {f['sim_ttft_s']['p50'] * 1e3:.0f}/{f['sim_ttft_s']['p90'] * 1e3:.0f}/{f['sim_ttft_s']['p99'] * 1e3:.0f} ms, "
                f"KS {f['ks_distance']:.3f} (warm-up fit: KS {fid['warmup_fit']['ks_distance']:.3f})",
            ]
    if 2 in parts:
        res2 = part_ontime(args)
        result["ontime"] = res2
        png = img_dir / "sfs-ontime-utility.png"
        plot_ontime(res2, png)
        pngs.append(png)
        summary.append("2. OnTimeUtility AUC ratio vs best baseline (target >= 1.25, paper 1.33):")
        for proc, r in res2["auc_ratio_by_process"].items():
            cells = ", ".join(
                f"{p} {v['ratio']:.2f}x (vs {v['best_baseline']})" for p, v in r.items()
            )
            summary.append(f"   {proc}: {cells}")
        cur = res2["ontime_utility"]
        rates = sorted(next(iter(cur.values())), key=float)
        summary.append("   poisson OnTimeUtility: rate " + " ".join(f"{r:>6}" for r in rates))
        for pol, c in cur.items():
            summary.append(f"   {pol:>18}: " + " ".join(f"{c[r]:6.3f}" for r in rates))
    if 3 in parts:
        res3 = part_frontier(args)
        result["frontier"] = res3
        png = img_dir / "sfs-frontier.png"
        plot_frontier(res3, png)
        pngs.append(png)
        summary.append(
            f"3. delta frontier at {res3['rate_rps']:g} req/s (mean TTFT, mean utility, OnTimeUtility):"
        )
        for p in res3["points"]:
            label = f"delta={p['delta']:g}" if p["delta"] is not None else p["policy"]
            summary.append(
                f"   {label:>18}: {p['mean_ttft_s'] * 1e3:9.1f} ms  {p['mean_utility']:.3f}  {p['ontime_utility']:.3f}"
            )
    if 4 in parts:
        res4 = part_decision(args)
        result["decision"] = res4

        def per_count(fmt: Callable[[str], str]) -> str:
            """One entry per instance count, e.g. '3 inst ..., 13 inst ...'."""
            return ", ".join(f"{n} inst {fmt(n)}" for n in res4["decision_us_p50"])

        summary.append(
            "4. decision cost incl. Redis snapshot reads (p50/p99 us): "
            + per_count(
                lambda n: f"{res4['decision_us_p50'][n]:.0f}/{res4['decision_us_p99'][n]:.0f}"
            )
            + "; estimator path (replay+choose): "
            + per_count(
                lambda n: (
                    f"{res4['service_path_us_p50'][n]:.0f}/{res4['service_path_us_p99'][n]:.0f}"
                    f" (cpu p50 {res4['service_path_cpu_us_p50'][n]:.0f})"
                )
            )
            + f"; target p50 <= {TARGET_DECISION_P50_US_13:.0f} us at 13; paper C++ ~{PAPER_DECISION_US:.0f} us"
            + "\n   TTFTs computed per decision (mean; share needing all): "
            + per_count(
                lambda n: (
                    f"{res4['ttfts_per_decision_mean'][n]:.1f} ({res4['all_ttfts_share'][n]:.0%})"
                )
            )
            + "; computing every TTFT instead (p50/p99 us): "
            + per_count(
                lambda n: (
                    f"{res4['every_ttft_decision_us_p50'][n]:.0f}/"
                    f"{res4['every_ttft_decision_us_p99'][n]:.0f}"
                )
            )
            + "; one instance's TTFT alone (p50/p99 us): "
            + per_count(
                lambda n: (
                    "n/a (every decision read every TTFT)"
                    if res4["ttft_us_per_instance_p50"][n] is None
                    else f"{res4['ttft_us_per_instance_p50'][n]:.0f}/"
                    f"{res4['ttft_us_per_instance_p99'][n]:.0f}"
                )
            )
            + f"\n   kernel: {res4['sfs_kernel']}; the plain-Python kernel side by side: "
            + per_count(
                lambda n: (
                    f"{res4['plain_kernel_decision_us_p50'][n]:.0f} with reads, "
                    f"{res4['plain_kernel_service_path_us_p50'][n]:.0f} path "
                    f"({res4['plain_kernel_service_path_us_p50'][n] / res4['service_path_us_p50'][n]:.2f}x)"
                )
            )
        )

    result["load_after"] = load_average()
    args.out.write_text(json.dumps(jsonable(result), indent=2))
    if args.docs_img is not None:
        args.docs_img.mkdir(parents=True, exist_ok=True)
        for p in pngs:
            dest = args.docs_img / p.name
            if p.resolve() != dest.resolve():  # --docs-img may be --out's folder
                shutil.copy(p, dest)
    print()
    print("\n".join(summary))
    print(f"load: before [{result['load_before']}] after [{result['load_after']}]")
    print(f"wrote {args.out}" + "".join(f", {p}" for p in pngs))


if __name__ == "__main__":
    main()
