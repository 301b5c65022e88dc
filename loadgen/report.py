"""Terminal summary and result files (--save-result JSON, --save-detailed JSONL)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from loadgen.metrics import LATENCY_METRICS, percentile_key
from loadgen.records import RequestRecord

WIDTH = 60
LAG_WARNING_MS = 50.0  # p99 dispatch lateness above this: say the client lagged
LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
HEADERS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.2f}"
    return str(value)


def _row(out: TextIO, label: str, value: Any) -> None:
    out.write(f"{label:<44} {_fmt(value):>15}\n")


def _rule(out: TextIO, title: str, fill: str = "-") -> None:
    out.write(f"{f' {title} ':{fill}^{WIDTH}}\n")


def _rows(out: TextIO, result: dict[str, Any], rows: Sequence[tuple[str, str]]) -> None:
    """One row per (label, result key)."""
    for label, key in rows:
        _row(out, label, result[key])


_THROUGHPUT_ROWS = (
    ("Output token throughput (tok/s):", "output_throughput"),
    ("Peak output token throughput (tok/s):", "max_output_tokens_per_s"),
    ("Peak concurrent requests:", "max_concurrent_requests"),
    ("Total Token throughput (tok/s):", "total_token_throughput"),
)
_RATE_ROWS = (
    ("Requested rate (req/s):", "requested_rate"),
    ("Scheduled rate (req/s):", "scheduled_rate"),
    ("Achieved rate (req/s):", "achieved_rate"),
    ("Mean schedule lag (ms):", "mean_schedule_lag_ms"),
    ("P99 schedule lag (ms):", "p99_schedule_lag_ms"),
)
_SLO_ROWS = (
    ("Requests with a TTFT target:", "num_with_slo"),
    ("Mean TTFT target (ms):", "mean_slo_ttft_ms"),
    ("TTFT SLO attainment:", "slo_attainment"),
    ("OnTimeUtility:", "ontime_utility"),
    ("Mean utility (on time or not):", "mean_utility"),
)


def print_summary(result: dict[str, Any], out: TextIO) -> None:
    """vLLM-style summary table plus rate, SLO, utility and routing sections."""
    _rule(out, "Serving Benchmark Result", "=")
    if result.get("interrupted"):
        out.write("  INTERRUPTED: partial results; unfinished requests count as cancelled\n")
    _row(out, "Successful requests:", result["completed"])
    _row(out, "Failed requests:", result["failed"])
    if result["failed"]:
        for status, count in result["failed_by_status"].items():
            _row(out, f"  {status}:", count)
        for sample in result["error_samples"][:3]:
            out.write(f"  e.g. {sample[: WIDTH + 10]}\n")
    if result.get("max_concurrency") is not None:
        _row(out, "Maximum request concurrency:", result["max_concurrency"])
    _rows(
        out,
        result,
        (
            ("Benchmark duration (s):", "duration"),
            ("Total input tokens:", "total_input_tokens"),
            ("Total generated tokens:", "total_output_tokens"),
            ("Request throughput (req/s):", "request_throughput"),
        ),
    )
    if result.get("request_goodput") is not None:
        _row(out, "Request goodput (req/s):", result["request_goodput"])
    _rows(out, result, _THROUGHPUT_ROWS)
    _rule(out, "Arrival rate")
    _rows(out, result, _RATE_ROWS)
    if result.get("max_concurrency") is not None:
        _row(out, "Mean queue time for a slot (ms):", result["mean_queue_ms"])
    if not result["kept_up"]:
        ratio = result["achieved_to_scheduled"]
        out.write(
            f"  WARNING: sent {ratio:.0%} of the scheduled rate "
            "(a --max-concurrency queue or an overloaded client)\n"
        )
    lag = result["p99_schedule_lag_ms"]
    if lag is not None and lag > LAG_WARNING_MS:
        out.write(f"  WARNING: p99 schedule lag {lag:.0f} ms: the client's event loop is busy\n")
    for name in LATENCY_METRICS:
        _rule(out, HEADERS[name])
        label = LABELS[name]
        _row(out, f"Mean {label} (ms):", result[f"mean_{name}_ms"])
        _row(out, f"Median {label} (ms):", result[f"median_{name}_ms"])
        for p in result["metric_percentiles"]:
            key = f"p{percentile_key(p)}_{name}_ms"
            if key in result:
                _row(out, f"P{percentile_key(p)} {label} (ms):", result[key])
    _rule(out, "SLO and utility")
    _rows(out, result, _SLO_ROWS)
    if result["served_model_counts"] or result["instance_counts"] or result["tokens_per_model"]:
        _rule(out, "Routing (server-reported)")
        for model, count in sorted(result["served_model_counts"].items()):
            _row(out, f"Served by {model}:", count)
        for instance, count in sorted(result["instance_counts"].items()):
            _row(out, f"Instance {instance}:", count)
        for model, share in sorted(result["token_share_per_model"].items()):
            _row(out, f"Token share {model}:", share)
        if result["mean_router_overhead_ms"] is not None:
            _row(out, "Mean router overhead (ms):", result["mean_router_overhead_ms"])
            _row(out, "P99 router overhead (ms):", result["p99_router_overhead_ms"])
        if result["mean_predicted_ttft_ms"] is not None:
            _row(out, "Mean predicted TTFT (ms):", result["mean_predicted_ttft_ms"])
            _row(out, "Mean TTFT - predicted (ms):", result["mean_ttft_prediction_error_ms"])
        if result["total_cost"] is not None:
            _row(out, "Total cost:", result["total_cost"])
    out.write("=" * WIDTH + "\n")


def write_result(path: Path, result: dict[str, Any]) -> None:
    """The --save-result JSON (infinite numbers written as the string "inf")."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(result), indent=2) + "\n")


def write_detailed(path: Path, records: Sequence[RequestRecord], origin_epoch_ns: int) -> None:
    """The --save-detailed JSONL: one line per request, timestamps in epoch ns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for record in records:
            f.write(json.dumps(_json_safe(record.to_detail(origin_epoch_ns))) + "\n")


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else None)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value
