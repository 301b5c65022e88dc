"""Summary statistics of a run, under `vllm bench serve`'s field names where it has them.

Definitions (as vLLM's): TTFT = first content chunk - send; TPOT = (E2EL - TTFT) /
(output tokens - 1) per request; ITL = every gap between content chunks, pooled;
E2EL = last byte - send; throughputs = totals / duration (origin to last end);
a request is "good" for goodput if every listed SLO holds (TPOT of a 1-token
answer counts as 0). Statistics over no values are null, never 0.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadgen.records import RequestRecord
from loadgen.utility import UtilityTable

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
KEEP_UP_RATIO = 0.95  # achieved / scheduled rate below this: the client could not keep up


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """What to compute."""

    percentiles: tuple[float, ...] = (90.0, 95.0, 99.0)
    percentile_metrics: tuple[str, ...] = LATENCY_METRICS
    goodput: dict[str, float] | None = None  # metric -> SLO in ms
    utility: UtilityTable | None = None


def parse_goodput(pairs: Sequence[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0}."""
    out: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {pair!r}: expected KEY:MS with KEY in {GOODPUT_METRICS}")
        if float(value) < 0:
            raise ValueError(f"--goodput {pair!r}: SLO must be >= 0 ms")
        out[name] = float(value)
    return out


def percentile_key(p: float) -> str:
    """99 -> '99', 99.9 -> '99.9' (vLLM's p-word)."""
    return str(int(p)) if int(p) == p else str(p)


def describe_ms(
    name: str, values_s: Sequence[float], percentiles: Sequence[float]
) -> dict[str, Any]:
    """mean/median/std/pP of values (seconds) as `{stat}_{name}_ms` fields."""
    arr = np.asarray(values_s, dtype=float) * 1000.0
    empty = arr.size == 0
    out: dict[str, Any] = {
        f"mean_{name}_ms": None if empty else float(arr.mean()),
        f"median_{name}_ms": None if empty else float(np.median(arr)),
        f"std_{name}_ms": None if empty else float(arr.std()),
    }
    for p in percentiles:
        out[f"p{percentile_key(p)}_{name}_ms"] = None if empty else float(np.percentile(arr, p))
    return out


