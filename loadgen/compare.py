"""`loadgen compare A.json B.json`: two runs side by side with B/A ratios."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TextIO

# Shown first, in this order, when present; then every other numeric field of either run.
HEADLINE_FIELDS = (
    "completed",
    "failed",
    "duration",
    "requested_rate",
    "achieved_rate",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "p99_e2el_ms",
    "slo_attainment",
    "ontime_utility",
    "mean_router_overhead_ms",
    "total_cost",
)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    if value == "inf":
        return math.inf
    return None


def compare_rows(
    a: dict[str, Any], b: dict[str, Any], fields: list[str] | None = None
) -> list[tuple[str, float | None, float | None, float | None]]:
    """(field, A, B, B/A) for the headline fields, then every other numeric field."""
    if fields is None:
        numeric = {k for d in (a, b) for k, v in d.items() if _number(v) is not None}
        fields = [f for f in HEADLINE_FIELDS if f in a or f in b]
        fields += sorted(numeric - set(fields))
    rows = []
    for name in fields:
        va, vb = _number(a.get(name)), _number(b.get(name))
        if va is None and vb is None:
            continue
        ratio = None
        if va is not None and vb is not None and va != 0 and math.isfinite(va):
            ratio = vb / va
        rows.append((name, va, vb, ratio))
    return rows


def _label(result: dict[str, Any], path: Path) -> str:
    return str(result.get("label") or path.stem)


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"


def print_comparison(
    path_a: Path, path_b: Path, out: TextIO, fields: list[str] | None = None
) -> None:
    """Print the side-by-side table."""
    a = json.loads(path_a.read_text())
    b = json.loads(path_b.read_text())
    label_a, label_b = _label(a, path_a), _label(b, path_b)
    rows = compare_rows(a, b, fields)
    width = max([len(r[0]) for r in rows] + [10])
    out.write(f"{'field':<{width}}  {'A: ' + label_a:>18}  {'B: ' + label_b:>18}  {'B/A':>8}\n")
    out.write("-" * (width + 50) + "\n")
    for name, va, vb, ratio in rows:
        out.write(f"{name:<{width}}  {_cell(va):>18}  {_cell(vb):>18}  {_cell(ratio):>8}\n")
