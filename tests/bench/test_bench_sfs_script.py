"""`just bench-sfs` as a user runs it, on a tiny setting of the parts that need no model
(2: OnTimeUtility on the simulated testbed, 3: the delta frontier, 4: the decision
cost against a real redis-server): it runs to the end and writes the JSON the issue
names, with the figures it printed, and the PNGs. The figures themselves are not
judged here (benchmarks print targets; tests do not time)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.sfs_cells import TASKS
from loadgen.data import has_files
from loadgen.workloads import PROMPT_SET_FILES

REPO = Path(__file__).resolve().parents[2]
POLICIES = {"round-robin", "shortest-queue", "latency-agnostic", "sfs-constraint", "sfs-lagrangian"}
PROMPT_SETS = [f"prompts/{PROMPT_SET_FILES[t]}" for t in TASKS]  # parts 2 and 3 read them


@pytest.mark.skipif(not has_files(*PROMPT_SETS), reason="no data directory (`just data`)")
def test_bench_sfs_writes_every_figure_it_names(tmp_path: Path) -> None:
    out = tmp_path / "bench_sfs.json"
    cmd = [
        sys.executable,
        "scripts/bench_sfs.py",
        *("--parts", "2", "3", "4"),
        *("--rates", "4", "16", "--mmpp-rates", "4", "16", "--mmpp-ratios", "3"),
        *("--deltas", "1", "3", "--frontier-rate", "8"),
        *("--cell-seconds", "2", "--min-requests", "30", "--jobs", "1"),
        *("--decisions", "20", "--decision-instances", "3", "5"),
        *("--out", str(out)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())

    ontime = res["ontime"]
    assert set(ontime["ontime_utility"]) == POLICIES
    for curve in ontime["ontime_utility"].values():
        assert set(curve) == {"4", "16"} and all(0 <= u <= 1 for u in curve.values())
    assert set(ontime["auc_ratio_by_process"]) == {"poisson", "mmpp-r3"}
    assert ontime["auc_ratio_vs_best_baseline"] > 0
    assert f"sfs-constraint {ontime['auc_ratio_vs_best_baseline']:.2f}x" in run.stdout

    deltas = [p["delta"] for p in res["frontier"]["points"] if p["policy"] == "sfs-lagrangian"]
    assert deltas == [1.0, 3.0]

    dec = res["decision"]
    for key in ("decision_us_p50", "decision_us_p99", "ttft_us_per_instance_p50"):
        assert set(dec[key]) == {"3", "5"}
        assert all(math.isfinite(v) and v > 0 for v in dec[key].values()), (key, dec[key])
    assert dec["decision_us_p50"]["5"] >= dec["redis_read_us_p50"]["5"]  # the read is in it
    assert f"5 inst {dec['decision_us_p50']['5']:.0f}/" in run.stdout

    for png in ("sfs-ontime-utility.png", "sfs-frontier.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_sfs_without_the_shared_data_says_what_is_missing(tmp_path: Path) -> None:
    """A data file missing: a usage error naming the file, no traceback."""
    missing = tmp_path / "no-trace.csv"
    run = subprocess.run(
        [sys.executable, "scripts/bench_sfs.py", "--parts", "1", "--trace", str(missing)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert str(missing) in run.stderr and "Traceback" not in run.stderr
