"""Parts 2 and 3 of the SFS benchmark (scripts/bench_sfs.py) on the simulated SFS
testbed: OnTimeUtility against the arrival rate per policy (`ontime_sweep`), and
sfs-lagrangian's utility-latency frontier over delta (`delta_frontier`).

A cell is one arrival process, rate and policy: requests drawn from the paper's four
tasks (`paper_tasks`), routed in the discrete-event simulation of
bench/cluster_sim.py. Cells run in a process pool; each is seeded from the run's seed,
its rate and its process, so a cell's result does not depend on the pool.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.cluster_sim import ClusterRun, make_requests, simulate_cluster
from bench.sfs_evaluation import auc_ratio
from bench.stats import percentile
from loadgen.arrivals import arrival_offsets, constant_profile, mmpp_profile
from loadgen.data import data_dir
from loadgen.tokens import WordCounter
from loadgen.workloads import load_prompt_set
from services.estimator.policies import create_policy
from services.estimator.sfs.utility import default_ttft_target_s
from shared.config import ClusterConfig, load_cluster

TASKS = ("alpaca", "hotpotqa", "govreport", "writingprompts")
BASELINES = ("round-robin", "shortest-queue", "latency-agnostic")
SFS_POLICIES = ("sfs-constraint", "sfs-lagrangian")

# A pool worker's cluster and task lengths (`_init_worker`), read by `run_cell`.
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
    """A pool worker's setup: the cluster and the task lengths every cell reads."""
    global _CLUSTER
    _CLUSTER = load_cluster(cluster_path)
    _TASKS.update(paper_tasks(min_out, max_out))
    gc.freeze()


@dataclass(frozen=True, slots=True)
class Cell:
    """One simulation: an arrival process at a rate, routed by one policy."""

    process: str  # "poisson" | "mmpp-r3" | ...
    rate: float
    policy: str
    delta: float
    lam: float
    num_requests: int
    length_error: float
    seed: int


def offsets_for(process: str, rate: float, n: int, seed: int) -> np.ndarray:
    """`n` arrival times (s) of `process` ("poisson" or "mmpp-r<ratio>") at mean `rate`."""
    rng = np.random.default_rng(seed)
    if process == "poisson":
        return arrival_offsets(constant_profile(rate), 1.0, rng, n, None)
    if process.startswith("mmpp-r"):
        ratio = float(process.removeprefix("mmpp-r"))
        # SFS public code's MMPP-2: high-state share 0.2, relaxation time 2 s.
        return arrival_offsets(mmpp_profile(rate, ratio, 0.2, 2.0, rng), 1.0, rng, n, None)
    raise ValueError(f"unknown arrival process {process!r}")


def run_cell(cell: Cell) -> dict[str, Any]:
    """One cell in a pool worker: its requests routed on the simulated cluster."""
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
        "p50_ttft_s": percentile(ttfts, 50),
        "p95_ttft_s": percentile(ttfts, 95),
        "share_by_model": run.share_by_model(),
        "wall_s": time.perf_counter() - t0,
    }


def run_cells(cells: list[Cell], args: argparse.Namespace, desc: str) -> list[dict[str, Any]]:
    """The cells' results, in the cells' order, from `args.jobs` processes."""
    init = (str(args.cluster), args.min_output, args.max_output_sim)
    results: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=args.jobs, initializer=_init_worker, initargs=init) as ex:
        futures = [ex.submit(run_cell, c) for c in cells]
        for f in tqdm(futures, desc=desc, unit="cell"):
            results.append(f.result())
    return results


def cell_requests(rate: float, args: argparse.Namespace) -> int:
    """Requests of a cell at `rate`: its arrival window's worth, at least --min-requests."""
    return max(args.min_requests, round(rate * args.cell_seconds))


def ontime_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Part 2: OnTimeUtility per policy and rate, for Poisson and MMPP-2 arrivals, and
    each SFS policy's area under it over the best baseline's."""
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


def delta_frontier(args: argparse.Namespace) -> dict[str, Any]:
    """Part 3: sfs-lagrangian over delta at one Poisson rate, beside the baselines and
    sfs-constraint (mean utility against mean TTFT)."""
    n = cell_requests(args.frontier_rate, args)
    runs = [("sfs-lagrangian", d) for d in args.deltas]
    runs += [(p, 0.0) for p in (*BASELINES, "sfs-constraint")]
    cells = [
        Cell("poisson", args.frontier_rate, p, d, args.lam, n, args.length_error, args.seed)
        for p, d in runs
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
