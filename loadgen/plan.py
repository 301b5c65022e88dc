"""The run's plan: arrival offsets and a workload, from the configuration.

Seeded: the same config and seed give the same offsets and the same prompts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadgen import arrivals
from loadgen.config import DEFAULT_NUM_PROMPTS, BenchConfig
from loadgen.tokens import TokenCounter
from loadgen.traces import TraceWindow, native_rate, read_trace, select_rows
from loadgen.workloads import (
    PROMPT_SET_FILES,
    JsonlWorkload,
    PromptSetWorkload,
    RandomWorkload,
    RequestPolicy,
    RequestSpec,
    TextCorpus,
    TraceWorkload,
    Workload,
    load_prompt_set,
    parse_mix,
)


@dataclass(slots=True)
class Plan:
    """When requests arrive and what they ask."""

    offsets_s: Iterable[float]  # ascending; may be endless for duration-bound closed loops
    total: int | None  # number of requests if known
    requested_rate: float  # req/s, inf for all-at-once or closed loop
    workload: Workload
    is_closed_loop: bool = False
    arrival: dict[str, Any] = field(default_factory=dict)  # description for the result JSON

    def specs(self, policy: RequestPolicy, counter: TokenCounter) -> Iterator[RequestSpec]:
        """Finalized specs, built one by one as the dispatcher asks."""
        for index, draft in enumerate(self.workload.drafts()):
            yield policy.finalize(index, draft, counter)


def detect_trace_format(path: str) -> str:
    """Guess azure|burstgpt|mooncake from the file name."""
    name = Path(path).name.lower()
    for fmt in ("azure", "burstgpt", "mooncake"):
        if fmt in name:
            return fmt
    if name.endswith(".jsonl"):
        return "mooncake"
    raise ValueError(f"cannot tell the format of {path}; pass --trace-format")


def build_plan(config: BenchConfig, counter: TokenCounter) -> Plan:
    """Offsets and workload for the config."""
    seeds = np.random.SeedSequence(config.seed).spawn(3)
    arrival_rng, modulation_rng, workload_rng = (np.random.default_rng(s) for s in seeds)
    data_dir = Path(config.data_dir)
    if config.trace:
        return _trace_plan(config, counter, data_dir, workload_rng)
    workload = _workload(config, counter, data_dir, workload_rng)
    if config.ramp_up_strategy is None and math.isinf(config.request_rate):
        return _all_at_once_plan(config, workload)
    profile, arrival, mean_rate = _profile(config, modulation_rng)
    max_count = config.num_prompts
    if max_count is None and config.duration is None:
        max_count = DEFAULT_NUM_PROMPTS
    offsets = arrivals.arrival_offsets(
        profile, config.burstiness, arrival_rng, max_count, config.duration
    )
    arrival["burstiness"] = config.burstiness
    return Plan(list(map(float, offsets)), len(offsets), mean_rate, workload, arrival=arrival)


def _all_at_once_plan(config: BenchConfig, workload: Workload) -> Plan:
    if config.max_concurrency:
        total = config.num_prompts
        if total is None and config.duration is None:
            total = DEFAULT_NUM_PROMPTS
        offsets: Iterable[float] = itertools.repeat(0.0) if total is None else [0.0] * total
        arrival = {"process": "closed-loop", "max_concurrency": config.max_concurrency}
        return Plan(offsets, total, math.inf, workload, is_closed_loop=True, arrival=arrival)
    total = config.num_prompts or DEFAULT_NUM_PROMPTS
    return Plan([0.0] * total, total, math.inf, workload, arrival={"process": "all-at-once"})


def _profile(
    config: BenchConfig, rng: np.random.Generator
) -> tuple[Iterator[arrivals.RatePiece], dict[str, Any], float]:
    """(rate profile, its description, its mean rate)."""
    if config.ramp_up_strategy is not None:
        start, end = config.ramp_up_start_rps, config.ramp_up_end_rps
        if start is None or end is None:
            raise ValueError("--ramp-up-strategy needs --ramp-up-start-rps and --ramp-up-end-rps")
        ramp_s = config.ramp_up_duration_s or config.duration
        if ramp_s is None:
            num = config.num_prompts or DEFAULT_NUM_PROMPTS
            ramp_s = arrivals.ramp_duration_for(config.ramp_up_strategy, start, end, num)
        describe = {
            "process": f"ramp-{config.ramp_up_strategy}",
            "ramp_up_start_rps": start,
            "ramp_up_end_rps": end,
            "ramp_up_duration_s": ramp_s,
        }
        mean = (
            (start + end) / 2
            if config.ramp_up_strategy == "linear"
            else ((end - start) / math.log(end / start) if start != end else start)
        )
        return arrivals.ramp_profile(config.ramp_up_strategy, start, end, ramp_s), describe, mean
    rate = config.request_rate
    if config.arrival == "gamma":
        return arrivals.constant_profile(rate), {"process": "gamma", "request_rate": rate}, rate
    share = (
        config.high_share
        if config.high_share is not None
        else (0.2 if config.arrival == "mmpp" else 0.5)
    )
    low, high = arrivals.two_level_rates(rate, config.rate_ratio, share)
    describe = {
        "process": config.arrival,
        "request_rate": rate,
        "rate_ratio": config.rate_ratio,
        "high_share": share,
        "low_rate": low,
        "high_rate": high,
    }
    if config.arrival == "mmpp":
        describe["mmpp_sojourn_s"] = config.mmpp_sojourn_s
        profile = arrivals.mmpp_profile(rate, config.rate_ratio, share, config.mmpp_sojourn_s, rng)
        return profile, describe, rate
    if config.arrival == "square":
        describe["square_period_s"] = config.square_period_s
        profile = arrivals.square_profile(rate, config.rate_ratio, share, config.square_period_s)
        return profile, describe, rate
    raise ValueError(f"unknown --arrival {config.arrival!r}")


def _text_source(config: BenchConfig) -> str:
    return config.dataset if config.dataset in PROMPT_SET_FILES else "alpaca"


def _workload(
    config: BenchConfig, counter: TokenCounter, data_dir: Path, rng: np.random.Generator
) -> Workload:
    name = config.dataset
    if name == "jsonl":
        if not config.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path FILE")
        return JsonlWorkload(Path(config.dataset_path), counter, config.max_tokens or 128)
    if name == "random":
        corpus = TextCorpus(load_prompt_set("alpaca", data_dir), counter, config.seed)
        return RandomWorkload(
            corpus,
            config.random_input_len,
            config.random_output_len,
            config.random_range_ratio,
            rng,
        )
    shares = parse_mix(config.mix) if name == "mixed" else {name: 1.0}
    sets = {task: load_prompt_set(task, data_dir) for task in shares}
    return PromptSetWorkload(sets, shares, counter, rng)


def _trace_plan(
    config: BenchConfig, counter: TokenCounter, data_dir: Path, rng: np.random.Generator
) -> Plan:
    assert config.trace is not None
    fmt = config.trace_format or detect_trace_format(config.trace)
    rows = read_trace(config.trace, fmt)
    window = TraceWindow(
        start_s=config.trace_start_s,
        trace_duration_s=config.trace_duration_s,
        num_prompts=config.num_prompts,
        time_scale=config.time_scale,
        target_rate=None if math.isinf(config.request_rate) else config.request_rate,
        duration_s=config.duration,
        max_input_tokens=config.max_input_tokens,
        max_output_tokens=config.max_output_tokens,
    )
    chosen, scale = select_rows(rows, window)
    source = _text_source(config)
    corpus = TextCorpus(load_prompt_set(source, data_dir), counter, config.seed)
    workload = TraceWorkload(chosen, corpus, f"trace-{fmt}", rng)
    offsets = [r.offset_s for r in chosen]
    requested = native_rate(chosen) if len(chosen) > 1 else math.inf
    if offsets[-1] > 0:
        requested = len(offsets) / offsets[-1]
    arrival = {
        "process": "trace",
        "trace_file": str(config.trace),
        "trace_format": fmt,
        "time_scale": scale,
        "trace_start_s": config.trace_start_s,
        "trace_duration_s": config.trace_duration_s,
        "trace_native_rate": native_rate(chosen) * scale,
        "prompt_text_source": source,
    }
    return Plan(offsets, len(offsets), requested, workload, arrival=arrival)
