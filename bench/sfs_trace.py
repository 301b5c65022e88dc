"""The trace the SFS benchmark replays on one instance, and the load it is replayed at.

Rows of the Azure conversation trace with their lengths scaled and capped to an
engine's limits (`trace_requests`), prompts cut from alpaca text (`alpaca_token_ids`),
and the time scale at which a SimEngine priced by a batch-time model queues the
requests to a given multiple of their idle TTFT (`calibrate_scale`).
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass
from typing import Any

from bench.cluster_sim import Arrival, simulate_single
from loadgen.data import data_dir
from loadgen.traces import read_trace
from loadgen.workloads import load_prompt_set
from shared.scheduling.batch_time import BatchTimeModel


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
    """(warm-up rows, measured rows) of the trace, lengths scaled and capped (the
    arguments are scripts/bench_sfs.py's part 1 options)."""
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
