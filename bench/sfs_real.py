"""Parts 1 and 5 of the SFS benchmark (scripts/bench_sfs.py): TTFT prediction on a
real engine, and the simulated engine's fidelity to it.

Part 1 (`run_real`) replays the trace (bench/sfs_trace.py) open loop on a real
LLMEngine in its own process (bench/engine_process.py), time-scaled so that queues
form. At each arrival the new request's TTFT is predicted from the engine's newest
snapshot plus the requests submitted but not yet in it, by the estimator service's
`LatencyEstimator` (the snapshot calibrated as a worker publishes it), by
`sfs_evaluation.estimate_from_now`, by `SfsReplayer.estimate` counted from the
snapshot's time, and by the throughput baseline; then it is measured (add_request to
the step that returns the first token). The batch-time model is fitted on a warm-up
of request bursts and refitted online as the estimator does; the throughput
baseline's profile is re-measured on the same window at every refit.

Part 5 (`fidelity`) runs the same arrivals on a SimEngine priced by the fitted
batch-time models and compares the TTFT distributions.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from tqdm import tqdm

from bench.cluster_sim import Arrival, simulate_single
from bench.engine_process import EngineProcess
from bench.sfs_evaluation import estimate_from_now, ks_distance, mape, signed_relative_errors
from bench.sfs_trace import TraceRequest, alpaca_token_ids, calibrate_scale, trace_requests
from bench.stats import percentile
from services.estimator.instances import LatencyEstimator, create_instance_state
from services.estimator.ledger import LedgerEntry
from services.estimator.sfs.baselines import profile_throughput, throughput_ttft_s
from services.estimator.sfs.fit import FitResult, OnlineBatchTimeFitter, fit_batch_time
from services.estimator.sfs.output_policy import OutputPolicy
from services.estimator.sfs.replay import PendingRequest, Probe, SfsReplayer
from shared.config import EstimatorConfig
from shared.messages.registry import WorkerInfo
from shared.scheduling.batch_time import BatchTimeModel
from shared.scheduling.scheduler import SchedulerConfig
from shared.scheduling.snapshot import BatchSample, WorkloadSnapshot, with_calibration
from shared.scheduling.speed import RecentSpeed

if TYPE_CHECKING:  # (imports torch: loaded only when part 1 runs)
    from services.worker.engine.config import EngineConfig

# The estimates part 1 scores ("errors" in its result) -> the Measured field holding them.
PREDICTIONS = {
    "sfs": "pred_sfs_s",
    "sfs_evaluation": "pred_sfs_eval_s",
    "sfs_point_lengths": "pred_sfs_point_s",
    "sfs_without_speed": "pred_sfs_flat_s",
    "sfs_from_snapshot": "pred_sfs_snapshot_s",
    "throughput": "pred_throughput_s",
    "sfs_compared": "pred_sfs_alt_s",  # with --compare-feature-set / --compare-speed-horizon-s
}


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
    pred_sfs_snapshot_s: (
        float  # SfsReplayer.estimate: counted from the snapshot's time (not in flight)
    )
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
        self.state.snapshot = with_calibration(
            snap, self.model.feature_set, self.model.coefs, self.speed.factor(snap.wall_time_s)
        )
        self.state.config_model = self.model
        self.state.snapshot_wall_time_s = snap.wall_time_s
        ttft_s = self.latency.ttft(self.state, probe, ledger, now_wall, now).ttft_s
        if self.latency.correction is not None:
            self.latency.correction.note(request_id, "real")
        return ttft_s

    def feedback(self, estimated_s: float, measured_s: float, request_id: str) -> None:
        if self.latency.correction is not None:
            self.latency.correction.observe("real", estimated_s, measured_s, request_id)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The real engine's configuration from part 1's options, as a worker's."""
    from services.worker.engine.config import EngineConfig

    ecfg = EngineConfig(
        model=args.model,
        dtype="auto",  # as workers run it: bf16 where the CPU computes it natively
        threads=1,
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_kv_blocks=args.num_kv_blocks,  # of the engine's default block size, as workers run
            max_model_len=args.max_model_len,
        ),
    ).with_env(os.environ)  # BATON_DTYPE / BATON_WEIGHT_DTYPE, as for workers
    if args.max_input + args.max_output > ecfg.scheduler.max_model_len:
        raise SystemExit("--max-input + --max-output must fit --max-model-len")
    return ecfg


def warm_up(
    runner: EngineProcess,
    args: argparse.Namespace,
    warm: list[TraceRequest],
    prompt_ids: Callable[[int], list[int]],
) -> list[BatchSample]:
    """Bursts of 1..max_num_seqs trace requests, each run to completion, so the fit
    sees prefill chunks, mixed and decode-only batches of every size: their batches."""
    from shared.sampling import SamplingParams

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
    return runner.take_samples()