def latency_values(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Seconds per metric over completed requests (ITL pooled over chunks)."""
    done = [r for r in records if r.is_ok]
    return {
        "ttft": [t for r in done if (t := r.ttft_s) is not None],
        "tpot": [t for r in done if (t := r.tpot_s) is not None],
        "itl": [x for r in done for x in r.itls_s],
        "e2el": [t for r in done if (t := r.e2el_s) is not None],
    }


def is_good(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Every listed SLO met (DistServe goodput); failures are never good."""
    if not record.is_ok:
        return False
    values = {
        "ttft": record.ttft_s if record.ttft_s is not None else math.inf,
        "tpot": record.tpot_s or 0.0,
        "e2el": record.e2el_s if record.e2el_s is not None else math.inf,
    }
    return all(values[name] * 1000.0 <= slo for name, slo in slos_ms.items())


def peak_output_rate(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """(max output tokens in any 1 s bucket, requests active in that peak bucket's second)."""
    done = [r for r in records if r.is_ok and r.chunk_ns]
    if not done:
        return 0.0, 0
    t0 = min(r.start_ns for r in done)
    t1 = max(r.end_ns for r in done)
    num_buckets = int((t1 - t0) // 1_000_000_000) + 1
    tokens = np.zeros(num_buckets)
    active = np.zeros(num_buckets, dtype=int)
    for r in done:
        weight = r.output_tokens / r.num_chunks  # usage may count more tokens than chunks
        buckets = (np.asarray(r.chunk_ns) - t0) // 1_000_000_000
        np.add.at(tokens, buckets, weight)
        active[(r.start_ns - t0) // 1_000_000_000 : (r.end_ns - t0) // 1_000_000_000 + 1] += 1
    peak = int(np.argmax(tokens))
    return float(tokens[peak]), int(active.max())


def rate_of(offsets_s: Sequence[float]) -> float | None:
    """count / last offset: the mean rate of a sample path starting at 0."""
    if not offsets_s:
        return None
    last = max(offsets_s)
    return None if last <= 0 else len(offsets_s) / last


def summarize(
    records: Sequence[RequestRecord], duration_s: float, config: MetricsConfig
) -> dict[str, Any]:
    """All summary fields of a run (no per-request arrays)."""
    done = [r for r in records if r.is_ok]
    total_in = sum(r.input_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    dur = max(duration_s, 1e-9)
    peak_tokens, peak_active = peak_output_rate(records)
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / dur,
        "request_goodput": None,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_active,
    }
    if config.goodput:
        out["request_goodput"] = sum(is_good(r, config.goodput) for r in records) / dur
        out["goodput_slos_ms"] = dict(config.goodput)
    values = latency_values(records)
    for name in LATENCY_METRICS:
        percentiles = config.percentiles if name in config.percentile_metrics else ()
        out.update(describe_ms(name, values[name], percentiles))
    out.update(schedule_fields(records))
    out.update(slo_fields(records, config.utility))
    out.update(error_fields(records))
    out.update(routing_fields(records))
    out["per_task"] = per_group(records, lambda r: r.spec.task, config.utility)
    out["per_model"] = per_group(records, lambda r: r.model_for_utility, config.utility)
    out["per_instance"] = per_group(
        [r for r in records if r.instance], lambda r: r.instance, config.utility
    )
    out["num_with_usage"] = sum(r.completion_tokens is not None for r in done)
    return out


def schedule_fields(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Scheduled vs achieved rate and how late the dispatcher was."""
    sent = [r for r in records if r.dispatched_ns]
    scheduled = rate_of([r.scheduled_ns / 1e9 for r in sent])
    achieved = rate_of([r.start_ns / 1e9 for r in sent if r.start_ns])
    lags = [max(0.0, r.lag_s) for r in sent]
    queues = [r.queue_s for r in sent if r.start_ns]
    out: dict[str, Any] = {
        "scheduled_rate": scheduled,
        "achieved_rate": achieved,
        "achieved_to_scheduled": (
            achieved / scheduled if achieved is not None and scheduled else None
        ),
    }
    out.update(describe_ms("schedule_lag", lags, (99.0,)))
    out["max_schedule_lag_ms"] = max(lags) * 1000.0 if lags else None
    out.update(describe_ms("queue", queues, (99.0,)))
    ratio = out["achieved_to_scheduled"]
    out["kept_up"] = ratio is None or ratio >= KEEP_UP_RATIO
    return out


def slo_fields(records: Sequence[RequestRecord], utility: UtilityTable | None) -> dict[str, Any]:
    """TTFT-target attainment and OnTimeUtility over all requests (failures miss)."""
    with_target = [r for r in records if r.spec.slo_ttft_ms is not None]
    attained = sum(bool(r.met_slo) for r in with_target)
    ontime, mean_u, missing = utility_sums(records, utility)
    n = max(len(records), 1)
    return {
        "num_with_slo": len(with_target),
        "slo_attainment": attained / len(with_target) if with_target else None,
        "mean_slo_ttft_ms": (
            float(np.mean([r.spec.slo_ttft_ms for r in with_target])) if with_target else None
        ),
        "ontime_utility": ontime / n if records else None,
        "mean_utility": mean_u / n if records else None,
        "num_utility_missing": missing,
    }


def utility_sums(
    records: Sequence[RequestRecord], utility: UtilityTable | None
) -> tuple[float, float, int]:
    """(sum of on-time utility, sum of utility of completed, lookups missing)."""
    ontime = total = 0.0
    missing = 0
    for r in records:
        if not r.is_ok:
            continue
        value = 1.0 if utility is None else utility.lookup(r.spec.task, r.model_for_utility)
        if value is None:
            missing += 1
            continue
        total += value
        if r.met_slo is not False:  # no target: on time if it completed
            ontime += value
    return ontime, total, missing


def error_fields(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Failures by kind and HTTP status, with a few distinct messages."""
    failed = [r for r in records if not r.is_ok]
    samples: list[str] = []
    for r in failed:
        if r.error not in samples:
            samples.append(r.error)
        if len(samples) == 5:
            break
    return {
        "failed_by_status": dict(Counter(str(r.status) for r in failed)),
        "failed_by_http_status": dict(Counter(str(r.http_status) for r in failed if r.http_status)),
        "error_samples": samples,
    }


def routing_fields(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Baton's per-response fields, aggregated (empty/null when the server sent none)."""
    done = [r for r in records if r.is_ok]
    tokens: Counter[str] = Counter()
    for r in done:
        tokens.update(r.tokens_per_model)
    total_tokens = sum(tokens.values())
    overheads = [r.router_overhead_ms / 1000.0 for r in done if r.router_overhead_ms is not None]
    predicted = [r.predicted_ttft_ms / 1000.0 for r in done if r.predicted_ttft_ms is not None]
    errors = [
        ttft - r.predicted_ttft_ms / 1000.0
        for r in done
        if r.predicted_ttft_ms is not None and (ttft := r.ttft_s) is not None
    ]
    costs = [r.cost for r in done if r.cost is not None]
    out: dict[str, Any] = {
        "num_with_baton": sum(r.has_baton for r in done),
        "num_with_server_request_id": sum(bool(r.server_request_id) for r in records),
        "served_model_counts": dict(Counter(r.served_model for r in done if r.served_model)),
        "instance_counts": dict(Counter(r.instance for r in done if r.instance)),
        "policy_counts": dict(Counter(r.policy for r in done if r.policy)),
        "tokens_per_model": dict(tokens),
        "token_share_per_model": (
            {m: n / total_tokens for m, n in tokens.items()} if total_tokens else {}
        ),
        "total_cost": float(sum(costs)) if costs else None,
        "mean_cost": float(np.mean(costs)) if costs else None,
    }
    out.update(describe_ms("router_overhead", overheads, (99.0,)))
    out.update(describe_ms("predicted_ttft", predicted, (99.0,)))
    # measured (client-side) TTFT minus the router's prediction: > 0 means it was optimistic
    out["mean_ttft_prediction_error_ms"] = float(np.mean(errors)) * 1000.0 if errors else None
    out["mean_abs_ttft_prediction_error_ms"] = (
        float(np.mean(np.abs(errors))) * 1000.0 if errors else None
    )
    return out


def per_group(
    records: Sequence[RequestRecord], key: Any, utility: UtilityTable | None
) -> dict[str, dict[str, Any]]:
    """Counts, TTFT, SLO attainment and OnTimeUtility per task, model or instance."""
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        groups[str(key(r))].append(r)
    out = {}
    for name, group in sorted(groups.items()):
        ttfts = [t for r in group if (t := r.ttft_s) is not None]
        predicted = [
            r.predicted_ttft_ms for r in group if r.is_ok and r.predicted_ttft_ms is not None
        ]
        slo = slo_fields(group, utility)
        out[name] = {
            "count": len(group),
            "completed": sum(r.is_ok for r in group),
            "mean_ttft_ms": float(np.mean(ttfts)) * 1000.0 if ttfts else None,
            "p99_ttft_ms": float(np.percentile(ttfts, 99)) * 1000.0 if ttfts else None,
            "mean_output_tokens": (
                float(np.mean([r.output_tokens for r in group if r.is_ok]))
                if any(r.is_ok for r in group)
                else None
            ),
            "mean_predicted_ttft_ms": float(np.mean(predicted)) if predicted else None,
            "slo_attainment": slo["slo_attainment"],
            "ontime_utility": slo["ontime_utility"],
        }
    return out
