"""PNG charts of a run (--plot DIR): TTFT CDF, latency vs arrival rate, throughput.

Every chart has a title with the run's label, axis units and a legend, and time
axes count seconds from the run's origin so the three line up.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib import ticker
from matplotlib.figure import Figure  # no pyplot: no global state, no display backend

from loadgen.records import RequestRecord

NICE_BINS_S = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
MAX_TASK_CURVES = 6


def choose_bin_s(span_s: float, target_bins: int = 40) -> float:
    """A round bin width giving about target_bins bins over span_s."""
    for width in NICE_BINS_S:
        if span_s / width <= target_bins:
            return width
    return NICE_BINS_S[-1]


def plot_run(
    records: Sequence[RequestRecord], out_dir: Path, title: str, requested_rate: float | None = None
) -> list[Path]:
    """Write the three charts; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        _ttft_cdf(records, out_dir / "ttft_cdf.png", title),
        _latency_over_time(records, out_dir / "latency_over_time.png", title, requested_rate),
        _throughput(records, out_dir / "throughput.png", title),
    ]
    return paths


def _ttft_cdf(records: Sequence[RequestRecord], path: Path, title: str) -> Path:
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    groups: dict[str, list[float]] = {"all requests": []}
    for r in records:
        if (t := r.ttft_s) is not None:
            groups["all requests"].append(t * 1000.0)
            groups.setdefault(r.spec.task, []).append(t * 1000.0)
    tasks = [k for k in groups if k != "all requests"]
    names = ["all requests"] + (tasks[:MAX_TASK_CURVES] if len(tasks) > 1 else [])
    for name in names:
        values = np.sort(groups[name])
        if values.size:
            width = 2.5 if name == "all requests" else 1.2
            ax.step(
                values,
                np.arange(1, values.size + 1) / values.size,
                where="post",
                linewidth=width,
                label=f"{name} (n={values.size})",
            )
    targets = [r.spec.slo_ttft_ms for r in records if r.spec.slo_ttft_ms is not None]
    if targets:
        ax.axvline(
            float(np.median(targets)),
            color="red",
            linestyle="--",
            label=f"median TTFT target {np.median(targets):.0f} ms",
        )
    all_values = groups["all requests"]
    if all_values and max(all_values) / max(min(all_values), 1e-3) > 50:
        ax.set_xscale("log")
    failed = sum(not r.is_ok for r in records)
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of completed requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(
        f"TTFT distribution: {title}" + (f"  ({failed} failed, not shown)" if failed else "")
    )
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _bins(records: Sequence[RequestRecord]) -> tuple[float, np.ndarray]:
    span = max([r.end_ns for r in records] + [r.scheduled_ns for r in records] + [1]) / 1e9
    width = choose_bin_s(span)
    return width, np.arange(0.0, span + width, width)


def _latency_over_time(
    records: Sequence[RequestRecord], path: Path, title: str, requested_rate: float | None
) -> Path:
    width, edges = _bins(records)
    centers = edges[:-1] + width / 2
    fig = Figure(figsize=(10, 7))
    ax_lat, ax_rate = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    done = [r for r in records if r.ttft_s is not None]
    sent_s = np.array([r.start_ns / 1e9 for r in done])
    for attr, color, label in (("ttft_s", "tab:blue", "TTFT"), ("e2el_s", "tab:orange", "E2EL")):
        values = np.array([getattr(r, attr) * 1000.0 for r in done])
        if values.size == 0:
            continue
        ax_lat.scatter(sent_s, values, s=4, alpha=0.25, color=color)
        idx = np.digitize(sent_s, edges) - 1
        for q, style in ((50, "-"), (90, "--")):
            line = [
                np.percentile(values[idx == b], q) if (idx == b).any() else np.nan
                for b in range(len(centers))
            ]
            ax_lat.plot(centers, line, style, color=color, linewidth=2, label=f"{label} p{q}")
    failed_s = [r.start_ns / 1e9 for r in records if not r.is_ok and r.start_ns]
    if failed_s:
        ax_lat.plot(
            failed_s, [0] * len(failed_s), "x", color="red", label=f"failed ({len(failed_s)})"
        )
    if done:
        ax_lat.set_yscale("log")
        ax_lat.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax_lat.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax_lat.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax_lat.set_ylabel("latency (ms), by send time")
    ax_lat.set_title(f"Latency over time vs arrival rate: {title}")
    ax_lat.grid(True, alpha=0.3)
    if ax_lat.get_legend_handles_labels()[0]:
        ax_lat.legend(loc="upper left", ncol=3, fontsize=8)

    scheduled = np.histogram([r.scheduled_ns / 1e9 for r in records], edges)[0] / width
    achieved = np.histogram([r.start_ns / 1e9 for r in records if r.start_ns], edges)[0] / width
    ax_rate.step(
        centers,
        scheduled,
        where="mid",
        color="gray",
        linewidth=4,
        alpha=0.5,
        label="scheduled arrivals",
    )
    ax_rate.step(centers, achieved, where="mid", color="tab:green", label="requests sent")
    if requested_rate is not None and np.isfinite(requested_rate):
        ax_rate.axhline(
            requested_rate,
            color="black",
            linestyle=":",
            label=f"requested mean {requested_rate:.3g} req/s",
        )
    ax_rate.set_ylim(bottom=0)
    ax_rate.set_ylabel(f"req/s ({width:g} s bins)")
    ax_rate.set_xlabel("time since start (s)")
    ax_rate.grid(True, alpha=0.3)
    ax_rate.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _throughput(records: Sequence[RequestRecord], path: Path, title: str) -> Path:
    width, edges = _bins(records)
    centers = edges[:-1] + width / 2
    tokens = np.zeros(len(centers))
    for r in records:
        if r.is_ok and r.chunk_ns:
            weight = r.output_tokens / r.num_chunks
            tokens += np.histogram(np.asarray(r.chunk_ns) / 1e9, edges)[0] * weight
    completed = np.histogram([r.end_ns / 1e9 for r in records if r.is_ok], edges)[0] / width
    starts = np.array([r.start_ns / 1e9 for r in records if r.start_ns])
    ends = np.array([r.end_ns / 1e9 for r in records if r.start_ns])
    # time-weighted mean number of requests in flight per bin
    in_flight = [
        np.clip(np.minimum(ends, b1) - np.maximum(starts, b0), 0, None).sum() / width
        for b0, b1 in itertools.pairwise(edges)
    ]
    fig = Figure(figsize=(10, 6))
    ax_tok, ax_req = fig.subplots(2, 1, sharex=True)
    ax_tok.step(centers, tokens / width, where="mid", color="tab:purple", linewidth=2)
    ax_tok.set_ylim(bottom=0)
    ax_tok.set_ylabel("output tokens/s")
    ax_tok.set_title(f"Throughput over time: {title}")
    ax_tok.grid(True, alpha=0.3)
    ax_req.step(
        centers, completed, where="mid", color="tab:green", linewidth=2, label="completed req/s"
    )
    ax_req.set_ylim(bottom=0)
    ax_req.set_ylabel(f"req/s ({width:g} s bins)")
    ax_req.set_xlabel("time since start (s)")
    ax_req.grid(True, alpha=0.3)
    ax_flight = ax_req.twinx()
    ax_flight.step(centers, in_flight, "--", where="mid", color="tab:gray", label="mean in flight")
    ax_flight.set_ylim(bottom=0)
    ax_flight.set_ylabel("requests in flight")
    lines = ax_req.get_legend_handles_labels()
    more = ax_flight.get_legend_handles_labels()
    ax_req.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
