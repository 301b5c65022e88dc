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

The harnesses are in bench/: sfs_trace.py (the trace and its load), engine_process.py
(the real engine in its own process), sfs_real.py (parts 1 and 5), sfs_cells.py
(parts 2 and 3), decision_cost.py (part 4).

    python scripts/bench_sfs.py [--parts 1 2 3 4 5] [--out results/bench_sfs.json]

Writes JSON to --out, PNGs next to it (and to --docs-img when given).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import msgspec  # noqa: E402
import uvloop  # noqa: E402

from bench.decision_cost import TARGET_DECISION_P50_US_13, decision_cost  # noqa: E402
from bench.sfs_cells import SFS_POLICIES, TASKS, delta_frontier, ontime_sweep  # noqa: E402
from bench.sfs_evaluation import mape  # noqa: E402
from bench.sfs_real import Measured, fidelity, run_real  # noqa: E402
from loadgen.data import data_dir, how_to_get  # noqa: E402
from loadgen.workloads import PROMPT_SET_FILES  # noqa: E402
from shared.scheduling.batch_time import FEATURE_SETS  # noqa: E402

TARGET_MAPE = 0.10
TARGET_AUC_RATIO = 1.25
PAPER_AUC_RATIO = 1.33
PAPER_MAPE_SFS, PAPER_MAPE_THROUGHPUT = 0.05, 0.85
PAPER_DECISION_US = 100.0


def part_decision(args: argparse.Namespace) -> dict[str, Any]:
    """Part 4 against a redis-server started here on a free port."""
    from bench_sfs_decision import live_snapshot

    from services.launcher.servers import start_redis

    server = start_redis("127.0.0.1", None)
    try:
        # on uvloop, as the estimator service runs (shared.runtime): the read is
        # measured on the event loop that does it there
        return uvloop.run(decision_cost(args, server.url, live_snapshot))
    finally:
        server.stop()


# A simulated part's plot (its result, the PNG's path) and its lines of the summary.
Plot = Callable[[dict[str, Any], Path], None]
Summary = Callable[[dict[str, Any]], list[str]]


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


