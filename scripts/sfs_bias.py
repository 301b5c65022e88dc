"""SFS's TTFT error where the machine cannot add any: bench_sfs part 1's trace and load on
a SimEngine with a virtual clock, so batch times are exactly the batch-time model and
every error left is the replay's own (output lengths it predicts, requests that arrive
after the probe). Prints MAPE and mean signed error per length-prediction error, with
running requests ending at their bare predictions and at an end drawn from the
snapshot's measured length ratios (the estimator's default; docs/sfs.md, "Bias from
length predictions"), and per snapshot period (--snapshot-period-ms: estimates from a
snapshot as old as the estimator's refresh makes it; docs/sfs.md, "Snapshots older
than one iteration"). Deterministic; about a minute per period.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import bench_sfs  # noqa: E402  (the same trace mapping and load calibration)

from bench.cluster_sim import Arrival, sfs_errors_on_sim  # noqa: E402
from bench.sfs_evaluation import mape, signed_relative_errors  # noqa: E402
from bench.sfs_trace import calibrate_scale, trace_requests  # noqa: E402
from services.estimator.sfs.output_policy import OutputPolicy  # noqa: E402
from services.worker.engine.config import EngineConfig  # noqa: E402
from services.worker.engine.sim import SimEngineConfig  # noqa: E402
from shared.scheduling.batch_time import FEATURE_SETS, SEVEN_TERM, BatchTimeModel  # noqa: E402
from shared.scheduling.scheduler import SchedulerConfig  # noqa: E402

# A seven-term fit of smollm2-small (bf16, one thread) from bench_sfs part 1 on a 2-core
# x86 VM: used when --batch-time-json has none.
FALLBACK_COEFS = (0.0187, 2.89e-4, 7.83e-8, 4.55e-4, 0.0, 1.50e-8, 3.52e-5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--batch-time-json",
        type=Path,
        default=REPO / "results" / "bench_sfs.json",
        help="bench_sfs output whose final fit (any feature set) prices the batches",
    )
    ap.add_argument("--length-errors", type=float, nargs="+", default=[0.0, 0.3, 0.6])
    ap.add_argument("--ttft-inflation", type=float, default=None, help="default: bench_sfs's")
    ap.add_argument("--duration-s", type=float, default=None, help="default: bench_sfs's")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="every request's cap (default: twice bench_sfs's --max-output, above every length)",
    )
    ap.add_argument(
        "--cap-at-truth",
        action="store_true",
        help="cap each request at its true length, as part 1 on the real engine must (the "
        "cap then tells the replay the length wherever a prediction overshoots it)",
    )
    ap.add_argument(
        "--snapshot-period-ms",
        type=float,
        nargs="+",
        default=[0.0],
        help="estimate from the snapshot of the first iteration this long after the last "
        "(0: every iteration; the estimator service reads snapshots every 20 ms)",
    )
    args = ap.parse_args()

    model, source = BatchTimeModel(SEVEN_TERM, FALLBACK_COEFS), "built-in fit"
    if args.batch_time_json.is_file():
        fit = json.loads(args.batch_time_json.read_text()).get("ttft_prediction", {})
        fit = fit.get("batch_time_fit", {})
        if fit.get("feature_set") in FEATURE_SETS and fit.get("final_coefs"):
            model = BatchTimeModel(fit["feature_set"], tuple(fit["final_coefs"]))
            source = str(args.batch_time_json)
    # part 1's trace mapping and engine limits, from bench_sfs's own defaults
    part1 = bench_sfs.build_parser().parse_args([])
    engine = EngineConfig(  # as bench_sfs part 1 configures its real engine
        model=part1.model,
        scheduler=SchedulerConfig(
            max_num_seqs=part1.max_num_seqs,
            max_num_batched_tokens=part1.max_num_batched_tokens,
            num_kv_blocks=part1.num_kv_blocks,
            max_model_len=part1.max_model_len,
        ),
    )
    cfg = SimEngineConfig.like(engine, clock="virtual")
    inflation = args.ttft_inflation or part1.ttft_inflation
    duration_s = args.duration_s or part1.duration_s
    _, rows = trace_requests(part1)
    scale, idle = calibrate_scale(cfg, model, rows, inflation, duration_s)
    plan = [r for r in rows if r.offset_s * scale < duration_s]
    arrivals = [
        Arrival(f"m{i}", r.offset_s * scale, r.num_prompt_tokens, r.num_output_tokens)
        for i, r in enumerate(plan)
    ]
    print(
        f"{len(arrivals)} requests in {duration_s:.0f} s (trace time x{scale:.3f}, modeled "
        f"mean TTFT {inflation:g}x the idle {idle * 1e3:.0f} ms); batch times: {source}"
    )
    cap = None if args.cap_at_truth else (args.max_tokens or 2 * part1.max_output)
    print(f"max_tokens: {'each true length' if cap is None else cap}")
    print(
        f"{'snapshot':<9} {'length prediction':<26} {'running requests end at':<34} "
        f"{'MAPE':>7} {'mean signed':>12}"
    )
    for period_ms in args.snapshot_period_ms:
        every = "every it." if period_ms == 0 else f"{period_ms:g} ms"
        for err in args.length_errors:
            rng = random.Random(args.seed)
            predicted = {
                a.request_id: max(1, round(a.num_output_tokens * (1 + rng.uniform(-err, err))))
                for a in arrivals
            }
            for measured in (False, True):
                policy = OutputPolicy(part1.max_output, use_measured_ratios=measured)
                pred, actual = sfs_errors_on_sim(
                    cfg,
                    model,
                    arrivals,
                    predicted,
                    policy,
                    max_tokens=cap,
                    snapshot_period_s=period_ms / 1e3,
                )
                rel = signed_relative_errors(pred, actual)
                how = "an end drawn from measured ratios" if measured else "the bare prediction"
                label = "exact" if err == 0 else f"true x U({1 - err:.1f}, {1 + err:.1f})"
                print(
                    f"{every:<9} {label:<26} {how:<34} {mape(pred, actual):>7.1%} "
                    f"{statistics.fmean(rel):>+12.1%}"
                )


if __name__ == "__main__":
    main()