def run_real(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1: the trace replayed open loop on a real engine in its own process, each
    request's TTFT predicted at its arrival and measured. The keys starting with `_`
    carry what part 5, the plots and the batch dump need (not JSON)."""
    import torch

    from services.worker.engine.sim import SimEngineConfig
    from shared.sampling import SamplingParams

    torch.set_num_threads(1)
    ecfg = engine_config(args)
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

    # 1. Warm-up, then the batch-time fit and the throughput baseline's profile on it.
    warm_samples = warm_up(runner, args, warm, prompt_ids)
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
        state.snapshot = with_calibration(
            snap, model.feature_set, model.coefs, speed.factor(snap.wall_time_s)
        )
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

    errors = {
        name: _errors([getattr(m, field) for m in done_rows], actual)
        for name, field in PREDICTIONS.items()
        if compared is not None or name != "sfs_compared"
    }
    queued = [m for m in done_rows if m.queue_at_arrival > 0]
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
        "actual_ttft_s": {q: percentile(actual, q) for q in (50, 90, 99)},
        "batch_time_fit": _fit_summary(
            args.feature_set, warm_samples, warm_fit, final_fit, measure_samples, refits
        ),
        "throughput_profile_warmup": {
            "prefill_tps": warm_profile.prefill_tps,
            "mean_decode_step_s": warm_profile.mean_decode_step_s,
        },
        "throughput_profile": {
            "prefill_tps": profile.prefill_tps,
            "mean_decode_step_s": profile.mean_decode_step_s,
        },
        "setup": _setup(args, ecfg, idle_ttft, est_cfg.speed_horizon_s),
    }
    # Part 5 needs the same arrivals on a SimEngine.
    arrivals = [
        Arrival(m.request_id, m.add_s, m.num_prompt_tokens, m.num_output_tokens) for m in rows
    ]
    result["_fidelity_inputs"] = (sim_cfg, warm_fit.model, final_fit.model, arrivals, done_rows)
    result["_rows"] = rows
    result["_batches"] = {"warmup": warm_samples, "replay": measure_samples}
    return result


def _errors(preds: list[float], actual: list[float]) -> dict[str, float]:
    """One estimator's TTFT predictions against the measured TTFTs."""
    rel = signed_relative_errors(preds, actual)
    return {
        "mape": mape(preds, actual),
        "median_ape": statistics.median(abs(x) for x in rel),
        "p90_ape": percentile([abs(x) for x in rel], 90),
        "mean_signed": statistics.fmean(rel),
    }


def _fit_summary(
    feature_set: str,
    warm_samples: list[BatchSample],
    warm_fit: FitResult,
    final_fit: FitResult,
    replay: list[BatchSample],
    num_refits: int,
) -> dict[str, Any]:
    """The batch-time fits of part 1: on the warm-up, and on everything at the end,
    each scored on the replay's batches."""
    return {
        "feature_set": feature_set,
        "warmup_samples": len(warm_samples),
        "warmup_mape_inliers": warm_fit.mape_inliers,
        "warmup_mape_all": warm_fit.mape_all,
        "warmup_model_mape_on_replay": _model_mape(warm_fit.model, replay),
        "warmup_model_sum_ratio_on_replay": _model_sum_ratio(warm_fit.model, replay),
        "final_model_sum_ratio_on_replay": _model_sum_ratio(final_fit.model, replay),
        # the batches a queued probe waits through to its first token are prefill-heavy
        "final_model_sum_ratio_prefill_batches": _model_sum_ratio(
            final_fit.model, [x for x in replay if x.num_prefill_tokens > 0]
        ),
        "final_model_sum_ratio_decode_batches": _model_sum_ratio(
            final_fit.model, [x for x in replay if x.num_prefill_tokens == 0]
        ),
        "step_gap_share": _step_gap_share(replay),
        "replay_samples": len(replay),
        "final_mape_inliers": final_fit.mape_inliers,
        "final_mape_all": final_fit.mape_all,
        "online_refits": num_refits,
        "warmup_coefs": list(warm_fit.model.coefs),
        "final_coefs": list(final_fit.model.coefs),
    }


def _setup(
    args: argparse.Namespace, ecfg: EngineConfig, idle_ttft_s: float, speed_horizon_s: float
) -> dict[str, Any]:
    """What part 1 ran: the engine, the trace's mapping, the load and the fit."""
    return {
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
        "idle_mean_ttft_s": idle_ttft_s,
        "fit": args.fit,
        "refit_every": args.refit_every,
        "fit_window": args.fit_window,
        "feature_set": args.feature_set,
        "speed_horizon_s": speed_horizon_s,
    }


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
            "real_ttft_s": {f"p{q}": percentile(rs, q) for q in (50, 90, 99)},
            "sim_ttft_s": {f"p{q}": percentile(ss, q) for q in (50, 90, 99)},
            "ks_distance": ks_distance(rs, ss),
            "per_request_mape": mape(ss, rs),
            "real_mean_s": statistics.fmean(rs),
            "sim_mean_s": statistics.fmean(ss),
        }
    out["ks_distance"] = out["final_fit"]["ks_distance"]
    return out