def summary_real(real: dict[str, Any]) -> list[str]:
    """Part 1's lines of the printed summary."""
    bt = real["batch_time_fit"]
    return [
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


def summary_fidelity(fid: dict[str, Any]) -> list[str]:
    """Part 5's lines of the printed summary."""
    f = fid["final_fit"]
    return [
        f"5. SimEngine fidelity ({fid['num_requests']} requests): TTFT p50/p90/p99 real "
        f"{f['real_ttft_s']['p50'] * 1e3:.0f}/{f['real_ttft_s']['p90'] * 1e3:.0f}/{f['real_ttft_s']['p99'] * 1e3:.0f} ms "
        f"vs sim {f['sim_ttft_s']['p50'] * 1e3:.0f}/{f['sim_ttft_s']['p90'] * 1e3:.0f}/{f['sim_ttft_s']['p99'] * 1e3:.0f} ms, "
        f"KS {f['ks_distance']:.3f} (warm-up fit: KS {fid['warmup_fit']['ks_distance']:.3f})",
    ]


def summary_ontime(res: dict[str, Any]) -> list[str]:
    """Part 2's lines of the printed summary."""
    lines = [
        f"2. OnTimeUtility AUC ratio vs best baseline (target >= {TARGET_AUC_RATIO:g}, "
        f"paper {PAPER_AUC_RATIO:g}):"
    ]
    for proc, r in res["auc_ratio_by_process"].items():
        cells = ", ".join(f"{p} {v['ratio']:.2f}x (vs {v['best_baseline']})" for p, v in r.items())
        lines.append(f"   {proc}: {cells}")
    cur = res["ontime_utility"]
    rates = sorted(next(iter(cur.values())), key=float)
    lines.append("   poisson OnTimeUtility: rate " + " ".join(f"{r:>6}" for r in rates))
    for pol, c in cur.items():
        lines.append(f"   {pol:>18}: " + " ".join(f"{c[r]:6.3f}" for r in rates))
    return lines


def summary_frontier(res: dict[str, Any]) -> list[str]:
    """Part 3's lines of the printed summary."""
    lines = [
        f"3. delta frontier at {res['rate_rps']:g} req/s (mean TTFT, mean utility, OnTimeUtility):"
    ]
    for p in res["points"]:
        label = f"delta={p['delta']:g}" if p["delta"] is not None else p["policy"]
        lines.append(
            f"   {label:>18}: {p['mean_ttft_s'] * 1e3:9.1f} ms  {p['mean_utility']:.3f}  {p['ontime_utility']:.3f}"
        )
    return lines


def summary_decision(res: dict[str, Any]) -> list[str]:
    """Part 4's lines of the printed summary."""

    def per_count(fmt: Callable[[str], str]) -> str:
        """One entry per instance count, e.g. '3 inst ..., 13 inst ...'."""
        return ", ".join(f"{n} inst {fmt(n)}" for n in res["decision_us_p50"])

    return [
        "4. decision cost incl. Redis snapshot reads (p50/p99 us): "
        + per_count(lambda n: f"{res['decision_us_p50'][n]:.0f}/{res['decision_us_p99'][n]:.0f}")
        + "; estimator path (replay+choose): "
        + per_count(
            lambda n: (
                f"{res['service_path_us_p50'][n]:.0f}/{res['service_path_us_p99'][n]:.0f}"
                f" (cpu p50 {res['service_path_cpu_us_p50'][n]:.0f})"
            )
        )
        + f"; target p50 <= {TARGET_DECISION_P50_US_13:.0f} us at 13; paper C++ ~{PAPER_DECISION_US:.0f} us"
        + "\n   TTFTs computed per decision (mean; share needing all): "
        + per_count(
            lambda n: f"{res['ttfts_per_decision_mean'][n]:.1f} ({res['all_ttfts_share'][n]:.0%})"
        )
        + "; computing every TTFT instead (p50/p99 us): "
        + per_count(
            lambda n: (
                f"{res['every_ttft_decision_us_p50'][n]:.0f}/"
                f"{res['every_ttft_decision_us_p99'][n]:.0f}"
            )
        )
        + "; one instance's TTFT alone (p50/p99 us): "
        + per_count(
            lambda n: (
                "n/a (every decision read every TTFT)"
                if res["ttft_us_per_instance_p50"][n] is None
                else f"{res['ttft_us_per_instance_p50'][n]:.0f}/"
                f"{res['ttft_us_per_instance_p99'][n]:.0f}"
            )
        )
        + f"\n   kernel: {res['sfs_kernel']}; the plain-Python kernel side by side: "
        + per_count(
            lambda n: (
                f"{res['plain_kernel_decision_us_p50'][n]:.0f} with reads, "
                f"{res['plain_kernel_service_path_us_p50'][n]:.0f} path "
                f"({res['plain_kernel_service_path_us_p50'][n] / res['service_path_us_p50'][n]:.2f}x)"
            )
        )
    ]


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
            summary += summary_real(real)
        if 5 in parts:
            result["sim_fidelity"] = fid = fidelity(fid_inputs)
            summary += summary_fidelity(fid)
    simulated: list[tuple[int, str, Callable[..., dict[str, Any]], Plot, str, Summary]] = [
        (2, "ontime", ontime_sweep, plot_ontime, "sfs-ontime-utility.png", summary_ontime),
        (3, "frontier", delta_frontier, plot_frontier, "sfs-frontier.png", summary_frontier),
    ]
    for part, key, run, plot, png_name, lines in simulated:
        if part in parts:
            result[key] = res = run(args)
            png = img_dir / png_name
            plot(res, png)
            pngs.append(png)
            summary += lines(res)
    if 4 in parts:
        result["decision"] = res4 = part_decision(args)
        summary += summary_decision(res4)

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
