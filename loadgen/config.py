"""The run's configuration: one frozen object built once from the command line."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from loadgen.data import data_dir

DEFAULT_NUM_PROMPTS = 1000


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Every option of a benchmark run (see `python -m loadgen --help`)."""

    # endpoint
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "chat"
    model: str | None = None
    api_key: str | None = None
    header: tuple[str, ...] = ()
    extra_body: dict[str, Any] | None = None
    timeout: float = 600.0
    temperature: float = 0.0
    ignore_eos: bool | None = None  # None: on for traces and random lengths
    tokenizer: str | None = None
    seed: int = 0
    label: str | None = None
    # arrivals
    request_rate: float = float("inf")
    burstiness: float = 1.0
    arrival: str = "gamma"
    rate_ratio: float = 4.0
    high_share: float | None = None
    mmpp_sojourn_s: float = 2.0
    square_period_s: float = 60.0
    ramp_up_strategy: str | None = None
    ramp_up_start_rps: float | None = None
    ramp_up_end_rps: float | None = None
    ramp_up_duration_s: float | None = None
    max_concurrency: int | None = None
    num_prompts: int | None = None
    duration: float | None = None
    # trace replay
    trace: str | None = None
    trace_format: str | None = None
    time_scale: float | None = None
    trace_start_s: float = 0.0
    trace_duration_s: float | None = None
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    # workload
    dataset: str = "alpaca"
    dataset_path: str | None = None
    mix: str | None = None
    random_input_len: int = 256
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    max_tokens: int | None = None
    data_dir: str = field(default_factory=lambda: str(data_dir()))
    # per-request routing inputs
    slo_ttft_ms: str = "paper"
    budget: float | None = None
    # metrics
    goodput: tuple[str, ...] = ()
    percentile_metrics: str = "ttft,tpot,itl,e2el"
    metric_percentiles: str = "90,95,99"
    utility_table: str | None = None
    # output
    save_result: str | None = None  # "" = default file name
    result_dir: str | None = None
    result_filename: str | None = None
    save_detailed: str | None = None  # "" = next to the result file
    plot: str | None = None
    metadata: tuple[str, ...] = ()
    keep_text: bool = False
    disable_tqdm: bool = False

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> BenchConfig:
        """Build from parsed arguments (list options become tuples)."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value = getattr(ns, f.name)
            values[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**values)

    @property
    def headers(self) -> dict[str, str]:
        return parse_pairs(self.header, "--header")

    @property
    def metadata_fields(self) -> dict[str, str]:
        return parse_pairs(self.metadata, "--metadata")

    @property
    def percentiles(self) -> tuple[float, ...]:
        return tuple(float(p) for p in self.metric_percentiles.split(",") if p.strip())

    @property
    def percentile_metric_names(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.percentile_metrics.split(",") if m.strip())


def parse_pairs(items: tuple[str, ...], option: str) -> dict[str, str]:
    """`("k=v", ...)` -> {k: v}."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{option} {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out
